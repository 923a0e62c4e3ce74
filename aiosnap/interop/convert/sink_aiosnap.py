"""An export into an aiosnap root: one step, written by aiosnap's commit protocol.

The selected entries are packed into data objects of at most a slab
(``<step>/<save id>/rank-0/<n>.bin``, each piece 64-byte aligned, a large tensor spread over
several objects), each object written whole from its slab with its CRC32C; every range's
crc32c comes from the same pass. The manifest -- the selection's tree, full tensors only,
a crc32c on every range -- is checked by the reader's own parser before it is written, last,
and only if the step is still absent. A root that already holds the step is refused (as
``aiosnap download`` does); a failed export removes its attempt's folder.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from typing import Any

from ...catalog.steps import committed_save_id
from ...core.names import attempt_prefix, manifest_name, object_prefix
from ...errors import AiosnapError
from ...format.manifest import PLAIN_VERSION, Manifest
from ...storage.base import Storage
from .copier import DestObject, Piece, Slice
from .selection import Selection

__all__ = ["AiosnapSink"]

ALIGN = 64


class AiosnapSink:
    """Step ``step`` of the aiosnap root ``storage`` (see the module)."""

    def __init__(self, storage: Storage, step: int, metadata: dict[str, Any]) -> None:
        self.storage = storage
        self.url = storage.url
        self.step = step
        self.metadata = metadata
        self.save_id = secrets.token_hex(8)
        self._ranges: list[list[dict[str, Any]]] = []
        self._crcs: dict[tuple[str, int], int] = {}
        self._selection: Selection | None = None
        self._objects: list[DestObject] = []

    async def layout(self, selection: Selection, object_bytes: int) -> list[DestObject]:
        """The data objects (see the module); refuses a root that holds the step."""
        if await committed_save_id(self.storage, self.step) is not None or await self.storage.exists(
            manifest_name(self.step)
        ):
            raise AiosnapError(f"{self.url} already holds step {self.step}; not replacing it (export elsewhere)")
        self._selection = selection
        prefix = object_prefix(self.step, self.save_id, 0)
        objects: list[DestObject] = []
        current: DestObject | None = None
        position = 0
        self._ranges = [[] for _ in selection.entries]
        for index, entry in enumerate(selection.entries):
            done = 0
            while done < entry.nbytes:
                pad = -position % ALIGN
                if current is None or position + pad >= object_bytes:
                    current = DestObject(f"{prefix}/{len(objects)}.bin")
                    objects.append(current)
                    position, pad = 0, 0
                if pad:
                    current.segments.append(bytes(pad))
                    position += pad
                take = min(entry.nbytes - done, object_bytes - position)
                current.segments.append(Slice(index, done, take))
                self._ranges[index].append({"object": current.name, "offset": position, "nbytes": take})
                position += take
                done += take
        self._objects = objects
        return objects

    async def put(self, piece: Piece) -> None:
        await self.storage.write_checksummed(piece.obj.name, piece.data, piece.checksums)
        position = piece.offset
        for segment in piece.obj.segments:  # an object is one piece: every range's crc32c is here
            length = len(segment) if isinstance(segment, bytes) else segment.nbytes
            if isinstance(segment, Slice):
                self._crcs[(piece.obj.name, position)] = piece.checksums.of(position, position + length)
            position += length

    def manifest(self) -> Manifest:
        assert self._selection is not None
        entries = []
        for index, entry in enumerate(self._selection.entries):
            ranges = [{**r, "crc32c": self._crcs[(r["object"], r["offset"])]} for r in self._ranges[index]]
            entries.append({
                "path": entry.path, "kind": "pickle" if entry.kind == "pickle" else "tensor", "dtype": entry.dtype,
                "shape": entry.shape, "stride": entry.stride, "device": entry.device, "nbytes": entry.nbytes,
                "ranges": ranges,
            })  # fmt: skip
        doc = {
            "format": "aiosnap", "format_version": PLAIN_VERSION, "step": self.step, "save_id": self.save_id,
            "created_at": time.time(), "world_size": 1,
            "objects": [{"name": o.name, "rank": 0, "nbytes": o.nbytes} for o in self._objects],
            "entries": entries, "tree": self._selection.tree, "metadata": self.metadata,
        }  # fmt: skip
        built = Manifest.from_document(doc, f"{self.url} (export)")
        return Manifest.from_json(built.to_json(), f"{self.url} (export)")  # what a reader will parse

    async def commit(self) -> None:
        document = self.manifest().to_json()
        name = manifest_name(self.step)
        try:
            await self.storage.write(name, document, if_absent=True)
        except FileExistsError:
            if await committed_save_id(self.storage, self.step) != self.save_id:
                raise FileExistsError(
                    f"{self.url}: step {self.step} was committed by another writer meanwhile"
                ) from None

    async def abort(self) -> None:
        with contextlib.suppress(Exception):  # the export's own failure is what the caller hears
            await self.storage.delete_prefix(attempt_prefix(self.step, self.save_id))
