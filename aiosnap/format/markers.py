"""The small objects through which the ranks of a multi-rank save tell each other what
happened, beside their parts (:mod:`.parts`) in the attempt folder ``<step>/<save id>/``.
Pure code: names and documents, no I/O. Everything read back is untrusted input.

- ``rank-<r>.alive``: rank ``r``'s heartbeat, rewritten while its part is in flight
  (:mod:`aiosnap.transfer.heartbeat`): a counter, the rank's phase and its progress (chunks
  captured and uploaded); ``aiosnap gc`` leaves an attempt alone while one changes within
  the lease it states.
- ``rank-<r>.failed``: rank ``r``'s part failed (see :func:`~.parts.failed_name`).
- ``verdict``: the one verdict of the save, written only if absent (so exactly one writer
  wins): ``commit``, claimed by the coordinator once every part is in and every object it
  names is there, right before it writes the step's manifest; or ``abort``, by the
  coordinator giving up, or by a follower that found the coordinator stopped. An ``abort``
  is final: no manifest of this save is ever written after it, and every rank removes its
  own data. A ``commit`` is followed by the manifest; only the coordinator may turn it into
  ``abort``, and only when its manifest was refused, or found, once written, to name objects
  that are gone. When a committed multi-rank step is later removed (retention, a re-save),
  its ``commit`` verdict stays for :data:`VERDICT_READ_S` as the only object of its folder:
  a rank that had not seen the manifest yet learns that its save did commit.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..core.names import attempt_prefix

__all__ = [
    "MAX_HEARTBEAT_BYTES",
    "MAX_VERDICT_BYTES",
    "VERDICT_FILE",
    "VERDICT_READ_S",
    "Verdict",
    "heartbeat_document",
    "heartbeat_interval",
    "heartbeat_lease",
    "heartbeat_name",
    "heartbeat_phase",
    "heartbeat_progress",
    "verdict_name",
]

MAX_HEARTBEAT_BYTES = 4096
MAX_VERDICT_BYTES = 8192
MAX_LEASE_S = 86400.0
VERDICT_FILE = "verdict"
VERDICT_READ_S = 60.0
"""How long after a multi-rank save's verdict was written its ranks may still be reading it:
``aiosnap gc`` leaves the attempt alone that long, and a removed step's verdict stays that long."""
Phase = Literal["uploading", "gathering"]


def heartbeat_name(step: int, save_id: str, rank: int) -> str:
    return f"{attempt_prefix(step, save_id)}/rank-{rank}.alive"


def verdict_name(step: int, save_id: str) -> str:
    return f"{attempt_prefix(step, save_id)}/{VERDICT_FILE}"


def heartbeat_document(
    rank: int, beat: int, phase: Phase, pid: int, interval_s: float, timeout_s: float, progress: int = 0
) -> bytes:
    return json.dumps({
        "format": "aiosnap-heartbeat", "rank": rank, "beat": beat, "phase": phase, "pid": pid,
        "interval_s": interval_s, "timeout_s": timeout_s, "progress": progress,
    }).encode()  # fmt: skip


def _heartbeat_field(document: bytes, key: str) -> object:
    try:
        doc = json.loads(document)
    except (ValueError, RecursionError):
        return None
    return doc.get(key) if isinstance(doc, dict) and doc.get("format") == "aiosnap-heartbeat" else None


def heartbeat_phase(document: bytes) -> Phase | None:
    """What the rank was doing when it wrote ``document`` (None: not a heartbeat)."""
    phase = _heartbeat_field(document, "phase")
    if phase == "uploading" or phase == "gathering":
        return phase
    return None


def _seconds(document: bytes, key: str) -> float | None:
    value = _heartbeat_field(document, key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= MAX_LEASE_S:
        return None
    return float(value)


def heartbeat_lease(document: bytes) -> float | None:
    """How long after it was written a heartbeat proves its rank alive (its ``timeout_s``),
    for ``aiosnap gc``; None when ``document`` is not a heartbeat."""
    return _seconds(document, "timeout_s")


def heartbeat_interval(document: bytes) -> float | None:
    """How often the rank that wrote ``document`` rewrites it (None: not a heartbeat)."""
    return _seconds(document, "interval_s")


def heartbeat_progress(document: bytes) -> int | None:
    """The rank's progress when it wrote ``document``: a count that grows with every chunk
    it captured or uploaded (None: not a heartbeat)."""
    progress = _heartbeat_field(document, "progress")
    if not isinstance(progress, int) or isinstance(progress, bool) or not 0 <= progress < 2**63:
        return None
    return progress


class Verdict(BaseModel):
    """The document of a save's ``verdict`` object."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    format: Literal["aiosnap-verdict"] = "aiosnap-verdict"
    verdict: Literal["commit", "abort"]
    save_id: str = Field(max_length=16)
    rank: int = Field(ge=0, lt=2**31)
    """The rank that wrote it."""
    error: str = Field("", max_length=200)
    message: str = Field("", max_length=1000)

    def to_json(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_json(cls, data: bytes) -> Verdict | None:
        """The verdict ``data`` holds; None when it is not one (damaged, foreign)."""
        if len(data) > MAX_VERDICT_BYTES:
            return None
        try:
            return cls.model_validate_json(data)
        except (ValidationError, ValueError):
            return None

    @property
    def reason(self) -> str:
        return f"{self.error}: {self.message} (rank {self.rank})" if self.error else f"(rank {self.rank})"
