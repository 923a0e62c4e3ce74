"""Whether ``aiosnap gc`` may remove the attempt folder of a multi-rank save (whichever loop
calls it). Its markers (:mod:`aiosnap.format.markers`) are untrusted input, read with limits.

- A verdict younger than :data:`~aiosnap.format.markers.VERDICT_READ_S`: *live* (its ranks
  may still be reading it).
- A standing ``commit`` claim beside data: *undecided*, never removed -- its coordinator may
  still write the manifest (held up after claiming: a paused machine) -- unless the step's
  manifest names another save and was written after the claim (the claim lost, or was
  replaced). A claim alone (a removed step's kept verdict) holds nothing to protect; nor
  does one beside only objects that later steps reference (they stay anyway).
- A heartbeat still within its lease: *live*. Judged by the store's times against this
  host's clock, which may be off: so a heartbeat whose lease ran out less than
  :data:`CLOCK_SKEW_S` ago is *watched* -- read again once its lease and interval have passed
  on this process's own clock (:func:`judge` with ``seen``) -- and live if it changed.
- Otherwise: *removable*.
"""

from __future__ import annotations

import re
from collections.abc import Set
from dataclasses import dataclass, field
from typing import Literal

from ..format.markers import (
    MAX_HEARTBEAT_BYTES,
    MAX_VERDICT_BYTES,
    VERDICT_FILE,
    VERDICT_READ_S,
    Verdict,
    heartbeat_interval,
    heartbeat_lease,
)
from ..storage.base import ObjectInfo, Storage

__all__ = ["CLOCK_SKEW_S", "MAX_WATCH_S", "Look", "judge"]

CLOCK_SKEW_S = 300.0
"""How far the store's clock (its objects' times) may be from this host's: a heartbeat whose
lease ran out longer ago than this counts as stopped without being watched."""
MAX_WATCH_S = 120.0
"""The longest gc watches heartbeats (their lease and interval); an attempt whose heartbeats
need longer is kept, as live."""

_HEARTBEAT = re.compile(r"rank-[0-9]+\.alive")
_MARKER = re.compile(r"rank-[0-9]+\.(alive|failed)|" + VERDICT_FILE)

State = Literal["removable", "live", "undecided", "watch"]


@dataclass
class Look:
    """What gc made of one attempt folder."""

    state: State
    heartbeats: dict[str, bytes] = field(default_factory=dict)
    """The heartbeats read (name -> document): one that changed by the next look is live."""
    watch_s: float = 0.0
    """For ``watch``: how long to wait before looking again (the longest lease and interval)."""


def _base(obj: ObjectInfo) -> str:
    return obj.name.rsplit("/", 1)[-1]


async def _read(storage: Storage, name: str, limit: int) -> bytes | None:
    try:
        return await storage.read(name, limit=limit)
    except FileNotFoundError:
        return None


async def judge(
    storage: Storage,
    members: list[ObjectInfo],
    now: float,
    *,
    save_id: str,
    owner: str | None,
    manifest_mtime: float | None,
    seen: dict[str, bytes] | None = None,
    named: Set[str] = frozenset(),
) -> Look:
    """How the attempt ``save_id`` whose objects are ``members`` stands at ``now`` (epoch
    seconds); ``owner``/``manifest_mtime``: the save id the step's manifest names and when
    that was written (None: no readable manifest). With ``seen`` (a second look, after
    watching), a heartbeat that differs from ``seen`` is live and none is watched again.
    ``named``: objects committed manifests name (a removed step's data that later steps
    reference): they are not the claimed save's data, which gc would protect."""
    verdict = next((o for o in members if _base(o) == VERDICT_FILE), None)
    if verdict is not None:
        if verdict.mtime >= now - VERDICT_READ_S:
            return Look("live")
        document = await _read(storage, verdict.name, MAX_VERDICT_BYTES)
        found = None if document is None else Verdict.from_json(document)
        holds_data = any(not _MARKER.fullmatch(_base(o)) and o.name not in named for o in members)
        if found is not None and found.verdict == "commit" and holds_data:
            superseded = owner is not None and owner != save_id and (manifest_mtime or 0.0) > verdict.mtime
            if not superseded:
                return Look("undecided")
    look = Look("removable")
    for beat in (o for o in members if _HEARTBEAT.fullmatch(_base(o))):
        document = await _read(storage, beat.name, MAX_HEARTBEAT_BYTES)
        lease = None if document is None else heartbeat_lease(document)
        if document is None or lease is None:
            continue  # its rank is done with it, or it is not a heartbeat
        look.heartbeats[beat.name] = document
        if seen is not None:
            if seen.get(beat.name) != document:
                return Look("live")
            continue
        if beat.mtime + lease >= now:
            return Look("live")
        wait = lease + (heartbeat_interval(document) or 0.0)
        if now - beat.mtime <= wait + CLOCK_SKEW_S:  # maybe only this host's clock says it ran out
            look.state, look.watch_s = "watch", max(look.watch_s, wait)
    if look.state == "watch" and look.watch_s > MAX_WATCH_S:
        return Look("live")
    return look
