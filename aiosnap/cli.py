"""The ``aiosnap`` command line (also ``python -m aiosnap``), built on Typer and Rich.

Commands: ``ls``, ``info``, ``verify``, ``download``, ``resume``, ``rollback``, ``gc``, ``bench``. URLs are storage
roots (a path, ``file://`` or ``s3://bucket/prefix``); ``--config FILE`` supplies the rest
(S3 endpoint, credentials, concurrency). Long operations show a progress bar on a terminal
and stay quiet when piped; ``--json`` prints one JSON document for scripts. Errors are one
line on stderr and a non-zero exit status (1; 2 for usage errors).

Runs on the main thread: each command drives its own event loop with ``asyncio.run``
(``resume`` uses a :class:`~aiosnap.SyncCheckpointer` and its background thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import json
import logging
import math
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from .catalog.garbage import collect_garbage
from .catalog.maintenance import list_steps, verify_step
from .catalog.steps import committed_steps, manifest_of, remove_steps_after
from .config import Config, load_config
from .errors import AiosnapError, CheckpointNotFoundError
from .format.manifest import Manifest
from .interop.singlefile import storage_for
from .load.select import entries_under
from .storage.base import Storage
from .storage.registry import storage_from_url
from .transfer.copy import copy_step
from .transfer.resume import ResumeReport

__all__ = ["app", "main"]

T = TypeVar("T")
app = typer.Typer(
    name="aiosnap",
    help="List, inspect, verify, copy, resume and clean aiosnap checkpoints; run the benchmarks.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(highlight=False, soft_wrap=True)

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML config (S3 endpoint, credentials, concurrency)")
]
JsonOption = Annotated[bool, typer.Option("--json", help="print one JSON document (for scripts)")]
StepOption = Annotated[int | None, typer.Option("--step", "-s", help="step to use (default: the latest)")]
UrlArgument = Annotated[str, typer.Argument(help="checkpoint root: a path, file:// or s3://bucket/prefix")]


def _config(path: Path | None) -> Config:
    """Settings for the command (S3 endpoint, concurrency); the URL argument names the root."""
    return load_config(path) if path is not None else Config()


def _on_storage(url: str, config: Config, work: Callable[[Storage], Awaitable[T]]) -> T:
    async def run() -> T:
        storage = storage_for(url, config)
        try:
            return await work(storage)
        finally:
            await storage.close()

    return asyncio.run(run())


def _when(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _emit_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, default=str))


def _progress(total: int | None, what: str, enabled: bool) -> tuple[Progress | None, Callable[[int], None]]:
    """A bytes progress bar on a terminal; a no-op when piped or for JSON output."""
    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        return None, lambda n: None
    bar = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    task = bar.add_task(what, total=total)
    return bar, lambda n: bar.advance(task, n)


@app.command("ls")
def list_command(
    url: UrlArgument,
    all_steps: Annotated[bool, typer.Option("--all", "-a", help="also incomplete saves and leftovers")] = False,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Committed steps with time, size and world size."""
    steps = _on_storage(url, _config(config), lambda s: list_steps(s, include_incomplete=all_steps))
    if as_json:
        _emit_json([dataclasses.asdict(info) for info in steps])
    elif steps:
        table = Table("step", "state", "time", "size", "world size", "save id", box=None, header_style="bold")
        for info in steps:
            note = f" (+{len(info.leftovers)} leftover)" if info.leftovers and info.state == "committed" else ""
            table.add_row(
                str(info.step),
                info.state + note,
                "" if info.state == "unreadable" else _when(info.time),
                _size(info.nbytes),
                "" if info.world_size is None else str(info.world_size),
                info.save_id or info.problem or "",
            )
        out.print(table)
    if not steps:
        print(f"no checkpoints in {url}", file=sys.stderr)
        raise typer.Exit(1)


