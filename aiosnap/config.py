"""Configuration: frozen pydantic models, loadable from YAML, overridable by ``AIOSNAP_`` env vars.

Precedence, highest first: arguments passed to :class:`Config` > ``AIOSNAP_*`` environment
variables (nested fields with ``__``, e.g. ``AIOSNAP_UPLOAD__CONCURRENCY=4``) > the YAML file
given to :func:`load_config` > the defaults below. Sizes accept integers (bytes) or strings
with units (``"512MiB"``, ``"2GB"``); ``ram_budget`` also accepts a share of the memory
available when the checkpointer starts (``"25%"``). Relative paths in a YAML file are taken
relative to the file's folder (as docker-compose does); paths given in code or in the
environment stay relative to the working directory.
"""

from __future__ import annotations

import contextvars
import difflib
import os
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlparse

import psutil
import yaml
from pydantic import (
    AfterValidator,
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
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, SettingsError

from .core.sources import source_of
from .core.units import format_bytes
from .errors import ConfigError

__all__ = ["Config", "load_config"]

MIN_RAM_BUDGET = 64 * 1024
ENV_PREFIX = "AIOSNAP_"
_BYTE_SIZE = TypeAdapter(ByteSize)

URL_SCHEMES: set[str] = {"file", "s3"}
"""Schemes ``storage.url`` may use; :func:`aiosnap.storage.registry.register_scheme` adds to it."""


class _RelativeToFile:
    """Marks a setting that holds a path (or a URL that may be one): relative in a YAML file,
    it is taken relative to that file's folder by :func:`load_config`."""

    def __repr__(self) -> str:
        return "RELATIVE_TO_FILE"


RELATIVE_TO_FILE = _RelativeToFile()


def parse_size(value: Any) -> int:
    """Parse ``1024``, ``"512MiB"`` or ``"2GB"`` into a positive number of bytes."""
    if isinstance(value, bool):
        raise ValueError("expected a size such as 1048576 or '512MiB', got a boolean")
    if _is_negative(value):
        raise ValueError(f"a size cannot be negative, got {value!r:.40}")
    try:
        size = int(_BYTE_SIZE.validate_python(value))
    except ValidationError as exc:
        raise ValueError(f"expected a size such as 1048576 or '512MiB', got {value!r:.40}") from exc
    if size <= 0:
        raise ValueError(f"a size must be positive, got {value!r:.40}")
    return size


def _is_negative(value: Any) -> bool:
    """``-5``, ``"-1GiB"``, ``" -2 MB"``: a size with a minus sign, which is not a format error."""
    if isinstance(value, int | float):
        return value < 0
    if isinstance(value, str) and value.strip().startswith("-"):
        try:
            _BYTE_SIZE.validate_python(value.strip()[1:])
        except ValidationError:
            return False
        return True
    return False


_UNIT_BYTES = {"KiB": 1024, "MiB": 1024**2, "GiB": 1024**3}


def _too_small(value: Any, size: int, minimum: int, unit: str) -> str:
    """Why ``value`` (``size`` bytes) is below a size's minimum. A plain number most likely
    lacks its unit (``ram_budget: 512`` meant 512MiB, not 512 bytes); one of four digits or
    more, the next smaller unit where that is still enough (``60000``: 60000KiB, not 58 GiB)."""
    if not (isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit())):
        return f"{value!r:.40} is {format_bytes(size)}, below the minimum of {format_bytes(minimum)}"
    units = list(_UNIT_BYTES)
    index = units.index(unit)
    if index > 0 and size >= 1024 and size * _UNIT_BYTES[units[index - 1]] >= minimum:
        index -= 1
    return (
        f"{size} bytes? did you mean {size}{units[index]}? (a size without a unit is in bytes; "
        f"the minimum is {format_bytes(minimum)})"
    )


def at_least(minimum: int, unit: str = "MiB") -> BeforeValidator:
    """A size of at least ``minimum`` bytes (a bare small number is most likely a unit
    forgotten: ``chunk_size: 64`` meant 64MiB, not 64 bytes; ``unit`` is the one suggested)."""

    def check(value: Any) -> int:
        size = parse_size(value)
        if size < minimum:
            raise ValueError(_too_small(value, size, minimum, unit))
        return size

    return BeforeValidator(check)


