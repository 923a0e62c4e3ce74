"""Where one of aiosnap's DCP writers or readers points: a checkpoint URL, a configuration,
and the storage backend they name (the process's shared one: :mod:`.runtime`)."""

from __future__ import annotations

import os
from typing import Any

from ...config import Config
from ...errors import ConfigError
from ...storage.base import Storage
from .runtime import runtime

__all__ = ["CheckpointLocation", "config_of"]


def config_of(config: Config | dict[str, Any] | None) -> Config:
    """An aiosnap Config from a Config, a dict of its fields, or None (the defaults)."""
    if config is None or isinstance(config, dict):
        return Config(**(config or {}))
    if isinstance(config, Config):
        return config
    raise ConfigError(f"config: expected an aiosnap Config or a dict of its fields, got {type(config).__name__}")


class CheckpointLocation:
    """``url`` (a folder path, ``file://`` or ``s3://bucket/prefix``) under ``config``, read
    and written through ``storage`` when given (a custom backend), else the backend the URL
    names. Pickles as these (DCP's PROCESS executor sends a writer to another process)."""

    def __init__(
        self, url: str | os.PathLike[str], config: Config | dict[str, Any] | None, storage: Storage | None
    ) -> None:
        self.url = os.fspath(url)
        self.config = config_of(config)
        self._storage = storage

    @property
    def storage(self) -> Storage:
        """The backend this writer or reader goes through."""
        return self._storage if self._storage is not None else runtime().storage(self.url, self.config)

    @property
    def checkpoint_id(self) -> str:
        return self.url

    def _point_at(self, checkpoint_id: str | os.PathLike[str] | None) -> None:
        """DCP's ``reset(checkpoint_id)``: another checkpoint, when one is given."""
        if checkpoint_id:
            self.url = os.fspath(checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        text = os.fspath(checkpoint_id)
        return bool(text) and (text.startswith(("s3://", "file://")) or "://" not in text)
