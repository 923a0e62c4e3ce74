"""The aiosnap command line, run as a real process (console script entry via python -m)."""

from __future__ import annotations

import json
import os
import pty
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from aiosnap import Config, SyncCheckpointer
from tests.conftest import CliRunner, s3_config


def aiosnap_process(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI as users run it: a separate process (slow to start: it imports torch)."""
    return subprocess.run(
        [sys.executable, "-m", "aiosnap", *args], capture_output=True, text=True, timeout=120, check=False
    )


def _fill(root: Path, steps: tuple[int, ...]) -> dict[int, int]:
    sizes = {}
    upload = {"chunk_size": "256KiB", "dedup": False}  # each step's bytes in its own folder (ls counts them there)
    config = Config(storage={"url": str(root)}, retention={"keep_last": None}, upload=upload)
    with SyncCheckpointer(config) as ckpt:
        for step in steps:
            state = {"model": {"w": torch.randn(100_000 + step), "b": torch.zeros(3, dtype=torch.int64)}}
            sizes[step] = ckpt.save(state, step=step, metadata={"epoch": step}).wait().nbytes
    return sizes


def _crash_leftover(root: Path, from_step: int, to_step: int, age_s: float) -> Path:
    """What a process killed between data and manifest leaves: data objects, no manifest."""
    source = next(p for p in (root / f"{from_step:012d}").iterdir() if p.is_dir())
    target = root / f"{to_step:012d}" / "deadbeef00000000"
    shutil.copytree(source, target)
    old = time.time() - age_s
    for path in target.rglob("*"):
        os.utime(path, (old, old))
    return target


@pytest.fixture
def filled(tmp_path: Path) -> tuple[Path, dict[int, int]]:
    root = tmp_path / "ckpt"
    return root, _fill(root, (10, 20, 30, 40))


def test_ls_lists_committed_steps_and_with_all_incomplete_ones(
    aiosnap: CliRunner, filled: tuple[Path, dict[int, int]]
) -> None:
    root, sizes = filled
    _crash_leftover(root, 40, 50, age_s=7200)
    listed = json.loads(aiosnap("ls", str(root), "--json").stdout)
    on_disk = {s: sum(p.stat().st_size for p in (root / f"{s:012d}").rglob("*.bin")) for s in sizes}
    assert [(d["step"], d["state"], d["nbytes"], d["world_size"]) for d in listed] == [
        (s, "committed", on_disk[s], 1) for s in sizes
    ]
    assert all(on_disk[s] >= n for s, n in sizes.items())
    assert all(abs(d["time"] - time.time()) < 300 for d in listed)
    everything = json.loads(aiosnap("ls", str(root), "--all", "--json").stdout)
    assert [(d["step"], d["state"]) for d in everything][-1] == (50, "incomplete")
    human = aiosnap("ls", str(root), "--all")
    assert human.returncode == 0
    assert "incomplete" in human.stdout and "40" in human.stdout and "committed" in human.stdout


def test_info_shows_entries_dtypes_shapes_bytes(aiosnap: CliRunner, filled: tuple[Path, dict[int, int]]) -> None:
    root, _ = filled
    shown = aiosnap("info", str(root), "--step", "20")
    assert shown.returncode == 0, shown.stderr
    assert "step 20" in shown.stdout and '"epoch": 20' in shown.stdout
    assert "model/w" in shown.stdout and "float32" in shown.stdout and "100020" in shown.stdout
    assert "model/b" in shown.stdout and "int64" in shown.stdout
    doc = json.loads(aiosnap("info", str(root), "--json").stdout)  # latest
    assert doc["step"] == 40 and [e["shape"] for e in doc["entries"]] == [[100040], [3]]
    assert doc["top_level_bytes"] == {"model": 100040 * 4 + 3 * 8}  # what load(paths=["model"]) reads
    assert "top-level key" in shown.stdout


def test_verify_passes_then_finds_a_flipped_byte(aiosnap: CliRunner, filled: tuple[Path, dict[int, int]]) -> None:
    root, _ = filled
    ok = aiosnap("verify", str(root), "--step", "30")
    assert ok.returncode == 0 and "ok" in ok.stdout
    data = next((root / f"{30:012d}").rglob("*.bin"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    bad = aiosnap("verify", str(root), "--step", "30")
    assert bad.returncode == 1
    assert "checksum mismatch" in bad.stderr and data.name in bad.stderr
    report = json.loads(aiosnap("verify", str(root), "--step", "30", "--json").stdout)
    assert report["ok"] is False and len(report["problems"]) == 1
    assert aiosnap("verify", str(root), "--step", "40").returncode == 0  # other steps untouched
    data = next((root / f"{20:012d}").rglob("*.bin"))
    data.write_bytes(data.read_bytes()[:1000])
    truncated = aiosnap("verify", str(root), "--step", "20")
    assert truncated.returncode == 1 and "truncated" in truncated.stderr


def test_gc_applies_retention_and_cleans_only_old_incomplete_saves(
    aiosnap: CliRunner, filled: tuple[Path, dict[int, int]]
) -> None:
    root, sizes = filled
    old = _crash_leftover(root, 40, 50, age_s=7200)
    young = _crash_leftover(root, 40, 60, age_s=10)  # may be a save in progress
    dry = json.loads(aiosnap("gc", str(root), "--keep-last", "2", "--dry-run", "--json").stdout)
    assert dry["deleted_steps"] == [10, 20] and dry["dry_run"] is True
    assert sorted(p.name for p in root.iterdir()) == [f"{s:012d}" for s in (10, 20, 30, 40, 50, 60)]

    done = aiosnap("gc", str(root), "--keep-last", "2", "--grace", "1h", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["deleted_steps"] == [10, 20]
    assert report["removed_incomplete"] == [f"{50:012d}/deadbeef00000000"]
    assert report["kept_recent"] == [f"{60:012d}/deadbeef00000000"]
    assert report["freed_bytes"] >= sizes[10] + sizes[20]
    assert not old.exists() and young.exists()
    assert json.loads(aiosnap("ls", str(root), "--json").stdout)[0]["step"] == 30
    assert aiosnap("verify", str(root)).returncode == 0


def test_gc_on_s3_aborts_stale_multipart_uploads(
    aiosnap: CliRunner, s3_endpoint: str, s3_bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    config = s3_config(s3_endpoint, s3_bucket)
    with SyncCheckpointer(config) as ckpt:
        ckpt.save({"w": torch.randn(1000)}, step=1).wait()
    s3_client.create_multipart_upload(Bucket=s3_bucket, Key="run/000000000002/abadcafe00000000/rank-0/0.bin")
    s3_client.create_multipart_upload(Bucket=s3_bucket, Key="elsewhere/x.bin")  # outside the root
    config_file = tmp_path / "s3.yaml"
    config_file.write_text(json.dumps({"s3": {"endpoint_url": s3_endpoint, "addressing_style": "path"}}))
    url = f"s3://{s3_bucket}/run"
    # moto reports every multipart upload as initiated in 2010, so the grace period cannot
    # be exercised here: the dry run must leave them alone, the real run abort ours only
    dry = aiosnap("gc", url, "-k", "1", "--dry-run", "--config", str(config_file), "--json")
    assert json.loads(dry.stdout)["aborted_uploads"] == 1  # what a real run would abort ...
    assert len(s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])) == 2  # ... not aborted
    done = aiosnap("gc", url, "-k", "1", "--grace", "1h", "--config", str(config_file), "--json")
    assert done.returncode == 0, done.stderr + done.stdout
    assert json.loads(done.stdout)["aborted_uploads"] == 1
    left = s3_client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
    assert [u["Key"] for u in left] == ["elsewhere/x.bin"]
    listed = json.loads(aiosnap("ls", url, "--config", str(config_file), "--json").stdout)
    assert [d["step"] for d in listed] == [1]


def test_verify_shows_a_progress_bar_on_a_terminal_only(tmp_path: Path) -> None:
    root = tmp_path / "big"
    with SyncCheckpointer(Config(storage={"url": str(root)}, upload={"chunk_size": "1MiB"})) as ckpt:
        ckpt.save({"w": torch.randn(4_000_000)}, step=1).wait()
    primary, secondary = pty.openpty()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "aiosnap", "verify", str(root)],
            stdout=subprocess.PIPE, stderr=secondary, timeout=120, check=False,
            env={**os.environ, "COLUMNS": "120"},
        )  # fmt: skip
        os.close(secondary)
        on_terminal = b""
        while True:
            try:
                chunk = os.read(primary, 65536)
            except OSError:
                break
            if not chunk:
                break
            on_terminal += chunk
    finally:
        os.close(primary)
    assert proc.returncode == 0
    assert b"verifying step 1" in on_terminal and b"MiB" in on_terminal  # bytes and rate, binary units
    assert b"MB" not in on_terminal and b"/s" in on_terminal
    piped = aiosnap_process("verify", str(root))
    assert piped.returncode == 0 and piped.stderr == "" and "\x1b" not in piped.stdout


def test_errors_are_one_line_and_non_zero(aiosnap: CliRunner, tmp_path: Path) -> None:
    missing = aiosnap_process("info", str(tmp_path / "nothing"))
    assert missing.returncode == 1
    assert missing.stderr.strip().count("\n") == 0 and "no committed checkpoint" in missing.stderr
    bad_config = tmp_path / "bad.yaml"
    bad_config.write_text("ram_budget: lots\n")
    broken = aiosnap("ls", str(tmp_path), "--config", str(bad_config))
    assert broken.returncode == 1 and "bad.yaml" in broken.stderr and "ram_budget" in broken.stderr
    assert "Traceback" not in broken.stderr
    assert aiosnap("gc", str(tmp_path), "--keep-last", "0").returncode == 2  # usage error
    assert aiosnap("gc", str(tmp_path), "--keep-last", "1", "--grace", "soon").returncode == 2
    no_spool = tmp_path / "plain.yaml"
    no_spool.write_text(f"storage: {{url: {tmp_path}}}\n")
    assert "no spool configured" in aiosnap("resume", "--config", str(no_spool)).stderr


def test_bench_runs_a_benchmark_and_prints_figures(tmp_path: Path) -> None:
    run = aiosnap_process(
        "bench", "local", "--size-mb", "8", "--small-budget-mib", "4", "--warm-rounds", "2", "--dir", str(tmp_path)
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    large = json.loads(run.stdout)["budget_larger_than_state"]
    assert len(large["warm"]["rounds_blocked_s"]) == len(large["warm_floor_rounds_s"]) == 2  # alternated
    assert large["warm"]["blocked_s"] > 0 and large["warm_floor_s"] > 0
    assert aiosnap_process("bench", "nope").returncode == 2


def test_the_many_tensor_benchmark_saves_what_it_measures(tmp_path: Path) -> None:
    run = aiosnap_process("bench", "many", "--tensors", "300", "--saves", "2", "--dir", str(tmp_path))
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["aiosnap"]["values_equal"] is True
    assert report["ratios"]["aiosnap_blocked_over_torch_save"] > 0


def test_download_copies_a_verified_step_and_refuses_corrupt_data(
    aiosnap: CliRunner, s3_endpoint: str, s3_bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    config = s3_config(s3_endpoint, s3_bucket)
    state = {"w": torch.randn(4_000_000), "step": 7}  # 16 MB: several objects, multipart
    with SyncCheckpointer(config) as ckpt:
        ckpt.save(state, step=7).wait()
    config_file = tmp_path / "s3.yaml"
    config_file.write_text(json.dumps({"s3": {"endpoint_url": s3_endpoint, "addressing_style": "path"}}))
    url, local = f"s3://{s3_bucket}/run", tmp_path / "local"
    done = aiosnap("download", url, str(local), "--config", str(config_file))
    assert done.returncode == 0, done.stderr
    assert "copied" in done.stdout
    with SyncCheckpointer(str(local)) as copy:
        assert copy.steps() == [7]
        restored = copy.load()
    assert torch.equal(restored["w"], state["w"]) and restored["step"] == 7

    key = next(o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"] if o["Key"].endswith(".bin"))
    body = bytearray(s3_client.get_object(Bucket=s3_bucket, Key=key)["Body"].read())
    body[100] ^= 0xFF
    s3_client.put_object(Bucket=s3_bucket, Key=key, Body=bytes(body))
    other = tmp_path / "other"
    refused = aiosnap("download", url, str(other), "--config", str(config_file))
    assert refused.returncode == 1 and "checksum mismatch" in refused.stderr
    assert not list(other.rglob("manifest.json")) and not list(other.rglob("*.bin"))


def test_rollback_makes_an_earlier_step_the_latest(aiosnap: CliRunner, filled: tuple[Path, dict[int, int]]) -> None:
    root, _ = filled
    dry = json.loads(aiosnap("rollback", str(root), "--to", "20", "--dry-run", "--json").stdout)
    assert dry == {"to": 20, "removed": [30, 40], "dry_run": True}
    assert json.loads(aiosnap("ls", str(root), "--json").stdout)[-1]["step"] == 40, "a dry run removes nothing"
    done = aiosnap("rollback", str(root), "--to", "20")
    assert done.returncode == 0 and "removed steps after 20: [30, 40]" in done.stdout
    assert [d["step"] for d in json.loads(aiosnap("ls", str(root), "--json").stdout)] == [10, 20]
    missing = aiosnap("rollback", str(root), "--to", "25")
    assert missing.returncode == 1 and "step 25 has no committed checkpoint" in missing.stderr
    with SyncCheckpointer(Config(storage={"url": str(root)})) as ckpt:
        ckpt.save({"x": torch.ones(1)}, step=21).wait()  # training continues from step 20
        assert ckpt.steps()[-1] == 21


@pytest.mark.parametrize("command", [["ls"], ["info"], ["verify"], ["gc", "--dry-run"]])
def test_commands_that_read_a_root_never_import_torch(command: list[str], filled: tuple[Path, dict[int, int]]) -> None:
    """Importing torch costs ~1.1 s here; `aiosnap ls` took 1.9 s with it, 0.3 s without."""
    root, _ = filled
    probe = (
        "import sys\n"
        "from aiosnap.cli import main\n"
        f"sys.argv = ['aiosnap', *{command!r}[:1], {str(root)!r}, *{command!r}[1:]]\n"
        "try:\n    main()\nexcept SystemExit as exit:\n    assert not exit.code, exit.code\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False", done.stdout[-500:]


def test_version_names_aiosnap_python_and_torch(aiosnap: CliRunner) -> None:
    import aiosnap as package

    done = aiosnap("--version")
    assert done.returncode == 0 and done.stdout.startswith(f"aiosnap {package.__version__} (Python 3.")
    assert f"torch {torch.__version__}" in done.stdout


def test_bench_help_lists_every_benchmark_and_each_benchmarks_own_options(aiosnap: CliRunner) -> None:
    from aiosnap.bench import BENCHMARKS

    for listing in (aiosnap("bench", "--help"), aiosnap("bench")):
        assert listing.returncode == 0
        assert all(f"  {name} " in listing.stdout for name in BENCHMARKS) and "  many " in listing.stdout
    own = aiosnap("bench", "s3", "--help")
    assert own.returncode == 0 and own.stdout.startswith("usage: aiosnap bench s3")
    assert "--cap-mb-s" in own.stdout and "--endpoint" in own.stdout
    assert aiosnap("bench", "many", "--no-such-option").returncode == 2


def test_usage_errors_with_json_print_a_json_document(aiosnap: CliRunner, tmp_path: Path) -> None:
    for args, where in (
        (["gc", str(tmp_path), "--keep-last", "0", "--json"], "--keep-last"),
        (["ls", str(tmp_path), "--json", "--bogus"], "--bogus"),
        (["info", "--json"], "URL"),
    ):
        failed = aiosnap(*args)
        assert failed.returncode == 2, args
        doc = json.loads(failed.stdout)
        assert where.lower() in doc["error"].lower() and doc["type"], (args, doc)
        assert where.lower() in failed.stderr.lower()  # and the usual message for people
    assert aiosnap("gc", str(tmp_path), "--keep-last", "0").stdout == ""  # no JSON unless asked


def test_a_wrong_step_lists_the_committed_ones(aiosnap: CliRunner, filled: tuple[Path, dict[int, int]]) -> None:
    root, _ = filled
    missing = aiosnap("info", str(root), "--step", "25")
    assert missing.returncode == 1
    assert "step 25 has no committed checkpoint" in missing.stderr
    assert "the committed steps are 10, 20, 30, 40" in missing.stderr
    back = aiosnap("rollback", str(root), "--to", "25", "--dry-run", "--json")
    assert "the committed steps are 10, 20, 30, 40" in json.loads(back.stdout)["error"]
    from aiosnap import CheckpointNotFoundError

    with SyncCheckpointer(str(root)) as ckpt, pytest.raises(CheckpointNotFoundError, match="are 10, 20, 30, 40$"):
        ckpt.load(step=25)


def test_redirected_output_never_cuts_an_entry_path(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    optim.step()
    deep = {"an_encoder_block_with_a_long_name": {"and_a_longer_sublayer_name": model}}
    with SyncCheckpointer(str(root)) as ckpt:
        ckpt.save({"model": deep, "optimizer_with_a_long_name": optim}, step=1).wait()
    shown = aiosnap_process("info", str(root))  # stdout is a pipe, as in `aiosnap info ... | less`
    assert shown.returncode == 0, shown.stderr
    paths = [line.split()[0] for line in shown.stdout.splitlines() if line.strip().startswith(("model/", "optim"))]
    assert "model/an_encoder_block_with_a_long_name/and_a_longer_sublayer_name/0.weight" in paths
    assert {"optimizer_with_a_long_name/state/0/exp_avg", "optimizer_with_a_long_name/state/0/exp_avg_sq"} <= set(paths)
    assert "…" not in shown.stdout


def test_keys_and_metadata_print_as_they_are_even_with_force_color(tmp_path: Path) -> None:
    """Rich markup in user data (``blocks[attn]``, ``[bold]``) is printed, not interpreted;
    FORCE_COLOR (colours asked for in a pipe) never makes a pipe as narrow as a terminal."""
    root = tmp_path / "ckpt"
    long_key = "very_long_" * 30 + "end"
    state = {"blocks[attn]": torch.zeros(2), "blocks[mlp]": torch.ones(2), long_key: torch.zeros(1)}
    with SyncCheckpointer(str(root)) as ckpt:
        ckpt.save(state, step=1, metadata={"note": "lr [bold]3e-4"}).wait()
    env = {**os.environ, "FORCE_COLOR": "1", "COLUMNS": "80"}
    shown = subprocess.run([sys.executable, "-m", "aiosnap", "info", str(root)], capture_output=True, text=True,
                           timeout=120, env=env, check=False)  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    words = shown.stdout.split()
    assert words.count("blocks[attn]") == 2 and words.count("blocks[mlp]") == 2  # the key table and the entries
    assert 'metadata: {"note": "lr [bold]3e-4"}' in shown.stdout
    assert words.count(long_key) == 2  # whole, on one line each time


def test_help_texts_keep_their_brackets(aiosnap: CliRunner) -> None:
    shown = aiosnap("--help")
    assert shown.returncode == 0
    assert "aiosnap bench NAME [options]" in " ".join(shown.stdout.split())


def test_a_benchmarks_usage_error_with_json_prints_a_json_document(aiosnap: CliRunner) -> None:
    failed = aiosnap("bench", "gpu", "--json", "--tensors", "x")
    assert failed.returncode == 2
    doc = json.loads(failed.stdout)
    assert doc["type"] == "UsageError" and "--tensors" in doc["error"] and "invalid" in doc["error"]
    assert "usage: aiosnap bench gpu" in failed.stderr  # and the usual message for people


def test_ctrl_c_says_so_and_with_json_prints_a_json_document(tmp_path: Path) -> None:
    """A listing that hangs (a store that stopped answering), then SIGINT: exit status 130,
    a line on stderr, and under --json a JSON document on stdout."""
    import signal

    hang = (
        "import asyncio, sys\n"
        "import aiosnap.cli as cli\n"
        "async def hangs(storage, include_incomplete=False):\n"
        "    print('listing', file=sys.stderr, flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "cli.list_steps = hangs\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    for json_args in ([], ["--json"]):
        child = subprocess.Popen([sys.executable, "-c", hang, "ls", str(tmp_path), *json_args],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        try:
            assert child.stderr is not None and child.stderr.readline() == "listing\n"
            child.send_signal(signal.SIGINT)
            out, err = child.communicate(timeout=60)
        finally:
            child.kill()
        assert child.returncode == 130 and "aiosnap: interrupted" in err, (out, err)
        if json_args:
            assert json.loads(out) == {"error": "interrupted", "type": "KeyboardInterrupt"}
        else:
            assert out == ""


def test_verify_and_info_count_what_a_multi_rank_step_references(aiosnap: CliRunner, tmp_path: Path) -> None:
    """Two writer groups hold one value, so each wrote a copy; one is referenced. verify
    reads and counts the referenced bytes (its progress reaches its total); info and ls say
    both what is referenced and what is stored."""
    import asyncio

    from aiosnap.catalog.maintenance import verify_step
    from aiosnap.storage.local import LocalStorage
    from tests.simulated_ranks import save_as_ranks
    from tests.test_layouts_values import _in_bucket_of

    states = [{"norm": torch.ones(1000)}, {"norm": torch.ones(1000), _in_bucket_of("norm"): torch.ones(2)}]
    manifest = save_as_ranks(tmp_path, states)
    report = json.loads(aiosnap("verify", str(tmp_path), "--json").stdout)
    assert report["ok"] and report["bytes"] == manifest.referenced_bytes == 4008
    assert report["stored_bytes"] == manifest.total_bytes >= 8008
    seen: list[int] = []

    async def verify() -> list[str]:
        storage = LocalStorage(str(tmp_path))
        try:
            return await verify_step(storage, manifest, progress=seen.append)
        finally:
            await storage.close()

    assert asyncio.run(verify()) == [] and sum(seen) == report["bytes"]
    assert "3.9 KiB in 2 entries verified" in aiosnap("verify", str(tmp_path)).stdout
    assert "3.9 KiB in 2 entries (7.9 KiB stored in 2 object(s))" in aiosnap("info", str(tmp_path)).stdout
    listed = json.loads(aiosnap("ls", str(tmp_path), "--json").stdout)
    assert (listed[0]["nbytes"], listed[0]["referenced_bytes"]) == (manifest.total_bytes, 4008)
