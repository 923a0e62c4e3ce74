"""``aiosnap export SRC DEST --to {aiosnap,dcp,torch}``: the converter on the command line
(registered on the ``aiosnap`` app by :mod:`aiosnap.cli`). Runs on the main thread; the
export itself on aiosnap's shared background loop (:func:`aiosnap.interop.convert.export`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

from .config import Config, load_config

__all__ = ["register"]

FORMATS = ("aiosnap", "dcp", "torch")


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def export_command(
    src: Annotated[str, typer.Argument(help="an aiosnap root or file, a DCP folder or a torch.save file")],
    dest: Annotated[str, typer.Argument(help="where to write: a path, file:// or s3://bucket/prefix")],
    to: Annotated[str, typer.Option("--to", "-t", help="aiosnap | dcp | torch")],
    step: Annotated[int | None, typer.Option("--step", "-s", help="step of an aiosnap source (latest)")] = None,
    paths: Annotated[
        list[str] | None, typer.Option("--paths", "-p", help="only key paths matching this glob (repeatable)")
    ] = None,
    allow_pickle: Annotated[
        bool, typer.Option("--allow-pickle", help="unpickle the source's pickled objects to write them")
    ] = False,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config (RAM budget, S3)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON document (for scripts)")] = False,
) -> None:
    """Convert a checkpoint between formats (detected by content), streaming under the RAM
    budget; multi-rank sources are consolidated into full tensors."""
    from .interop.convert import export  # torch: imported only when a conversion runs

    if to not in FORMATS:
        raise typer.BadParameter(f"{to!r}: choose one of {', '.join(FORMATS)}", param_hint="--to")
    settings = load_config(config) if config is not None else Config()
    console = Console(stderr=True)
    bar = None
    if not as_json and console.is_terminal:
        bar = Progress(
            "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), console=console, transient=True,
        )  # fmt: skip
    task = bar.add_task(f"exporting to {to}", total=None) if bar is not None else None

    def progress(done: int, total: int) -> None:
        if bar is not None and task is not None:
            bar.update(task, completed=done, total=total)

    if bar is not None:
        with bar:
            result = export(src, dest, to=to, step=step, paths=paths, config=settings, allow_pickle=allow_pickle,
                            progress=progress)  # fmt: skip
    else:
        result = export(src, dest, to=to, step=step, paths=paths, config=settings, allow_pickle=allow_pickle)
    if as_json:
        print(json.dumps(dataclasses.asdict(result), indent=2))
        return
    Console(highlight=False, soft_wrap=True).print(
        f"{src} ({result.source_kind}, step {result.step}): {result.entries} entries, {_size(result.nbytes)} "
        f"exported to {dest} as {to}"
    )


def register(app: typer.Typer) -> None:
    """Add ``export`` to the ``aiosnap`` command."""
    app.command("export")(export_command)
