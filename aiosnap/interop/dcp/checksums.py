"""The crc32c of every item of a DCP checkpoint aiosnap wrote: a sidecar file beside it.

DCP's ``.metadata`` has no place for checksums that torch's own ``FileSystemReader`` would
tolerate, so aiosnap's writer records them in ``.aiosnap-checksums.<save id>.json`` in the
checkpoint folder, written before the ``.metadata`` that commits the checkpoint (whose
``storage_meta.save_id`` is that save id). Per item: where it is (file, offset, length, as
in ``.metadata``), the crc32c of its whole bytes, and where its *payload* lies -- a tensor's
raw bytes, or the pickle of a value -- with their crc32c. aiosnap's reader checks them;
torch's ignores the file. Untrusted input: parsed and checked like a manifest (strict types,
the document's own crc32c). Pure code, no I/O, no torch.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator, model_validator

from ...core.names import check_object_name
from ...errors import ManifestError
from ...format.manifest import crc_matches, parse_json, signed_json, validated

__all__ = ["MAX_CHECKSUMS_BYTES", "ItemChecksums", "SaveChecksums", "checksums_name", "is_aiosnap_save_id"]

MAX_CHECKSUMS_BYTES = 256 * 1024**2
_SAVE_ID = re.compile(r"[0-9a-f]{16}")
_S = Strict()
_Int = Annotated[int, _S, Field(ge=0, lt=2**63)]
_Crc = Annotated[int, _S, Field(ge=0, lt=2**32)]


def is_aiosnap_save_id(save_id: str | None) -> bool:
    """Whether a ``.metadata``'s ``storage_meta.save_id`` is one aiosnap's writer makes
    (torch's writers use a UUID): then its checksums must be there."""
    return save_id is not None and _SAVE_ID.fullmatch(save_id) is not None


def checksums_name(save_id: str) -> str:
    return f".aiosnap-checksums.{save_id}.json"


ItemChecksums = Annotated[tuple[str, _Int, _Int, _Crc, _Int, _Int, _Crc], Strict(False)]
"""``[file, offset, length, crc32c, payload offset, payload bytes, payload crc32c]`` of one
item (offsets in the file)."""


class SaveChecksums(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    format: str = "aiosnap-dcp-checksums"
    version: Annotated[int, Field(ge=1, le=1)] = 1
    save_id: str
    items: list[ItemChecksums]

    @field_validator("format")
    @classmethod
    def _format(cls, value: str) -> str:
        if value != "aiosnap-dcp-checksums":
            raise ValueError("not aiosnap's DCP checksums")
        return value

    @field_validator("save_id")
    @classmethod
    def _save_id(cls, value: str) -> str:
        if not is_aiosnap_save_id(value):
            raise ValueError("invalid save id")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> SaveChecksums:
        seen: set[tuple[str, int]] = set()
        for name, offset, length, _, at, nbytes, _ in self.items:
            check_object_name(name)
            if (name, offset) in seen:
                raise ValueError(f"item at {offset} of {name!r} is listed twice")
            seen.add((name, offset))
            if not (offset <= at and at + nbytes <= offset + length):
                raise ValueError(f"the payload of the item at {offset} of {name!r} lies outside it")
        return self

    def by_place(self) -> dict[tuple[str, int, int], ItemChecksums]:
        """Each item's record, keyed by (file, offset, length)."""
        return {(item[0], item[1], item[2]): item for item in self.items}

    def to_json(self) -> bytes:
        return signed_json(self)

    @classmethod
    def from_json(cls, data: bytes, where: str) -> SaveChecksums:
        doc = parse_json(data, where, MAX_CHECKSUMS_BYTES, "checksums")
        if not crc_matches(data, doc.pop("crc32c", None) if isinstance(doc, dict) else None):
            raise ManifestError(f"{where}: the checksums file is damaged (its crc32c does not match its bytes)")
        return validated(cls, doc, where, "checksums")