def parse_budget(value: Any, minimum: int = 1, unit: str = "MiB") -> int | str:
    """Parse a byte budget: a size (see :func:`parse_size`) of at least ``minimum`` bytes, or
    a share such as ``"25%"``."""
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            share = float(value.strip()[:-1])
        except ValueError as exc:
            raise ValueError(f"expected a share such as '25%', got {value!r}") from exc
        if not 0 < share <= 100:
            raise ValueError(f"a share of memory must be in (0%, 100%], got {value!r}")
        return f"{share:g}%"
    size = parse_size(value)
    if size < minimum:
        raise ValueError(_too_small(value, size, minimum, unit))
    return size


Size = Annotated[int, BeforeValidator(parse_size)]
Budget = Annotated[int | str, BeforeValidator(parse_budget)]
RamBudget = Annotated[int | str, BeforeValidator(lambda value: parse_budget(value, MIN_RAM_BUDGET))]
ChunkSize = Annotated[int, at_least(64 * 1024)]
PartSize = Annotated[int, at_least(5 * 1024**2)]
SpoolBudget = Annotated[int | str, BeforeValidator(lambda value: parse_budget(value, 1024**2, "GiB"))]


def redacted(url: str) -> str:
    """``url`` as a message may show it: without the credentials a URL can carry (``user:
    password@``, a query string that may hold a token), each replaced by ``***``."""
    parsed = urlparse(url)
    if not parsed.scheme or (len(parsed.scheme) == 1 and url[1:3] in (":\\", ":/")):
        return url
    netloc = parsed.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rsplit("@", 1)[1]
    shown = parsed._replace(
        netloc=netloc, query="***" if parsed.query else "", fragment="***" if parsed.fragment else ""
    )
    ending = url[-1] if url.endswith(("?", "#")) and not (parsed.query or parsed.fragment) else ""
    return shown.geturl() + ending


def check_url(url: str) -> str:
    """A storage URL whose scheme some backend serves (a plain path has none)."""
    parsed = urlparse(url)
    if parsed.scheme == "" or (len(parsed.scheme) == 1 and url[1:3] in (":\\", ":/")):
        return url  # a plain path (or a Windows drive)
    if parsed.scheme not in URL_SCHEMES:
        known = ", ".join(f"{s}://" for s in sorted(URL_SCHEMES))
        hint = " (Google Cloud Storage: s3:// with s3.endpoint_url set to its S3 interop endpoint)"
        raise ValueError(
            f"unsupported scheme {parsed.scheme!r} in {redacted(url)!r:.200}: use a path or {known}"
            + (hint if parsed.scheme in ("gs", "gcs") else "")
        )
    return url


StorageUrl = Annotated[str, Field(min_length=1), AfterValidator(check_url), RELATIVE_TO_FILE]
LocalFolder = Annotated[str | None, RELATIVE_TO_FILE]
LocalFile = Annotated[Path | None, RELATIVE_TO_FILE]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class StorageConfig(_Section):
    """Where checkpoints go."""

    url: StorageUrl = "./checkpoints"
    """A directory path, ``file:///abs/path``, or ``s3://bucket/prefix``."""

    @model_validator(mode="before")
    @classmethod
    def _a_url_alone(cls, data: Any) -> Any:
        """``storage: ./ck`` is ``storage: {url: ./ck}``."""
        return {"url": data} if isinstance(data, str) else data


class RetentionConfig(_Section):
    """Which committed checkpoints to keep."""

    keep_last: int | None = Field(3, ge=1)
    """Keep the newest N committed steps (``null`` keeps all). Older steps are deleted only
    after a new one has committed; the step just committed is never deleted."""


