"""The base of an incremental save, and the check that its references still stand (loop).

The base is the latest committed step of the root, read at the save's preflight (the
ranges of the save this transfer side committed last are reused when the committed
manifest is still that save's: the same step and save id): its ranges, by
digest, are what the save may name instead of uploading (:mod:`.dedup`). Before the
manifest of a save that names earlier objects is committed, every one of them must still
be in storage with its recorded size (one size request each): an object another process
deleted meanwhile (``aiosnap purge``, ``rollback``, gc) fails the save with
:class:`~aiosnap.errors.CorruptCheckpointError` naming it, and nothing is committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from ..catalog.commit import whose_commit
from ..catalog.pins import pins_for
from ..catalog.steps import committed_document, read_manifest
from ..core.aio import run_all
from ..core.checksums import crc32c_of
from ..core.codec import check_frame, decompress_into
from ..core.console import STAYS_COMMITTED
from ..core.names import manifest_name
from ..errors import AiosnapError, CorruptCheckpointError
from ..format.manifest import Checksums, Manifest, build_manifest
from ..format.placement import BaseRanges, Landing, Reference, Reuse, landed_manifest
from ..format.spec import SaveSpec
from ..storage.base import Storage
from .readback import CheckedRanges, CheckedReuse

__all__ = [
    "CHECK_CONCURRENCY",
    "IncrementalSave",
    "check_references",
    "read_base",
    "take_back",
    "verify_ranges",
]

log = logging.getLogger("aiosnap")

CHECK_CONCURRENCY = 16
"""Size requests in flight while checking references."""


async def read_base(storage: Storage, latest: int | None, rank: int, known: BaseRanges | None) -> BaseRanges | None:
    """The ranges of step ``latest`` that ``rank`` may reuse, read from its manifest; or
    ``known`` when the committed manifest is the very save ``known`` holds (the step and
    its save id: another writer may have re-saved that step, removing the objects ``known``
    names; the bytes this process committed, byte for byte, are not parsed again). None
    (the save writes every byte) when there is no committed step or its manifest cannot be
    read."""
    if latest is None:
        return None
    try:
        if known is not None and known.step == latest:
            found = await committed_document(storage, latest)  # trusted bytes: no second validation
            if found is not None and found[1] == known.save_id:
                return known
        manifest = await read_manifest(storage, latest)
    except (AiosnapError, OSError) as exc:
        log.info("aiosnap: step %d of %s cannot serve as a base (this save writes whole): %r", latest, storage.url, exc)
        return None
    if known is not None and (known.step, known.save_id) == (manifest.step, manifest.save_id):
        return known
    return BaseRanges.of(manifest, rank)


async def check_references(storage: Storage, step: int, references: Sequence[Reference]) -> None:
    """Every referenced object is in storage with its recorded size; else
    :class:`CorruptCheckpointError` naming the step being saved and the object."""
    limit = asyncio.Semaphore(CHECK_CONCURRENCY)

    async def check(name: str, nbytes: int) -> None:
        async with limit:
            try:
                size = await storage.size(name)
            except FileNotFoundError:
                size = None
        if size != nbytes:
            found = "is gone" if size is None else f"has {size} bytes, not {nbytes}"
            raise CorruptCheckpointError(
                f"{storage.url} step {step}: referenced object {name!r} of an earlier step {found} "
                "(deleted by another process?); nothing was committed, the next save writes whole"
            )

    await run_all(check(name, nbytes) for name, _, nbytes in references)


async def take_back(
    storage: Storage, manifest: Manifest, gone: CorruptCheckpointError
) -> tuple[CorruptCheckpointError, bool]:
    """The one-rank incremental save of ``manifest`` committed, but checked once more (before
    its retention), an object it references is ``gone``: deleted between its check and its
    manifest's write, by a second job saving to this root (unsupported: pins and holds are
    per process). The step does not load, so its commit is taken back (its manifest deleted
    while it is still this save's) and retention does not run: it would count the step and
    delete the other writer's good ones. Returns the error the save fails with, and whether
    the commit was taken back (False: the manifest still stands, or another writer's does;
    the save's data is then left in place for ``aiosnap gc``). Run it to its end whatever
    cancels its caller (see :func:`~aiosnap.core.aio.complete_before_cancel`)."""
    step = manifest.step
    taken = False
    try:
        verdict = await whose_commit(storage, step, manifest.save_id)
        if verdict == "ours":
            await storage.delete(manifest_name(step))
            taken = True
            what = "its commit was taken back: the step is not committed"
        elif verdict == "other":
            what = "another writer's manifest stands for the step now"
        else:
            what = f"its manifest could not be read back: the step may be committed, and then it {STAYS_COMMITTED}"
    except Exception as exc:  # the step stays committed and unloadable: say so loudly
        log.error("aiosnap: %s step %d references a deleted object; taking its commit back failed: %r",
                  storage.url, step, exc)  # fmt: skip
        what = f"taking its commit back failed ({exc!r}): the step {STAYS_COMMITTED}; roll it back or purge it"
    return CorruptCheckpointError(
        f"{storage.url} step {step}: an object it references was deleted while it committed (a second job saving "
        f"to this root?): {what}; retention did not run, and the next save writes whole. The check found: "
        f"{str(gone).split(';')[0]}"
    ), taken


async def verify_ranges(storage: Storage, manifest: Manifest, names: set[str], concurrency: int) -> None:
    """Read every range of ``manifest`` in the objects ``names`` and check its crc32c
    (:class:`CorruptCheckpointError` naming the first that does not match): what a resumed
    incremental save does with the places its journal recorded, before it commits them. A
    compressed range is also decompressed and its raw bytes' crc32c checked: its frame's
    crc32c says nothing of the codec fields the journal recorded for it. Holds at most
    ``concurrency`` ranges in memory (a compressed one: its frame and its raw bytes)."""
    limit = asyncio.Semaphore(concurrency)
    compressed = {(r.object, r.offset): r for _, r in manifest.whole_ranges() if r.codec is not None}

    async def check(name: str, offset: int, nbytes: int, crc: int | None) -> None:
        async with limit:
            buffer = memoryview(bytearray(nbytes))
            try:
                got = await storage.read_into(name, offset, buffer)
            except FileNotFoundError:
                got = -1
            good = got == nbytes and crc is not None and await asyncio.to_thread(crc32c_of, buffer) == crc
            raw = compressed.get((name, offset))
            if good and raw is not None:
                good = await asyncio.to_thread(_inflates_to, buffer, raw.nbytes, raw.shuffle or 1, raw.crc32c)
            if not good:
                raise CorruptCheckpointError(
                    f"{storage.url} step {manifest.step}: {nbytes} bytes at {offset} of {name!r} do not match "
                    "the crc32c the save recorded"
                )

    await run_all(
        check(span.object, span.offset, span.nbytes, span.crc32c)
        for _, span in manifest.all_ranges()
        if span.object in names
    )  # fmt: skip


def _inflates_to(frame: memoryview, nbytes: int, itemsize: int, crc: int | None) -> bool:
    """Whether ``frame`` decompresses (unshuffled by ``itemsize``) to ``nbytes`` raw bytes
    whose crc32c is ``crc`` (a worker thread)."""
    try:
        check_frame(frame, nbytes)  # before anything of that size is allocated
        raw = memoryview(bytearray(nbytes))
        decompress_into(frame, raw, itemsize)
    except ValueError:
        return False
    return crc is not None and crc32c_of(raw) == crc


class IncrementalSave:
    """One incremental save's base, the pins that keep its objects, and the check of its
    references before the commit (transfer loop). ``known``: the base this transfer side
    committed last on the root (None: read one); ``whole``: write every byte (the last
    save found a reference gone); ``checked``: the stored ranges this transfer side knows
    to be good (a base range is named only once it is: :mod:`.readback`)."""

    def __init__(
        self, storage: Storage, spec: SaveSpec, known: BaseRanges | None, *, whole: bool, dedup: bool = True,
        checked: CheckedRanges | None = None,
    ) -> None:  # fmt: skip
        self.storage = storage
        self.spec = spec
        self.known = known
        self.whole = whole
        self.dedup = dedup
        """False: only compressed (every piece written, no digests, no base)."""
        self.checked = checked if checked is not None else CheckedRanges()
        self.reuse = CheckedReuse(storage, Reuse(BaseRanges(-1, "", {})), self.checked, spec.step)
        """Nothing to reuse until :meth:`start` found a base (digests are taken anyway:
        the next save compares with them)."""
        self._token: int | None = None

    async def start(self, latest: int | None) -> None:
        """Find the base (the root's latest step ``latest``, older than this one) and pin
        its objects, before the first upload."""
        if not self.dedup or self.whole or latest is None or latest >= self.spec.step:
            return
        base = await read_base(self.storage, latest, self.spec.rank, self.known)
        if base is None:
            return
        self._token = pins_for(self.storage.url).pin(base.names)
        self.checked.adopt(self.storage.url, base)
        reuse = Reuse(base, compressed=self.spec.distributed is None)
        self.reuse = CheckedReuse(self.storage, reuse, self.checked, self.spec.step)

    def manifest(self, crcs: Checksums, landings: Sequence[Landing]) -> Manifest:
        """The manifest to commit: each piece where it landed."""
        plan = [(c.object_name, [p.dst_offset for p in c.pieces]) for c in self.spec.chunks]
        return landed_manifest(build_manifest(self.spec, crcs), plan, landings)

    async def check(self, manifest: Manifest) -> None:
        """Every object ``manifest`` references is still there (see the module docstring)."""
        references = [(o.name, o.rank, o.nbytes) for o in manifest.references or ()]
        if references:
            await check_references(self.storage, self.spec.step, references)

    def release(self) -> None:
        """The save is over (committed, failed or cancelled): unpin."""
        if self._token is not None:
            pins_for(self.storage.url).release(self._token)
            self._token = None