@app.command("info")
def info_command(
    url: UrlArgument, step: StepOption = None, config: ConfigOption = None, as_json: JsonOption = False
) -> None:
    """A step's manifest in human form: entries, dtypes, shapes, bytes."""
    manifest = _on_storage(url, _config(config), lambda s: manifest_of(s, step))
    by_key = _bytes_by_top_level_key(manifest)
    if as_json:
        doc = manifest.model_dump(mode="json")
        doc.pop("tree")
        doc["top_level_bytes"] = by_key
        _emit_json(doc)
        return
    out.print(
        f"step {manifest.step} of {url}: committed {_when(manifest.created_at)}, "
        f"{_size(manifest.referenced_bytes)} in {len(manifest.entries)} entries ({_size(manifest.total_bytes)} stored "
        f"in {len(manifest.objects)} object(s)), world size {manifest.world_size}, "
        f"save id {manifest.save_id}"
    )
    if manifest.metadata:
        out.print(f"metadata: {json.dumps(manifest.metadata)}")
    if by_key:
        keys = Table("top-level key", "bytes", box=None, header_style="bold")
        for key, nbytes in by_key.items():
            keys.add_row(key, _size(nbytes))
        out.print(keys)
    table = Table("entry", "kind", "dtype", "shape", "bytes", "device", box=None, header_style="bold")
    for entry in manifest.entries:
        shape = "" if entry.kind == "pickle" else "x".join(map(str, entry.shape)) or "scalar"
        kind = f"sharded ({len(entry.shards)})" if entry.shards is not None else entry.kind
        table.add_row(entry.path, kind, entry.dtype, shape, _size(entry.nbytes), entry.device)
    out.print(table)
    if manifest.rank_local is not None:
        each = [sum(e.nbytes for e in part.entries) for part in manifest.rank_local]
        out.print(f"rank-local values: {len(manifest.rank_local)} rank(s), {_size(sum(each))} in all")


def _bytes_by_top_level_key(manifest: Manifest) -> dict[str, int]:
    """Bytes stored under each top-level key of the state (what ``load(paths=[key])`` reads;
    a tensor shared by two keys counts under both)."""
    tree = manifest.tree
    if not (isinstance(tree, dict) and tree.get("t") in ("dict", "odict")):
        return {}
    sizes: dict[str, int] = {}
    for raw_key, child in tree["items"]:
        name = raw_key if isinstance(raw_key, str) else json.dumps(raw_key)
        sizes[name] = sum(manifest.entries[i].nbytes for i in entries_under(child))
        for slot in _slots_under(child):  # every rank's own values under this key
            for part in manifest.rank_local or ():
                sizes[name] += sum(part.entries[i].nbytes for i in entries_under(part.values[slot]))
    return sizes


def _slots_under(node: Any) -> list[int]:
    found, stack = [], [node]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            if current.get("t") == "rank_local":
                found.append(current["slot"])
            else:
                stack.extend(current.values())
        elif isinstance(current, list):
            stack.extend(current)
    return found


@app.command("verify")
def verify_command(
    url: UrlArgument, step: StepOption = None, config: ConfigOption = None, as_json: JsonOption = False
) -> None:
    """Read every byte of a step and check every checksum (exit status 1 on any problem)."""
    settings = _config(config)

    async def run(storage: Storage) -> tuple[Manifest, list[str]]:
        async with storage.reading():  # one version of a single-file checkpoint a writer may replace
            manifest = await manifest_of(storage, step)
            bar, advance = _progress(manifest.referenced_bytes, f"verifying step {manifest.step}", not as_json)
            if bar is None:
                return manifest, await verify_step(storage, manifest, concurrency=settings.upload.concurrency)
            with bar:
                problems = await verify_step(
                    storage, manifest, concurrency=settings.upload.concurrency, progress=advance
                )  # fmt: skip
            return manifest, problems

    manifest, problems = _on_storage(url, settings, run)
    if as_json:
        _emit_json({
            "step": manifest.step, "ok": not problems, "bytes": manifest.referenced_bytes,
            "stored_bytes": manifest.total_bytes, "problems": problems,
        })  # fmt: skip
    elif problems:
        for problem in problems:
            print(problem, file=sys.stderr)
        print(f"step {manifest.step}: {len(problems)} problem(s)", file=sys.stderr)
    else:
        checked = f"{_size(manifest.referenced_bytes)} in {len(manifest.entries)} entries"
        out.print(f"step {manifest.step}: ok, {checked} verified")
    if problems:
        raise typer.Exit(1)


