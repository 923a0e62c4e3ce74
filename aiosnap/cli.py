"""The ``aiosnap`` command line (also ``python -m aiosnap``), built on Typer and Rich.

Commands: ``ls``, ``info``, ``verify``, ``download``, ``export`` (:mod:`aiosnap.cli_export`), ``resume``,
``rollback``, ``gc``, ``bench``. URLs are storage
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
import io
import json
import logging
import math
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, ProgressColumn, Task, TimeRemainingColumn
from rich.table import Table
from rich.text import Text

from .catalog.garbage import collect_garbage
from .catalog.maintenance import list_steps, referenced_steps, verify_step
from .catalog.steps import committed_steps, manifest_of, not_committed, remove_steps_after
from .cli_export import register as register_export
from .config import Config, load_config
from .core.units import format_bytes, format_rate
from .errors import AiosnapError
from .format.manifest import Manifest
from .interop.detect import describe, open_checkpoint
from .load.select import entries_under
from .storage.base import Storage
from .storage.registry import storage_from_url
from .transfer.copy import copy_step
from .transfer.resume import ResumeReport

__all__ = ["app", "main"]

T = TypeVar("T")
app = typer.Typer(
    name="aiosnap",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts as written: "[options]" is not markup
)


def _real_terminal(stream: Any) -> bool:
    """Whether ``stream`` is a terminal itself (``FORCE_COLOR`` may ask Rich for colours in
    a file or a pipe, never for a terminal's width there)."""
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


class _Output:
    """Standard output, as it is when a command prints: on a terminal, tables fit its width
    (long entry paths fold onto a second line); redirected to a file or a pipe, lines are as
    long as they need to be, so nothing is ever cut (``exp_avg`` and ``exp_avg_sq`` stay two
    names). Text is printed as it is: no Rich markup (``blocks[attn]`` stays whole)."""

    def print(self, *objects: Any) -> None:
        width = None if _real_terminal(sys.stdout) else UNLIMITED_WIDTH
        Console(highlight=False, markup=False, soft_wrap=True, width=width).print(*objects)


UNLIMITED_WIDTH = 1 << 20
out = _Output()

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
        storage = await open_checkpoint(url, config)  # a DCP folder or torch.save file: read-only, one step
        try:
            return await work(storage)
        finally:
            await storage.close()

    return asyncio.run(run())


def _foreign(storage: Storage) -> bool:
    """A checkpoint of another format (DCP, torch.save, safetensors), seen as one read-only step."""
    return getattr(storage, "translator", None) is not None or storage.read_only


def _when(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch).astimezone().strftime("%Y-%m-%d %H:%M:%S")


def _size(nbytes: int) -> str:
    return format_bytes(nbytes)


def _table(*headers: str) -> Table:
    """A plain table whose cells fold onto more lines rather than lose characters (fill it
    with :func:`_add_row`)."""
    table = Table(box=None, header_style="bold")
    for header in headers:
        table.add_column(header, overflow="fold")
    return table


def _add_row(table: Table, *cells: str) -> None:
    """A row of plain text: entry paths, keys and metadata are never read as Rich markup."""
    table.add_row(*(Text(cell) for cell in cells))


def _emit_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2, default=str))


class AverageRateColumn(ProgressColumn):
    """Bytes per second since the task started. Rich's own speed column estimates from the
    updates of the last 30 s alone, which shows many times the real rate when bytes are
    reported in bursts (several files finishing together)."""

    def render(self, task: Task) -> Text:
        elapsed = task.elapsed
        if not elapsed or not task.completed:
            return Text("?", style="progress.data.speed")
        return Text(format_rate(task.completed / elapsed), style="progress.data.speed")


def bytes_bar(console: Console, get_time: Callable[[], float] | None = None) -> Progress:
    """The commands' progress bar of bytes (``get_time``: its clock, for tests)."""
    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(binary_units=True),
        AverageRateColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        get_time=get_time,
    )


