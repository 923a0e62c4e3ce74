"""The file that stands at a single-file checkpoint's path while its first save is in flight.

Lightning's checks need something at the path as soon as ``save_checkpoint`` returns
(``ModelCheckpoint``'s version counter, ``save_last="link"``). An empty file there made a
plain ``torch.load`` fail with a bare ``EOFError``. The placeholder is instead a small zip in
the layout ``torch.load`` reads, whose ``byteorder`` record is a message: ``torch.load``
(``weights_only`` True or False, ``mmap`` or not, a path or an open file) checks that record
before it unpickles anything, and raises ``ValueError("Unknown endianness type: <the
message>")``, which says that aiosnap's save is still running and how to wait for it.
Nothing in it is ever executed or unpickled.

Pure code: bytes in, bytes out (the caller writes and reads the file).
"""

from __future__ import annotations

import io
import time
import zipfile

__all__ = ["MAX_PLACEHOLDER_BYTES", "placeholder_bytes", "placeholder_message"]

MAX_PLACEHOLDER_BYTES = 4096
"""A file larger than this is never a placeholder (nothing larger is read to tell)."""

_FOLDER = "aiosnap-placeholder"
_NAMES = [f"{_FOLDER}/byteorder", f"{_FOLDER}/data.pkl", f"{_FOLDER}/version"]
_HEAD = "aiosnap: this file is a placeholder, not a checkpoint yet"
_EMPTY_PICKLE = b"\x80\x02N."  # pickle protocol 2 of None; never reached: torch stops at byteorder


def placeholder_bytes(pid: int, started: float | None = None) -> bytes:
    """The placeholder that process ``pid`` puts at a path whose first save it starts (at
    ``started``, seconds since the epoch; now by default)."""
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(time.time() if started is None else started))
    message = (
        f"\n{_HEAD}: its first save (process {pid}, started {when}) is still running, or that process "
        "stopped before the save committed; when it commits, the checkpoint replaces this file whole. "
        "To wait for it in the process that saves, call "
        "aiosnap.integrations.lightning.wait_for_checkpoint(path) before torch.load(path), or load through "
        "the plugin (AiosnapCheckpointIO.load_checkpoint and Trainer.fit(ckpt_path=...) with the plugin "
        "wait); from another process, load it once the save has committed."
    )
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name, data in zip(_NAMES, (message.encode(), _EMPTY_PICKLE, b"3\n"), strict=True):
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            archive.writestr(info, data)
    data = buffer.getvalue()
    assert len(data) <= MAX_PLACEHOLDER_BYTES
    return data


def placeholder_message(data: bytes) -> str | None:
    """The message of a placeholder (untrusted bytes read from a file), or None when
    ``data`` is not exactly one. Only *stored* entries, each no larger than ``data``, are
    read: a compressed entry (which could expand without bound) makes it no placeholder."""
    if len(data) > MAX_PLACEHOLDER_BYTES:
        return None
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = archive.infolist()
            if sorted(e.filename for e in entries) != _NAMES or not all(_stored_within(e, len(data)) for e in entries):
                return None
            message = archive.read(_NAMES[0]).decode("utf-8")
    except Exception:  # any malformed zip (untrusted bytes) is simply not a placeholder
        return None
    return message.strip() if message.startswith(f"\n{_HEAD}") else None


def _stored_within(entry: zipfile.ZipInfo, limit: int) -> bool:
    """True when ``entry`` is stored as is (not compressed), in at most ``limit`` bytes."""
    return entry.compress_type == zipfile.ZIP_STORED and entry.file_size == entry.compress_size <= limit
