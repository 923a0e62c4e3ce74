"""``aiosnap export``: a checkpoint to Hugging Face safetensors, or a safetensors folder into
an aiosnap root. Registered on the main command line by :func:`register`.

Under ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) every rank runs the command: it
joins a gloo group of the job and does its share of the export (see :mod:`.api`). Runs on
the main thread.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Annotated

import typer

__all__ = ["export_command", "register"]


def export_command(
    src: Annotated[str, typer.Argument(help="an aiosnap root or file, or a safetensors folder (path or s3://)")],
    dest: Annotated[str, typer.Argument(help="the folder to write (a path or s3://bucket/prefix)")],
    to: Annotated[str, typer.Option("--to", help="safetensors | aiosnap")] = "safetensors",
    step: Annotated[int | None, typer.Option("--step", "-s", help="step to export (default: the latest)")] = None,
    paths: Annotated[
        list[str] | None, typer.Option("--paths", help="glob over aiosnap paths, e.g. 'model/*' (repeatable)")
    ] = None,
    max_shard_size: Annotated[str, typer.Option("--max-shard-size", help="tensor bytes per file")] = "5GB",
    dtype: Annotated[str | None, typer.Option("--dtype", help="convert floating tensors: bf16, fp16, fp32")] = None,
    strip: Annotated[str, typer.Option("--strip", help="prefix removed from paths to make names")] = "model/",
    prefix: Annotated[str, typer.Option("--prefix", help="where a safetensors source's tensors go")] = "model/",
    dest_step: Annotated[int, typer.Option("--dest-step", help="step of an import (--to aiosnap)")] = 0,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="replace an export already in DEST")] = False,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config (S3, concurrency, RAM)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON document")] = False,
) -> None:
    """Export a checkpoint as Hugging Face safetensors shards and their index (written
    last), with no local staging; or (--to aiosnap) import a safetensors folder."""
    from .api import export  # torch: imported by the commands that need it only

    joined = _join_job()
    try:
        report = export(
            src, dest, to=to, step=step, paths=paths, max_shard_size=max_shard_size, dtype=dtype, strip=strip,
            prefix=prefix, config=config, overwrite=overwrite, dest_step=dest_step,
        )  # fmt: skip
    finally:
        if joined:
            import torch.distributed as dist

            dist.destroy_process_group()
    if as_json:
        print(json.dumps(dataclasses.asdict(report), indent=2))
    else:
        print(f"{report.tensors} tensor(s), {report.nbytes} bytes, to {report.url} in {report.seconds:.2f} s")
        for name in report.files:
            print(f"  {name}")


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
