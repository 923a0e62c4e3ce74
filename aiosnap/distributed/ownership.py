"""Who writes each entry of a multi-rank save, decided without any rank's plan leaving it.

Ranks may hold different entries (pipeline stages hold their own layers, expert-parallel
ranks their own experts, one rank an extra key); the checkpoint is the union of what they
hold. How each kind of entry finds its writer, on the caller's thread, from what the
rank holds and what the agreement's one all-gather of fixed size told it:

- A DTensor's boxes: by the DTensor itself (:mod:`aiosnap.trainer.dtensor`): its mesh says
  which ranks hold each box; one of them writes it. Exact, whatever else ranks hold.
- Rank-local values: by their rank.
- Plain tensors and pickled values (held by one rank, or by several: replicated norms,
  DDP replicas, tied embeddings on the first and last pipeline stage): each entry falls in
  one of :data:`BUCKETS` buckets by its path with the numbers taken out
  (:mod:`aiosnap.format.buckets`) (so
  ``layers.3.experts.5.w1`` and ``layers.7.experts.2.w1`` share one, and what differs
  between ranks gathers in few buckets), and each rank sends one 64-bit digest per bucket
  of what it holds there (paths, dtypes, shapes). The ranks with the same digest for a
  bucket hold the same entries in it: a *writer group*. Each group splits its bucket's
  entries among its members, tensors balanced by bytes (largest first, to the member that
  writes the fewest so far, counting what each writes anyway), pickled values by its
  lowest member. Groups with the same members pool their buckets, so a job whose ranks
  hold the same entries (data, tensor and FSDP parallelism) is one group: each entry is
  written once, balanced over all ranks, as before.

An entry held by ranks of different groups (the tied embedding of two pipeline stages, a
norm in a bucket where the ranks' other entries differ) is written once by each group;
the coordinator's merge keeps the copy of the lowest rank and leaves the others' bytes
unreferenced (:mod:`aiosnap.format.merge`). That costs bytes, never correctness: the
alternative, telling each rank who else holds each key, is a gather of every rank's plan
(what DCP does at every save, O(ranks x entries)). The exchange stays
``8 * (7 + BUCKETS)`` bytes per rank whatever the state holds.

The *class* of a rank is its whole table and the shape of its tree (what it holds, not the
values of plain leaves): ranks of one class share a table, which only the lowest of them,
the class's leader, ships in its part for the coordinator.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..errors import UnsupportedStateError
from ..format.buckets import BUCKETS, bucket_of
from ..trainer.plan import Agreement, Flattened
from .assign import assign_writers

__all__ = ["BUCKETS", "Holdings", "Proposed", "decide", "holdings", "plain_writes", "tree_skeleton"]

_SIGNED = 2**63


def _word(data: bytes) -> int:
    """A digest as a signed 64-bit word, never 0 (0: the rank holds nothing there)."""
    value = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big") - _SIGNED
    return value or 1


@dataclass(frozen=True)
class Holdings:
    """What one rank holds, as the agreement carries it."""

    class_digest: str  # 32 hex digits: the table and the tree's shape
    local_digest: int  # the rank-local paths (every rank must declare the same)
    buckets: tuple[int, ...]  # per bucket: a digest of the plain entries held there, 0 for none
    preload: int  # bytes this rank writes whatever the others hold (its boxes, its rank-local values)


def holdings(flat: Flattened, signatures: Sequence[str]) -> Holdings:
    """Caller's thread: ``flat``'s holdings; ``signatures`` is ``flat.signatures()`` (the
    rank-local paths, then one line per main entry)."""
    lines: list[list[str]] = [[] for _ in range(BUCKETS)]
    shards = flat.shards
    described = signatures[len(flat.local_paths) :]  # "path: dtype shape" of each main entry, in order
    seen: dict[str, int] = {}
    for entry, line in zip(flat.entries[: flat.main_entries], described, strict=True):
        first = seen.setdefault(entry.path, entry.index)
        if first != entry.index and not _boxes_of_one(flat, first, entry.index):
            raise UnsupportedStateError(
                f"{entry.path}: two values of the state have this path; a multi-rank checkpoint merges the ranks' "
                "states by path (rename one of the keys)"
            )
        if entry.index not in shards:
            lines[bucket_of(entry.path)].append(line)
    buckets = tuple(_word("\n".join(found).encode()) if found else 0 for found in lines)
    whole = hashlib.blake2b(digest_size=16)
    whole.update("\n".join(signatures).encode())
    whole.update(b"\0")
    whole.update(tree_skeleton(flat.tree).encode())
    local = _word("\n".join(flat.local_paths).encode()) if flat.local_paths else 0
    main = flat.main_entries
    preload = sum(flat.entries[i].nbytes for i, shard in flat.shards.items() if shard.writes)
    preload += sum(e.nbytes for e in flat.entries[main:])
    return Holdings(whole.hexdigest(), local, buckets, preload)


class Proposed(Protocol):
    """What the agreement gathered from one rank (:class:`~aiosnap.distributed.group.SaveProposal`)."""

    @property
    def save_id(self) -> str: ...
    @property
    def digest(self) -> str: ...
    @property
    def preload(self) -> int: ...
    @property
    def buckets(self) -> tuple[int, ...]: ...


def decide(
    flat: Flattened, rank: int, held: Holdings, found: Sequence[Proposed], coordinator: int, commit_timeout: float
) -> Agreement:
    """This rank's share of the save, from every rank's proposal ``found`` (caller's
    thread, after the exchange): what it writes, and whose table its part refers to."""
    written = plain_writes(flat, rank, [p.buckets for p in found], [p.preload for p in found])
    written |= {i for i, shard in flat.shards.items() if shard.writes}
    table_of = next(r for r, p in enumerate(found) if p.digest == held.class_digest)
    return Agreement(
        found[coordinator].save_id, frozenset(written), coordinator, commit_timeout,
        table_of=table_of, class_digest=held.class_digest, buckets=held.buckets,
    )  # fmt: skip


def _boxes_of_one(flat: Flattened, first: int, index: int) -> bool:
    """Entries ``first`` to ``index`` are boxes of one DTensor (made one after the other)."""
    return all(i in flat.shards and flat.entries[i].path == flat.entries[first].path for i in range(first, index + 1))


def plain_writes(flat: Flattened, rank: int, buckets: Sequence[Sequence[int]], preloads: Sequence[int]) -> set[int]:
    """The plain entries of ``flat`` this ``rank`` writes, given every rank's bucket digests
    and preloads (from the agreement). Every member of a writer group computes the same
    split of the group's entries: the same entries (equal digests), the same members."""
    mine = buckets[rank]
    pools: dict[tuple[int, ...], list[int]] = {}
    for bucket, digest in enumerate(mine):
        if digest:
            members = tuple(r for r, theirs in enumerate(buckets) if theirs[bucket] == digest)
            pools.setdefault(members, []).append(bucket)
    by_bucket: dict[int, list[int]] = {}
    for entry in flat.entries[: flat.main_entries]:
        if entry.index not in flat.shards:
            by_bucket.setdefault(bucket_of(entry.path), []).append(entry.index)
    written: set[int] = set()
    for members, pooled in pools.items():
        held = [index for bucket in pooled for index in by_bucket.get(bucket, ())]
        if len(members) == 1:
            written.update(held)
            continue
        if members[0] == rank:  # pickled values (their bytes may differ): the lowest member's
            written.update(i for i in held if flat.entries[i].kind == "pickle")
        tensors = [i for i in held if flat.entries[i].kind != "pickle"]
        sizes: list[int | None] = [flat.entries[i].nbytes for i in tensors]
        writers = assign_writers(sizes, [preloads[r] for r in members])
        me = members.index(rank)
        written.update(i for i, w in zip(tensors, writers, strict=True) if w == me)
    return written


