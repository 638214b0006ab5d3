"""Verifying a version where a worker will read it: a private snapshot of the registered files,
copied and checked there (sizes, digests against `store.py`'s, safetensors headers, every
tensor of the served model present exactly once with its shape, optionally finite values), so
the bytes checked are the bytes the engine reads, whatever happens to the published files later.
Used by the worker's version follower (full versions) and its resident adapters (adapters)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from rollq.protocol import FileDigest, VersionEntry
from rollq.registry.adapters import check_adapter
from rollq.registry.safetensors_check import Schema, WeightError, check_compatible, check_header
from rollq.registry.store import (check_digest_of, copy_over, mapped, open_version_file, refuse_links,
                                  refuse_unsafe)


class Snapshots:
    """This worker's private copies of the versions it loads (a temp dir, `TMPDIR` decides where)."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self.root: Path | None = None
        """Made at the first swap: a worker that never swaps leaves nothing behind. A killed
        worker (no atexit) leaves its last snapshot in `TMPDIR`."""
        self._spare: Path | None = None
        """A snapshot the engine no longer reads, kept for the next full version's copy: with the
        loaded one, two checkpoints' worth of disk under `TMPDIR` (one before)."""

    def new(self, version: int) -> Path:
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix=f"rollq-snapshots-{self.worker_id}-"))
            atexit.register(shutil.rmtree, self.root, True)
        return self.root / f"v{version}-{uuid.uuid4().hex[:8]}"

    def drop(self, path: str | Path | None, *, spare: bool = False) -> None:
        """Remove a snapshot the engine no longer reads (never the start-up model's directory).
        `spare`: keep it, if no other is kept, for the next version's copy to write over
        (`take_spare`): writing into a file's existing blocks and cached pages took 0.07 s for
        445 MB against 0.16 s for a new file here (its pages allocated, its blocks too)."""
        if path is None or self.root is None or self.root not in Path(path).parents:
            return
        if spare and self._spare is None and Path(path).is_dir():
            self._spare = self.root / f"spare-{uuid.uuid4().hex[:8]}"
            os.rename(path, self._spare)
            return
        shutil.rmtree(path, ignore_errors=True)

    def take_spare(self) -> Path | None:
        """A snapshot directory no longer read, to be renamed and written over (or None)."""
        spare, self._spare = self._spare, None
        return spare


_IN_MEMORY = 64 << 20
"""Files up to this size (an adapter's) are copied through memory, see `_copy_small`."""


def _copy_checked(source: Path, target: Path, expected: FileDigest) -> None:
    """Copy one file, then hash the copy: the copy is private, so the bytes hashed are the bytes
    the engine will read. A `target` left by a spare snapshot is written over in place (its
    blocks and pages reused), then cut to size. (The kernel's copy plus a hash of the copy
    measured faster than one Python pass copying and hashing; see docs/benchmarks.md.)"""
    # Through one descriptor opened without following links or blocking: a link or FIFO put in
    # place after the directory was checked is refused, never followed or waited on; locked
    # while it is read, so the store never writes a retired version's file over under the copy.
    with os.fdopen(open_version_file(source), "rb", buffering=0) as src:
        size = os.fstat(src.fileno()).st_size
        if size == expected.bytes <= _IN_MEMORY:
            target.unlink(missing_ok=True)
            _copy_small(src, target, expected)
            return
        if size == expected.bytes:
            copy_over(src.fileno(), target, size, 0o600)  # (a short copy: refused below)
            size = target.stat().st_size
    if size != expected.bytes:
        raise WeightError(f"{expected.name}: {size} bytes, registered {expected.bytes} "
                          "(truncated or replaced)")
    _check_copy(target, expected)


def _check_copy(copy: Path, expected: FileDigest) -> None:
    """Hash the private copy through a memory map (`store.mapped`: only for a private copy)."""
    with mapped(copy) as data:
        check_digest_of(data, expected)


