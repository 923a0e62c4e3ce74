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
    ("text", "expected"), [("512MiB", 512 * 1024**2), ("2GB", 2 * 10**9), (4096, 4096), ("1.5KiB", 1536)]
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
    with pytest.raises(ValidationError) as info:
        Config(**fields)  # type: ignore[arg-type]
    assert field_name in str(info.value)


def test_impossible_budgets_are_refused_when_resolved(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ram_budget.*exceeds this machine's memory"):
        SyncCheckpointer({"storage": {"url": str(tmp_path)}, "ram_budget": "100TiB"})
    with pytest.raises(ConfigError, match="ram_budget.*below the minimum"):
        SyncCheckpointer({"storage": {"url": str(tmp_path)}, "ram_budget": 1000})


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