class UploadConfig(_Section):
    """The stage that writes captured chunks to storage."""

    concurrency: int = Field(8, ge=1, le=256)
    """Data objects written (and, on load, byte ranges read) at the same time."""
    chunk_size: ChunkSize = 64 * 1024 * 1024
    """Largest data object; large tensors are split, small ones batched, up to this size.
    Capped at a quarter of the RAM budget so capture and upload overlap."""
    executor: Literal["thread", "process"] = "thread"
    """Where uploads, checksums, commit and retention run: on a thread of the training
    process, or in a helper process (started with the checkpointer, sharing the staging
    memory) so that their Python work never takes the trainer's GIL."""
    compression: Literal["none", "zstd"] = "none"
    """Lossless compression of each tensor byte range: ``zstd`` after a byte shuffle for
    multi-byte dtypes (a range whose compressed form is not smaller is stored raw). Pays on
    slow links (object stores), not on fast disk. Not for multi-rank saves or single-file
    checkpoints (stored raw). See docs/guides/incremental.md."""
    dedup: bool = True
    """Incremental saves (on by default): a tensor byte range whose captured bytes (xxh3-128
    digest, size and crc32c) equal a range of the root's latest committed step is not
    uploaded again; the new manifest names that step's range. Decided per range, on the
    bytes captured at ``save()``. Multi-rank saves: each rank against its own earlier ranges.
    Single-file checkpoints and saves with ``also_as`` are written whole. ``false``: every
    save writes every byte. See docs/guides/incremental.md."""


class SpoolConfig(_Section):
    """Local-disk spool: captured chunks that RAM cannot hold go to local disk, so save()
    returns at disk speed while a slow target (S3, NFS, Lustre) catches up."""

    dir: LocalFolder = None
    """Spool directory on fast local disk (one checkpointer at a time: a lock file). In a
    multi-rank job each rank needs its own: ranks on one host given the same one all fail
    with ``SpoolBusyError`` when the checkpointer is made."""
    budget: SpoolBudget = "50%"
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
    """Where structured save/load events go (see :mod:`aiosnap.core.events`); callbacks are
    passed to the checkpointer in code."""

    log: bool = True
    """Send events to the standard logger ``aiosnap.events`` (INFO; failures at WARNING;
    while logging is not set up, not the failures that ``stderr`` below reports already)."""
    jsonl: LocalFile = None
    """Append every event as one JSON line to this file."""
    stderr: bool = True
    """One line on stderr as each save commits (rank 0 only) or fails (every rank), whatever
    logging is set up: ``aiosnap: step 200 committed: 503.0 MiB in 1.2 s (419 MiB/s) to ...``."""
    live: bool = False
    """A live progress display on stderr (Rich) while saves upload, once one has run for 2 s;
    only when stderr is a terminal. Off by default: training loops often draw a progress bar
    of their own, and two live displays on one terminal garble each other."""


class DistributedConfig(_Section):
    """Multi-rank checkpoints (torch.distributed with more than one rank)."""

    commit_timeout: float = Field(600.0, gt=0, le=86400)
    """Seconds the coordinator (rank 0) waits for every rank's part of a save once its own is
    written; then the save fails on every rank, naming the ranks missing, and the previous
    checkpoint stays the latest. A rank that stops (killed, its upload helper dead, wedged)
    is named sooner, after ``heartbeat_timeout``. Once the coordinator has claimed the
    commit, the other ranks wait this long (plus 5 s) for its manifest."""
    heartbeat_interval: float = Field(2.0, gt=0, le=3600)
    """Seconds between the heartbeats a rank writes to storage while its part of a save is
    in flight (``<step>/<save id>/rank-<r>.alive``): how the other ranks, and ``aiosnap gc``,
    know it is alive."""
    heartbeat_timeout: float = Field(20.0, gt=0, le=86400)
    """Seconds without a new heartbeat after which a rank counts as stopped: the save fails on
    every rank, naming it. At least twice ``heartbeat_interval``."""
    progress_timeout: float = Field(1800.0, gt=0, le=86400)
    """Seconds the other ranks wait for a coordinator whose heartbeat goes on but which makes
    no progress (not one chunk of its part captured or uploaded: a write that hangs) before
    they give the save up, on every rank. Longer than any one chunk's upload takes."""
    agree_timeout: float = Field(600.0, gt=0, le=86400)
    """Seconds ``save()``/``load()`` wait for every rank to arrive (ranks agree on the save on
    aiosnap's own CPU group); then they raise, naming the ranks that did not."""
    rank_local: list[str] = []
    """Path patterns (``fnmatch``, keys joined by ``/``: ``"rng"``, ``"loader/*"``) whose
    values each rank saves for itself and gets back (RNG states, data-loader positions);
    ``save(rank_local=...)`` adds to these."""

    @model_validator(mode="after")
    def _heartbeats_before_their_timeout(self) -> DistributedConfig:
        if self.heartbeat_timeout < 2 * self.heartbeat_interval:
            raise ValueError(
                f"heartbeat_timeout ({self.heartbeat_timeout:g} s) must be at least twice heartbeat_interval "
                f"({self.heartbeat_interval:g} s): one late heartbeat must not make a live rank count as stopped"
            )
        return self


