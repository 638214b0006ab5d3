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
from rollq.registry.store import digest_dir, verify


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


def _store_with_spare_rules(tmp_path, monkeypatch):
    from rollq.registry import store as store_module
    from rollq.registry.store import WeightStore

    monkeypatch.setattr(store_module, "SPARE_FROM", 1 << 20)  # 1 MiB: this test's versions
    return store_module, WeightStore(tmp_path / "store")


def test_a_copy_of_a_store_version_stays_whole_when_its_spare_is_written_over(tmp_path, monkeypatch):
    """Issue 43, item 2: a publish copying a store version (a rollback by path) while that
    version is retired to the spare and the next version written: the copy holds the old
    version's bytes only (the next version's file is a new one, not the file being read). It
    failed before (the copy's second half was v2's bytes, registered under its own digest)."""
    import threading

    from rollq.registry.staging import Staging

    store_module, store = _store_with_spare_rules(tmp_path, monkeypatch)
    staging = Staging()
    v1, v1_files = store.write_image("p", 1, staging.pack(_state(1)))
    inode = (v1 / "model.safetensors").stat().st_ino
    halfway, resume = threading.Event(), threading.Event()
    real_copy_fd = store_module.copy_fd

    def paused(src, dst, size):  # the copier's kernel copy waits half way
        if threading.current_thread().name != "copier":
            return real_copy_fd(src, dst, size)
        done = os.sendfile(dst, src, 0, size // 2)
        halfway.set()
        resume.wait(10)
        while done < size and (sent := os.sendfile(dst, src, done, size - done)):
            done += sent
        return done

    monkeypatch.setattr(store_module, "copy_fd", paused)
    out = {}
    copier = threading.Thread(name="copier", target=lambda: out.update(r=store.copy_dir("p", 10, v1)))
    copier.start()
    try:
        assert halfway.wait(10)
        store.delete(v1)  # retired: the policy's spare
        v2, v2_files = store.write_image("p", 2, staging.pack(_state(2)))
    finally:
        resume.set()
        copier.join(10)
    copy, files = out["r"]
    assert [f.digest for f in files] == [f.digest for f in v1_files]  # v1's bytes, whole
    verify(copy, v1_files)
    assert (v2 / "model.safetensors").stat().st_ino != inode  # not written over under the reader
    verify(v2, v2_files)


@pytest.mark.parametrize("reader", ["copy_dir", "digest_dir", "copy_version"])
def test_a_file_opened_as_its_version_is_retired_and_written_over_is_refused(
        tmp_path, monkeypatch, reader):
    """A reader that opened a store version's file just before the version became the spare and
    was written over (before it could lock it) refuses it, whatever reads it: a publish copying
    it, a by-reference publish hashing it, a worker's private copy."""
    from rollq.registry.staging import Staging

    store_module, store = _store_with_spare_rules(tmp_path, monkeypatch)
    staging = Staging()
    v1, v1_files = store.write_image("p", 1, staging.pack(_state(1)))
    real_open = store_module.open_regular
    once = []

    def retired_meanwhile(path, *args):
        fd = real_open(path, *args)
        if not once:
            once.append(path)
            store.delete(v1)
            store.write_image("p", 2, staging.pack(_state(2)))  # over the spare, in place
        return fd

    monkeypatch.setattr(store_module, "open_regular", retired_meanwhile)
    with pytest.raises(WeightError, match="retired while it was opened"):
        if reader == "copy_dir":
            store.copy_dir("p", 3, v1)
        elif reader == "digest_dir":
            store_module.digest_dir(v1)
        else:
            entry = VersionEntry(1, str(v1), v1_files, v1_files[0].bytes, time.time(), "t", True)
            copy_version(entry, tmp_path / "snapshot")
    assert once  # (the interleaving happened)



def test_a_file_a_writer_holds_is_refused_at_once_not_waited_for(published):
    """A reader never waits on a writer's lock (a planted lock must not hang a publish helper)."""
    import fcntl

    from rollq.registry.store import open_version_file

    held = os.open(published / "model.safetensors", os.O_WRONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(WeightError, match="locked by a writer"):
            open_version_file(published / "model.safetensors")
    finally:
        os.close(held)
    os.close(open_version_file(published / "model.safetensors"))  # once released: read
