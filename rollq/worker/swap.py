"""Follow the registry: learn of new versions at once, verify them, swap the engine to them.

New versions are announced on a stream that the follower blocks on; the newest version is also
read every `poll_s`, so a missed announcement (reconnect, Redis restart) delays a swap, never
loses it.

A version is pinned in Redis (`Registry.pin`) before anything else: retention cannot remove it
while this worker verifies it, drains toward it, loads it or serves it. Its files are then
copied into a snapshot directory private to this worker and checked there (sizes, digests,
headers, every tensor of the served model present exactly once with its shape): the bytes
checked are the bytes the engine reads, whatever happens to the published files later. The
engine loads the snapshot; the previous snapshot stays until the swap is done, so a failed load
can always go back to it. A version that fails is reported (log, heartbeat) and skipped while
the worker goes on serving the one it has.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import logging
import os
import shutil
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from rollq.protocol import FileDigest, SwapMode, VersionEntry
from rollq.registry.safetensors_check import (Schema, WeightError, check_compatible, check_header,
                                              open_regular)
from rollq.registry.store import check_digest, check_digest_of, refuse_links, refuse_unsafe
from rollq.registry.versions import Registry
from rollq.worker.resident import ResidentAdapters
from rollq.worker.windows import crossing

if TYPE_CHECKING:
    from rollq.worker.loop import Worker

log = logging.getLogger("rollq.worker")

class Snapshots:
    """This worker's private copies of the versions it loads (a temp dir, `TMPDIR` decides where)."""

    def __init__(self, worker_id: str):
        self.worker_id = worker_id
        self.root: Path | None = None
        """Made at the first swap: a worker that never swaps leaves nothing behind. A killed
        worker (no atexit) leaves its last snapshot in `TMPDIR`."""

    def new(self, version: int) -> Path:
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix=f"rollq-snapshots-{self.worker_id}-"))
            atexit.register(shutil.rmtree, self.root, True)
        return self.root / f"v{version}-{uuid.uuid4().hex[:8]}"

    def drop(self, path: str | Path | None) -> None:
        if path is not None and self.root is not None and self.root in Path(path).parents:
            shutil.rmtree(path, ignore_errors=True)  # never the start-up model's directory


_IN_MEMORY = 64 << 20
"""Files up to this size (an adapter's) are copied through memory, see `_copy_small`."""


def _copy_checked(source: Path, target: Path, expected: FileDigest) -> None:
    """Copy one file, then hash the copy: the copy is private, so the bytes hashed are the bytes
    the engine will read. (The kernel's copy plus a hash from the page cache measured faster
    than one Python pass copying and hashing a checkpoint; see docs/architecture.md.)"""
    # Through one descriptor opened without following links or blocking: a link or FIFO put in
    # place after the directory was checked is refused, never followed or waited on.
    with os.fdopen(open_regular(source), "rb", buffering=0) as src:
        size = os.fstat(src.fileno()).st_size
        if size == expected.bytes <= _IN_MEMORY:
            _copy_small(src, target, expected)
            return
        if size == expected.bytes:
            with open(target, "wb") as dst:
                _copy_fd(src.fileno(), dst.fileno(), size)
            size = target.stat().st_size
    if size != expected.bytes:
        raise WeightError(f"{expected.name}: {size} bytes, registered {expected.bytes} "
                          "(truncated or replaced)")
    with open(target, "rb") as copy:
        check_digest(copy, expected)


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


def _copy_fd(src: int, dst: int, size: int) -> None:
    """The kernel copies (sendfile), as shutil.copyfile does for paths."""
    offset = 0
    while offset < size:
        sent = os.sendfile(dst, src, offset, min(size - offset, 1 << 30))
        if sent == 0:  # the file shrank under us: the size check that follows refuses it
            break
        offset += sent


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


def copy_version(entry: VersionEntry, into: Path) -> None:
    """Copy the version's registered files into `into` (a private snapshot), checking sizes and
    digests of the copies; raises WeightError."""
    source = Path(entry.path)
    if not source.is_dir():
        raise WeightError(f"{source}: version directory is missing")
    refuse_unsafe(source)
    refuse_links(source)
    expected = {d.name for d in entry.files}
    present = {p.name for p in source.iterdir() if p.suffix == ".safetensors" or p.name in expected}
    if present != expected:
        raise WeightError(f"{source}: files {sorted(present)} differ from the registered "
                          f"{sorted(expected)}")
    into.mkdir(mode=0o700)
    for d in entry.files:
        _copy_checked(source / d.name, into / d.name, d)


