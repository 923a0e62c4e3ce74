"""Configuration: frozen pydantic models, loadable from YAML, overridable by ``AIOSNAP_`` env vars.

Precedence, highest first: arguments passed to :class:`Config` > ``AIOSNAP_*`` environment
variables (nested fields with ``__``, e.g. ``AIOSNAP_UPLOAD__CONCURRENCY=4``) > the YAML file
given to :func:`load_config` > the defaults below. Sizes accept integers (bytes) or strings
with units (``"512MiB"``, ``"2GB"``); ``ram_budget`` also accepts a share of the memory
available when the checkpointer starts (``"25%"``).
"""

from __future__ import annotations

import contextvars
from pathlib import Path
from typing import Annotated, Any, Literal

import psutil
import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    SecretStr,
    TypeAdapter,
    ValidationError,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from .errors import ConfigError

__all__ = ["Config", "load_config"]

MIN_RAM_BUDGET = 64 * 1024
_BYTE_SIZE = TypeAdapter(ByteSize)


def parse_size(value: Any) -> int:
    """Parse ``1024``, ``"512MiB"`` or ``"2GB"`` into a positive number of bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 1048576 or '512MiB', got a boolean")
    try:
        size = int(_BYTE_SIZE.validate_python(value))
    except ValidationError as exc:
        raise ValueError(f"expected a size such as 1048576 or '512MiB', got {value!r}") from exc
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


def parse_budget(value: Any) -> int | str:
    """Parse a byte budget: a size (see :func:`parse_size`) or a share such as ``"25%"``."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1])
        except ValueError as exc:
            raise ValueError(f"expected a share such as '25%', got {value!r}") from exc
        if not 0 < share <= 100:
            raise ValueError(f"a share of memory must be in (0%, 100%], got {value!r}")
        return f"{share:g}%"
    return parse_size(value)


Size = Annotated[int, BeforeValidator(parse_size)]
Budget = Annotated[int | str, BeforeValidator(parse_budget)]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StorageConfig(_Section):
    """Where checkpoints go."""

    url: str = Field("./checkpoints", min_length=1)
    """A directory path, ``file:///abs/path``, or ``s3://bucket/prefix``."""


class RetentionConfig(_Section):
    """Which committed checkpoints to keep."""

    keep_last: int | None = Field(3, ge=1)
    """Keep the newest N committed steps (``null`` keeps all). Older steps are deleted only
    after a new one has committed; the step just committed is never deleted."""


class UploadConfig(_Section):
    """The stage that writes captured chunks to storage."""

    concurrency: int = Field(8, ge=1, le=256)
    """Data objects written (and, on load, byte ranges read) at the same time."""
    chunk_size: Size = 64 * 1024 * 1024
    """Largest data object; large tensors are split, small ones batched, up to this size.
    Capped at a quarter of the RAM budget so capture and upload overlap."""


class SpoolConfig(_Section):
    """Local-disk spool: captured chunks that RAM cannot hold go to local disk, so save()
    returns at disk speed while a slow target (S3, NFS, Lustre) catches up."""

    dir: str | None = None
    """Spool directory on fast local disk (one checkpointer at a time: a lock file)."""
    budget: Budget = "50%"
    """Most bytes on spool disk: a size, or a share such as "50%" of the free space of the
    spool file system when the checkpointer starts (never more than that free space)."""
    mode: Literal["off", "overflow", "always"] | None = None
    """overflow: spill only when the RAM budget is exhausted (default when ``dir`` is set);
    always: every chunk is on local disk before save() returns (survives a crash);
    off: no spool (default without ``dir``)."""
    resume: bool = True
    """On start, finish the uploads of fully captured saves a crashed process left behind."""

    @property
    def effective_mode(self) -> Literal["off", "overflow", "always"]:
        if self.mode is not None:
            return self.mode
        return "overflow" if self.dir else "off"

    @model_validator(mode="after")
    def _dir_when_on(self) -> SpoolConfig:
        if self.mode in ("overflow", "always") and not self.dir:
            raise ValueError(f"spool mode {self.mode!r} needs spool.dir")
        return self


class EventsConfig(_Section):
    """Where structured save/load events go (see :mod:`aiosnap.events`); callbacks are
    passed to the checkpointer in code."""

    log: bool = True
    """Send events to the standard logger ``aiosnap.events`` (INFO; failures at WARNING)."""
    jsonl: Path | None = None
    """Append every event as one JSON line to this file."""


