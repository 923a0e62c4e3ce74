"""The folder an export writes: claimed before anything is written, cleared when replaced,
released when the export ends.

One export at a time writes a folder, and what it leaves is either a model or not one:

- **The claim**: :func:`claim_folder` first writes ``.aiosnap-export.json`` (who, when) if
  absent; a second export to the folder is refused while it is there (two exports at once
  would complete each other's shard names). The writer reads it back before it writes the
  index (:meth:`Claim.check`), so an export whose claim was taken away never publishes.
  The claim goes when the export ends (:meth:`Claim.release`), failed or not; a process
  killed mid-export leaves it, and the next export is refused with a message that names the
  file: delete it once no export is running. (On an S3 store configured without
  conditional writes, ``s3.conditional_commit: false``, the claim is only checked, not
  exclusive.)
- **What a folder already holds** (an index, ``model.safetensors``, ``*-0000k-of-0000n``
  shards, or a file its index names) is refused unless ``overwrite``; with ``overwrite`` it
  is deleted before a byte of the new export is written, the index first: a folder never
  mixes two exports, and the reader refuses several shards without an index
  (:class:`~.reader.SafetensorsFolder`), so a folder whose clearing or export was cut short
  is no model at all rather than a wrong one.
- **What a dead export left** under the claim (its open S3 multipart uploads and local
  temporary files, of export file names) is removed once the claim is held.

Runs on whichever event loop calls it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ...storage.base import Storage
from .layout import INDEX_FILE, MAX_INDEX_BYTES, SINGLE_FILE, parse_index

__all__ = ["CLAIM_FILE", "Claim", "claim_folder", "export_files"]

log = logging.getLogger("aiosnap")

CLAIM_FILE = ".aiosnap-export.json"
_SHARD = re.compile(r"[A-Za-z0-9._-]*-[0-9]{5}-of-[0-9]{5}\.safetensors")
_TEMP = re.compile(r"\.([A-Za-z0-9._-]*-[0-9]{5}-of-[0-9]{5}\.safetensors|model\.safetensors)\.[0-9a-f]{8}\.tmp")
_FAR_FUTURE = 2**40


def export_files(names: Sequence[str]) -> list[str]:
    """Of a folder's ``names``, those that make (part of) a Hugging Face model."""
    return sorted(n for n in names if n in (INDEX_FILE, SINGLE_FILE) or _SHARD.fullmatch(n))


def _prefix(folder: str) -> str:
    folder = folder.strip("/")
    return f"{folder}/" if folder else ""


@dataclass
class Claim:
    """This export's hold on ``folder`` of ``storage`` (see the module docstring)."""

    storage: Storage
    folder: str
    owner: str

    @property
    def name(self) -> str:
        return _prefix(self.folder) + CLAIM_FILE

    @property
    def where(self) -> str:
        return f"{self.storage.url}/{self.name}"

    async def holder(self) -> str | None:
        """The owner the claim file names now (None: no claim, or one unreadable)."""
        try:
            document = json.loads(await self.storage.read(self.name, limit=4096))
        except FileNotFoundError:
            return None
        except ValueError:
            return None
        owner = document.get("owner") if isinstance(document, dict) else None
        return owner if isinstance(owner, str) else None

    async def check(self) -> None:
        """Raise FileExistsError unless the folder is still claimed by this export."""
        holder = await self.holder()
        if holder != self.owner:
            raise FileExistsError(
                f"{self.where}: this export's claim on the folder was removed or taken by another "
                f"({holder or 'none'}): not writing the index"
            )

    async def release(self) -> None:
        """Remove the claim if it is still this export's (best effort: logged)."""
        try:
            if await self.holder() == self.owner:
                await self.storage.delete(self.name)
        except Exception as exc:
            log.warning("aiosnap: %s: could not remove the export's claim: %r", self.where, exc)


def _identity() -> dict[str, object]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "started_at": time.time()}


async def claim_folder(storage: Storage, folder: str, files: Sequence[str], *, overwrite: bool) -> Claim:
    """Claim ``folder`` for an export that writes ``files`` (and the index); refuse one
    holding an export unless ``overwrite``, which deletes it now (see the module docstring)."""
    claim = Claim(storage, folder.strip("/"), secrets.token_hex(8))
    document = json.dumps({"owner": claim.owner, **_identity()}).encode()
    try:
        await storage.write(claim.name, document, if_absent=True)
    except FileExistsError:
        if await claim.holder() != claim.owner:  # not our own retried write that landed
            raise FileExistsError(
                f"{claim.where}: another export is writing this folder, or one was killed: once none is "
                f"running, delete {CLAIM_FILE} and export again"
            ) from None
    try:
        await _clear(storage, claim.folder, files, overwrite)
        await _remove_leftovers(storage, claim.folder)
    except BaseException:
        await claim.release()
        raise
    return claim


async def _clear(storage: Storage, folder: str, files: Sequence[str], overwrite: bool) -> None:
    prefix = _prefix(folder)
    present = await storage.list_children(folder)
    named: list[str] = []
    if INDEX_FILE in present:
        try:
            old = await storage.read(prefix + INDEX_FILE, limit=MAX_INDEX_BYTES)
            named = sorted(set(parse_index(old, f"{storage.url}/{prefix}{INDEX_FILE}").values()))
        except Exception:  # an unreadable old index: the files of export names still go
            named = []
    clashes = sorted((set(export_files(present)) | set(named) | set(files)) & set(present))
    if not clashes:
        return
    if not overwrite:
        raise FileExistsError(
            f"{storage.url}/{prefix}: holds {clashes[0]!r} already (overwrite=True, or --overwrite, replaces it)"
        )
    ordered = [INDEX_FILE] if INDEX_FILE in clashes else []  # the folder stops being a model first
    for name in ordered + [n for n in clashes if n != INDEX_FILE]:
        await storage.delete(prefix + name)


async def _remove_leftovers(storage: Storage, folder: str) -> None:
    """Open uploads and temporary files of export names in ``folder`` (the claim is held:
    whoever left them is gone)."""
    prefix = _prefix(folder)
    for name, upload in await storage.stale_uploads(_FAR_FUTURE):
        if name.startswith(prefix) and "/" not in name[len(prefix) :] and export_files([name[len(prefix) :]]):
            await storage.abort_upload(name, upload)
    for name in await storage.list_children(folder):
        if _TEMP.fullmatch(name):
            await storage.delete(prefix + name)
