"""``aiosnap.dcp.StorageWriter``: torch.distributed.checkpoint's storage writer on aiosnap.

``dcp.save(state_dict, storage_writer=StorageWriter(url))`` and ``dcp.async_save(...,
storage_writer=StorageWriter(url), async_checkpointer_type=THREAD or PROCESS)`` write a
real DCP checkpoint (torch's ``FileSystemReader`` loads a local one) to a local folder or
``s3://bucket/prefix``, through aiosnap's storage backends (atomic files, S3 multipart with
retries, deadlines and per-part CRC32C), its RAM budget and its commit protocol
(:mod:`.commit`): data under names of this attempt alone, a crc32c of every item in a
checksums file (:mod:`.checksums`), ``.metadata`` last and conditionally.

DCP calls the methods in this order, from whichever thread (or process) runs the save:
``reset`` and ``set_up_storage_writer`` on every rank, ``prepare_local_plan`` (large
items cut into tiles: :mod:`.tiles`), ``prepare_global_plan`` on the coordinator (the
attempt's save id; a look at what is there), ``write_data`` on every rank
(:mod:`.upload`), ``finish`` on the coordinator (the commit). The writer pickles (DCP's
PROCESS executor sends it to its checkpoint process) as its URL and configuration; the
loop, backends and slabs are the process's (:mod:`.runtime`).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import secrets
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter as _TorchStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ...config import Config
from ...errors import ConfigError
from ...storage.base import Storage
from .checksums import SaveChecksums
from .commit import CommitPlan, abandon, commit, look
from .events import save_events
from .location import CheckpointLocation
from .readable import check_metadata, check_plan
from .runtime import runtime
from .tiles import Tile, tile_plan
from .upload import WrittenItem, write_items

__all__ = ["StorageWriter"]

DCP_VERSION = "1.0.0"
"""The ``Metadata.version`` torch 2.13's ``FileSystemWriter`` records."""
TILE_MARGIN = 4096
"""Bytes of a slab kept for a tile's archive around its payload."""


@dataclass(frozen=True)
class _RankPlan:
    """The coordinator's word to each rank (a SavePlan's ``storage_data``)."""

    save_id: str
    rank: int


class StorageWriter(CheckpointLocation, _TorchStorageWriter):
    """A DCP storage writer for ``url`` (a folder path, ``file://`` or ``s3://bucket/prefix``).

    ``config``: an :class:`aiosnap.Config` (or a dict of its fields) for the RAM budget,
    chunk size, upload concurrency and S3 settings (``storage.url`` is not used: ``url``
    is). ``overwrite``: whether a checkpoint already at ``url`` may be replaced (its files
    are removed once the new one has committed); False makes that an error, as with
    ``FileSystemWriter(overwrite=False)``. ``storage``: a backend to write through instead
    of the one ``url`` names (it must pickle for DCP's PROCESS executor).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        config: Config | dict[str, Any] | None = None,
        *,
        overwrite: bool = True,
        storage: Storage | None = None,
    ) -> None:
        CheckpointLocation.__init__(self, url, config, storage)
        self.overwrite = overwrite
        self.is_coordinator = True
        self.rank = 0
        self._fresh()

    def _fresh(self) -> None:
        self._tiles: dict[MetadataIndex, Tile] = {}
        self._commit: CommitPlan | None = None
        self._save_id: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_tiles"} | {"_tiles": {}}

    # -- DCP's calls ----------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._point_at(checkpoint_id)
        self._fresh()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ConfigError(
                "aiosnap.dcp.StorageWriter: use_collectives=False (one .metadata per rank) is not supported; "
                "save with collectives (the default)"
            )
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url, save_id=self._save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        check_plan(plan, self.url)
        pool = runtime().pool(self.config)
        plan, self._tiles = tile_plan(plan, max(1, pool.slab_bytes - TILE_MARGIN))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        self._commit = runtime().run(look(self.storage, overwrite=self.overwrite))
        self._save_id = secrets.token_hex(8)
        return [dataclasses.replace(p, storage_data=_RankPlan(self._save_id, rank)) for rank, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        told = plan.storage_data
        if not isinstance(told, _RankPlan):
            raise ConfigError(
                "aiosnap.dcp.StorageWriter: the plan was not prepared by this writer's prepare_global_plan"
            )
        self._save_id = told.save_id
        run = runtime()
        with save_events(self.config, self.url, told.save_id, told.rank, "upload", whole=False) as figures:
            results = write_items(
                plan.items, self._tiles, planner, self.storage, run, run.pool(self.config),
                rank=told.rank, save_id=told.save_id, concurrency=self.config.upload.concurrency,
            )  # fmt: skip
            figures["nbytes"] = sum(r.size_in_bytes for r in results)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self._commit is None or self._save_id is None:
            raise ConfigError("aiosnap.dcp.StorageWriter: finish() without prepare_global_plan()")
        written: dict[MetadataIndex, WrittenItem] = {}
        for rank_results in results:
            for result in rank_results:
                assert isinstance(result.storage_data, WrittenItem)
                written[result.index] = result.storage_data
        metadata.version = DCP_VERSION
        metadata.storage_data = {
            index: _StorageInfo(w.relative_path, w.offset, w.length) for index, w in written.items()
        }
        metadata.storage_meta = StorageMeta(checkpoint_id=self.url, save_id=self._save_id)
        checksums = SaveChecksums(
            save_id=self._save_id,
            items=[
                (w.relative_path, w.offset, w.length, w.crc32c, w.payload_offset, w.payload_nbytes, w.payload_crc32c)
                for w in written.values()
            ],
        )
        own = sorted({w.relative_path for w in written.values()})
        document = pickle.dumps(metadata)
        try:
            check_metadata(document, self.url)
        except ConfigError:
            runtime().run(abandon(self.storage, own))
            raise
        with save_events(self.config, self.url, self._save_id, self.rank, "commit", whole=True) as figures:
            runtime().run(commit(self.storage, self._commit, document, checksums.to_json(), self._save_id, own))
            figures["nbytes"] = len(document)
            figures["total"] = sum(w.length for w in written.values())