@app.command("download")
def download_command(
    url: UrlArgument,
    dest: Annotated[str, typer.Argument(help="root to copy into: a path, file:// or s3://bucket/prefix")],
    step: StepOption = None,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Copy a step to another root (e.g. S3 to local disk), checking every checksum; the
    copy is committed (manifest written) only once complete."""
    settings = _config(config)

    async def run(storage: Storage) -> tuple[Manifest, bool]:
        manifest = await manifest_of(storage, step)
        target = storage_from_url(dest, settings)
        try:
            bar, advance = _progress(manifest.total_bytes, f"downloading step {manifest.step}", not as_json)
            copy = copy_step(storage, target, manifest, concurrency=settings.upload.concurrency, progress=advance)
            if bar is None:
                copied = await copy
            else:
                with bar:
                    copied = await copy
        finally:
            await target.close()
        return manifest, copied

    manifest, copied = _on_storage(url, settings, run)
    if as_json:
        _emit_json({"step": manifest.step, "bytes": manifest.total_bytes, "dest": dest, "copied": copied})
    elif copied:
        out.print(f"step {manifest.step}: {_size(manifest.total_bytes)} copied to {dest}, every checksum verified")
    else:
        out.print(f"step {manifest.step}: already in {dest} (the same save), nothing copied")


@app.command("resume")
def resume_command(
    config: Annotated[Path, typer.Option("--config", "-c", help="the training job's YAML config")],
    roots: Annotated[
        list[str] | None,
        typer.Option("--root", help="also resume saves made for this other root (at(), Lightning paths); repeatable"),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Finish and commit the spooled saves a crashed training process left behind: those
    for the config's root (with its retention), and for each --root given (deleting
    nothing there)."""
    settings = load_config(config)
    if settings.spool.effective_mode == "off":
        raise AiosnapError(f"{config}: no spool configured (spool.dir), nothing to resume")
    settings = settings.model_copy(update={"spool": settings.spool.model_copy(update={"resume": False})})
    from .checkpointer import SyncCheckpointer  # torch: only the commands that need it import it

    with SyncCheckpointer(settings) as ckpt:
        bar, advance = _progress(None, "uploading spooled chunks", not as_json)

        def landed(nbytes: int, total: int) -> None:
            if bar is not None:
                bar.update(bar.task_ids[0], total=total)
            advance(nbytes)

        targets = [ckpt, *(ckpt.at(root) for root in roots or [])]
        reports = []
        with bar if bar is not None else contextlib.nullcontext():
            for target in targets:
                reports.append(target.resume_spool(landed if bar is not None else None))
        everywhere = set.intersection(*({save_id for save_id, _ in r.skipped} for r in reports))
        report = ResumeReport(
            resumed=[step for r in reports for step in r.resumed],
            discarded=[item for r in reports for item in r.discarded],
            failed=[item for r in reports for item in r.failed],
            skipped=[item for item in reports[0].skipped if item[0] in everywhere],  # skipped by every root
        )
        steps = ckpt.steps()
    if as_json:
        _emit_json({"resumed": report.resumed, "discarded": report.discarded, "failed": report.failed,
                    "skipped": report.skipped, "committed_steps": steps})  # fmt: skip
    else:
        out.print(f"resumed and committed: {report.resumed or 'none'}")
        for save_id, why in report.discarded:
            out.print(f"discarded {save_id}: {why}")
        for save_id, why in report.failed:
            out.print(f"FAILED {save_id} (kept in the spool): {why}")
        for save_id, why in report.skipped:
            out.print(f"skipped {save_id}: {why}")
        out.print(f"committed steps in {ckpt.url}: {steps}")
    if report.failed:
        raise typer.Exit(1)


@app.command("rollback")
def rollback_command(
    url: UrlArgument,
    to: Annotated[int, typer.Option("--to", help="the committed step to continue from")],
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="only say what would be removed")] = False,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Make a committed step the latest again: remove every committed step after it (newest
    first, manifest first), so that training can continue from it. Stop the job first."""

    async def run(storage: Storage) -> list[int]:
        if dry_run:
            steps = await committed_steps(storage)
            if to not in steps:
                raise CheckpointNotFoundError(f"step {to} has no committed checkpoint in {storage.url}")
            return [s for s in steps if s > to]
        return await remove_steps_after(storage, to)

    removed = _on_storage(url, _config(config), run)
    if as_json:
        _emit_json({"to": to, "removed": removed, "dry_run": dry_run})
        return
    verb = "would remove" if dry_run else "removed"
    out.print(f"{verb} steps after {to}: {removed or 'none'}")


def _seconds(text: str) -> float:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip().lower()
    try:
        seconds = float(text[:-1]) * units[text[-1]] if text[-1:] in units else float(text)
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a duration (e.g. 90s, 30m, 2h, 1d)") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise typer.BadParameter(f"{text!r}: a duration must be finite and not negative (e.g. 90s, 30m, 2h, 1d)")
    return seconds


@app.command("gc")
def gc_command(
    url: UrlArgument,
    keep_last: Annotated[int, typer.Option("--keep-last", "-k", min=1, help="committed steps to keep")],
    grace: Annotated[
        str, typer.Option(help="leave incomplete saves younger than this alone (they may be in progress)")
    ] = "1h",
    dry_run: Annotated[bool, typer.Option("--dry-run", "-n", help="only say what would be removed")] = False,
    config: ConfigOption = None,
    as_json: JsonOption = False,
) -> None:
    """Retention, cleanup of incomplete saves older than the grace period, abort of stale
    multipart uploads (S3)."""
    grace_s = _seconds(grace)
    report = _on_storage(
        url, _config(config), lambda s: collect_garbage(s, keep_last=keep_last, grace_s=grace_s, dry_run=dry_run)
    )
    if as_json:
        _emit_json(dataclasses.asdict(report))
        return
    verb = "would delete" if dry_run else "deleted"
    out.print(f"{verb} steps: {report.deleted_steps or 'none'}")
    for prefix in report.removed_incomplete:
        out.print(f"{verb} incomplete: {prefix}")
    for prefix in report.kept_recent:
        out.print(f"kept (younger than {grace}): {prefix}")
    for step in report.kept_unreadable:
        out.print(f"kept (manifest unreadable, never guessed about): step {step}")
    for prefix in report.skipped:
        out.print(f"kept (no longer garbage when re-checked): {prefix}")
    out.print(f"{'would abort' if dry_run else 'aborted'} multipart uploads: {report.aborted_uploads}")
    out.print(f"{'would free' if dry_run else 'freed'} {_size(report.freed_bytes)}")


@app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def bench_command(
    ctx: typer.Context,
    which: Annotated[
        str,
        typer.Argument(
            help="local | s3 | spool | lightning | load | interference | distributed; options go to that benchmark"
        ),
    ] = "local",
) -> None:
    """Run a benchmark and print its figures (``aiosnap bench s3 --help`` for its options)."""
    from .bench import BENCHMARKS, run

    if which not in BENCHMARKS:
        raise typer.BadParameter(f"{which!r}: choose one of {', '.join(BENCHMARKS)}", param_hint="WHICH")
    run(which, list(ctx.args))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        app(args=argv, prog_name="aiosnap")  # usage errors: message and exit status 2
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except Exception as exc:  # one line, whatever failed (no traceback for an operator)
        known = isinstance(exc, (AiosnapError, OSError, NotImplementedError, ValueError))
        message = str(exc) if known else f"{type(exc).__name__}: {exc}"
        print(f"aiosnap: error: {message}", file=sys.stderr)
        if "--json" in (argv if argv is not None else sys.argv[1:]):  # scripts parse stdout
            print(json.dumps({"error": message, "type": type(exc).__name__}))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