def check_version(entry: VersionEntry, base_schema: Schema | None, into: Path, *,
                  finite: bool = False) -> None:
    """Copy the version into `into` (a private snapshot) and check the copy; raises WeightError.
    `finite`: also refuse a NaN or infinite value (keep swaps, see `check_finite`)."""
    if entry.kind != "full":
        raise WeightError(f"version {entry.version} is an adapter on version {entry.base}, not "
                          "full weights: it cannot be swapped in")
    copy_version(entry, into)
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


async def swap_to(worker: Worker, entry: VersionEntry, path: Path, mode: SwapMode, *,
                  verify_s: float = 0.0) -> bool:
    """Gate closed → drain what must finish on the old version → swap to `path` → gate open.

    `verify_s`: time already spent checking the files, reported with the other phases.
    """
    version, began, versions = entry.version, time.monotonic(), worker.versions
    versions.moving("draining")
    adapters = versions.adapters
    crosses = crossing(mode, worker.engine)
    # Groups that may not cross this swap finish first: the job declines the mode, the new
    # version is outside the window, an interrupted continuation would not be exact, or the
    # group runs on an adapter (it applies on the weights being replaced).
    await worker.admission.close(lambda item: not crosses(item, version) or (
        adapters is not None and id(item) in adapters.serving))
    phases = {"verify": verify_s, "drain": time.monotonic() - began}
    versions.moving("swapping")
    try:
        phases |= await worker.engine.swap(version, str(path), interrupt=mode == "interrupt",
                                           keep=mode == "keep")
    except Exception as e:  # the engine is back on its old weights (or dead); report, never retry
        versions.refuse(version, f"swap to version {version} failed: {type(e).__name__}: {e}")
        worker.stats.swap(False, time.monotonic() - began, phases)
        log.error("%s; still serving version %d", versions.last_error, worker.engine.version)
        return False
    finally:
        versions.moving("serving")
        worker.admission.reopen()
    log.info("now serving version %d (%s swap, %.2f s: %s)", version, mode, time.monotonic() - began,
             ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items()))
    worker.stats.swap(True, time.monotonic() - began, phases)
    return True


