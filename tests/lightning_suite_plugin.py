"""A pytest plugin that runs Lightning's own test suite with aiosnap's CheckpointIO in place
of Lightning's default one (not part of aiosnap's suite: Lightning's tests are not shipped).

From a checkout of Lightning's ``tests/`` matching the installed Lightning, with this
worktree on ``PYTHONPATH``::

    cd lightning/tests
    PYTHONPATH=/path/to/aiosnap python -m pytest -p tests.lightning_suite_plugin \\
        tests_pytorch/checkpointing tests_pytorch/models/test_restore.py

Every ``Trainer`` whose strategy would use Lightning's ``TorchCheckpointIO`` gets an
:class:`~aiosnap.integrations.lightning.AiosnapCheckpointIO` instead (one per trainer, as a
user adds it with ``plugins=[...]``); a trainer given its own CheckpointIO keeps it.
``--aiosnap-reader=torch`` makes that plugin read with Lightning's own ``torch.load``
reader (no waiting for saves in flight, no verification): what a user's script that reads
checkpoints with plain ``torch.load`` meets. ``--aiosnap-plain-reads-wait`` makes the plugin
``AiosnapCheckpointIO(plain_reads_wait=True)``: plain reads by the thread that saved wait for
the save (Lightning's tests that ``torch.load`` a file right after saving it need that).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
from aiosnap import Config
from aiosnap.integrations.lightning import AiosnapCheckpointIO


class _PlainReader(AiosnapCheckpointIO):
    """Saves through aiosnap, reads with Lightning's own ``torch.load`` reader."""

    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> Any:
        from lightning.fabric.plugins import TorchCheckpointIO

        return TorchCheckpointIO().load_checkpoint(path, map_location=map_location, weights_only=weights_only)


_made: list[AiosnapCheckpointIO] = []
"""The plugins made for the running test: torn down when its body ends, as at the end of
a user's script (before Lightning's fixtures look for threads left running)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--aiosnap-reader",
        choices=("plugin", "torch"),
        default="plugin",
        help="read checkpoints through the aiosnap plugin (default) or Lightning's torch.load reader",
    )
    parser.addoption(
        "--aiosnap-plain-reads-wait",
        action="store_true",
        help="AiosnapCheckpointIO(plain_reads_wait=True): plain reads by the saving thread wait",
    )


def pytest_configure(config: pytest.Config) -> None:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import TorchCheckpointIO

    plugin_class = _PlainReader if config.getoption("--aiosnap-reader") == "torch" else AiosnapCheckpointIO
    reads_wait = bool(config.getoption("--aiosnap-plain-reads-wait"))
    original = pl.Trainer.__init__

    @functools.wraps(original)
    def init(self: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        strategy = self.strategy
        if type(strategy.checkpoint_io) is TorchCheckpointIO:
            strategy.checkpoint_io = plugin = plugin_class(
                Config(ram_budget="64MiB"), allow_pickle=True, plain_reads_wait=reads_wait
            )
            _made.append(plugin)

    pl.Trainer.__init__ = init  # type: ignore[method-assign]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    try:
        yield
    finally:
        plugins = list(_made)
        _made.clear()
        for plugin in plugins:
            plugin.teardown()
