"""Launching the ranks of a multi-rank test (:mod:`dist_child`) as separate processes.

A free port for each job, a deadline for the whole job, every process killed (and reaped)
when it passes, each rank's output kept for the failure message.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CHILD = Path(__file__).resolve().parent / "dist_child.py"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_ranks(
    scenario: str, world: int, work: Path, timeout: float = 50, child: Path = CHILD, **params: Any
) -> list[dict[str, Any]]:
    """Run ``scenario`` (a function of ``child``, :mod:`dist_child` by default) on ``world``
    ranks; each rank's result (``{"ok": ...}`` or ``{"error": type, "message": ...}``;
    ``{"exit": code}`` for a rank that wrote none)."""
    work.mkdir(parents=True, exist_ok=True)
    for old in work.glob("result-*.json"):
        old.unlink()
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIOSNAP_")}
    env["OMP_NUM_THREADS"] = "1"
    procs = []
    for rank in range(world):
        log = open(work / f"rank-{rank}.log", "w")  # noqa: SIM115 - closed below
        args = [sys.executable, str(child), scenario, str(rank), str(world), str(port), str(work), json.dumps(params)]
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        procs.append((proc, log))
    deadline = time.monotonic() + timeout
    try:
        for proc, _ in procs:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        logs = "\n".join(f"--- rank {r}\n{(work / f'rank-{r}.log').read_text()[-3000:]}" for r in range(world))
        raise AssertionError(f"{scenario} on {world} ranks did not finish in {timeout} s\n{logs}") from None
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
    results = []
    for rank, (proc, _) in enumerate(procs):
        path = work / f"result-{rank}.json"
        if path.exists():
            results.append({**json.loads(path.read_text()), "status": proc.returncode})
        else:
            results.append({"exit": proc.returncode})
    return results


def ok(results: list[dict[str, Any]], work: Path) -> list[Any]:
    """Every rank's result, or an AssertionError with the ranks' errors and logs."""
    if all("ok" in r for r in results):
        return [r["ok"] for r in results]
    details = [
        f"--- rank {i}: {r.get('error', r)} {r.get('message', '')}\n{r.get('trace', '')}"
        + (work / f"rank-{i}.log").read_text()[-2000:]
        for i, r in enumerate(results)
    ]
    raise AssertionError("\n".join(details))
