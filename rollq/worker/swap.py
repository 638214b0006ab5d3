"""Follow the registry: learn of new versions at once, verify them, swap the engine to them.

New versions are announced on a stream that the follower blocks on; the newest version is also
read every `poll_s`, so a missed announcement (reconnect, Redis restart) delays a swap, never
loses it.

A version is pinned in Redis (`Registry.pin`) before anything else: retention cannot remove it
while this worker verifies it, drains toward it, loads it or serves it. Its files are then
copied into a snapshot directory private to this worker and checked there
(`rollq/registry/snapshots.py`): the bytes checked are the bytes the engine reads. The
engine loads the snapshot; the previous snapshot stays until the swap is done, so a failed load
can always go back to it. A version that fails is reported (log, heartbeat) and skipped while
the worker goes on serving the one it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from rollq.canary import CanaryRefused, Tolerance, canary_of
from rollq.engine import pushes
from rollq.protocol import SwapMode, VersionEntry
from rollq.registry.safetensors_check import Schema, WeightError, check_compatible
from rollq.registry.snapshots import Snapshots, check_version
from rollq.queue.workers import live_workers
from rollq.registry.versions import Registry
from rollq.worker.resident import ResidentAdapters
from rollq.worker.windows import crossing

if TYPE_CHECKING:
    from rollq.engine.base import Engine
    from rollq.worker.admission import Admission
    from rollq.worker.heartbeat import Heartbeat
    from rollq.worker.stats import WorkerStats
    from rollq.worker.versions import VersionState

log = logging.getLogger("rollq.worker")

FILES_POLL_S = 0.05
"""How often a worker looks for the files of a pushed version being written (`_files_written`)."""


class VersionFollower:
    def __init__(self, engine: Engine, registry: Registry, versions: VersionState, *,
                 admission: Admission, heartbeat: Heartbeat, stats: WorkerStats, worker_id: str,
                 stopping: Callable[[], bool], mode: SwapMode, base_schema: Schema | None,
                 poll_s: float, tolerance: Tolerance | None = None, refusal: str = "previous",
                 push_timeout_s: float = pushes.PUSH_TIMEOUT_S):
        """The worker's parts it uses: `admission` (the gate a swap closes), `heartbeat` (pins
        held, the target), `stats` (swaps), `stopping` (when to end). `tolerance`: the
        operator's for version canaries (None: the dtype's default). `push_timeout_s`: the bound
        on reading and checking a push (each rank gives it up then: refused, nothing loaded)."""
        self.engine = engine
        self.registry = registry
        self.admission = admission
        self.heartbeat = heartbeat
        self.stats = stats
        self.worker_id = worker_id
        self.stopping = stopping
        self.mode = mode
        self.base_schema = base_schema
        self.poll_s = poll_s
        self.tolerance = tolerance
        self.refusal = refusal
        """`--canary-refusal`: after a refusal, serve the `previous` version or `none`."""
        self._below_refused_seen: tuple[int, int, int] | None = None
        self.push_timeout_s = push_timeout_s
        self._push_failed: int | None = None
        """The last version whose push failed here: tried again, it loads the files."""
        self.spoil: Callable[[int, Path], None] | None = None
        """Tests only: changes a checked snapshot's files before the engine loads them (a worker
        made to load wrong bytes on purpose, for the canary to catch). Never set in `rollq worker`."""
        self.snapshots = Snapshots(worker_id)
        self._checker = ThreadPoolExecutor(1, thread_name_prefix="rollq-version-check")
        """The snapshot copy and check run here, not in the loop's default executor: a new
        version's check must not queue behind whatever else the process runs in threads."""
        self.loaded: tuple[int, Path] | None = None
        self._unchecked: int | None = None
        """A pushed version served whose files failed their check (so not `loaded`): its pin
        goes when a later version serves."""
        """The version the engine serves from a snapshot of ours (None: the start-up weights)."""
        self.versions = versions
        """Written here (and by the adapters served beside the loaded version); the worker reads it."""
        self.adapters: ResidentAdapters | None = None
        if getattr(engine, "max_loras", 0):  # started with adapter support
            self.adapters = ResidentAdapters(engine, registry, self.snapshots, base_schema,
                                             worker_id=worker_id, heartbeat=heartbeat, versions=versions,
                                             stats=stats, tolerance=tolerance)
            self.versions.serve_adapters(self.adapters)
            heartbeat.adapters = self.adapters.loaded  # read at each beat

    async def run(self) -> None:
        """Until the worker stops (it ends by itself within `poll_s` of that).

        Announcements come on a stream read with a server-side block (XREAD BLOCK), not on
        pub/sub: redis-py's pub/sub reads time out client-side, and on Python 3.11 a cancellation
        that lands as such a timeout fires can be lost, which hung a worker's shutdown.
        """
        last = "$"
        try:
            while not self.stopping():
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
        engine = self.engine
        if self.adapters is not None:  # also notices adapters retention deregistered
            await self.adapters.refresh(newest)
        if newest is not None and newest in versions.cannot_load and newest > engine.version:
            newest = await self._below_refused(newest)
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

    async def _below_refused(self, newest: int) -> int | None:
        """The newest refused here (its canary, a bad file): the newest full version between the
        one served and it that is not, if any. Else a worker that went straight for a refused
        version would serve the one before it for ever, and jobs that need a version in between
        (published, valid, that other workers may serve) would wait on it. Read once per
        (newest, served, refused) state: the registry's whole listing is not read every poll."""
        seen = (newest, self.engine.version, len(self.versions.cannot_load))
        if self._below_refused_seen == seen:
            return None
        self._below_refused_seen = seen
        served, refused = self.engine.version, self.versions.cannot_load
        return max((e.version for e in await self.registry.entries()
                    if e.kind == "full" and served < e.version < newest and e.version not in refused),
                   default=None)

    async def _full_target(self, newest: int) -> int | None:
        """The full version to swap to for the newest version (None: none). An adapter version
        needs its base: swap to it if it is ahead, else serve the adapter beside it (loaded now,
        before any group asks for it)."""
        known = {} if self.adapters is None else self.adapters.entries
        entry = known.get(newest) or await self.registry.get(newest)
        if entry is None or entry.kind == "full":
            return newest
        engine = self.engine
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
        """Pin → (push, or snapshot and check) → swap; the pin and snapshot of the version not
        served go."""
        heartbeat = self.heartbeat
        entry = await self.registry.pin(version, self.worker_id, heartbeat.ttl_s)
        if entry is None:  # retired since `latest` was read: the next catch-up finds a newer one
            return
        heartbeat.holds.add(version)
        heartbeat.target = version
        if entry.tensors and version != self._push_failed \
                and pushes.reachable(entry.push, getattr(self.engine, "push_transport", None)):
            if await self._pushed(entry):
                return
            if version in self.versions.cannot_load:  # its canary refused it, or the engine died
                await heartbeat.release(version)  # (never served here: retention may take it)
                return
            self._push_failed = version  # (a later try of this version goes to the files)
            heartbeat.target = version  # refused: the files, as a worker that missed the push
        if not await self._files_written(entry):
            heartbeat.target = None
            await heartbeat.release(version)
            return
        log.info("version %d: pinned; checking a private copy of its files", version)
        snapshot, served = self.snapshots.new(version), False
        try:
            checking = time.monotonic()
            await asyncio.get_running_loop().run_in_executor(
                self._checker, functools.partial(check_version, entry, self.base_schema, snapshot,
                                                 finite=self.mode == "keep",
                                                 spare=self.snapshots.take_spare()))
            if self.spoil is not None:
                self.spoil(version, snapshot)
            served = await self.swap_to(entry, snapshot, verify_s=time.monotonic() - checking)
        finally:
            heartbeat.target = None
            if served:
                old, self.loaded = self.loaded, (version, snapshot)
                if old is not None:
                    await self._release(*old)
                await self._release_unchecked()
                if self.adapters is not None:
                    await self.adapters.rebase()
            else:
                await self._release(version, snapshot)

    async def _pushed(self, entry: VersionEntry) -> bool:
        """Swap to `entry` by its push (the engine checks every tensor's fingerprint before it
        loads any), then copy and check its files as the engine's restore point (a later failed
        load goes back to them, not to the version before), off the path to serving. False: the
        push failed (the engine is back on its last verified files); load the files instead."""
        version = entry.version
        if self.base_schema is not None:  # vLLM only warns of tensors it was not given
            try:
                check_compatible({t.name: (t.dtype, tuple(t.shape)) for t in entry.tensors},
                                 self.base_schema, f"version {version}'s push")
            except WeightError as e:  # (its files hold the same tensors: their check refuses it)
                log.error("%s; not taken", e)
                return False
        info = pushes.update_info(entry.push, entry.tensors, self.push_timeout_s) | {
            "finite": self.mode == "keep"}
        try:
            try:  # received and checked while the engine serves and drains
                await self.engine.stage_push(info)
            except Exception as e:  # the push's own update_weights reads it then, paused
                log.warning("version %d: staging the push failed (%s); receiving it paused", version, e)
            if not await self.swap_to(entry, None, push=info):
                return False
            if self.adapters is not None:
                await self.adapters.rebase()
            if not await self._files_written(entry):  # served from checked bytes all the same
                await self._release_unchecked()
                self._unchecked = version
                log.warning("version %d: pushed and served; its files never came (a newer version "
                            "came first): a failed load goes back further", version)
                return True
            snapshot = self.snapshots.new(version)
            try:
                await asyncio.get_running_loop().run_in_executor(
                    self._checker, functools.partial(check_version, entry, self.base_schema, snapshot,
                                                     spare=self.snapshots.take_spare()))
            except Exception as e:  # served from checked bytes all the same; restore stays older
                self.snapshots.drop(snapshot)
                await self._release_unchecked()
                self._unchecked = version
                self.versions.failed(f"version {version}: pushed, but its files failed their check "
                                     f"({type(e).__name__}: {e}); a failed load goes back further")
                log.error("%s", self.versions.last_error)
                return True
            self.engine.restore_point(version, str(snapshot))
            old, self.loaded = self.loaded, (version, snapshot)
            if old is not None:
                await self._release(*old)
            await self._release_unchecked()
            return True
        finally:
            self.heartbeat.target = None

    async def _files_written(self, entry: VersionEntry) -> bool:
        """A pushed version is registered before its files are written (the push does not wait
        for the trainer's disk: `client/publishing.py`), which appear in its directory all at
        once (renamed into place). Wait for them: True once there; False once a newer version is
        registered (a trainer that died before writing them is followed by one that publishes
        again) or the worker stops. Any other version's files are there when it registers."""
        path = Path(entry.path)
        if entry.push is None or path.exists():
            return True
        log.info("version %d: waiting for its files to be written (%s)", entry.version, path)
        if self.engine.version < entry.version:  # (until written: its groups go to the pushers)
            self.versions.awaited = entry.version
            self.admission.wake()
        asked = time.monotonic()
        try:
            while not path.exists():
                if self.stopping():
                    return False
                if time.monotonic() - asked >= self.poll_s:
                    asked = time.monotonic()
                    latest = await self.registry.latest()
                    if latest is not None and latest > entry.version and not path.exists():
                        log.warning("version %d: its files were not written before version %d was "
                                    "registered; not waiting for them", entry.version, latest)
                        return False
                await asyncio.sleep(FILES_POLL_S)
            return True
        finally:
            self.versions.awaited = None

    async def swap_to(self, entry: VersionEntry, path: Path | None, *, verify_s: float = 0.0,
                      push: dict | None = None) -> bool:
        """Gate closed → drain what must finish on the old version → swap to `path` (or by
        `push`, vLLM's update payload) → gate open.

        `verify_s`: time already spent checking the files, reported with the other phases. A
        failed swap refuses the version; a failed push only reports it (the files come next).
        """
        version, began, versions, mode, engine = entry.version, time.monotonic(), self.versions, \
            self.mode, self.engine
        canary = canary_of(entry)  # (a malformed one refuses the version: `catch_up`)
        # Only with a canary: an engine of another make need not know the keywords.
        checked = {} if canary is None else {"canary": canary, "tolerance": self.tolerance}
        versions.moving("draining")
        self.heartbeat.soon()
        adapters = versions.adapters
        crosses = crossing(mode, engine)
        # Groups that may not cross this swap finish first: the job declines the mode, the new
        # version is outside the window, an interrupted continuation would not be exact, or the
        # group runs on an adapter (it applies on the weights being replaced).
        await self.admission.close(lambda item: not crosses(item, version) or (
            adapters is not None and id(item) in adapters.serving))
        # (a push has no verify phase: its check is part of its load, phase `push`)
        phases = ({} if push else {"verify": verify_s}) | {"drain": time.monotonic() - began}
        versions.moving("swapping")
        try:
            if push is None:
                phases |= await engine.swap(version, str(path), interrupt=mode == "interrupt",
                                            keep=mode == "keep", **checked)
            else:
                pushed = await engine.push(version, push, interrupt=mode == "interrupt",
                                           keep=mode == "keep", **checked)
                phases |= {("push" if k == "load" else k): v for k, v in pushed.items()}
        except CanaryRefused as e:  # back on its old weights; the same bytes by files would fail too
            versions.refuse(version, f"version {version} refused: {e}")
            if self.refusal == "none":
                versions.suspend(versions.last_error)
            if e.verdict is not None:
                versions.checked(version, e.verdict)
            self.stats.swap(False, time.monotonic() - began, phases)
            log.error("%s; still serving version %d", versions.last_error, engine.version)
            await self._report_refusal(version, str(e))
            return False
        except Exception as e:  # the engine is back on its old weights (or dead); report, never retry
            what = f"{'push' if push else 'swap'} to version {version} failed: {type(e).__name__}: {e}"
            if push is None or not engine.alive:
                versions.refuse(version, what)
            else:
                versions.failed(what)
            self.stats.swap(False, time.monotonic() - began, phases)
            log.error("%s; still serving version %d", versions.last_error, engine.version)
            return False
        finally:
            versions.moving("serving")
            self.admission.reopen()
            self.heartbeat.soon()  # the version served (new or old), at once: not in 10 s
        log.info("now serving version %d (%s %s, %.2f s: %s)", version, mode,
                 "push" if push else "swap", time.monotonic() - began,
                 ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items()))
        self.stats.swap(True, time.monotonic() - began, phases)
        versions.resume()  # (a version accepted: a worker that served none serves again)
        if canary is not None and engine.verdict is not None:
            versions.checked(version, engine.verdict)
            log.info("version %d: %s", version, engine.verdict.describe())
            with contextlib.suppress(RedisError):  # (a mark it leaves is cleared by the next)
                await self.registry.canary_accepted(version, self.worker_id)
        return True

    async def _report_refusal(self, version: int, reason: str) -> None:
        """Into the registry: this worker's refusal, and the version's mark once every live
        worker that follows the registry has refused it."""
        try:
            followers = {w.worker_id for w in await live_workers(self.registry.redis, self.registry.keys)
                         if not w.pinned} | {self.worker_id}
            if await self.registry.canary_refused(version, self.worker_id, reason, followers):
                log.error("version %d is refused by every live worker: groups that only it can "
                          "serve fail", version)
        except RedisError as e:  # the refusal stands here; other workers find it themselves
            log.warning("could not record the refusal of version %d (%s)", version, e)

    async def _release_unchecked(self) -> None:
        version, self._unchecked = self._unchecked, None
        if version is not None:
            await self.heartbeat.release(version)

    async def _release(self, version: int, snapshot: Path) -> None:
        """The engine reads `snapshot` no more (swapped past it, or back from it): its files
        are kept as the spare the next version's copy writes over."""
        self.snapshots.drop(snapshot, spare=True)
        await self.heartbeat.release(version)


async def load_pinned(engine: Engine, registry: Registry, heartbeat: Heartbeat, worker_id: str,
                      version: int, base_schema: Schema | None, tolerance: Tolerance | None = None) -> None:
    """A pinned worker loads its version once at start (and holds its pin); raises if it cannot."""
    if version == engine.version:
        return
    entry = await registry.pin(version, worker_id, heartbeat.ttl_s)
    if entry is None:
        raise WeightError(f"--pin-version {version}: no such version in the registry")
    heartbeat.holds.add(version)
    snapshot = Snapshots(worker_id).new(version)
    await asyncio.to_thread(check_version, entry, base_schema, snapshot)
    canary = canary_of(entry)
    await engine.swap(version, str(snapshot), interrupt=False,
                      **({} if canary is None else {"canary": canary, "tolerance": tolerance}))
