"""The multi-rank fault soak: 2-rank jobs (real gloo ranks, :func:`dist_verdicts.soak_job`)
in which a rank, or its upload helper, is killed at a random point of a random save.

Invariant, checked after every job: every step listed loads bit-exact on every rank (the next
job checks, on both ranks, before it saves); the ranks that lived gave one verdict per step; a
step reported committed is listed (unless retention removed it since), a step reported failed
for certain is not; the newest listed step is never older than the newest reported durable.
"""

from __future__ import annotations

import random
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiosnap import SyncCheckpointer

from dist_launch import run_ranks

KILL_POINTS = {
    # (executor, victim rank): where a kill may land
    ("thread", 0): ["after_save", "delay", "data", "verdict", "manifest"],
    ("thread", 1): ["after_save", "delay", "data", "part"],
    ("process", 0): ["helper", "data", "verdict", "manifest", "after_save"],
    ("process", 1): ["helper", "data", "part", "after_save"],
}
"""``after_save``/``delay``: the rank dies right after (or a moment after) its save() returned;
``helper``: its upload helper is SIGKILLed a moment after; ``data``/``part``/``verdict``/
``manifest``: the process carrying the save (the rank, or in process mode its helper) dies as
that object is written."""
STEPS_PER_JOB = 3
KEEP_LAST = 4
TIMERS = {"heartbeat_interval": 0.25, "heartbeat_timeout": 3.0}


@dataclass
class RankFigures:
    jobs: int = 0
    saves: int = 0
    kills: Counter[str] = field(default_factory=Counter)
    committed: int = 0
    failures_reported: int = 0
    undecided: int = 0
    steps_verified: int = 0
    verdict_seconds: list[float] = field(default_factory=list)
    """A killed rank's save that failed: from save() to the failure, on the rank that lived."""
    problems: list[str] = field(default_factory=list)

    def line(self) -> str:
        kills = ", ".join(f"{k} {v}" for k, v in sorted(self.kills.items()))
        told = ""
        if self.verdict_seconds:
            told = (
                f", {len(self.verdict_seconds)} rank death(s) named after median "
                f"{statistics.median(self.verdict_seconds):.1f} s (max {max(self.verdict_seconds):.1f} s)"
            )
        return (
            f"jobs {self.jobs}, saves tried {self.saves}, kills {sum(self.kills.values())} ({kills}), "
            f"committed {self.committed}, failures reported {self.failures_reported}, undecided {self.undecided}, "
            f"steps verified on every rank {self.steps_verified}{told}, problems {len(self.problems)}"
        )


def _undecided(outcome: str) -> bool:
    return "may still be committed" in outcome


def _check_job(
    results: list[dict[str, Any]], listed: list[int], victim: int, kill_step: int, figures: RankFigures
) -> int | None:
    """The verdicts of one job against the steps listed after it; the newest durable step."""
    alive = {rank: r["ok"] for rank, r in enumerate(results) if "ok" in r}
    for rank, r in enumerate(results):
        if "ok" not in r and r != {"exit": 9}:
            figures.problems.append(f"rank {rank} ended with {r}")
    for result in alive.values():
        figures.problems += result["bad"]
    if len(alive) == len(results):  # the check ran before any kill: on every rank
        figures.steps_verified += min(result["verified"] for result in alive.values())
    by_step: dict[int, dict[int, str]] = {}
    for rank, result in alive.items():
        for step, outcome, seconds in result["outcomes"]:
            by_step.setdefault(step, {})[rank] = outcome
            if step == kill_step and rank != victim and victim not in alive and outcome != "committed":
                figures.verdict_seconds.append(seconds)
    durable = None
    oldest = listed[0] if listed else None
    for step, outcomes in sorted(by_step.items()):
        figures.saves += 1
        committed = [o == "committed" for o in outcomes.values() if not _undecided(o)]
        figures.undecided += sum(_undecided(o) for o in outcomes.values())
        if any(committed) and not all(committed):
            figures.problems.append(f"step {step}: the ranks were told different verdicts: {outcomes}")
        if committed and all(committed):
            figures.committed += 1
            durable = step
            if step not in listed and (oldest is None or step > oldest):
                figures.problems.append(f"step {step} reported committed but is not listed ({listed})")
        elif committed:
            figures.failures_reported += 1
            if step in listed:
                figures.problems.append(f"step {step} reported failed ({outcomes}) but is listed")
    return durable


def soak_rank_jobs(root: Path, work: Path, jobs: int, seed: int, figures: RankFigures) -> None:
    """``jobs`` 2-rank jobs into ``root``, each killing a rank or a helper (every kind of
    kill of :data:`KILL_POINTS` before any twice), then one that only checks every listed
    step on both ranks."""
    rng = random.Random(seed)
    kinds = [(executor, victim, point) for (executor, victim), points in KILL_POINTS.items() for point in points]
    rng.shuffle(kinds)  # every kind of kill once (in a random order) before any twice
    step = 0
    newest_durable: int | None = None
    for job in range(jobs + 1):
        last = job == jobs
        executor, victim, point = kinds[job % len(kinds)]
        steps = [] if last else list(range(step + 1, step + 1 + STEPS_PER_JOB))
        kill_step = rng.choice(steps) if steps else -1
        results = run_ranks(
            "soak_job", 2, work / f"job-{job}", timeout=120, root=str(root), executor=executor, victim=victim,
            point=point if steps else None, kill_step=kill_step, steps=steps, verify=job > 0,
            delay=rng.uniform(0.0, 0.3), timers=TIMERS, keep_last=KEEP_LAST, hard_exit=True,
        )  # fmt: skip
        figures.jobs += 1
        if steps:
            helper = point == "helper" or (executor == "process" and point != "after_save")
            figures.kills[f"{'helper' if helper else 'rank'} at {point}"] += 1
        with SyncCheckpointer({"storage": {"url": str(root)}, "events": {"log": False}}) as ckpt:
            listed = ckpt.steps()
        durable = _check_job(results, listed, victim, kill_step, figures)
        newest_durable = durable if durable is not None else newest_durable
        if newest_durable is not None and (not listed or listed[-1] < newest_durable):
            figures.problems.append(f"newest listed step {listed[-1:]} is older than durable step {newest_durable}")
        step = max([step, *steps])
