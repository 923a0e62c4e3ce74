"""A seeded mutator for JSON documents and their bytes (manifests, spool journals), shared
by the fuzz tests and the soak. Deterministic for a given seed; no dependencies."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Sequence
from typing import Any

INTERESTING: list[Any] = [
    None, True, False, 0, 1, -1, 7, 2**31, 2**63, 2**70, -(2**63), 0.5, -0.0, 1e308, float("nan"), float("inf"),
    "", "x", "../x", "/etc/passwd", "a/../../b", "C:\\x", "000000000001", "tensor", "pickle", "dict", "list",
    "stateful", "float", "bytes", "size", "uint8", "float32", "os.system", "cpu", "warp:9", "\x00", "é" * 3,
    [], {}, [[]], {"t": "pickle", "id": 0}, {"t": "tensor", "id": 0}, {"t": "tensor", "id": 10**9},
    {"t": "dict", "items": [[[], 1]]}, {"t": "list", "items": 3},
    "sharded", "dtensor", {"t": "dtensor", "id": 0}, {"t": "rank_local", "slot": 0}, {"t": "skipped"},
    [0, 0], [2**62, 1], [-1, 4],
]  # fmt: skip


def laughs(width: int, depth: int) -> list[Any]:
    """``width`` references to one list, ``depth`` levels deep: a pickle of a few hundred
    bytes that is ``width ** depth`` values as a tree."""
    node: list[Any] = ["x"]
    for _ in range(depth):
        node = [node] * width
    return node


def _paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every location in a JSON document (dict keys and list indices)."""
    found = [prefix]
    if isinstance(doc, dict):
        for key, value in doc.items():
            found += _paths(value, (*prefix, key))
    elif isinstance(doc, list):
        for index, value in enumerate(doc):
            found += _paths(value, (*prefix, index))
    return found


def _get(doc: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        doc = doc[part]
    return doc


def _set(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    _get(doc, path[:-1])[path[-1]] = value
    return doc


def mutate_document(doc: Any, rng: random.Random, extra: Sequence[Any] = ()) -> Any:
    """A copy of ``doc`` with one to three structural mutations, still a document JSON can
    write (deep nesting applied twice can outgrow Python's recursion limit in ``deepcopy`` or
    ``json.dumps``: such a draw is made again). ``extra``: more values worth trying, beside
    :data:`INTERESTING` (a format's own hostile values)."""
    interesting = INTERESTING + list(extra) if extra else INTERESTING
    for _ in range(10):
        try:
            mutated = _mutate(copy.deepcopy(doc), rng, interesting)
            json.dumps(mutated)
            return mutated
        except RecursionError:
            continue
    return copy.deepcopy(doc)


def _mutate(doc: Any, rng: random.Random, interesting: list[Any]) -> Any:
    for _ in range(rng.randint(1, 3)):
        paths = _paths(doc)
        path = rng.choice(paths)
        target = _get(doc, path)
        action = rng.randrange(9)
        if action == 0:
            doc = _set(doc, path, copy.deepcopy(rng.choice(interesting)))
        elif action == 1 and isinstance(target, int) and not isinstance(target, bool):
            doc = _set(doc, path, target + rng.choice([-1, 1, 64, -(2**20), 2**40]))
        elif action == 2 and path:  # delete a key or an item
            parent = _get(doc, path[:-1])
            del parent[path[-1]]
        elif action == 3 and isinstance(target, dict):
            target[rng.choice(["t", "id", "items", "v", "meta", "extra", "kind"])] = copy.deepcopy(
                rng.choice(interesting)
            )
        elif action == 4 and isinstance(target, list) and target:
            target.append(copy.deepcopy(rng.choice(target)))
        elif action == 5:  # move another part of the document here
            doc = _set(doc, path, copy.deepcopy(_get(doc, rng.choice(paths))))
        elif action == 6 and isinstance(target, str):
            doc = _set(doc, path, target + rng.choice(["/..", "x", "/", "0", "\\"]))
        elif action == 7:  # nest deeply
            node: Any = target
            for _ in range(rng.choice([2, 50, 200])):
                node = {"t": "list", "items": [node]} if rng.random() < 0.5 else [node]
            doc = _set(doc, path, node)
        elif action == 8 and isinstance(target, list):
            rng.shuffle(target)
    return doc


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    """``data`` with a few bytes flipped, inserted or removed, or cut short."""
    buffer = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        if not buffer:
            break
        at = rng.randrange(len(buffer))
        choice = rng.randrange(4)
        if choice == 0:
            buffer[at] ^= 1 << rng.randrange(8)
        elif choice == 1:
            buffer.insert(at, rng.choice(b'{}[]",:0\\n'))
        elif choice == 2:
            del buffer[at]
        else:
            del buffer[at:]
    return bytes(buffer)


def mutated_text(document: Any, rng: random.Random) -> bytes:
    """One fuzz case: mostly structural mutations, sometimes raw byte damage."""
    if rng.random() < 0.8:
        return json.dumps(mutate_document(document, rng)).encode()
    return mutate_bytes(json.dumps(document).encode(), rng)


def sign_manifest(doc: Any) -> bytes:
    """``doc`` as manifest bytes with a matching crc32c: what someone who may write the
    storage can forge (the checksum guards against damage, not against them)."""
    import crc32c

    if not isinstance(doc, dict):
        return json.dumps(doc).encode()
    body = json.dumps({k: v for k, v in doc.items() if k != "crc32c"}).encode()
    return body[:-1] + b',"crc32c":%d}' % crc32c.crc32c(body)