class S3Config(_Section):
    """S3 and S3-compatible stores (used when ``storage.url`` is ``s3://bucket/prefix``).

    Credentials come from the standard AWS chain (environment, profile, instance role)
    unless given here; they are secrets: never logged, never written to a manifest."""

    endpoint_url: str | None = None
    """Custom endpoint (MinIO, Ceph RGW, R2, GCS interop, a local test server)."""
    region: str | None = None
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    profile: str | None = None
    access_key_id: SecretStr | None = None
    secret_access_key: SecretStr | None = None
    session_token: SecretStr | None = None
    multipart_threshold: Size = 16 * 1024 * 1024
    """Objects larger than this go as multipart uploads; smaller ones as one PUT."""
    part_size: Size = 8 * 1024 * 1024
    """Multipart part size; raised to S3's 5 MiB minimum and to fit in 10,000 parts."""
    part_concurrency: int = Field(4, ge=1, le=64)
    """Parts of one object uploaded at the same time."""
    request_timeout: float = Field(60.0, gt=0)
    """Seconds one request (body included) may take before it is abandoned and retried."""
    retry_deadline: float = Field(120.0, gt=0)
    """Seconds one operation keeps retrying throttling, 5xx, resets and timeouts."""
    conditional_commit: bool = True
    """Write a new step's manifest with If-None-Match so two writers never silently
    overwrite one committed step (needs a server that supports conditional writes)."""

    @model_validator(mode="after")
    def _keys_come_in_pairs(self) -> S3Config:
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError("access_key_id and secret_access_key must be given together")
        return self


class Config(BaseSettings):
    """Every tunable of aiosnap. Frozen; unknown keys are errors."""

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        env_prefix="AIOSNAP_",
        env_nested_delimiter="__",
        validate_default=True,
    )

    storage: StorageConfig = StorageConfig()
    ram_budget: Budget = 1024**3
    """Most bytes of host RAM held by staging buffers: a size, or a share such as "25%" of
    the memory available when the checkpointer starts."""
    max_pending_saves: int = Field(1, ge=1, le=64)
    """Saves captured but not yet committed; a further save() waits for the oldest."""
    retention: RetentionConfig = RetentionConfig()
    upload: UploadConfig = UploadConfig()
    loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    """Event loop of the background thread: uvloop when installed (auto), or forced."""
    s3: S3Config = S3Config()
    spool: SpoolConfig = SpoolConfig()
    events: EventsConfig = EventsConfig()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _FileSource(settings_cls))

    def ram_budget_bytes(self) -> int:
        """The RAM budget in bytes, a share resolved against memory available now."""
        memory = psutil.virtual_memory()
        if isinstance(self.ram_budget, str):
            budget = int(memory.available * float(self.ram_budget[:-1]) / 100)
        else:
            budget = self.ram_budget
        if budget < MIN_RAM_BUDGET:
            raise ConfigError(f"ram_budget: {budget} bytes is below the minimum of {MIN_RAM_BUDGET}")
        if budget > memory.total:
            raise ConfigError(f"ram_budget: {budget} bytes exceeds this machine's memory ({memory.total} bytes)")
        return budget

    @classmethod
    def coerce(cls, value: Config | str | Path | dict[str, Any] | None) -> Config:
        """Accept a Config, a storage URL or path, or a dict of fields."""
        if value is None:
            return cls()
        if isinstance(value, Config):
            return value
        if isinstance(value, (str, Path)):
            return cls(storage=StorageConfig(url=str(value)))
        if isinstance(value, dict):
            return cls(**value)
        raise ConfigError(f"expected a Config, a URL or a dict, got {type(value).__name__}")


_file_data: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("_file_data", default=None)


class _FileSource(PydanticBaseSettingsSource):
    """Values read from a YAML file by load_config(); below env vars in precedence."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (_file_data.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_file_data.get() or {})


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def load_config(path: str | Path) -> Config:
    """Read a YAML file into a :class:`Config`; errors name the file and the field."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    token = _file_data.set(data)
    try:
        return Config()
    except ValidationError as exc:
        raise ConfigError(f"{path}: {_describe(exc)}") from exc
    finally:
        _file_data.reset(token)
