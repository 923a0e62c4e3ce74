"""LocalStorage: atomic writes, ranged reads, names confined to the root."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiosnap.storage.local import LocalStorage
from aiosnap.storage.registry import storage_from_url


async def test_write_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    await storage.write("a/b/obj.bin", b"x" * 1000)
    await storage.write("a/b/obj.bin", memoryview(b"y" * 10))
    assert (tmp_path / "a/b/obj.bin").read_bytes() == b"y" * 10
    assert [p.name for p in (tmp_path / "a/b").iterdir()] == ["obj.bin"]


async def test_ranged_read_into_and_short_reads(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    await storage.write("o", bytes(range(100)))
    dest = bytearray(10)
    assert await storage.read_into("o", 50, memoryview(dest)) == 10 and dest == bytes(range(50, 60))
    assert await storage.read_into("o", 95, memoryview(bytearray(10))) == 5


async def test_missing_object_is_file_not_found(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    with pytest.raises(FileNotFoundError):
        await storage.read("nope")
    assert await storage.list_children("nowhere") == []
    await storage.delete("nope")
    await storage.delete_prefix("nowhere")


async def test_failed_write_removes_its_temp_file(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)

    class Exploding:
        def __buffer__(self, flags: int) -> memoryview:
            raise OSError("device error (injected)")

    with pytest.raises((OSError, TypeError)):
        await storage.write("d/obj", Exploding())  # type: ignore[arg-type]
    assert [p for p in (tmp_path / "d").iterdir()] == []


@pytest.mark.parametrize("name", ["../x", "/abs", "a/../../b", "a//b", "./a"])
async def test_names_cannot_escape_the_root(tmp_path: Path, name: str) -> None:
    storage = LocalStorage(tmp_path / "root")
    with pytest.raises(ValueError, match="unsafe object name"):
        await storage.write(name, b"x")


async def test_symlinked_folders_in_the_root_are_followed(tmp_path: Path) -> None:
    (tmp_path / "root").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "root" / "moved").symlink_to(tmp_path / "elsewhere")  # a folder moved to another disk
    storage = LocalStorage(tmp_path / "root")
    await storage.write("moved/x", b"x")
    assert (tmp_path / "elsewhere" / "x").read_bytes() == b"x"
    assert [o.name for o in await storage.walk()] == ["moved/x"]
    with pytest.raises(ValueError, match="unsafe object name"):
        await storage.write("moved/../../x", b"x")  # names themselves never leave the root


def test_url_forms(tmp_path: Path) -> None:
    assert storage_from_url(str(tmp_path)).url == str(tmp_path)
    assert storage_from_url(f"file://{tmp_path}").url == str(tmp_path)


async def test_new_parent_folders_are_fsynced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from aiosnap.core import durable

    synced: list[Path] = []
    real = durable.fsync_dir
    monkeypatch.setattr(durable, "fsync_dir", lambda path: (synced.append(Path(path)), real(path))[1])
    storage = LocalStorage(tmp_path / "root")
    await storage.write("000000000001/abc/rank-0/0.bin", b"data")
    for created in ("root", "root/000000000001", "root/000000000001/abc", "root/000000000001/abc/rank-0"):
        assert (tmp_path / created).parent in synced, f"the parent of new folder {created} was not fsynced"
