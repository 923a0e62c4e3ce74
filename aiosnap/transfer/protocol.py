"""The messages between the trainer and the upload process (``upload.executor: process``).

A Unix socket pair carries small tuples (``multiprocessing.connection`` framing): commands
trainer -> upload process (``config``, ``open``, ``begin``, ``staged``, ``may_upload``,
``captured``, ``abort``, ``close``) and reports back (``ready``, ``preflight``,
``sent`` (upload progress: bytes of a chunk that reached storage, one report per request),
``done_with``, ``stage``, ``finished``, ``closed``), in order. They describe chunks, never
carry their bytes: those stay in the shared staging arena or the spool files.

Exceptions cross with their type: pickled when they survive a round trip, else rebuilt as
an instance of the same class carrying the message (SDK errors whose constructor wants
other arguments), else an :class:`~aiosnap.errors.UploadProcessError` naming the type.
Their cause goes along (``raise ... from``), and the upload process's traceback as a note.
"""

from __future__ import annotations

import importlib
import pickle
import traceback
from typing import Any

from ..errors import UploadProcessError

__all__ = ["ExceptionBlob", "pack_exception", "unpack_exception"]

ExceptionBlob = tuple[Any, ...]
"""(how, payload, cause blob or None, traceback text): how is "pickle" (payload: bytes) or
"rebuild" (payload: module, qualname, message)."""
_CAUSES = 3


def pack_exception(exc: BaseException, depth: int = 0) -> ExceptionBlob:
    """``exc`` in a form that crosses the boundary with its type (upload process side)."""
    cause = exc.__cause__
    packed_cause = pack_exception(cause, depth + 1) if cause is not None and depth < _CAUSES else None
    trace = "".join(traceback.format_exception(exc, chain=False)) if depth == 0 else ""
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)  # noqa: S301 - our own bytes, checked to come back
        return ("pickle", blob, packed_cause, trace)
    except Exception:
        kind = type(exc)
        return ("rebuild", (kind.__module__, kind.__qualname__, str(exc)), packed_cause, trace)


def unpack_exception(blob: ExceptionBlob) -> BaseException:
    """The exception :func:`pack_exception` sent (trainer side)."""
    how, payload, cause, trace = blob
    exc = _unpack_one(how, payload)
    if cause is not None:
        exc.__cause__ = unpack_exception(cause)
    if trace:
        exc.add_note(f"raised in the upload process:\n{trace.rstrip()}")
    return exc


def _unpack_one(how: str, payload: Any) -> BaseException:
    if how == "pickle":
        exc: BaseException = pickle.loads(payload)  # noqa: S301 - from our own upload process
        return exc
    module, qualname, message = payload
    try:
        kind: Any = importlib.import_module(module)
        for part in qualname.split("."):
            kind = getattr(kind, part)
        if isinstance(kind, type) and issubclass(kind, BaseException):
            rebuilt = kind.__new__(kind, message)
            rebuilt.args = (message,)
            return rebuilt
    except Exception as exc:  # the type cannot be made here: say what it was
        return UploadProcessError(f"{module}.{qualname}: {message} (not rebuilt here: {exc!r})")
    return UploadProcessError(f"{module}.{qualname}: {message}")
