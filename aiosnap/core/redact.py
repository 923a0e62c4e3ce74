"""Locations fit for messages and logs: what says where, without what grants access.

A URL may carry credentials: a password (``https://user:secret@host``), a token as the
whole user part (``https://TOKEN@host``), a signature or token in its query string
(``?X-Amz-Signature=...``, ``?sig=...``) or fragment. :func:`shown_url` replaces each with
``***``; :func:`scrubbed` does the same to any text (another library's error message) that
may quote them. Local paths are shown as they are.

Pure code, no I/O; built by hand rather than with :mod:`urllib.parse`, which raises on some
malformed URLs (a message must never fail to be made).
"""

from __future__ import annotations

import os

__all__ = ["shown_url", "scrubbed"]

HIDDEN = "***"
_SHORTEST_VALUE = 4  # shorter query values (``b=2``) are no secrets, and replacing them would garble text


def _parts(url: str) -> tuple[str, str, str, str] | None:
    """(``scheme://``, userinfo, host and path, query and fragment) of a URL, or None for
    a local path."""
    scheme, separator, rest = url.partition("://")
    if not separator:
        return None
    cut = [i for i in (rest.find(c) for c in "/?#") if i >= 0]
    netloc_end = min(cut, default=len(rest))
    userinfo, at, host = rest[:netloc_end].rpartition("@")
    rest_of_it = host + rest[netloc_end:]
    query_at = [i for i in (rest_of_it.find(c) for c in "?#") if i >= 0]
    split = min(query_at, default=len(rest_of_it))
    return scheme + separator, userinfo if at else "", rest_of_it[:split], rest_of_it[split:]


def shown_url(location: str | os.PathLike[str]) -> str:
    """``location`` with its credentials replaced by ``***``: the password (the user name
    stays), a user part with no password (a token), the query string and the fragment."""
    text = os.fspath(location)
    parts = _parts(text)
    if parts is None:
        return text
    scheme, userinfo, where, query = parts
    if userinfo:
        user, colon, _ = userinfo.partition(":")
        where = f"{user}:{HIDDEN}@{where}" if colon else f"{HIDDEN}@{where}"
    return scheme + where + (query[0] + HIDDEN if query else "")


def scrubbed(text: str, location: str | os.PathLike[str]) -> str:
    """``text`` (a message that may quote ``location``, whole or in pieces) with every
    credential of ``location`` replaced by ``***``."""
    parts = _parts(os.fspath(location))
    if parts is None:
        return text
    _, userinfo, _, query = parts
    user, colon, password = userinfo.partition(":")
    secrets = [password if colon else user]
    for piece in query[1:].split("#"):  # the query and the fragment, whole and each value
        values = (value for _, _, value in (pair.partition("=") for pair in piece.split("&")))
        secrets += [piece, *(value for value in values if len(value) >= _SHORTEST_VALUE)]
    for secret in sorted((s for s in secrets if s), key=len, reverse=True):
        text = text.replace(secret, HIDDEN)
    return text
