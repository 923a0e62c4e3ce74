"""Config models, YAML loading, env overrides, and errors that name the field and file."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiosnap import Config, ConfigError, SyncCheckpointer, load_config
from pydantic import ValidationError

REPO = Path(__file__).parent.parent


def test_defaults_match_the_documented_yaml() -> None:
    config = Config()
    assert config.storage.url == "./checkpoints"
    assert config.ram_budget == 1024**3
    assert config.max_pending_saves == 1
    assert config.retention.keep_last == 3
    assert (config.upload.concurrency, config.upload.chunk_size) == (8, 64 * 1024**2)
    assert config.loop == "auto"


@pytest.mark.parametrize(
    ("text", "expected"), [("512MiB", 512 * 1024**2), ("2GB", 2 * 10**9), (1048576, 1048576), ("1.5MiB", 1572864)]
)
def test_sizes_accept_units(text: object, expected: int) -> None:
    assert Config(ram_budget=text).ram_budget == expected  # type: ignore[arg-type]


def test_budget_as_share_of_available_memory() -> None:
    import psutil

    config = Config(ram_budget="10%")
    assert config.ram_budget == "10%"
    resolved = config.ram_budget_bytes()
    assert 0.05 * psutil.virtual_memory().available < resolved < 0.15 * psutil.virtual_memory().available


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"ram_budget": -5}, "ram_budget"),
        ({"ram_budget": 0}, "ram_budget"),
        ({"ram_budget": "150%"}, "ram_budget"),
        ({"ram_budget": "lots"}, "ram_budget"),
        ({"max_pending_saves": 0}, "max_pending_saves"),
        ({"upload": {"concurrency": 0}}, "upload.concurrency"),
        ({"upload": {"chunk_size": "-1MiB"}}, "upload.chunk_size"),
        ({"retention": {"keep_last": 0}}, "retention.keep_last"),
        ({"loop": "trio"}, "loop"),
        ({"storage": {"url": ""}}, "storage.url"),
        ({"unknown_key": 1}, "unknown_key"),
        ({"upload": {"chunksize": 1}}, "upload.chunksize"),
    ],
)
def test_bad_values_name_the_field(fields: dict[str, object], field_name: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config(**fields)  # type: ignore[arg-type]
    assert field_name in str(info.value)
    assert info.value.__cause__ is None and info.value.__context__ is None


def test_impossible_budgets_are_refused_when_resolved(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ram_budget.*exceeds this machine's memory"):
        SyncCheckpointer({"storage": {"url": str(tmp_path)}, "ram_budget": "100TiB"})
    with pytest.raises(ConfigError, match=r"ram_budget: 1e-06% of the available memory is \d+ B, below the minimum"):
        SyncCheckpointer({"storage": {"url": str(tmp_path)}, "ram_budget": "0.000001%"})


def test_config_is_frozen() -> None:
    with pytest.raises(ValidationError):
        Config().max_pending_saves = 3  # type: ignore[misc]


def test_load_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "ckpt.yaml"
    path.write_text(
        "storage: {url: /data/ckpt}\nram_budget: 256MiB\nretention: {keep_last: 5}\nupload: {concurrency: 2}\n"
    )
    config = load_config(path)
    assert (config.storage.url, config.ram_budget, config.retention.keep_last) == ("/data/ckpt", 256 * 1024**2, 5)


def test_every_shipped_config_file_loads() -> None:
    files = sorted((REPO / "configs").glob("*.yaml"))
    assert files
    for path in files:
        load_config(path)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("storage: [unclosed", "invalid YAML"),
        ("- a list\n", "expected a mapping"),
        ("ram_budget: -1\n", "ram_budget"),
        ("upload: {concurency: 3}\n", "upload.concurency"),
    ],
)
def test_yaml_errors_name_file_and_field(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value) and message in str(info.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_env_overrides_file_and_arguments_override_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("upload: {concurrency: 3}\nmax_pending_saves: 2\n")
    monkeypatch.setenv("AIOSNAP_UPLOAD__CONCURRENCY", "5")
    monkeypatch.setenv("AIOSNAP_RAM_BUDGET", "128MiB")
    config = load_config(path)
    assert (config.upload.concurrency, config.max_pending_saves, config.ram_budget) == (5, 2, 128 * 1024**2)
    assert Config(ram_budget="64MiB").ram_budget == 64 * 1024**2


def test_unknown_storage_scheme_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="storage.url"):
        SyncCheckpointer("gs://bucket/x")


def test_s3_url_without_bucket_names_the_field() -> None:
    with pytest.raises(ConfigError, match="storage.url.*no bucket"):
        SyncCheckpointer("s3:///prefix-only")


SECRET = "wJalrXUtnFEMI-do-not-print-me"


def _every_text(exc: BaseException) -> str:
    import traceback

    return "".join(traceback.format_exception(exc)) + repr(exc.__context__) + repr(exc.__cause__)


def test_a_misspelt_secret_never_reaches_an_error_or_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(f"s3:\n  access_key_id: AKIA\n  secret_acess_key: {SECRET}\n")
    with pytest.raises(ConfigError, match="s3.secret_acess_key") as from_yaml:
        load_config(path)
    with pytest.raises(ConfigError, match="s3.secret_acess_key") as from_dict:
        SyncCheckpointer({"storage": {"url": str(tmp_path)}, "s3": {"secret_acess_key": SECRET}})
    monkeypatch.setenv("AIOSNAP_S3__SECRET_ACESS_KEY", SECRET)
    with pytest.raises(ConfigError, match="AIOSNAP_S3__SECRET_ACESS_KEY.*secret_access_key") as from_env:
        Config()
    for caught in (from_yaml, from_dict, from_env):
        assert SECRET not in _every_text(caught.value)
    from aiosnap.cli import main

    assert main(["ls", str(tmp_path)]) == 1  # the CLI refuses, and prints no secret (checked below)


def test_the_cli_never_prints_a_misspelt_secret(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "AIOSNAP_S3__SECRET_ACESS_KEY": SECRET}
    run = subprocess.run([sys.executable, "-m", "aiosnap", "ls", str(tmp_path)], capture_output=True, text=True,
                         env=env, timeout=120, check=False)  # fmt: skip
    assert run.returncode == 1 and "AIOSNAP_S3__SECRET_ACESS_KEY" in run.stderr
    assert SECRET not in run.stdout + run.stderr


def test_misspelt_environment_variables_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOSNAP_RAM_BUDGT", "1GiB")
    with pytest.raises(ConfigError, match="AIOSNAP_RAM_BUDGT.*did you mean ram_budget"):
        Config()


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"upload": {"chunk_size": 64}}, "upload.chunk_size"),
        ({"s3": {"part_size": 8}}, "s3.part_size"),
        ({"s3": {"multipart_threshold": "16"}}, "s3.multipart_threshold"),
        ({"spool": {"dir": "/tmp/x", "budget": 500}}, "spool.budget"),
    ],
)
def test_a_forgotten_unit_is_refused(fields: dict[str, object], field_name: str) -> None:
    with pytest.raises(ConfigError, match=rf"{field_name}: \d+ bytes\? did you mean \d+[MG]iB\?"):
        Config(**fields)  # type: ignore[arg-type]


def test_duplicate_yaml_keys_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "twice.yaml"
    path.write_text("ram_budget: 1GiB\nupload:\n  concurrency: 4\nram_budget: 2GiB\n")
    with pytest.raises(ConfigError, match=r"twice.yaml.*'ram_budget' is given twice \(lines 1 and 4\)"):
        load_config(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("retention:\n  keep_lats: 2\n", "retention.keep_lats: unknown setting (did you mean retention.keep_last?)"),
        ("keep_last: 2\n", "keep_last: unknown setting (did you mean retention.keep_last?)"),
        ("upload: {concurency: 3}\n", "upload.concurency: unknown setting (did you mean upload.concurrency?)"),
        ("retension: {keep_last: 2}\n", "retension: unknown setting (did you mean retention?)"),
        ("zzz_qqq: 1\n", "zzz_qqq: unknown setting"),
    ],
)
def test_a_misspelt_key_gets_a_did_you_mean(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: {expected}"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"ram_budget": "-1GiB"}, "ram_budget: a size cannot be negative, got '-1GiB'"),
        ({"upload": {"chunk_size": -5}}, "upload.chunk_size: a size cannot be negative, got -5"),
        ({"ram_budget": "lots"}, "ram_budget: expected a size such as 1048576 or '512MiB', got 'lots'"),
        ({"spool": {"mode": "always"}}, "spool: spool mode 'always' needs spool.dir"),
        (
            {"ram_budget": 512},
            "ram_budget: 512 bytes? did you mean 512MiB? (a size without a unit is in bytes; the minimum is 64 KiB)",
        ),
    ],
)
def test_messages_are_aiosnaps_own_words(fields: dict[str, object], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config(**fields)  # type: ignore[arg-type]
    assert str(info.value) == expected and "Value error" not in str(info.value)


def test_load_config_catches_a_unit_forgotten_and_an_unsupported_scheme(tmp_path: Path) -> None:
    small = tmp_path / "small.yaml"
    small.write_text("ram_budget: 512\n")
    with pytest.raises(ConfigError, match=r"small.yaml: ram_budget: 512 bytes\? did you mean 512MiB\?"):
        load_config(small)
    gcs = tmp_path / "gcs.yaml"
    gcs.write_text("storage:\n  url: gs://bucket/run\n")
    with pytest.raises(ConfigError, match=r"gcs.yaml: storage.url: unsupported scheme 'gs' in 'gs://bucket/run'"):
        load_config(gcs)


def test_a_registered_scheme_is_a_valid_storage_url() -> None:
    from aiosnap.config import URL_SCHEMES
    from aiosnap.storage import registry
    from aiosnap.storage.local import LocalStorage

    with pytest.raises(ConfigError, match="unsupported scheme 'aiosnaptest'"):
        Config(storage={"url": "aiosnaptest://x"})
    registry.register_scheme("aiosnaptest", lambda url, path, config: LocalStorage(path))
    try:
        assert Config(storage={"url": "aiosnaptest://x"}).storage.url == "aiosnaptest://x"
    finally:
        registry._SCHEMES.pop("aiosnaptest")
        URL_SCHEMES.discard("aiosnaptest")


def test_relative_paths_in_a_yaml_file_follow_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    folder = tmp_path / "conf"
    folder.mkdir()
    path = folder / "job.yaml"
    path.write_text(
        "storage: {url: ./ckpt}\nspool: {dir: ../spool}\nevents: {jsonl: logs/events.jsonl}\n"
    )  # fmt: skip
    (folder / "logs").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_config("../conf/job.yaml")  # a relative path to the file itself, too
    assert config.storage.url == str(folder / "ckpt")
    assert config.spool.dir == str(folder / "../spool")
    assert config.events.jsonl == folder / "logs" / "events.jsonl"
    with SyncCheckpointer(config) as ckpt:
        ckpt.save({"x": torch.ones(3)}, step=1).wait()
    assert (folder / "ckpt" / f"{1:012d}" / "manifest.json").is_file()
    assert (folder / "logs" / "events.jsonl").stat().st_size > 0
    assert not list(elsewhere.iterdir()), "nothing lands in the working directory"

    path.write_text("storage: {url: s3://bucket/run}\nspool: {dir: /abs/spool}\nevents: {jsonl: ~/events.jsonl}\n")
    kept = load_config(path)  # URLs, absolute paths and ~ are left as they are
    assert (kept.storage.url, kept.spool.dir, kept.events.jsonl) == (
        "s3://bucket/run",
        "/abs/spool",
        Path("~/events.jsonl"),
    )
    path.write_text("spool: {dir: ./spool}\n")
    monkeypatch.setenv("AIOSNAP_STORAGE__URL", "from-env")  # the environment and code: the working directory
    from_env = load_config(path)
    assert (from_env.storage.url, from_env.spool.dir) == ("from-env", str(folder / "spool"))
    assert Config(storage={"url": "in-code"}).storage.url == "in-code"


def test_tilde_is_the_home_folder_in_every_path_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(elsewhere)
    path = tmp_path / "job.yaml"
    path.write_text("storage: {url: ~/ckpts}\nspool: {dir: ~/spool}\nevents: {jsonl: ~/logs/events.jsonl}\n")
    with SyncCheckpointer(load_config(path)) as ckpt:
        ckpt.save({"x": torch.ones(3)}, step=1).wait()
    assert (home / "ckpts" / f"{1:012d}" / "manifest.json").is_file()
    assert (home / "spool").is_dir()
    assert (home / "logs" / "events.jsonl").stat().st_size > 0
    assert not list(elsewhere.iterdir()), "no folder named '~' in the working directory"


@pytest.mark.parametrize(
    ("nbytes", "shown"),
    [(72, "72 B"), (1536, "1.5 KiB"), (65536, "64 KiB"), (1023, "1023 B"), (1048575, "1 MiB"),
     (1048576 * 1023.96, "1 GiB"), (-1536, "-1.5 KiB"), (float("inf"), "inf B"), (float("nan"), "nan B")],
)  # fmt: skip
def test_byte_counts_never_read_1024_of_a_unit(nbytes: float, shown: str) -> None:
    from aiosnap.core.units import format_bytes, format_rate

    assert format_bytes(nbytes) == shown
    assert format_rate(nbytes) == f"{shown}/s"


@pytest.mark.parametrize(
    ("fields", "suggested"),
    [
        ({"ram_budget": 512}, "512MiB"),
        ({"ram_budget": 60000}, "60000KiB"),  # 60000MiB would be 58 GiB
        ({"spool": {"dir": "/tmp/x", "budget": 5000}}, "5000MiB"),
        ({"s3": {"part_size": 4000}}, "4000MiB"),  # 4000KiB is below the 5 MiB minimum
    ],
)
def test_a_forgotten_unit_is_guessed_at_a_plausible_size(fields: dict[str, object], suggested: str) -> None:
    with pytest.raises(ConfigError, match=rf"did you mean {suggested}\?"):
        Config(**fields)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^s3.multipart_threshold: '16KiB' is 16 KiB, below the minimum of 5 MiB$"):
        Config(s3={"multipart_threshold": "16KiB"})  # a unit was given: nothing to guess


@pytest.mark.parametrize(
    "url", ["https://alice:hunter2@example.com/ckpt", "gs://alice:hunter2@bucket/run", "s3://b/run?token=hunter2"]
)
def test_a_refused_url_never_echoes_its_credentials(url: str) -> None:
    from aiosnap.storage.registry import storage_from_url

    refusals = [lambda: storage_from_url(url)]
    if not url.startswith("s3:"):  # an s3:// URL passes validation; its query is refused when it is opened
        refusals.append(lambda: Config(storage={"url": url}))
    for refuse in refusals:
        with pytest.raises(ConfigError) as info:
            refuse()
        assert "storage.url" in str(info.value) and "***" in str(info.value)
        assert "hunter2" not in str(info.value) and "alice" not in str(info.value)


def test_an_environment_variables_error_names_the_variable_not_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("ram_budget: 64MiB\nretention: {keep_last: 0}\n")
    monkeypatch.setenv("AIOSNAP_STORAGE__URL", "gs://bucket/run")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    problems = str(info.value).split("; ")
    assert problems[0].startswith("environment variable AIOSNAP_STORAGE__URL: storage.url: unsupported scheme 'gs'")
    assert problems[1] == f"{path}: retention.keep_last: Input should be greater than or equal to 1"
    monkeypatch.setenv("AIOSNAP_RAM_BUDGET", "512")
    with pytest.raises(ConfigError, match=r"^environment variable AIOSNAP_RAM_BUDGET: ram_budget: 512 bytes\?"):
        Config(storage={"url": "./fine"})


def test_storage_may_be_given_as_its_url_alone(tmp_path: Path) -> None:
    """``storage: ./ck`` (a newcomer's first try) is ``storage: {url: ./ck}``, relative to the file."""
    path = tmp_path / "job.yaml"
    path.write_text("storage: ./ck\n")
    assert load_config(path).storage.url == str(tmp_path / "ck")
    assert Config(storage="s3://bucket/run").storage.url == "s3://bucket/run"
