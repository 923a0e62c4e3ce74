"""What an export takes from its source: the part of the tree ``paths`` select, made of
full tensors, with the entries it names.

A multi-rank source is consolidated: a sharded entry (a DTensor saved by many ranks) becomes
one full tensor, and each rank-local value (``rank_local`` paths) is taken as rank 0 saved
it. The result is a tree whose tensor and pickle nodes name :attr:`Selection.entries` (the
source's entry records, whose ranges or shards say where their bytes are). Pure code on a
checked manifest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ...errors import PickleNotAllowedError
from ...format.manifest import EntryRecord, Manifest
from ...format.tree import shift_entry_ids
from ...load.apply import key_decoder
from ...load.decode import TreeDecoder
from ...load.select import entries_under, select_paths

__all__ = ["Selection", "select", "stub_manifest"]


def stub_manifest(entries: list[EntryRecord], tree: Any = None) -> Manifest:
    """A manifest holding just ``entries`` and ``tree`` (unvalidated: they come from a
    checked one), for the load code that looks at a manifest's entries and tree."""
    return Manifest.model_construct(
        format_version=0, step=0, save_id="0" * 16, created_at=0.0, world_size=1, objects=[],
        entries=entries, tree=tree, metadata={},
    )  # fmt: skip


@dataclass
class Selection:
    """The tree to export (``dtensor`` nodes made ``tensor`` nodes: full tensors) and the
    entries its nodes name, in order; ``pickles``: the bytes of its pickle entries, once
    read (a sink that writes values decodes them)."""

    tree: Any
    entries: list[EntryRecord]
    pickles: dict[int, bytes] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def decoder(self, tensor_of: Callable[[int], torch.Tensor], allow_pickle: bool, where: str) -> TreeDecoder:
        """A decoder of the tree's values: tensors from ``tensor_of``, pickles from their
        bytes (unpickled only with ``allow_pickle``)."""

        def entry(index: int) -> torch.Tensor:
            blob = self.pickles.get(index)
            if blob is not None:
                return (
                    torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else torch.empty(0, dtype=torch.uint8)
                )
            return tensor_of(index)

        kinds = ["tensor" if e.kind == "sharded" else e.kind for e in self.entries]  # full tensors now
        paths = [e.path for e in self.entries]
        return TreeDecoder(entry, kinds, paths, allow_pickle=allow_pickle, where=where)


def _inline(node: Any, manifest: Manifest, extra: list[EntryRecord], base: int) -> Any:
    """``node`` with rank-local slots replaced by rank 0's values (their entries appended to
    ``extra``, numbered from ``base``) and dtensor nodes made tensor nodes."""
    if isinstance(node, dict):
        tag = node.get("t")
        if tag == "dtensor":
            return {"t": "tensor", "id": node["id"]}
        if tag == "rank_local":
            assert manifest.rank_local is not None
            part = manifest.rank_local[0]
            shift = base + len(extra)
            extra.extend(part.entries)
            return shift_entry_ids(part.values[node["slot"]], shift)
        return {k: _inline(v, manifest, extra, base) for k, v in node.items()}
    if isinstance(node, list):
        return [_inline(v, manifest, extra, base) for v in node]
    return node


def _renumber(node: Any, ids: dict[int, int]) -> Any:
    if isinstance(node, dict):
        if node.get("t") in ("tensor", "pickle"):
            return {**node, "id": ids[node["id"]]}
        return {k: _renumber(v, ids) for k, v in node.items()}
    if isinstance(node, list):
        return [_renumber(v, ids) for v in node]
    return node


def select(
    manifest: Manifest, paths: Sequence[str] | None = None, *, allow_pickle: bool = True, where: str = ""
) -> Selection:
    """What an export of ``manifest`` takes (``paths``: glob patterns of key paths, as
    ``load(paths=...)``; None: everything). ``allow_pickle`` False refuses a selection that
    holds a pickled object (a format that must unpickle it to write it)."""
    tree = manifest.tree
    if paths is not None:
        tree = select_paths(tree, list(paths), key_decoder(manifest, allow_pickle=False))
    extra: list[EntryRecord] = []
    tree = _inline(tree, manifest, extra, len(manifest.entries))
    pool = [*manifest.entries, *extra]
    used = sorted(entries_under(tree))
    if not allow_pickle:
        pickled = [pool[i].path for i in used if pool[i].kind == "pickle"]
        if pickled:
            raise PickleNotAllowedError(
                f"{where or 'the source'} holds pickled object(s) {pickled[:5]!r}; writing them in another format "
                "unpickles them, which can execute arbitrary code: pass allow_pickle=True only if you trust it"
            )
    ids = {old: new for new, old in enumerate(used)}
    return Selection(_renumber(tree, ids), [pool[i] for i in used])
