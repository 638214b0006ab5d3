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