class VersionFollower:
    def __init__(self, worker: Worker, registry: Registry, *, mode: SwapMode,
                 base_schema: Schema | None, poll_s: float):
        self.worker = worker
        self.registry = registry
        self.mode = mode
        self.base_schema = base_schema
        self.poll_s = poll_s
        self.snapshots = Snapshots(worker.worker_id)
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="rollq-version-check")
        """The snapshot copy and check run here, not in the loop's default executor: a new
        version's check must not queue behind whatever else the process runs in threads."""
        self.loaded: tuple[int, Path] | None = None
        """The version the engine serves from a snapshot of ours (None: the start-up weights)."""
        self.versions = worker.versions
        """Written here (and by the adapters served beside the loaded version); the worker reads it."""
        self.adapters: ResidentAdapters | None = None
        if getattr(worker.engine, "max_loras", 0):  # started with adapter support
            self.adapters = ResidentAdapters(worker, registry, self.snapshots, base_schema)
            self.versions.serve_adapters(self.adapters)
            worker.heartbeat.adapters = self.adapters.loaded  # read at each beat

    async def run(self) -> None:
        """Until the worker stops (it ends by itself within `poll_s` of that).

        Announcements come on a stream read with a server-side block (XREAD BLOCK), not on
        pub/sub: redis-py's pub/sub reads time out client-side, and on Python 3.11 a cancellation
        that lands as such a timeout fires can be lost, which hung a worker's shutdown.
        """
        last = "$"
        try:
            while not self.worker.stopping:
                try:
                    await self.catch_up()
                    reply = await self.registry.redis.xread(
                        {self.registry.keys.version_events: last}, count=100,
                        block=max(1, int(self.poll_s * 1000)))
                    for _, entries in reply or []:
                        last = entries[-1][0]
                except RedisError as e:
                    log.warning("reading new versions failed (%s); retrying", e)
                    await asyncio.sleep(self.poll_s)
                except Exception as e:  # a bug must not end following silently: the worker
                    # would serve its old version for ever, its heartbeat still fresh
                    self.versions.failed(f"following versions failed: {type(e).__name__}: {e}")
                    log.exception("following versions failed; retrying in %.1f s", self.poll_s)
                    await asyncio.sleep(self.poll_s)
        finally:
            self._checker.shutdown(wait=False)

    async def catch_up(self) -> None:
        versions = self.versions
        newest = await versions.read_newest()
        engine = self.worker.engine
        if self.adapters is not None:  # also notices adapters retention deregistered
            await self.adapters.refresh(newest)
        if newest is None or newest <= engine.version or newest in versions.cannot_load:
            return
        target = newest
        try:
            target = await self._full_target(newest)
            if target is not None and target > engine.version and target not in versions.cannot_load:
                await self._follow(target)
        except RedisError:  # Redis trouble is not the version's fault: run() retries
            raise
        except Exception as e:  # a hostile file, a bug, the engine: whatever it is, the follower
            # must live on (else the worker never follows again) and never retry this version
            versions.refuse(target, f"version {target} refused: {type(e).__name__}: {e}")
            log.error("%s; still serving version %d", versions.last_error, engine.version)

    async def _full_target(self, newest: int) -> int | None:
        """The full version to swap to for the newest version (None: none). An adapter version
        needs its base: swap to it if it is ahead, else serve the adapter beside it (loaded now,
        before any group asks for it)."""
        known = {} if self.adapters is None else self.adapters.entries
        entry = known.get(newest) or await self.registry.get(newest)
        if entry is None or entry.kind == "full":
            return newest
        engine = self.worker.engine
        if self.adapters is None or entry.base < engine.version:
            # Never servable here: no window waits for this worker on it.
            why = ("this worker has no adapter support (--enable-lora)" if self.adapters is None
                   else f"this worker serves version {engine.version} already")
            self.versions.skip(newest)
            log.warning("version %d is an adapter on version %d: %s", newest, entry.base, why)
            return None
        if entry.base == engine.version:
            await self.adapters.load(newest)
            return None
        return entry.base

    async def _follow(self, version: int) -> None:
        """Pin → snapshot and check → swap; the pin and snapshot of the version not served go."""
        heartbeat = self.worker.heartbeat
        entry = await self.registry.pin(version, self.worker.worker_id, heartbeat.ttl_s)
        if entry is None:  # retired since `latest` was read: the next catch-up finds a newer one
            return
        heartbeat.holds.add(version)
        heartbeat.target = version
        log.info("version %d: pinned; checking a private copy of its files", version)
        snapshot, served = self.snapshots.new(version), False
        try:
            checking = time.monotonic()
            await asyncio.get_running_loop().run_in_executor(
                self._checker, functools.partial(check_version, entry, self.base_schema, snapshot,
                                                 finite=self.mode == "keep"))
            served = await swap_to(self.worker, entry, snapshot, self.mode,
                                   verify_s=time.monotonic() - checking)
        finally:
            heartbeat.target = None
            if served:
                old, self.loaded = self.loaded, (version, snapshot)
                if old is not None:
                    await self._release(*old)
                if self.adapters is not None:
                    await self.adapters.rebase()
            else:
                await self._release(version, snapshot)

    async def _release(self, version: int, snapshot: Path) -> None:
        self.worker.heartbeat.holds.discard(version)
        self.snapshots.drop(snapshot)
        with contextlib.suppress(RedisError):  # else the lease lapses by itself
            await self.registry.unpin(version, self.worker.worker_id)


async def load_pinned(worker: Worker, registry: Registry, version: int,
                      base_schema: Schema | None) -> None:
    """A pinned worker loads its version once at start (and holds its pin); raises if it cannot."""
    if version == worker.engine.version:
        return
    entry = await registry.pin(version, worker.worker_id, worker.heartbeat.ttl_s)
    if entry is None:
        raise WeightError(f"--pin-version {version}: no such version in the registry")
    worker.heartbeat.holds.add(version)
    snapshot = Snapshots(worker.worker_id).new(version)
    await asyncio.to_thread(check_version, entry, base_schema, snapshot)
    await worker.engine.swap(version, str(snapshot), interrupt=False)
