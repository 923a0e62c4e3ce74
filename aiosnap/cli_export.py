"""``aiosnap export SRC DEST [--to safetensors|aiosnap|dcp|torch]``: every conversion on the
command line (registered on the ``aiosnap`` app by :mod:`aiosnap.cli`), through
:func:`aiosnap.export`. Runs on the main thread.

Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) a safetensors export runs on every
rank: each joins a gloo group of the job and does its share (see
:mod:`aiosnap.interop.safetensors.api`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

from .config import Config, load_config
from .core.units import format_bytes

__all__ = ["export_command", "register"]

FORMATS = ("safetensors", "aiosnap", "dcp", "torch")


def export_command(
    src: Annotated[
        str, typer.Argument(help="an aiosnap root or file, a DCP folder, a torch.save file or a safetensors folder")
    ],
    dest: Annotated[str, typer.Argument(help="where to write: a path, file:// or s3://bucket/prefix")],
    to: Annotated[str, typer.Option("--to", "-t", help="safetensors | aiosnap | dcp | torch")] = "safetensors",
    step: Annotated[int | None, typer.Option("--step", "-s", help="step of an aiosnap source (latest)")] = None,
    paths: Annotated[
        list[str] | None, typer.Option("--paths", "-p", help="only key paths matching this glob (repeatable)")
    ] = None,
    allow_pickle: Annotated[
        bool, typer.Option("--allow-pickle", help="unpickle the source's pickled objects to write them")
    ] = False,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="safetensors: tensor bytes per file")] = "5GB",
    dtype: Annotated[
        str | None, typer.Option("--dtype", help="safetensors: convert floating tensors (bf16, fp16, fp32)")
    ] = None,
    strip: Annotated[str, typer.Option("--strip", help="safetensors: prefix removed from paths")] = "model/",
    prefix: Annotated[str, typer.Option("--prefix", help="where a safetensors source's tensors go")] = "model/",
    dest_step: Annotated[int, typer.Option("--dest-step", help="step of a safetensors import")] = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="safetensors: replace an export in DEST")] = False,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config (RAM budget, S3)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON document (for scripts)")] = False,
) -> None:
    """Convert a checkpoint between formats (the source's told by its content), streaming
    under the RAM budget with no local staging; multi-rank sources are consolidated into
    full tensors. Safetensors: shards and their index (written last)."""
    from .interop.convert import ExportResult
    from .interop.exporting import export, is_safetensors_folder  # torch: imported only when one runs

    if to not in FORMATS:
        raise typer.BadParameter(f"{to!r}: choose one of {', '.join(FORMATS)}", param_hint="--to")
    settings = load_config(config) if config is not None else Config()
    options: dict[str, Any] = {}
    if to == "safetensors" or (to == "aiosnap" and is_safetensors_folder(src, settings)):
        options = {"max_shard_size": max_shard_size, "dtype": dtype, "strip": strip, "prefix": prefix,
                   "overwrite": overwrite, "dest_step": dest_step}  # fmt: skip
    console = Console(stderr=True)
    bar = None
    if not as_json and console.is_terminal:
        bar = Progress(
            "[progress.description]{task.description}", BarColumn(), DownloadColumn(binary_units=True),
            TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True,
        )  # fmt: skip
    task = bar.add_task(f"exporting to {to}", total=None) if bar is not None else None

    def progress(done: int, total: int) -> None:
        if bar is not None and task is not None:
            bar.update(task, completed=done, total=total or None)

    joined = to == "safetensors" and _join_job()
    try:
        if bar is not None:
            with bar:
                result = export(src, dest, to=to, step=step, paths=paths, config=settings,
                                allow_pickle=allow_pickle, progress=progress, **options)  # fmt: skip
        else:
            result = export(src, dest, to=to, step=step, paths=paths, config=settings, allow_pickle=allow_pickle,
                            **options)  # fmt: skip
    finally:
        if joined:
            import torch.distributed as dist

            dist.destroy_process_group()
    if as_json:
        print(json.dumps(dataclasses.asdict(result), indent=2))
        return
    show = Console(highlight=False, soft_wrap=True)
    if not isinstance(result, ExportResult):  # a safetensors export or import
        show.print(f"{result.tensors} tensor(s), {result.nbytes} bytes, to {result.url} in {result.seconds:.2f} s")
        for name in result.files:
            show.print(f"  {name}")
        return
    show.print(
        f"{src} ({result.source_kind}, step {result.step}): {result.entries} entries, {format_bytes(result.nbytes)} "
        f"exported to {dest} as {to}"
    )


def _join_job() -> bool:
    """Under torchrun: join the job's gloo group (True when this call made it)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    dist.init_process_group("gloo")
    return True


def register(app: typer.Typer) -> None:
    """Add ``export`` to the ``aiosnap`` command line."""
    app.command("export")(export_command)