class PreemptionConfig(_Section):
    """What a preemption signal (SIGTERM from Kubernetes, SLURM, a spot-instance reclaim)
    does to a training process with a checkpointer (see :mod:`aiosnap.core.preemption`)."""

    enabled: bool = False
    """Handle the signals below: finish (or, with a spool, secure on local disk) the saves
    in flight, let the trainer see ``ckpt.preempted`` and take a last save, then exit as the
    signal would have. Off by default: the signals keep their usual effect."""
    signals: list[Literal["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP"]] = Field(["SIGTERM"], min_length=1)
    """Which signals mean preemption."""
    grace_period: float = Field(20.0, gt=0, le=3600)
    """Seconds from the signal to the exit, at most: set it a few seconds below what the
    cluster gives (Kubernetes ``terminationGracePeriodSeconds``, 30 by default; SLURM
    ``KillWait``, 30 by default; the ``--signal`` lead time of sbatch)."""


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
    multipart_threshold: PartSize = 16 * 1024 * 1024
    """Objects larger than this go as multipart uploads; smaller ones as one PUT."""
    part_size: PartSize = 8 * 1024 * 1024
    """Multipart part size; raised to S3's 5 MiB minimum and to fit in 10,000 parts."""
    part_concurrency: int = Field(8, ge=1, le=64)
    """Parts of one object uploaded at the same time."""
    max_requests: int = Field(8, ge=1, le=256)
    """PUTs and parts in flight at once on one root, all objects together. The earliest
    object's parts go first, so objects complete one after another while the next ones
    stream (no burst of completions at the end); raise it for links that need more
    connections than this to fill."""
    request_timeout: float = Field(60.0, gt=0)
    """Seconds one request (body included) may take before it is abandoned and retried."""
    retry_deadline: float = Field(120.0, gt=0)
    """Seconds one operation keeps retrying throttling, 5xx, resets and timeouts."""
    conditional_commit: bool = True
    """Write a new step's manifest with If-None-Match so two writers never silently
    overwrite one committed step (needs a server that supports conditional writes).
    Multi-rank checkpointers need it (their verdict is written the same way): with
    ``false`` they are refused with a ``ConfigError``."""

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
    ram_budget: RamBudget = 1024**3
    """Most bytes of host RAM held by staging buffers: a size, or a share such as "25%" of
    the memory available when the checkpointer starts."""
    max_pending_saves: int = Field(1, ge=1, le=64)
    """Saves captured but not yet committed; a further save() waits for the oldest."""
    retention: RetentionConfig = RetentionConfig()
    pickle_values: bool = False
    """Pickle the values save() cannot store as data (a set, a numpy scalar, your own class)
    instead of refusing them; loading them then needs ``load(..., allow_pickle=True)``."""
    upload: UploadConfig = UploadConfig()
    loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    """Event loop of the background thread: uvloop when installed (auto), or forced."""
    s3: S3Config = S3Config()
    spool: SpoolConfig = SpoolConfig()
    events: EventsConfig = EventsConfig()
    distributed: DistributedConfig = DistributedConfig()
    preemption: PreemptionConfig = PreemptionConfig()

    def __init__(self, **values: Any) -> None:
        """Validate ``values`` over the environment, the YAML file being loaded and the
        defaults; every problem is a :class:`ConfigError` naming the field (or the
        ``AIOSNAP_*`` variable), never echoing a value (it may be a secret)."""
        _check_environment()
        try:
            super().__init__(**values)
            return
        except ValidationError as exc:
            problem = describe(exc, values)
        except SettingsError as exc:  # an AIOSNAP_* variable whose JSON cannot be parsed
            problem = f"environment: {str(exc).split(':', 1)[0]}"
        raise ConfigError(problem)  # outside the handler: no chained error holding the input

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
            raise ConfigError(
                f"ram_budget: {self.ram_budget} of the available memory is {format_bytes(budget)}, "
                f"below the minimum of {format_bytes(MIN_RAM_BUDGET)}"
            )
        if budget > memory.total:
            raise ConfigError(
                f"ram_budget: {format_bytes(budget)} exceeds this machine's memory ({format_bytes(memory.total)})"
            )
        return budget

    @classmethod
    def coerce(cls, value: Config | str | Path | dict[str, Any] | None) -> Config:
        """Accept a Config, a storage URL or path, or a dict of fields."""
        if value is None:
            return cls()
        if isinstance(value, Config):
            return value
        if isinstance(value, (str, Path)):
            return cls(storage={"url": str(value)})
        if isinstance(value, dict):
            return cls(**value)
        raise ConfigError(f"expected a Config, a URL or a dict, got {type(value).__name__}")


