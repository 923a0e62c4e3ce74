"""Which source gave a setting that failed validation: the code (``Config(...)``), an
``AIOSNAP_*`` environment variable, or the YAML file being loaded; so that a message names the
right one (a bad ``AIOSNAP_STORAGE__URL`` is not the YAML file's fault). Pure code.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["environment_variable_for", "given_in", "source_of"]


def given_in(data: Mapping[str, Any] | None, where: tuple[str, ...]) -> bool:
    """Whether the nested settings ``data`` give ``where`` (or a value above it that holds it)."""
    node: Any = data
    if node is None:
        return False
    for part in where:
        if not isinstance(node, Mapping):
            return True  # a value given above ``where``: it is what failed
        if part not in node:
            return False
        node = node[part]
    return True


def _setting_of(name: str, prefix: str) -> tuple[str, ...] | None:
    if not name.upper().startswith(prefix):
        return None
    return tuple(name[len(prefix) :].lower().split("__"))


def environment_variable_for(
    where: tuple[str, ...], environ: Iterable[str], prefix: str, *, inside: bool = False
) -> str | None:
    """The variable (of ``environ``'s names) that sets ``where`` or a section above it; with
    ``inside``, one that sets a setting within ``where`` instead."""
    for name in sorted(environ):
        setting = _setting_of(name, prefix)
        if setting is None or not where:
            continue
        above = setting == where[: len(setting)]  # ``where`` itself, or a section holding it
        within = len(setting) > len(where) and setting[: len(where)] == where
        if within if inside else above:
            return name
    return None


def source_of(
    where: tuple[str, ...],
    *,
    code: Mapping[str, Any],
    environ: Iterable[str],
    prefix: str,
    file: tuple[str, Mapping[str, Any]] | None,
) -> str:
    """Who gave the setting at ``where``, as a message's prefix (``""``: the code or the
    defaults): in order of precedence the code, the environment, the file (``(name,
    data)``). A section's problem names the file and the variables within it both."""
    names = list(environ)
    if given_in(code, where):
        return ""
    variable = environment_variable_for(where, names, prefix)
    if variable is not None:
        return f"environment variable {variable}: "
    sources = [file[0]] if file is not None and given_in(file[1], where) else []
    within = environment_variable_for(where, names, prefix, inside=True)
    if within is not None:
        sources.append(f"environment variable {within}")
    return f"{' and '.join(sources)}: " if sources else ""
