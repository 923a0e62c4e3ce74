"""Preemption: a real SIGTERM sent to a real training process (tests/preempt_child.py), and
how a process with aiosnap's handlers ends (tests/signal_child.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Config, ConfigError, SyncCheckpointer
from tests.dist_launch import ok, run_ranks
from tests.preempt_child import packed_state, state

REPO = Path(__file__).resolve().parent.parent


class Child:
    """The child trainer, its output read line by line."""

    def __init__(self, *args: str, executor: str = "thread", env: dict[str, str] | None = None) -> None:
        env = {**os.environ, "AIOSNAP_UPLOAD__EXECUTOR": executor, **(env or {})}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.preempt_child", *args], cwd=REPO, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.lines: list[str] = []

    def wait_for(self, prefix: str, timeout: float = 60) -> str:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if not line:
                break
            self.lines.append(line.strip())
            if line.startswith(prefix):
                return line.strip()
        self.process.kill()
        raise AssertionError(f"no {prefix!r} from the child: {self.lines} {self.process.communicate()[1][-3000:]}")

    def preempt_after(self, prefix: str) -> tuple[int, str, str]:
        """Send SIGTERM once the child printed ``prefix``; its exit status, stdout, stderr."""
        self.wait_for(prefix)
        self.process.send_signal(signal.SIGTERM)
        return self.end()

    def end(self, timeout: float = 60) -> tuple[int, str, str]:
        try:
            out, err = self.process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            out, err = self.process.communicate()
            raise AssertionError(f"the child did not exit: {err[-3000:]}") from None
        self.lines += out.splitlines()
        return self.process.returncode, "\n".join(self.lines), err


def _committed(root: Path) -> list[int]:
    config = Config(storage={"url": str(root)}, events={"log": False, "stderr": False})
    with SyncCheckpointer(config) as ckpt:
        return ckpt.steps()


def _loads(root: Path, step: int) -> bool:
    config = Config(storage={"url": str(root)}, events={"log": False, "stderr": False})
    with SyncCheckpointer(config) as ckpt:
        restored = ckpt.load(step=step)
    expected = state(step)
    return all(torch.equal(restored[k], v) for k, v in expected.items())


def test_sigterm_mid_upload_finishes_the_save_takes_a_last_one_and_exits_as_sigterm(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    code, out, err = Child("in-flight", str(root)).preempt_after("UPLOADING")
    assert code == -signal.SIGTERM, (code, out, err[-3000:])
    assert "PREEMPTED upload done=False" in out and "CLOSED" in out
    assert "SIGTERM: preempted" in err
    assert _committed(root) == [1, 2]
    assert _loads(root, 1) and _loads(root, 2)


def test_saves_the_grace_period_is_too_short_for_are_resumed_from_the_spool(tmp_path: Path) -> None:
    """Two trainers at once (each waits out its 2 s grace period): one whose save has not
    landed a byte (every chunk is in RAM: written to the spool), one whose chunks have all
    landed and whose manifest write is under way (nothing in RAM: journalled all the same)."""
    began = time.monotonic()
    children = {
        scenario: (Child(scenario, str(tmp_path / scenario / "ckpt"), str(tmp_path / scenario / "spool")), prefix)
        for scenario, prefix in (("stuck", "UPLOADING"), ("committing", "COMMITTING"))
    }
    for child, prefix in children.values():
        child.wait_for(prefix)
        child.process.send_signal(signal.SIGTERM)
    for scenario, (child, _) in children.items():
        code, out, err = child.end()
        assert code == -signal.SIGTERM, (scenario, code, out, err[-3000:])
        assert "NOT REACHED" not in out and "grace period of 2 s is over" in err, (scenario, err[-3000:])
        root, spool = tmp_path / scenario / "ckpt", tmp_path / scenario / "spool"
        assert _committed(root) == []  # the storage held the writes: the data, or the manifest
        config = Config(storage={"url": str(root)}, spool={"dir": str(spool)}, events={"log": False, "stderr": False})
        with SyncCheckpointer(config) as ckpt:
            assert ckpt.resume_report.resumed == [1], (scenario, ckpt.resume_report)
            assert ckpt.steps() == [1]
        assert _loads(root, 1)
    assert time.monotonic() - began >= 2  # they waited for the grace period


def test_a_preempted_incremental_compressed_upload_resumes_to_the_bytes_it_captured(tmp_path: Path) -> None:
    """dedup + zstd: the chunk of step 2 holds two new pieces (packed, compressed) and two
    that step 1 wrote; its write is held, SIGTERM, the grace period runs out and the slab is
    secured to the spool. The slab must still hold the captured bytes at the plan's offsets
    (packing into it in place once made the resume commit wrong bytes that passed every
    check), so the resumed step 2 loads bit-exact."""
    root, spool = tmp_path / "ckpt", tmp_path / "spool"
    code, out, err = Child("stuck-packed", str(root), str(spool)).preempt_after("UPLOADING")
    assert code == -signal.SIGTERM and "NOT REACHED" not in out, (code, out, err[-3000:])
    config = Config(storage={"url": str(root)}, spool={"dir": str(spool)}, events={"log": False, "stderr": False})
    with SyncCheckpointer(config) as ckpt:
        assert ckpt.resume_report.resumed == [2], ckpt.resume_report
        for step in (1, 2):
            restored, expected = ckpt.load(step=step), packed_state(step)
            assert all(torch.equal(restored[k], v) for k, v in expected.items()), step


def test_a_preempted_compressed_upload_in_the_upload_process_resumes_to_the_bytes_it_captured(
    tmp_path: Path, s3_endpoint: str, s3_bucket: str, proxy: Any
) -> None:
    """The same with ``upload.executor: process`` and S3: the upload process compresses the
    chunk, its request body stalls at the proxy, SIGTERM, the trainer secures the slab (in
    the arena it shares with the upload process) to the spool; the resume loads bit-exact."""
    proxy.reset_after_bytes = 64 * 1024
    proxy.stall_every = 1
    spool = tmp_path / "spool"
    url = f"s3://{s3_bucket}/run"
    s3 = {"AIOSNAP_S3__ENDPOINT_URL": proxy.url, "AIOSNAP_S3__ADDRESSING_STYLE": "path"}
    child = Child("stuck-compressed", url, str(spool), executor="process", env=s3)
    child.wait_for("CAPTURED")
    deadline = time.monotonic() + 60
    while proxy.stalls == 0:  # the chunk is compressed and its body on the way: held
        assert time.monotonic() < deadline and child.process.poll() is None, "the upload never started"
        time.sleep(0.01)
    child.process.send_signal(signal.SIGTERM)
    code, out, err = child.end()
    assert code == -signal.SIGTERM and "NOT REACHED" not in out, (code, out, err[-3000:])
    proxy.clear()
    config = Config(
        storage={"url": url}, spool={"dir": str(spool)}, events={"log": False, "stderr": False},
        s3={"endpoint_url": s3_endpoint, "addressing_style": "path"},
    )  # fmt: skip
    with SyncCheckpointer(config) as ckpt:
        assert ckpt.resume_report.resumed == [1], ckpt.resume_report
        restored, expected = ckpt.load(step=1), packed_state(2)
        assert all(torch.equal(restored[k], v) for k, v in expected.items())


_WATCH_THE_HELPER = """
import signal, sys, time
from pathlib import Path
from aiosnap import Config, SyncCheckpointer