def _known_settings(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every setting's dotted path (``upload.concurrency``), sections included."""
    known: set[str] = set()
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        known.add(path)
        section = _section_model(info)
        if section is not None:
            known |= _known_settings(section, path + ".")
    return known


def _section_model(info: FieldInfo) -> type[BaseModel] | None:
    annotation = info.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _model_at(where: tuple[str, ...]) -> type[BaseModel] | None:
    """The section model at the dotted location ``where`` (``()`` is :class:`Config`)."""
    model: type[BaseModel] | None = Config
    for name in where:
        info = None if model is None else model.model_fields.get(name)
        model = None if info is None else _section_model(info)
    return model


def did_you_mean(where: tuple[str, ...]) -> str:
    """``" (did you mean retention.keep_last?)"`` for a setting that does not exist: a close
    spelling in its section, else the same name in another section, else a close spelling
    anywhere; ``""`` when nothing is close."""
    name, parent = where[-1], where[:-1]
    section = _model_at(parent)
    prefix = "".join(f"{part}." for part in parent)
    close = [] if section is None else _closest(name, list(section.model_fields), cutoff=0.6)
    known = sorted(_known_settings(Config))
    options = [prefix + c for c in close] or [k for k in known if k.rsplit(".", 1)[-1] == name]
    options = options or _closest(".".join(where), known, cutoff=0.75)
    return f" (did you mean {' or '.join(options)}?)" if options else ""


def _closest(word: str, choices: list[str], cutoff: float) -> list[str]:
    """Up to three spellings close to ``word``, only those nearly as close as the best one
    (``retension`` suggests ``retention``, not also ``preemption``)."""
    scored = sorted(((difflib.SequenceMatcher(None, word, c).ratio(), c) for c in choices), reverse=True)
    scored = [(score, c) for score, c in scored if score >= cutoff]
    return [c for score, c in scored[:3] if score >= scored[0][0] - 0.1]


def _check_environment() -> None:
    """Refuse an ``AIOSNAP_*`` variable that names no setting (a misspelling would be
    ignored otherwise); the message names the variable, never its value."""
    known = _known_settings(Config)
    for name in os.environ:
        if not name.upper().startswith(ENV_PREFIX):
            continue
        setting = ".".join(name[len(ENV_PREFIX) :].lower().split("__"))
        if setting not in known:
            hint = did_you_mean(tuple(setting.split(".")))
            raise ConfigError(f"environment variable {name} names no aiosnap setting {setting!r}{hint}")


_file_data: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("_file_data", default=None)
_file_name: contextvars.ContextVar[str | None] = contextvars.ContextVar("_file_name", default=None)


class _FileSource(PydanticBaseSettingsSource):
    """Values read from a YAML file by load_config(); below env vars in precedence."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (_file_data.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_file_data.get() or {})


def describe(exc: ValidationError, code: dict[str, Any] | None = None) -> str:
    """Each problem as ``field: message``, after the source that gave the field (the YAML
    file being loaded, an ``AIOSNAP_*`` variable; nothing for ``code``, the arguments, and
    the defaults); input values are left out (they may be secrets)."""
    data, name = _file_data.get(), _file_name.get()
    file = (name, data) if name is not None and data is not None else None
    parts = []
    for err in exc.errors(include_input=False, include_url=False):
        loc = tuple(str(p) for p in err["loc"])
        where = ".".join(loc) or "(top level)"
        source = source_of(loc, code=code or {}, environ=os.environ, prefix=ENV_PREFIX, file=file)
        if err["type"] == "extra_forbidden":
            message = "unknown setting" + did_you_mean(tuple(str(p) for p in err["loc"]))
        elif err["type"] in ("value_error", "assertion_error") and "error" in err.get("ctx", {}):
            message = str(err["ctx"]["error"])  # our own words, without pydantic's "Value error, "
        else:
            message = err["msg"]
        parts.append(f"{source}{where}: {message}")
    return "; ".join(parts)


class _UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping."""


class _DuplicateKey(yaml.YAMLError):
    """A key given twice in one mapping (the message names the key and both lines)."""


def _mapping_without_duplicates(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> Any:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # '<<: *defaults' merges; keys given here override it
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        try:
            first = seen.setdefault(key, line)
        except TypeError:
            raise _DuplicateKey(f"line {line}: a mapping key must be a plain value") from None
        if first != line:
            raise _DuplicateKey(f"key {key!r} is given twice (lines {first} and {line})")
    return loader.construct_mapping(node, deep=deep)


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """Where and what, never the offending line itself (it may hold a secret)."""
    if isinstance(exc, _DuplicateKey):
        return str(exc)
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        return where + " ".join(part for part in (exc.context, exc.problem) if part)
    return type(exc).__name__


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def load_config(path: str | Path) -> Config:
    """Read a YAML file into a :class:`Config`; errors name the file and the field. Relative
    paths in it (``storage.url``, ``spool.dir``, ``events.jsonl``) are taken relative to the
    file's folder."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file: {exc.strerror or exc}") from exc
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
        problem = None
    except yaml.YAMLError as exc:
        problem = f"{path}: invalid YAML: {_yaml_problem(exc)}"
    if problem is not None:
        raise ConfigError(problem)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    _resolve_paths(data, Config, Path(os.path.abspath(path)).parent)
    tokens = _file_data.set(data), _file_name.set(str(path))
    try:
        return Config()  # its errors name the file, or the environment variable, at fault
    finally:
        _file_data.reset(tokens[0])
        _file_name.reset(tokens[1])


def _resolve_paths(data: dict[str, Any], model: type[BaseModel], folder: Path) -> None:
    """Make the relative paths among ``data``'s settings (those marked ``RELATIVE_TO_FILE``)
    relative to ``folder``, in place. Values of the wrong type are left to validation."""
    for name, info in model.model_fields.items():
        value = data.get(name)
        section = _section_model(info)
        if section is StorageConfig and isinstance(value, str):  # ``storage: ./ck``, the url alone
            value = data[name] = {"url": value}
        if section is not None and isinstance(value, dict):
            _resolve_paths(value, section, folder)
        elif RELATIVE_TO_FILE in info.metadata and isinstance(value, str) and _is_relative_path(value):
            data[name] = str(folder / value)


def _is_relative_path(value: str) -> bool:
    """A path relative to some folder: not a URL, not absolute, not ``~/...``, not empty."""
    if not value.strip() or value.startswith("~") or os.path.isabs(value):
        return False
    scheme = urlparse(value).scheme
    return scheme == "" or (len(scheme) == 1 and value[1:3] in (":\\", ":/"))
