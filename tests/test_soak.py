"""The fault soak (see tests/soak.py): short here, long with ``make soak``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiosnap import Config
from aiosnap.storage.local import LocalStorage
from tests.conftest import FaultyStorage, s3_config
from tests.soak import Figures, concurrent_gc, soak_in_process, soak_killed_children

from soak_ranks import RankFigures, soak_rank_jobs

pytestmark = pytest.mark.both_executors


def _report(figures: Figures, what: str) -> None:
    print(f"\nsoak ({what}): {figures.line()}")
    assert figures.data_lost == 0, figures.problems
    assert figures.steps_verified > 0


@pytest.mark.thread_only  # wraps a storage in the trainer's process
async def test_soak_local_disk(root: Path, request: pytest.FixtureRequest) -> None:
    config = Config(
        storage={"url": str(root)}, ram_budget="1MiB", upload={"chunk_size": "256KiB"}, events={"log": False}
    )
    figures = Figures()
    await soak_in_process(
        config, request.config.getoption("--soak-rounds"), 11, figures, store=FaultyStorage(LocalStorage(root))
    )
    _report(figures, "local disk, failing storage wrapper")


@pytest.mark.thread_only  # wraps a storage in the trainer's process
async def test_soak_incremental_compressed_saves_with_retention_and_a_concurrent_gc(
    root: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Dedup and compression on, retention (keep_last 3) deleting steps under live saves, and
    ``aiosnap gc`` (keep_last 2) looping in another process: nothing committed is lost."""
    config = Config(
        storage={"url": str(root)}, ram_budget="1MiB", events={"log": False},
        upload={"chunk_size": "256KiB", "dedup": True, "compression": "zstd"},
    )  # fmt: skip
    figures = Figures()
    rounds = request.config.getoption("--soak-rounds")
    with concurrent_gc(root, tmp_path / "stop-gc", limit_s=30 + 10 * rounds) as gc_runs:
        await soak_in_process(config, rounds, 13, figures, store=FaultyStorage(LocalStorage(root)))
    _report(figures, f"dedup + zstd, retention, gc in another process ({gc_runs[0]} gc runs)")
    assert gc_runs[0] > 0
    assert figures.referencing_steps, "no save named an earlier step's bytes: the soak did not exercise dedup"


async def test_soak_s3_through_the_fault_proxy(
    s3_endpoint: str, s3_bucket: str, proxy: Any, request: pytest.FixtureRequest
) -> None:
    base = s3_config(proxy.url, s3_bucket, retry_deadline=10, request_timeout=5)
    config = base.model_copy(update={"ram_budget": 2 * 1024 * 1024, "events": type(base.events)(log=False)})
    figures = Figures()
    await soak_in_process(config, max(4, request.config.getoption("--soak-rounds") // 2), 12, figures, proxy=proxy)
    _report(figures, "S3 through the fault proxy")


@pytest.mark.parametrize("mode", ["always", "overflow", "off"])
def test_soak_sigkill_of_a_child_trainer(tmp_path: Path, request: pytest.FixtureRequest, mode: str) -> None:
    spool = {"dir": str(tmp_path / "spool"), "mode": mode} if mode != "off" else {}
    config = Config(
        storage={"url": str(tmp_path / "ckpt")},
        ram_budget="1MiB",
        upload={"chunk_size": "128KiB", "concurrency": 4},
        spool=spool,
        events={"log": False},
    )
    figures = Figures()
    soak_killed_children(config, request.config.getoption("--soak-kills"), 13, figures)
    _report(figures, f"SIGKILL, spool {mode}")


@pytest.mark.thread_only  # each job picks its ranks' executor itself
@pytest.mark.timeout(3000)
def test_soak_two_rank_jobs_with_a_rank_or_a_helper_killed(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    figures = RankFigures()
    jobs = max(1, request.config.getoption("--soak-kills"))
    soak_rank_jobs(tmp_path / "root", tmp_path / "jobs", jobs, 14, figures)
    print(f"\nsoak (2-rank jobs, a rank or an upload helper killed): {figures.line()}")
    assert figures.problems == []
    assert figures.steps_verified > 0