def _progress(total: int | None, what: str, enabled: bool) -> tuple[Progress | None, Callable[[int], None]]:
    """A bytes progress bar on a terminal; a no-op when piped or for JSON output."""
    console = Console(stderr=True)
    if not enabled or not _real_terminal(sys.stderr):
        return None, lambda n: None
    bar = bytes_bar(console)
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

    async def run(storage: Storage) -> tuple[list[Any], str, bool]:
        found = await list_steps(storage, include_incomplete=all_steps)
        return found, describe(storage), _foreign(storage)

    steps, kind, foreign = _on_storage(url, _config(config), run)
    if as_json:
        _emit_json([{**dataclasses.asdict(info), "format": kind} for info in steps])
        return
    if foreign and steps:
        print(f"{url} is {kind}, which aiosnap reads as step 0 (read-only): `aiosnap info`, `aiosnap verify` and "
              f"`aiosnap export {url} DEST --to aiosnap|dcp|torch|safetensors` take it", file=sys.stderr)  # fmt: skip
    if steps:
        incremental = any(i.own_bytes is not None and i.own_bytes != i.nbytes for i in steps)
        sizes = ("size", "own") if incremental else ("size",)  # own: less what earlier saves hold
        table = _table("step", "state", "time", *sizes, "world size", "save id")
        for info in steps:
            note = f" (+{len(info.leftovers)} leftover)" if info.leftovers and info.state == "committed" else ""
            own = ("" if info.own_bytes is None else _size(info.own_bytes),) if incremental else ()
            _add_row(
                table,
                str(info.step),
                info.state + note,
                "" if info.state == "unreadable" or foreign else _when(info.time),
                _size(info.nbytes),
                *own,
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

    async def run(storage: Storage) -> tuple[Manifest, str]:
        return await manifest_of(storage, step), describe(storage)

    manifest, kind = _on_storage(url, _config(config), run)
    by_key = _bytes_by_top_level_key(manifest)
    if as_json:
        doc = manifest.model_dump(mode="json", exclude_none=True)
        doc.pop("tree")
        doc["top_level_bytes"] = by_key
        doc["kind"] = kind
        doc["own_bytes"], doc["total_bytes"] = manifest.own_bytes, manifest.total_bytes
        doc["referenced_steps"] = [dataclasses.asdict(r) for r in referenced_steps(manifest)]
        _emit_json(doc)
        return
    if manifest.foreign is not None:
        out.print(
            f"{url} is {kind} (read by aiosnap as step {manifest.step}, read-only): "
            f"{_size(manifest.total_bytes)} in {len(manifest.objects)} file(s), written by {manifest.world_size} "
            f"rank(s); {_unverified(manifest)}"
        )
    else:
        out.print(
            f"step {manifest.step} of {url}: committed {_when(manifest.created_at)}, "
            f"{_size(manifest.referenced_bytes)} in {len(manifest.entries)} entries ({_size(manifest.total_bytes)} "
            f"stored in {len(manifest.stored_objects())} object(s)), world size {manifest.world_size}, "
            f"save id {manifest.save_id}"
        )
    _print_references(manifest)
    if manifest.metadata:
        out.print(f"metadata: {json.dumps(manifest.metadata)}")
    if by_key:
        keys = _table("top-level key", "bytes")
        for key, nbytes in by_key.items():
            _add_row(keys, key, _size(nbytes))
        out.print(keys)
    table = _table("entry", "kind", "dtype", "shape", "bytes", "device")
    for entry in manifest.entries:
        shape = "" if entry.kind == "pickle" else "x".join(map(str, entry.shape)) or "scalar"
        kind = f"sharded ({len(entry.shards)})" if entry.shards is not None else entry.kind
        _add_row(table, entry.path, kind, entry.dtype, shape, _size(entry.nbytes), entry.device)
    out.print(table)
    if manifest.rank_local is not None:
        each = [sum(e.nbytes for e in part.entries) for part in manifest.rank_local]
        out.print(f"rank-local values: {len(manifest.rank_local)} rank(s), {_size(sum(each))} in all")


def _print_references(manifest: Manifest) -> None:
    """What a step names of earlier saves' objects, by step, and how much is its own."""
    earlier = referenced_steps(manifest)
    if not earlier:
        return
    out.print(
        f"own: {_size(manifest.own_bytes)} in {len(manifest.objects)} object(s); references "
        f"{_size(manifest.total_bytes - manifest.own_bytes)} in {len(manifest.references or ())} object(s) of "
        f"{len(earlier)} earlier step(s), kept while this step is"
    )
    table = _table("referenced step", "save id", "objects", "stored", "read by this step")
    for ref in earlier:
        _add_row(table, str(ref.step), ref.save_id, str(ref.objects), _size(ref.nbytes), _size(ref.range_bytes))
    out.print(table)


def _unverified(manifest: Manifest) -> str:
    """How much of a translated manifest's bytes has no recorded checksum."""
    total = sum(r.nbytes for _, r in manifest.all_ranges())
    unchecked = sum(r.nbytes for _, r in manifest.all_ranges() if r.crc32c is None)
    if not unchecked:
        return "every range has a crc32c (written by aiosnap)"
    return f"{_size(unchecked)} of {_size(total)} has no recorded checksum (read whole by verify, not checked)"


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
    unchecked = sum(r.nbytes for _, r in manifest.all_ranges() if r.crc32c is None)
    if as_json:
        _emit_json({
            "step": manifest.step, "ok": not problems, "bytes": manifest.referenced_bytes,
            "stored_bytes": manifest.total_bytes, "own_bytes": manifest.own_bytes, "problems": problems,
            "unverified_bytes": unchecked,
            "referenced_steps": [dataclasses.asdict(r) for r in referenced_steps(manifest)],
        })  # fmt: skip
    elif problems:
        for problem in problems:
            print(problem, file=sys.stderr)
        print(f"step {manifest.step}: {len(problems)} problem(s)", file=sys.stderr)
    else:
        checked = f"{_size(manifest.referenced_bytes)} in {len(manifest.entries)} entries"
        earlier = referenced_steps(manifest)
        if earlier:
            steps_named = ", ".join(str(r.step) for r in earlier)
            shared = _size(sum(r.range_bytes for r in earlier))
            checked += f" ({shared} of it in objects of earlier step(s) {steps_named})"
        if unchecked:
            out.print(f"step {manifest.step}: ok, {checked} read whole; {_unverified(manifest)}")
        else:
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
    """Copy a step to another root (from S3 to local disk, say), checking every checksum; the
    copy is committed (manifest written) only once complete."""
    settings = _config(config)
    if "://" not in dest and Path(dest).expanduser().is_file():
        raise AiosnapError(
            f"{dest} is a file: download copies a step into a checkpoint root (a folder); to write one "
            f"torch.load-readable file, `aiosnap export {url} {dest}.new --to torch`"
        )

    async def run(storage: Storage) -> tuple[Manifest, bool]:
        if _foreign(storage):
            raise AiosnapError(
                f"{url} is {describe(storage)}, not an aiosnap root: `aiosnap export {url} {dest} --to aiosnap` "
                "copies it into one"
            )
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
    settings = settings.model_copy(
        update={
            "spool": settings.spool.model_copy(update={"resume": False}),
            "events": settings.events.model_copy(update={"stderr": False}),  # this command reports itself
        }
    )
    from .checkpointer import SyncCheckpointer  # torch: only the commands that need it import it

    with SyncCheckpointer(settings) as ckpt:
        bar, advance = _progress(None, "uploading spooled chunks", not as_json)
        done_before = 0  # bytes of the roots resumed before this one

        def landed(nbytes: int, total: int) -> None:  # total: this root's
            if bar is not None:
                bar.update(bar.task_ids[0], total=done_before + total)
            advance(nbytes)

        targets = [ckpt, *(ckpt.at(root) for root in roots or [])]
        reports = []
        with bar if bar is not None else contextlib.nullcontext():
            for target in targets:
                reports.append(target.resume_spool(landed if bar is not None else None))
                done_before = 0 if bar is None else int(bar.tasks[0].completed)
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
                raise await not_committed(storage, to, " to roll back to")
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
    for prefix in report.kept_live:
        out.print(f"kept (a multi-rank save in progress: a live heartbeat or a young verdict): {prefix}")
    for prefix in report.kept_undecided:
        out.print(
            f"kept (a multi-rank save whose commit was claimed, and whose manifest never appeared: its coordinator "
            f"may still write it; remove it by hand once its job is gone): {prefix}"
        )
    for step in report.kept_unreadable:
        out.print(f"kept (manifest unreadable, never guessed about): step {step}")
    for prefix in report.kept_referenced:
        out.print(f"kept (objects that later steps reference; they go with the last step naming them): {prefix}")
    for prefix in report.skipped:
        out.print(f"kept (no longer garbage when re-checked): {prefix}")
    out.print(f"{'would abort' if dry_run else 'aborted'} multipart uploads: {report.aborted_uploads}")
    out.print(f"{'would free' if dry_run else 'freed'} {_size(report.freed_bytes)}")


@app.command("bench", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             add_help_option=False,
             short_help="Run a benchmark: aiosnap bench NAME [options] (--help: the list)")  # fmt: skip
def bench_command(
    ctx: typer.Context,
    which: Annotated[
        str | None,
        typer.Argument(help="the benchmark; its options follow (aiosnap bench NAME --help)", show_default=False),
    ] = None,
) -> None:
    """Run a benchmark and print its figures: aiosnap bench NAME [options]; aiosnap bench NAME
    --help for its options; aiosnap bench --help for the list."""
    from .bench import BENCHMARKS, describe_benchmarks, run

    if which is None or which in ("-h", "--help"):
        print(
            f"usage: aiosnap bench NAME [options]   (aiosnap bench NAME --help: its options)\n\n{describe_benchmarks()}"
        )
        return
    if which not in BENCHMARKS:
        raise typer.BadParameter(f"{which!r}: choose one of {', '.join(BENCHMARKS)}", param_hint="NAME")
    if "--json" not in ctx.args:
        run(which, list(ctx.args))
        return
    with contextlib.redirect_stderr(_Tee(sys.stderr)) as said:
        try:
            run(which, list(ctx.args))
        except SystemExit as done:
            if done.code == 2:  # the benchmark's own usage error (argparse): scripts get JSON too
                message = said.text.strip().splitlines()[-1:] or ["usage error"]
                print(json.dumps({"error": message[0], "type": "UsageError"}))
            raise


class _Tee(io.TextIOBase):
    """A text stream that writes through to ``stream`` and keeps what was written."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._kept = io.StringIO()

    @property
    def text(self) -> str:
        return self._kept.getvalue()

    def write(self, text: str) -> int:
        self._kept.write(text)
        return int(self._stream.write(text))

    def flush(self) -> None:
        self._stream.flush()


def _version(show: bool) -> None:
    if show:
        from importlib.metadata import PackageNotFoundError, version

        from . import __version__

        try:
            torch = f"torch {version('torch')}"
        except PackageNotFoundError:
            torch = "no torch"
        print(f"aiosnap {__version__} (Python {sys.version.split()[0]}, {torch})")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool, typer.Option("--version", help="print the version and exit", is_eager=True, callback=_version)
    ] = False,
) -> None:
    """List, inspect, verify, copy, resume and clean aiosnap checkpoints; run the benchmarks."""


INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl-C (128 + SIGINT, as typer returns it)."""

_CLICK_ERROR: type[Any] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
"""Click's error class: the click that typer runs on (its own copy in recent typer releases)."""


register_export(app)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script; returns the exit status."""
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in args  # scripts parse stdout: every error is a JSON document there too
    try:
        code = app(args=args, prog_name="aiosnap", standalone_mode=False)
        if code == INTERRUPTED:  # typer's answer to Ctrl-C (KeyboardInterrupt)
            print("aiosnap: interrupted", file=sys.stderr)
            if as_json:
                print(json.dumps({"error": "interrupted", "type": "KeyboardInterrupt"}))
    except _CLICK_ERROR as exc:  # a usage error (exit status 2): the message, then JSON if asked
        exc.show()
        if as_json:
            print(json.dumps({"error": exc.format_message(), "type": type(exc).__name__}))
        return int(exc.exit_code)
    except typer.Abort:
        print("aiosnap: aborted", file=sys.stderr)
        return 1
    except SystemExit as done:  # a benchmark's own argument parser (its --help, its usage errors)
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except Exception as exc:  # one line, whatever failed (no traceback for an operator)
        known = isinstance(exc, (AiosnapError, OSError, NotImplementedError, ValueError))
        message = str(exc) if known else f"{type(exc).__name__}: {exc}"
        print(f"aiosnap: error: {message}", file=sys.stderr)
        if as_json:
            print(json.dumps({"error": message, "type": type(exc).__name__}))
        return 1
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
