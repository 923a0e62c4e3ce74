"""The safetensors sink: any checkpoint presented as a Manifest + Storage, written as a
Hugging Face folder (sharded ``*.safetensors`` files and their index) to any storage.

:func:`plan_export` (pure) picks the tensors (``paths`` glob patterns over aiosnap paths,
every tensor by default; pickled objects and plain values are never exported), names them
(:mod:`.layout`), converts floating-point dtypes when asked and lays out the shards.
:func:`export_manifest` writes them: parts filled by a :class:`~.consolidate.Consolidator`
(DTensor shards consolidated into full tensors, each stored range read once while needed,
verified) and uploaded by :mod:`.writer`, within ``ram_budget`` (half for parts being
filled, half for the ranges they read). Runs on whichever event loop calls it.

The destination is claimed for the export's duration and must not hold an export already
unless ``overwrite``, which deletes the old one first (see :mod:`.destination`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

import torch

from ...core.budget import ByteBudget
from ...errors import AiosnapError
from ...format.manifest import Manifest
from ...load.decode import torch_dtype
from ...storage.base import Storage
from ...storage.registry import roots_overlap
from .consolidate import Consolidator, RangeCache
from .destination import claim_folder
from .header import CODE_OF_AIOSNAP
from .layout import INDEX_FILE, ExportTensor, NameRule, Shard, map_names, plan_shards
from .writer import ShardUploads, write_shards

__all__ = [
    "DTYPE_ALIASES",
    "ExportOptions",
    "ExportPlan",
    "ExportReport",
    "budgets_for",
    "export_manifest",
    "plan_export",
    "uploads_for",
]

DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "f16": "float16", "float16": "float16",
    "half": "float16", "fp32": "float32", "f32": "float32", "float32": "float32", "float": "float32",
    "fp64": "float64", "f64": "float64", "float64": "float64",
}  # fmt: skip
"""What ``dtype=`` / ``--dtype`` accepts."""
CONVERTIBLE = {"float16", "bfloat16", "float32", "float64"}
"""Stored dtypes a ``dtype`` conversion applies to (integers, bools and float8 stay as they are)."""


@dataclass(frozen=True)
class ExportOptions:
    """What to export and how (see :func:`plan_export`)."""

    paths: Sequence[str] | None = None
    """Glob patterns over aiosnap paths (``model/*``); None: every tensor."""
    strip: str = "model/"
    """The prefix removed from paths to make names (see :func:`~.layout.hf_name`)."""
    names: NameRule | None = None
    """Names of the caller's own, instead of the rule."""
    max_shard_size: int = 5_000_000_000
    dtype: str | None = None
    """Convert floating-point tensors to this dtype (``bf16``, ``fp16``, ``fp32``, ...)."""
    metadata: dict[str, str] = field(default_factory=dict)
    """Extra ``__metadata__`` strings in every file's header (``format: pt`` is always there)."""
    concurrency: int = 8
    ram_budget: int = 1024**3
    overwrite: bool = False


@dataclass
class ExportPlan:
    """The tensors an export writes, their files, and the entries converted to another dtype."""

    tensors: list[ExportTensor]
    shards: list[Shard]
    out_dtypes: dict[int, torch.dtype]


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote."""

    url: str
    files: tuple[str, ...]
    tensors: int
    nbytes: int
    """Bytes of tensor data written (headers excluded)."""
    bytes_read: int
    """Bytes this process read from the source."""
    seconds: float


def plan_export(manifest: Manifest, options: ExportOptions) -> ExportPlan:
    """The export of ``manifest``'s tensors (whole and sharded entries; rank-local values,
    pickles and plain values are left out) that ``options`` selects."""
    wanted = [
        (index, entry)
        for index, entry in enumerate(manifest.entries)
        if entry.kind in ("tensor", "sharded")
        and (options.paths is None or any(fnmatchcase(entry.path, p) for p in options.paths))
    ]
    if options.paths is not None and not wanted:
        raise ValueError(f"no tensor of step {manifest.step} matches {list(options.paths)!r}")
    names = map_names([entry.path for _, entry in wanted], options.names, options.strip)
    target = None
    if options.dtype is not None:
        target = DTYPE_ALIASES.get(options.dtype.lower())
        if target is None:
            raise ValueError(f"dtype {options.dtype!r}: choose one of {', '.join(sorted(DTYPE_ALIASES))}")
    tensors: list[ExportTensor] = []
    out_dtypes: dict[int, torch.dtype] = {}
    for index, entry in wanted:
        if entry.path not in names:
            continue
        dtype = entry.dtype
        if target is not None and dtype in CONVERTIBLE and dtype != target:
            dtype = target
            out_dtypes[index] = torch_dtype(target)
        code = CODE_OF_AIOSNAP.get(dtype)
        if code is None:
            raise ValueError(
                f"{entry.path!r}: safetensors cannot hold {dtype} tensors (leave it out with paths=, or convert it)"
            )
        tensors.append(ExportTensor(names[entry.path], code, tuple(entry.shape), index))
    return ExportPlan(tensors, plan_shards(tensors, options.max_shard_size, options.metadata), out_dtypes)


MIN_SOURCE_BYTES = 4 * 1024**2
"""The least RAM an export gives the source ranges it reads (beside its parts)."""


def budgets_for(ram_budget: int, part_bytes: int) -> tuple[ByteBudget, int]:
    """The parts' share of the RAM budget (half, at least one part) and the source ranges'
    (the rest, at least :data:`MIN_SOURCE_BYTES`): a budget under one part plus that is
    exceeded by the difference."""
    parts = max(ram_budget // 2, part_bytes)
    return ByteBudget(parts, "export ram_budget"), max(ram_budget - parts, MIN_SOURCE_BYTES)


async def export_manifest(
    source: Storage,
    manifest: Manifest,
    dest: Storage,
    options: ExportOptions,
    *,
    folder: str = "",
    progress: Callable[[int], None] | None = None,
) -> ExportReport:
    """Export ``manifest`` (read from ``source``) to ``folder`` of ``dest`` in this process."""
    started = time.perf_counter()
    if roots_overlap(source, dest):  # writing where the bytes are read from: never
        raise AiosnapError(f"{dest.url} and {source.url} overlap: export to a folder outside the source")
    plan = plan_export(manifest, options)
    files = [shard.file for shard in plan.shards]
    part_bytes = max((dest.part_size_for(s.size) for s in plan.shards), default=1)
    budget, cache_bytes = budgets_for(options.ram_budget, part_bytes)
    cache = RangeCache(source, f"{source.url} step {manifest.step}", cache_bytes)
    filler = Consolidator(source, manifest, cache, plan.out_dtypes)
    claim = await claim_folder(dest, folder, files, overwrite=options.overwrite)
    try:
        async with source.reading():
            await write_shards(
                dest, plan.shards, filler.fill, folder=folder, concurrency=options.concurrency, budget=budget,
                progress=progress, claim=claim,
            )  # fmt: skip
    finally:
        await asyncio.shield(claim.release())
    return ExportReport(
        dest.url if not folder else f"{dest.url}/{folder.strip('/')}",
        (*files, INDEX_FILE),
        len(plan.tensors),
        sum(t.nbytes for t in plan.tensors),
        cache.bytes_read,
        time.perf_counter() - started,
    )


def uploads_for(dest: Storage, plan: ExportPlan, folder: str = "") -> ShardUploads:
    """The uploads of ``plan``'s shards (a multi-rank export drives their phases itself)."""
    return ShardUploads(dest, plan.shards, folder)
