"""Values several ranks hold, and keys that only look alike: ranks simulated in this process
(:mod:`simulated_ranks`: aiosnap's planner, ownership, parts and the coordinator's merge on
real bytes in a real local store), loaded back with a real checkpointer.

A value held by several ranks is written once only if they hold the same bytes: pipeline
stages saving a torch optimizer's own state dict (its parameters numbered 0..n-1 on every
stage) are refused at ``wait()`` with :class:`RanksDisagreeError`, whatever group wrote
which copy; keys whose paths coincide (``"a/b"`` beside ``a -> b``, ``0`` beside ``"0"``)
stay apart.
"""

from __future__ import annotations

import itertools
import string
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import RanksDisagreeError, ShardedState, StateMismatchError, SyncCheckpointer
from aiosnap.format.buckets import bucket_of
from tests.simulated_ranks import plan_ranks, save_as_ranks

CONFIG = {"events": {"log": False}}
HINT = "use aiosnap.ShardedState, which saves it by parameter name"


def _load(root: Path, state: dict[str, Any] | None = None, **kwargs: Any) -> Any:
    with SyncCheckpointer({"storage": {"url": str(root)}, **CONFIG}) as ckpt:
        return ckpt.load(state, **kwargs)


def _stage(rank: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Pipeline stage ``rank`` of a two-layer model (its layer keeps the whole model's name),
    trained one step with Adam."""
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({str(rank): torch.nn.Linear(4, 4)})
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + seed))
    model.layers[str(rank)](x).pow(2).sum().backward()
    optim.step()
    return model, optim


@pytest.mark.parametrize(
    ("saved", "named"),
    [
        ("state_dict", rf"'optim': ranks 0 and 1, which hold different keys.*{HINT}"),
        ("stateful", rf"'optim': ranks 0 and 1, which hold different keys.*{HINT}"),
        ("state", r"'optim/[01]/exp_avg(_sq)?': rank 1 holds other bytes than rank 0"),  # the tensors compared
    ],
)
def test_pipeline_stages_saving_optimizer_state_by_index_are_refused(tmp_path: Path, saved: str, named: str) -> None:
    """Each stage's Adam state is numbered 0..1: the stages hold the same keys with other
    values. Written once, a stage would get its own exp_avg and the other stage's exp_avg_sq."""
    states: list[dict[str, Any]] = []
    for model, optim in (_stage(rank, seed=rank) for rank in (0, 1)):
        if saved == "state_dict":
            states.append({"model": model.state_dict(), "optim": optim.state_dict()})
        elif saved == "stateful":
            states.append({"model": model, "optim": optim})
        else:
            states.append({"model": model.state_dict(), "optim": optim.state_dict()["state"]})
    with pytest.raises(RanksDisagreeError, match=f"different values at one path: {named}"):
        save_as_ranks(tmp_path, states)
    assert not list(tmp_path.glob("*/manifest.json"))


def test_optimizer_state_dicts_of_ranks_holding_different_keys_are_refused_even_equal(tmp_path: Path) -> None:
    """Before the first step (no tensors yet) two stages' optimizers differ only in their
    learning rate and parameter count; two ranks holding other keys beside equal optimizer
    states. Neither is a plain value the lowest rank's copy may stand for: whether they are
    equal at this step says nothing of the next."""
    states = []
    for rank, lr in ((0, 0.1), (1, 0.2)):
        params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(1 + rank)]
        states.append({"optim": torch.optim.SGD(params, lr=lr).state_dict(), "w": torch.full((2,), float(rank))})
    with pytest.raises(RanksDisagreeError, match=rf"'optim': ranks 0 and 1, which hold different keys.*{HINT}"):
        save_as_ranks(tmp_path / "stages", states)
    model, optim = _stage(0, seed=0)
    replicas = [{"model": model.state_dict(), "optim": optim.state_dict()} for _ in range(2)]
    replicas[1]["extra"] = torch.ones(3)
    with pytest.raises(RanksDisagreeError, match=HINT):
        save_as_ranks(tmp_path / "replicas", replicas)
    replicas[1]["extra"] = torch.ones(3)
    del replicas[1]["extra"]  # replicas holding the same keys: one class, saved once
    manifest = save_as_ranks(tmp_path / "same", replicas)
    assert len([e for e in manifest.entries if e.path.startswith("optim/state/0/")]) == 3


def _in_bucket_of(path: str) -> str:
    """Another key in the bucket of ``path``: ranks holding it beside ``path`` fall in
    another writer group for that bucket than ranks holding ``path`` alone."""
    names = ("".join(letters) for letters in itertools.product(string.ascii_lowercase, repeat=3))
    return next(k for k in names if k != path and bucket_of(k) == bucket_of(path))


def test_copies_written_by_two_groups_must_be_equal(tmp_path: Path) -> None:
    """Both ranks hold ``norm``; rank 1 also holds another key of its bucket, so each rank
    writes its own copy. Equal copies: one is kept (the other is unreferenced, and verify
    and info count what is referenced); different ones: refused."""
    other = _in_bucket_of("norm")
    equal = [{"norm": torch.full((1000,), 1.0)}, {"norm": torch.full((1000,), 1.0), other: torch.ones(2)}]
    manifest = save_as_ranks(tmp_path / "equal", equal)
    assert manifest.referenced_bytes == 4008 < manifest.total_bytes  # both copies stored, one referenced
    different = [{"norm": torch.full((1000,), 1.0)}, {"norm": torch.full((1000,), 2.0), other: torch.ones(2)}]
    with pytest.raises(RanksDisagreeError, match="'norm': rank 1 holds other bytes than rank 0"):
        save_as_ranks(tmp_path / "different", different)


def test_a_weight_tied_to_another_value_is_refused(tmp_path: Path) -> None:
    """Rank 0 ties its embedding to the output head; the last stage holds a head of other
    values at that key: keeping rank 0's would replace the last stage's head."""
    embed = torch.arange(12.0).reshape(3, 4)
    first = {"embed": embed, "head": embed}
    with pytest.raises(RanksDisagreeError, match="'embed': rank 1 holds other bytes than rank 0"):
        save_as_ranks(tmp_path, [first, {"head": embed + 1}])


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"a/b": torch.full((3,), 1.0)}, {"a": {"b": torch.full((3,), 2.0)}}),  # a slash in a key
        ({"x": {0: torch.full((3,), 1.0)}}, {"x": {"0": torch.full((3,), 2.0)}}),  # an int key and a str key
        ({"x": {"a#_metadata": torch.full((3,), 1.0)}}, {"x": {"a%23_metadata": torch.full((3,), 2.0)}}),
    ],
)
def test_keys_whose_paths_coincide_stay_apart(tmp_path: Path, first: dict[str, Any], second: dict[str, Any]) -> None:
    """Two ranks' keys that flatten to one path (``a/b``) or print alike (``0``) are two
    values: each rank loads its own, and one process loads both."""
    save_as_ranks(tmp_path, [first, second])
    for state in (first, second):
        target = {
            k: {kk: torch.zeros(3) for kk in v} if isinstance(v, dict) else torch.zeros(3) for k, v in state.items()
        }
        _load(tmp_path, target)
        assert str(target) == str(state), (target, state)
    both = _load(tmp_path)
    merged = {**first, **second}
    for key in set(first) & set(second):
        merged[key] = {**first[key], **second[key]}
    assert str(both) == str(merged)


