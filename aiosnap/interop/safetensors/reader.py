"""A Hugging Face safetensors folder seen as a read-only aiosnap root: the safetensors source.

:class:`SafetensorsFolder` wraps the storage of a folder (a local path or ``s3://``) and
presents it as a root holding one committed step (:data:`STEP`), whose manifest is
translated from the files' headers: one entry per tensor at ``prefix + name``
(``model/lm_head.weight``), its bytes as byte ranges of its file. So the whole load
machinery works on it unchanged: ``load(state)`` in place into a plain model, into
FSDP2/TP DTensors on any mesh (each rank reads only the byte ranges of its own shards),
partial loads, staging slabs, the RAM budget; and any converter that takes a Manifest +
Storage reads it.

The files are found from ``model.safetensors.index.json`` (its weight map), else
``model.safetensors``, else the folder's one ``*.safetensors`` file. Several files with no
index are refused, as is one named ``*-0000k-of-0000n`` with n > 1: an index is written
last, so a folder of shards without one is an export that did not finish (or whose
replacement was cut short), never a model; Hugging Face's loaders refuse it too. Each file's header
is read with one ranged read of its first bytes (a second one only for headers larger than
that) and checked as untrusted input (:func:`~.header.parse_header`; the index too,
:func:`~.layout.parse_index`); the weight map must agree with the headers. safetensors
records no checksums: the translated ranges are *unverified* (``crc32c`` None), which is
allowed only in translated manifests (aiosnap never commits one). A tensor's bytes are cut
into ranges of :data:`RANGE_BYTES`, so that a rank loading a shard of a large tensor reads
little more than its shard.

Every coroutine runs on the loop of whoever owns the storage (a checkpointer's background
loop); the translation happens once, at the first request.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
from collections.abc import Sequence
from typing import Any

from ...catalog.steps import trust_translated
from ...core.names import MANIFEST_FILE, attempt_prefix, manifest_name, step_dir
from ...errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from ...format.manifest import PLAIN_VERSION, ByteRange, DataObject, EntryRecord, Manifest, signed_json
from ...format.tiling import row_major_strides
from ...storage.base import BytesLike, ObjectInfo, Storage
from .header import ParsedHeader, header_length, parse_header
from .layout import INDEX_FILE, MAX_INDEX_BYTES, SINGLE_FILE, check_shard_file, parse_index

__all__ = ["RANGE_BYTES", "STEP", "SafetensorsFolder", "translate"]

STEP = 0
"""The step a safetensors folder holds, as aiosnap sees it."""
RANGE_BYTES = 4 * 1024**2
"""Largest byte range a tensor is cut into (a multiple of every element size)."""
_FIRST_READ = 256 * 1024
"""Bytes read from the start of a file to find its header (most headers fit)."""
_HEADER_READS = 8
_SHARD_OF = re.compile(r".*-[0-9]+-of-([0-9]+)\.safetensors")


_RANGE_FIELDS = set(ByteRange.model_fields)
_ENTRY_FIELDS = set(EntryRecord.model_fields)
"""Every field is set: one set shared by all the records a translation builds (each
record's own would cost 700 bytes a tensor; a frozen record never changes it)."""


def _ranges(obj: str, start: int, nbytes: int) -> list[ByteRange]:
    return [
        ByteRange.model_construct(
            _RANGE_FIELDS, object=obj, offset=start + at, nbytes=min(RANGE_BYTES, nbytes - at), crc32c=None
        )
        for at in range(0, nbytes, RANGE_BYTES)
    ]


def translate(headers: dict[str, tuple[int, ParsedHeader]], prefix: str, where: str) -> Manifest:
    """The manifest of a folder whose files (name -> (size, checked header)) are
    ``headers``: entries at ``prefix + name``, in file order.

    Built without pydantic's validation (``model_construct``): every value comes from a
    header :func:`~.header.parse_header` checked (names, dtypes, shapes below 2**63, ranges
    that tile each file), which is what validating would check again, at a cost of about
    a second per 10^4 tensors. Worker thread (large folders take a while)."""
    digest = hashlib.blake2b(digest_size=8)
    for file in sorted(headers):
        size, header = headers[file]
        digest.update(f"{file}\0{size}\0{header.data_start}\0".encode())
        for t in header.tensors:
            digest.update(f"{t.name}\0{t.dtype}\0{t.shape}\0{t.begin}\0".encode())
    save_id = digest.hexdigest()
    folder = attempt_prefix(STEP, save_id)
    keys = [k for k in prefix.split("/") if k]
    entries: list[EntryRecord] = []
    items: list[list[Any]] = []
    seen: dict[str, str] = {}
    metadata: dict[str, str] = {}
    for file in sorted(headers):
        size, header = headers[file]
        metadata.update(header.metadata)
        obj = f"{folder}/{file}"
        for t in header.tensors:
            if t.name in seen:
                raise CorruptCheckpointError(f"{where}: tensor {t.name!r:.120} is in both {seen[t.name]} and {file}")
            seen[t.name] = file
            items.append([t.name, {"t": "tensor", "id": len(entries)}])
            entries.append(
                EntryRecord.model_construct(
                    _ENTRY_FIELDS, path=prefix + t.name, kind="tensor", dtype=t.aiosnap_dtype, shape=list(t.shape),
                    stride=row_major_strides(t.shape), device="cpu", nbytes=t.nbytes,
                    ranges=_ranges(obj, header.data_start + t.begin, t.nbytes), shards=None,
                )
            )  # fmt: skip
    tree: Any = {"t": "dict", "items": items}
    for key in reversed(keys):
        tree = {"t": "dict", "items": [[key, tree]]}
    return Manifest.model_construct(
        format="aiosnap", format_version=PLAIN_VERSION, step=STEP, save_id=save_id, created_at=0.0, world_size=1,
        objects=[DataObject(name=f"{folder}/{file}", rank=0, nbytes=headers[file][0]) for file in sorted(headers)],
        entries=entries, tree=tree, metadata={"source": "safetensors", "header_metadata": metadata}, rank_local=None,
        foreign="safetensors",
    )  # fmt: skip


class SafetensorsFolder(Storage):
    """A read-only root over ``inner``, the storage of a safetensors folder (see the
    module docstring). ``prefix`` is where its tensors appear in the state (``model/``)."""

    settled_writes = True
    read_only = True

    def __init__(self, inner: Storage, *, prefix: str = "model/") -> None:
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        self.inner = inner
        self.prefix = prefix
        self.url = inner.url
        self._manifest: Manifest | None = None
        self._document = b""
        self._lock: asyncio.Lock | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"inner": self.inner, "prefix": self.prefix}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["inner"], prefix=state["prefix"])  # type: ignore[misc]

    # -- the translation ---------------------------------------------------------------

    async def manifest(self) -> Manifest:
        """The translated manifest (the headers are read at the first call)."""
        if self._manifest is None:
            self._lock = self._lock or asyncio.Lock()
            async with self._lock:
                if self._manifest is None:
                    manifest = await self._translate()
                    # served from memory, never stored (to_json refuses a translated manifest)
                    self._document = await asyncio.to_thread(signed_json, manifest)
                    trust_translated(STEP, self._document, manifest)
                    self._manifest = manifest
        return self._manifest

    async def translated_manifest(self, step: int) -> Manifest:
        """What :func:`~aiosnap.catalog.steps.read_manifest` gives for this folder: the
        translated manifest of its one step (the bytes it serves are never parsed again)."""
        if step != STEP:
            raise CheckpointNotFoundError(f"{self.url} is a safetensors folder: it holds step {STEP}, not {step}")
        return await self.manifest()

    async def _files(self) -> tuple[list[str], dict[str, str] | None]:
        """The shard files, and the index's weight map when there is one."""
        where = f"{self.url}/{INDEX_FILE}"
        try:
            data = await self.inner.read(INDEX_FILE, limit=MAX_INDEX_BYTES)
        except FileNotFoundError:
            data = None
        if data is not None:
            weight_map = await asyncio.to_thread(parse_index, data, where)
            return sorted(set(weight_map.values())), weight_map
        if await self.inner.exists(SINGLE_FILE):
            return [SINGLE_FILE], None
        found = sorted(n for n in await self.inner.list_children("") if n.endswith(".safetensors"))
        files = [check_shard_file(n, self.url) for n in found if not n.startswith(".")]
        if not files:
            raise CheckpointNotFoundError(f"{self.url}: no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors file")
        sharded = _SHARD_OF.fullmatch(files[0])
        if len(files) > 1 or (sharded is not None and int(sharded.group(1)) > 1):
            raise CheckpointNotFoundError(
                f"{self.url}: {len(files)} shard file(s) ({files[0]}, ...) but no {INDEX_FILE}: an export that "
                "did not finish (or was being replaced), not a model"
            )
        return files, None

    async def _header(self, file: str) -> tuple[int, ParsedHeader]:
        where = f"{self.url}/{file}"
        try:
            size = await self.inner.size(file)
        except FileNotFoundError as exc:
            raise CorruptCheckpointError(f"{where}: named by the index, but missing") from exc
        first = bytearray(min(size, _FIRST_READ))
        got = await self.inner.read_into(file, 0, memoryview(first))
        length = header_length(bytes(first[: min(got, 8)]), size, where)  # checked against the size before reading more
        head = memoryview(first)[:got]
        if 8 + length > got:
            whole = bytearray(8 + length)
            whole[:got] = head
            head.release()
            got += await self.inner.read_into(file, got, memoryview(whole)[got:])
            head = memoryview(whole)[:got]
        parsed = await asyncio.to_thread(parse_header, head, size, where)
        return size, parsed

    async def _translate(self) -> Manifest:
        files, weight_map = await self._files()
        limit = asyncio.Semaphore(_HEADER_READS)

        async def one(file: str) -> tuple[int, ParsedHeader]:
            async with limit:
                return await self._header(file)

        found = await asyncio.gather(*(one(f) for f in files))
        headers = dict(zip(files, found, strict=True))
        if weight_map is not None:
            _check_weight_map(weight_map, headers, f"{self.url}/{INDEX_FILE}")
        return await asyncio.to_thread(translate, headers, self.prefix, self.url)

    def _file(self, name: str) -> str:
        """The file behind object ``name`` of the translated manifest."""
        manifest = self._manifest
        folder = attempt_prefix(STEP, manifest.save_id) + "/" if manifest is not None else None
        if folder is None or not name.startswith(folder):
            raise FileNotFoundError(f"{self.url}: no object {name!r}")
        return check_shard_file(name[len(folder) :], self.url)

    # -- the read-only protocol ----------------------------------------------------------

    async def read(self, name: str, *, limit: int | None = None) -> bytes:
        if name == manifest_name(STEP):
            await self.manifest()
            return self._document if limit is None or len(self._document) <= limit else self._document[: limit + 1]
        await self.manifest()
        return await self.inner.read(self._file(name), limit=limit)

    async def size(self, name: str) -> int:
        if name == manifest_name(STEP):
            await self.manifest()
            return len(self._document)
        await self.manifest()
        return await self.inner.size(self._file(name))

    async def read_into(self, name: str, offset: int, dest: memoryview) -> int:
        await self.manifest()
        return await self.inner.read_into(self._file(name), offset, dest)

    async def read_scatter(self, name: str, offset: int, buffers: Sequence[memoryview]) -> int:
        await self.manifest()
        return await self.inner.read_scatter(self._file(name), offset, buffers)

    async def exists(self, name: str) -> bool:
        manifest = await self.manifest()
        if name == manifest_name(STEP):
            return True
        if not name.startswith(attempt_prefix(STEP, manifest.save_id) + "/"):
            return False
        return await self.inner.exists(self._file(name))

    async def list_children(self, prefix: str = "") -> list[str]:
        manifest = await self.manifest()
        wanted = prefix.strip("/")
        if wanted == "":
            return [step_dir(STEP)]
        if wanted == step_dir(STEP):
            return sorted([MANIFEST_FILE, manifest.save_id])
        return []

    async def walk(self, prefix: str = "") -> list[ObjectInfo]:
        manifest = await self.manifest()
        found = [ObjectInfo(manifest_name(STEP), len(self._document), 0.0)]
        found += [ObjectInfo(o.name, o.nbytes, 0.0) for o in manifest.objects]
        return [o for o in found if o.name.startswith(prefix)]

    def _read_only(self) -> StorageError:
        return StorageError(f"{self.url}: a safetensors folder is read-only here (export to it instead)")

    async def write(self, name: str, data: BytesLike, *, if_absent: bool = False) -> None:
        raise self._read_only()

    async def delete(self, name: str) -> None:
        raise self._read_only()

    async def delete_prefix(self, prefix: str) -> None:
        raise self._read_only()

    def reading(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self.inner.reading()

    async def connect(self) -> None:
        await self.inner.connect()

    async def check_root(self) -> None:
        await self.manifest()

    async def close(self) -> None:
        await self.inner.close()


def _check_weight_map(weight_map: dict[str, str], headers: dict[str, tuple[int, ParsedHeader]], where: str) -> None:
    """Every tensor of the weight map is in the file it names, and every tensor of the
    files is in the weight map."""
    held = {t.name: file for file, (_, header) in headers.items() for t in header.tensors}
    for name, file in weight_map.items():
        if held.get(name) != file:
            found = f"in {held[name]}" if name in held else "in no file"
            raise CorruptCheckpointError(f"{where}: names {name!r:.120} in {file}, but it is {found}")
    extra = sorted(set(held) - set(weight_map))
    if extra:
        raise CorruptCheckpointError(f"{where}: {len(extra)} tensor(s) of the files are not in it ({extra[0]!r:.120})")
