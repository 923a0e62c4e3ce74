"""The view of a multi-rank checkpoint that one rank loads: its own rank-local values.

A manifest with rank-local values keeps, in its tree, a ``{"t": "rank_local", "slot": N}``
node where each rank's value was, and beside the tree one record per rank. Rank ``r`` of a
job with the same world size loads its own record's values in their place (entry ids moved
past the shared table). With another world size they cannot be given to anyone: they become
``{"t": "unavailable"}`` nodes, and a load that needs one of them is refused before anything
is read (a partial load of other keys goes ahead), unless the caller asks to skip them, which
leaves ``{"t": "skipped"}`` in their place: those keys of a state are left as they are, and a
new state leaves them out. Pure code; runs on the loop thread on a manifest already validated.
"""

from __future__ import annotations

from typing import Any

from ..format.manifest import Manifest
from ..format.tree import shift_entry_ids
from .select import UNAVAILABLE

__all__ = ["SKIPPED", "rank_view"]

SKIPPED = {"t": "skipped"}


def _substitute(node: Any, values: list[Any] | dict[str, Any] | None, shift: int) -> Any:
    """``node`` with each rank-local slot replaced: by its value in ``values`` (a list), by
    ``values`` itself (a dict: one node for every slot), or by :data:`SKIPPED` (None)."""
    if isinstance(node, dict):
        tag = node.get("t")
        if tag == "rank_local":
            if values is None:
                return SKIPPED
            return values if isinstance(values, dict) else shift_entry_ids(values[node["slot"]], shift)
        if tag in ("tensor", "pickle", "dtensor"):
            return node
        return {k: _substitute(v, values, shift) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v, values, shift) for v in node]
    return node


def rank_view(manifest: Manifest, rank: int, world_size: int, *, skip_rank_local: bool) -> Manifest:
    """The manifest as rank ``rank`` of ``world_size`` loads it."""
    if manifest.rank_local is None:
        return manifest
    if skip_rank_local:
        return manifest.model_copy(update={"tree": _substitute(manifest.tree, None, 0), "rank_local": None})
    if manifest.world_size != world_size:
        why = (
            f"step {manifest.step} holds rank-local values (RNG states, loader positions) of each of its "
            f"{manifest.world_size} ranks; this job has {world_size} rank(s), so they cannot be restored: "
            "load(..., skip_rank_local=True) restores everything else and leaves them as they are"
        )
        unavailable = {"t": UNAVAILABLE, "why": why}
        return manifest.model_copy(update={"tree": _substitute(manifest.tree, unavailable, 0), "rank_local": None})
    part = manifest.rank_local[rank]
    offset = len(manifest.entries)
    return manifest.model_copy(
        update={
            "tree": _substitute(manifest.tree, part.values, offset),
            "entries": [*manifest.entries, *part.entries],
            "rank_local": None,
        }
    )