def signal_set(pid, field):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)

config = Config(
    storage={"url": sys.argv[1]}, upload={"executor": "process"},
    preemption={"enabled": True, "grace_period": 5}, events={"log": False, "stderr": False},
)
term = 1 << (signal.SIGTERM - 1)
with SyncCheckpointer(config) as ckpt:
    pid = ckpt._engine.transfer.pid
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        blocked, ignored = signal_set(pid, "SigBlk") & term, signal_set(pid, "SigIgn") & term
        if not (blocked or ignored):
            sys.exit("the upload process would die of SIGTERM now")
        if ignored and not blocked:
            break
    else:
        sys.exit("the upload process never came to ignore SIGTERM")
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set(), "the trainer's own mask changed"
print("OK")
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the signal sets from /proc")
def test_the_upload_process_never_dies_of_a_preemption_signal_while_it_starts(tmp_path: Path) -> None:
    """A cluster signals every process of the job, maybe while the upload process is still
    starting (before it could ignore the signal): from its first instruction the signal is
    blocked, then ignored; never left to its default action, which ends the process. (In a
    child: the preemption handler stays in the process that enabled it.)"""
    done = subprocess.run([sys.executable, "-c", _WATCH_THE_HELPER, str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "OK", (done.stdout, done.stderr[-3000:])


def test_sigterm_with_no_save_in_flight_lets_the_trainer_take_a_last_save(tmp_path: Path) -> None:
    """With the upload process, which gets the signal too (a SLURM job's processes all do):
    it ignores it, and the last save goes through it."""
    root = tmp_path / "ckpt"
    child = Child("idle", str(root), executor="process")
    os.kill(int(child.wait_for("HELPER").split()[1]), signal.SIGTERM)
    code, out, err = child.preempt_after("READY")
    assert code == -signal.SIGTERM, (code, out, err[-3000:])
    assert _committed(root) == [5] and _loads(root, 5)


def test_ranks_agree_on_their_signals_take_one_last_save_together_and_exit_as_sigterm(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = run_ranks("preempted", 2, tmp_path / "job", root=str(root))
    assert [r.get("status") for r in results] == [-signal.SIGTERM, -signal.SIGTERM], results
    for result in ok(results, tmp_path / "job"):
        assert result == {"last": 4, "preempted": True, "steps": [4]}
    config = Config(storage={"url": str(root)}, events={"log": False, "stderr": False})
    with SyncCheckpointer(config, world_size=1) as ckpt:
        assert ckpt.steps() == [4] and ckpt.load(skip_rank_local=True)["step"] == 4


def _signal_child(scenario: str) -> tuple[int, str, str]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.signal_child", scenario], cwd=REPO, capture_output=True, text=True, timeout=60
    )  # fmt: skip
    return done.returncode, done.stdout, done.stderr


def test_a_forked_child_is_not_the_preempted_process() -> None:
    """multiprocessing's fork children (a Pool's workers, DataLoader's) die of a SIGTERM as
    before, without preempting their parent; a child of a preempted process exits normally."""
    code, out, err = _signal_child("fork")
    assert out.splitlines() == ["TERMINATED -15", "POOL [1, 2]", "PREEMPTED False", "FORKED 0"], (out, err)
    assert code == -signal.SIGTERM, (code, err)


@pytest.mark.parametrize(
    ("scenario", "status"),
    [("sigint", -signal.SIGINT), ("sysexit", 7), ("raises", 1), ("native", 15), ("native-grace", 15)],
)
def test_the_process_ends_as_the_handler_from_before_would_have_ended_it(scenario: str, status: int) -> None:
    """At the interpreter's exit (or at the grace period's end): Python's SIGINT handler
    (KeyboardInterrupt: killed by SIGINT), one that calls sys.exit(7), one that raises, one
    installed from C (libc's _exit(15)). The other atexit functions run first, once each."""
    code, out, err = _signal_child(scenario)
    assert code == status, (code, out, err)
    assert "RETURNING" in out and "Exception ignored" not in err, (out, err)
    if scenario != "native-grace":
        assert out.count("ATEXIT before") == 1 and out.count("ATEXIT after") == 1, out
    if scenario == "raises":
        assert "RuntimeError: raised by the handler from before" in err, err


def test_off_by_default_and_refused_off_the_main_thread(tmp_path: Path) -> None:
    config = Config(storage={"url": str(tmp_path / "ckpt")}, events={"log": False})
    assert not config.preemption.enabled
    with SyncCheckpointer(config) as ckpt:
        assert not ckpt.preempted and ckpt.preemption is None
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    enabled = config.model_copy(update={"preemption": config.preemption.model_copy(update={"enabled": True})})
    failures: list[BaseException] = []

    def make() -> None:
        try:
            SyncCheckpointer(enabled).close()
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=make, name="trainer-2")
    thread.start()
    thread.join(60)
    assert len(failures) == 1 and isinstance(failures[0], ConfigError), failures
    assert "main thread" in str(failures[0]) and "'trainer-2'" in str(failures[0])
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
