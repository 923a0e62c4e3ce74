"""The resume idiom: ``load_latest(state)`` loads the latest committed step into ``state`` when
there is one and returns its step, else returns None and leaves ``state`` alone; the step a
checkpointer last restored is ``loaded_step``. (Multi-rank agreement on the step runs in
tests/test_distributed.py with the example, on two gloo ranks, twice.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from aiosnap import Checkpointer, Config, ManifestError, SyncCheckpointer


def _state(seed: int) -> dict[str, object]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 3)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "extra": {"epoch": seed}}


def _weights(state: dict[str, object]) -> torch.Tensor:
    model = state["model"]
    assert isinstance(model, torch.nn.Linear)
    return model.weight.detach().clone()


def test_a_first_run_gets_none_and_its_state_stays(small_config: Config) -> None:
    state = _state(1)
    before = _weights(state)
    with SyncCheckpointer(small_config) as ckpt:
        assert ckpt.load_latest(state) is None and ckpt.loaded_step is None
    assert torch.equal(_weights(state), before) and state["extra"] == {"epoch": 1}


def test_a_later_run_gets_the_latest_step_in_its_state(small_config: Config) -> None:
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save(_state(0), step=0).wait()  # step 0: `1 if done is None else done + 1`, not `done or ...`
        assert ckpt.load_latest(_state(9)) == 0
        saved = _state(5)
        ckpt.save(saved, step=5).wait()
    fresh = _state(7)
    with SyncCheckpointer(small_config) as ckpt:  # a new process would do the same
        assert ckpt.load_latest(fresh) == 5 and ckpt.loaded_step == 5
        assert torch.equal(_weights(fresh), _weights(saved)) and fresh["extra"] == {"epoch": 5}
        momentum = fresh["optim"].state_dict()["state"][0]["momentum_buffer"]  # type: ignore[attr-defined]
        assert torch.equal(momentum, saved["optim"].state_dict()["state"][0]["momentum_buffer"])  # type: ignore[attr-defined]
        ckpt.load(_state(3), step=0)
        assert ckpt.loaded_step == 0  # any load says which step it restored
        view = ckpt.at(str(Path(small_config.storage.url) / "other"))
        assert view.loaded_step is None and view.load_latest(_state(2)) is None


def test_the_async_api_resumes_the_same_way(small_config: Config) -> None:
    async def run() -> tuple[int | None, int | None, int | None]:
        async with Checkpointer(small_config) as ckpt:
            first = await ckpt.load_latest(_state(1))
            await (await ckpt.save(_state(4), step=4))
            fresh = _state(8)
            again = await ckpt.load_latest(fresh)
            assert torch.equal(_weights(fresh), _weights(_state(4)))
            return first, again, ckpt.loaded_step

    assert asyncio.run(run()) == (None, 4, 4)


def test_a_damaged_latest_step_is_an_error_never_an_older_step(small_config: Config) -> None:
    with SyncCheckpointer(small_config) as ckpt:
        ckpt.save(_state(1), step=1).wait()
        ckpt.save(_state(2), step=2).wait()
    (Path(small_config.storage.url) / f"{2:012d}" / "manifest.json").write_text("{ not json")
    state = _state(6)
    before = _weights(state)
    with SyncCheckpointer(small_config) as ckpt, pytest.raises(ManifestError, match="newest loadable step is 1"):
        ckpt.load_latest(state)
    assert torch.equal(_weights(state), before)


def test_a_damaged_step_asked_for_by_number_names_the_newest_loadable_too(small_config: Config) -> None:
    """What every rank of a multi-rank load gets (they load rank 0's latest step by number)."""
    with SyncCheckpointer(small_config) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(_state(step), step=step).wait()
    root = Path(small_config.storage.url)
    (root / f"{3:012d}" / "manifest.json").write_text("{ not json")
    (root / f"{2:012d}" / "manifest.json").write_text("{ not json")
    with SyncCheckpointer(small_config) as ckpt:
        with pytest.raises(ManifestError, match=r"newest loadable step is 1: load\(step=1\), or .* rollback\(1\)$"):
            ckpt.load(_state(6), step=3)  # the latest: rolling back to 1 makes it the latest again
        with pytest.raises(ManifestError, match=r"newest loadable step is 1: load\(step=1\)$"):
            ckpt.load(_state(6), step=2)  # not the latest: no rollback advice