def test_one_rank_holding_two_values_at_one_path_saves_both(tmp_path: Path) -> None:
    """A key with a slash beside a nested dict, in one rank's state (a single-rank save
    takes it too)."""
    mine = {"a/b": torch.ones(2), "a": {"b": torch.zeros(3)}}
    save_as_ranks(tmp_path, [mine, {"c": torch.ones(1)}])
    loaded = _load(tmp_path)
    assert torch.equal(loaded["a/b"], torch.ones(2)) and torch.equal(loaded["a"]["b"], torch.zeros(3))


def test_a_stage_module_loading_a_pipeline_checkpoint_gets_a_typed_error(tmp_path: Path) -> None:
    """Stages saved as modules: the checkpoint holds both stages' keys. Loading one stage's
    module whole (``load_state_dict``, strict) is a StateMismatchError naming the keys and
    ShardedState (which restores a stage by key); a plain dict target takes its own keys."""
    stages = [_stage(rank, seed=rank)[0] for rank in (0, 1)]
    save_as_ranks(tmp_path, [{"model": m} for m in stages])
    fresh = _stage(0, seed=5)[0]
    with pytest.raises(StateMismatchError, match=r"(?s)model: Error\(s\) in loading.*layers.1.weight.*ShardedState"):
        _load(tmp_path, {"model": fresh})
    own = {"model": {k: torch.zeros_like(v) for k, v in stages[0].state_dict().items()}}
    _load(tmp_path, own)
    assert torch.equal(own["model"]["layers.0.weight"], stages[0].layers["0"].weight)


def test_an_old_nested_optimizer_checkpoint_says_how_to_load_it(tmp_path: Path) -> None:
    """A ShardedState checkpoint of the nested optimizer layout (aiosnap's before pipeline
    layouts) loaded with today's default (flattened by name): a short StateMismatchError
    that says flatten_optimizer=False; with it, the load succeeds."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 4)).sum().backward()
    optim.step()
    with SyncCheckpointer({"storage": {"url": str(tmp_path)}, **CONFIG}) as ckpt:
        ckpt.save({"train": ShardedState(model, optim, flatten_optimizer=False)}, step=1).wait()
    again = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    again_optim = torch.optim.AdamW(again.parameters(), lr=0.01)
    with pytest.raises(StateMismatchError, match="flatten_optimizer=False") as caught:
        _load(tmp_path, {"train": ShardedState(again, again_optim)})
    assert len(str(caught.value)) < 900 and "in all" in str(caught.value)
    _load(tmp_path, {"train": ShardedState(again, again_optim, flatten_optimizer=False)})
    assert torch.equal(again_optim.state[again[0].weight]["exp_avg"], optim.state[model[0].weight]["exp_avg"])


def test_holders_of_a_value_another_class_writes_ship_its_checksum() -> None:
    """Where a writer group holds ranks of two classes, each rank holding a plain tensor that
    a rank of the other class writes ships its crc32c; replicas of one class ship none."""
    shared = {f"w{i}": torch.full((16,), float(i)) for i in range(6)}
    replicas = plan_ranks([{"model": dict(shared)} for _ in range(3)])
    assert all(not p.spec.distributed.checksums for p in replicas)  # type: ignore[union-attr]
    states = [{"model": dict(shared)} for _ in range(3)]
    states[2]["probe"] = torch.ones(1)  # rank 2: a class of its own
    plans = plan_ranks(states)
    written = [set(p.spec.distributed.written) for p in plans]  # type: ignore[union-attr]
    shipped = [{e for e, _ in p.spec.distributed.checksums} for p in plans]  # type: ignore[union-attr]
    model = set(range(6))  # the entries of "model" (rank 2's "probe" is its 7th)
    assert shipped[2] == model - written[2]  # what ranks 0 and 1 write
    assert shipped[0] == written[2] & model == shipped[1]  # what rank 2 writes