def _copy_small(src, target: Path, expected: FileDigest) -> None:
    """Read the file once into memory, hash those bytes, write the private copy from them: the
    bytes hashed are the bytes the engine reads, with one read of the file instead of two (a
    rank-16 adapter's copy: 2.5-2.7 -> 1.8 ms alone, median of 40)."""
    data = memoryview(bytearray(expected.bytes))
    got = 0
    while got < expected.bytes and (n := src.readinto(data[got:])):
        got += n
    if got != expected.bytes or src.read(1):
        raise WeightError(f"{expected.name}: size changed while it was copied, registered "
                          f"{expected.bytes} bytes (truncated or replaced)")
    check_digest_of(data, expected)
    with open(target, "xb", buffering=0) as dst:
        written = 0
        while written < expected.bytes:  # a raw write may take less than it was given
            written += dst.write(data[written:])


def snapshot_schema(directory: Path) -> Schema:
    """Every tensor of the version, refusing one stored twice (which shard would vLLM keep?)."""
    schema: Schema = {}
    where: dict[str, str] = {}
    for f in sorted(directory.glob("*.safetensors")):
        for name, spec in check_header(f).items():
            if name in schema:
                raise WeightError(f"tensor {name!r} is in both {where[name]} and {f.name}")
            schema[name], where[name] = spec, f.name
    return schema


def copy_version(entry: VersionEntry, into: Path, spare: Path | None = None) -> None:
    """Copy the version's registered files into `into` (a private snapshot), checking sizes and
    digests of the copies; raises WeightError. `spare`: a snapshot directory of ours no longer
    read (`Snapshots.take_spare`), renamed to `into` and written over."""
    expected = {d.name for d in entry.files}
    if spare is not None:  # first: whatever is refused below, `into` is the caller's to drop
        os.rename(spare, into)
        for left in into.iterdir():  # the spare's files of names this version has are written
            if left.name not in expected:  # over (`_copy_checked`), the others go
                left.unlink()
    source = Path(entry.path)
    if not source.is_dir():
        raise WeightError(f"{source}: version directory is missing")
    refuse_unsafe(source)
    refuse_links(source)
    present = {p.name for p in source.iterdir() if p.suffix == ".safetensors" or p.name in expected}
    if present != expected:
        raise WeightError(f"{source}: files {sorted(present)} differ from the registered "
                          f"{sorted(expected)}")
    if spare is None:
        into.mkdir(mode=0o700)
    for d in entry.files:
        _copy_checked(source / d.name, into / d.name, d)


def check_version(entry: VersionEntry, base_schema: Schema | None, into: Path, *,
                  finite: bool = False, spare: Path | None = None) -> None:
    """Copy the version into `into` (a private snapshot) and check the copy; raises WeightError.
    `finite`: also refuse a NaN or infinite value (keep swaps, see `check_finite`)."""
    if entry.kind != "full":
        raise WeightError(f"version {entry.version} is an adapter on version {entry.base}, not "
                          "full weights: it cannot be swapped in")
    copy_version(entry, into, spare)
    schema = snapshot_schema(into)
    if base_schema is not None:  # complete: every tensor the served model needs, right shapes
        check_compatible(schema, base_schema, f"version {entry.version}")
    if finite:
        check_finite(into)


def check_finite(directory: Path) -> None:
    """A keep swap resumes the frozen requests on the new weights before the engine's probe token
    answers, so weights a diverged trainer published with NaN or inf are refused here, while the
    old version still serves (one more read of the snapshot, from the page cache)."""
    import torch
    from safetensors import safe_open

    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is not a mapping)
                t = tensors.get_tensor(name)
                if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                    raise WeightError(f"{f.name}: tensor {name!r} holds NaN or infinite values")


def check_adapter_version(entry: VersionEntry, base_schema: Schema | None, max_rank: int,
                          into: Path) -> None:
    """Copy the adapter's files into `into` (private), check digests, then config and tensors."""
    copy_version(entry, into)
    check_adapter(into, base_schema, max_rank)