def tree_skeleton(tree: Any) -> str:
    """The shape of a tree: its containers, keys and entries, not the values of plain leaves
    (ranks whose plain values differ still share a class)."""
    out: list[str] = []
    _skeleton(tree, out)
    return "\0".join(out)


def _skeleton(node: Any, out: list[str]) -> None:
    if type(node) is not dict:
        out.append(".")
        return
    tag = node.get("t")
    if tag in ("dict", "odict"):
        append = out.append
        append(tag)
        for key, value in node["items"]:
            append(key if type(key) is str else repr(key))
            if type(value) is dict and value.get("t") == "tensor":  # the common leaf, inline
                append(str(value["id"]))
            else:
                _skeleton(value, out)
        if "meta" in node:
            out.append("meta")
            _skeleton(node["meta"], out)
        out.append("}")
    elif tag in ("list", "tuple"):
        out.append(tag)
        for value in node["items"]:
            _skeleton(value, out)
        out.append("]")
    elif tag == "stateful":
        out.append("stateful")
        _skeleton(node["v"], out)
    elif tag == "tensor":
        out.append(str(node["id"]))  # as the inline case above
    elif tag in ("dtensor", "pickle"):
        out.append(f"{tag[0]}{node['id']}")
    elif tag == "rank_local":
        out.append(f"r{node['slot']}")
    else:
        out.append(".")
