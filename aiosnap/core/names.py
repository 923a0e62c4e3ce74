"""Names inside a storage root: step folders, attempt folders, manifests, object names.

Pure functions, no I/O. Only the exact names aiosnap writes are taken for its own: a
step folder is the zero-padded decimal step (``000000000300``), an attempt folder a save
id; anything else a user keeps in a root is neither listed nor deleted.
"""

from __future__ import annotations

import re

__all__ = [
    "MANIFEST_FILE",
    "STEP_LIMIT",
    "attempt_of_object",
    "attempt_prefix",
    "check_object_name",
    "check_save_id",
    "manifest_name",
    "object_prefix",
    "parse_step_dir",
    "step_dir",
]

MANIFEST_FILE = "manifest.json"
STEP_DIGITS = 12
STEP_LIMIT = 10**20
"""Steps are below this: a step folder's name has at most 20 digits."""
_SAVE_ID = re.compile(r"[0-9a-f]{16}")
_STEP_DIR = re.compile(r"[0-9]{12,20}")


def step_dir(step: int) -> str:
    """Folder name of a step: zero-padded to 12 digits so names sort like numbers."""
    return f"{step:0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step a folder name stands for, or None when aiosnap would not have written it
    (``2``, ``²``, ``0300``, ``2024``, ``000000000300.bak`` are not step folders)."""
    if not _STEP_DIR.fullmatch(name):
        return None
    step = int(name)
    return step if step_dir(step) == name else None


def check_save_id(save_id: str) -> str:
    """Return ``save_id`` if it is a name aiosnap makes (16 lower-case hex digits), else
    raise ValueError: it becomes a folder name, and anything else in a step folder is not
    aiosnap's to touch."""
    if not isinstance(save_id, str) or not _SAVE_ID.fullmatch(save_id):
        raise ValueError(f"invalid save id {save_id!r:.80}")
    return save_id


def attempt_prefix(step: int, save_id: str) -> str:
    """Root-relative folder of one save attempt of ``step``."""
    return f"{step_dir(step)}/{check_save_id(save_id)}"


def attempt_of_object(name: str) -> tuple[int, str] | None:
    """The (step, save id) of the attempt folder an object name lies in (``<step
    folder>/<save id>/...``), or None when it lies in none."""
    parts = name.split("/")
    if len(parts) < 3:
        return None
    step = parse_step_dir(parts[0])
    if step is None or not _SAVE_ID.fullmatch(parts[1]):
        return None
    return step, parts[1]


def object_prefix(step: int, save_id: str, rank: int) -> str:
    """Root-relative prefix of the data objects one rank writes in one save attempt."""
    return f"{attempt_prefix(step, save_id)}/rank-{rank}"


def manifest_name(step: int) -> str:
    """Root-relative name of a step's manifest."""
    return f"{step_dir(step)}/{MANIFEST_FILE}"


def check_object_name(name: str) -> str:
    """Return ``name`` if it is a normalised root-relative name, else raise ValueError."""
    if not isinstance(name, str) or not name or name.startswith("/"):
        raise ValueError(f"unsafe object name {name!r:.200}")
    if "\\" in name or "\x00" in name or ":" in name or "#" in name or "?" in name:
        raise ValueError(f"unsafe object name {name!r:.200}")
    if any(part in ("", ".", "..") for part in name.split("/")):
        raise ValueError(f"unsafe object name {name!r:.200}")
    return name
