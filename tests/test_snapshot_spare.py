"""A worker's private copy written over a spare snapshot (issue 32): the same file reused, its
bytes exactly the version's, nothing of the spare left, and every check still refusing."""

import os
import time

import pytest
import torch
from safetensors.torch import save_file

from rollq.protocol import VersionEntry
from rollq.registry.safetensors_check import WeightError
from rollq.registry.snapshots import Snapshots, copy_version
from rollq.registry.store import digest_dir


def entry_of(directory, version: int = 1) -> VersionEntry:
    files = digest_dir(directory)
    return VersionEntry(version, str(directory), files, sum(f.bytes for f in files), time.time(),
                        "test", False)


@pytest.fixture
def published(tmp_path):
    """A version of one file over the in-memory copy's bound (the big-file path)."""
    source = tmp_path / "published"
    source.mkdir()
    save_file({"w": torch.arange(17 << 20, dtype=torch.float32)}, source / "model.safetensors")
    return source


def test_the_copy_writes_over_the_spare_and_holds_exactly_the_versions_bytes(published):
    snapshots = Snapshots("spare-test")
    first = snapshots.new(1)
    copy_version(entry_of(published), first)
    (first / "model.safetensors").write_bytes(os.urandom(80 << 20))  # longer, other bytes
    (first / "extra.safetensors").write_bytes(b"left over")
    inode = (first / "model.safetensors").stat().st_ino
    snapshots.drop(first, spare=True)
    assert not first.exists()

    second = snapshots.new(2)
    copy_version(entry_of(published, 2), second, snapshots.take_spare())
    assert sorted(p.name for p in second.iterdir()) == ["model.safetensors"]
    copy = second / "model.safetensors"
    assert copy.stat().st_ino == inode  # the spare's file, written over
    assert copy.read_bytes() == (published / "model.safetensors").read_bytes()
    assert snapshots.take_spare() is None  # taken once


def test_a_spare_never_hides_a_refused_version(published):
    snapshots = Snapshots("spare-test")
    first = snapshots.new(1)
    copy_version(entry_of(published), first)
    entry = entry_of(published, 2)
    snapshots.drop(first, spare=True)
    with open(published / "model.safetensors", "r+b") as f:  # replaced after registration
        f.seek(4096)
        f.write(b"\xff" * 8)
    second = snapshots.new(2)
    with pytest.raises(WeightError, match="does not match the registered"):
        copy_version(entry, second, snapshots.take_spare())
    snapshots.drop(second, spare=True)  # what the follower does with a refused version
    (published / "model.safetensors").write_bytes(b"short")
    third = snapshots.new(3)
    with pytest.raises(WeightError, match="registered"):
        copy_version(entry, third, snapshots.take_spare())


def _state(seed: int) -> dict:
    return {"w": torch.randn(1 << 10, 1 << 8, generator=torch.Generator().manual_seed(seed))}


def test_the_store_writes_a_version_over_the_spare_a_retired_one_left(tmp_path, monkeypatch):
    """The store keeps a retired full version as its policy's spare, and the next version is
    written over its file (same inode): exactly the new bytes, its digest right, nothing of
    the spare left (other files, a link), one spare at most, none of an adapter's size."""
    from safetensors.torch import load_file

    from rollq.registry import store as store_module
    from rollq.registry.staging import Staging
    from rollq.registry.store import WeightStore, verify

    monkeypatch.setattr(store_module, "SPARE_FROM", 1 << 20)  # 1 MiB: this test's versions
    store = WeightStore(tmp_path / "store")
    staging = Staging()
    old, old_files = store.write_image("p", 1, staging.pack(_state(1)))
    inode = (old / "model.safetensors").stat().st_ino
    (old / "extra.safetensors").write_bytes(b"left over")
    (old / "link").symlink_to("/etc/hostname")
    store.delete(old)
    [spare] = (tmp_path / "store" / "p").glob(".spare-*")
    assert not old.exists()

    source = tmp_path / "source"  # a directory copied in: longer than the spare's file
    source.mkdir()
    save_file({"w": torch.randn(1 << 11, 1 << 8)}, source / "model.safetensors")
    new, files = store.copy_dir("p", 2, source)
    assert not spare.exists()
    assert (new / "model.safetensors").stat().st_ino == inode  # written over, not a new file
    assert sorted(p.name for p in new.iterdir()) == ["COMMITTED", "model.safetensors"]
    assert (new / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    verify(new, files)
    assert (new / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~_umask()

    third, third_files = store.write_image("p", 3, staging.pack(_state(3)))  # shorter again
    assert torch.equal(load_file(third / "model.safetensors")["w"], _state(3)["w"])
    verify(third, third_files)
    store.delete(new)
    store.delete(third)  # a spare exists already: this one goes
    assert len(list((tmp_path / "store" / "p").glob(".spare-*"))) == 1
    assert not third.exists()

    monkeypatch.setattr(store_module, "SPARE_FROM", 1 << 30)  # too small to keep: deleted
    fourth, _ = store.write_image("p", 4, staging.pack(_state(4)))
    fifth, _ = store.write_image("p", 5, staging.pack(_state(5)))
    store.delete(fifth)
    assert not list((tmp_path / "store" / "p").glob(".trash-*")) and not fifth.exists()


def test_a_spare_another_writer_took_first_is_not_needed(tmp_path, monkeypatch):
    """Two writers, one spare: whoever renames it first writes over it, the other a new file."""
    from rollq.registry import store as store_module
    from rollq.registry.staging import Staging
    from rollq.registry.store import WeightStore

    monkeypatch.setattr(store_module, "SPARE_FROM", 1 << 20)
    store = WeightStore(tmp_path / "store")
    old, _ = store.write_image("p", 1, Staging().pack(_state(1)))
    store.delete(old)
    [spare] = (tmp_path / "store" / "p").glob(".spare-*")
    rename = os.rename

    def taken_meanwhile(src, dst):
        if str(src) == str(spare):
            rename(src, tmp_path / "elsewhere")  # the other writer's rename came first
        return rename(src, dst)

    monkeypatch.setattr(store_module.os, "rename", taken_meanwhile)
    new, _ = store.write_image("p", 2, Staging().pack(_state(2)))
    assert (new / "model.safetensors").exists() and (tmp_path / "elsewhere").exists()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
