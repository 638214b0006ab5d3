"""Adapter versions served side by side: which ones this worker can serve, loaded on demand.

A worker whose engine has adapter support serves, beside its full version, every registered
adapter version whose `base` is that full version: a group whose window admits one is served
by the newest such adapter, as a LoRA request on the running engine. No swap, no drain, no
pause: groups of v5 and v6 run in the same batches. Loading an adapter is the swap code's
check on a small scale: pin it, copy its two files into a private snapshot, check sizes and
digests, then its config (rank within the engine's limit) and tensors against the served
model, and only then hand it to vLLM (`add_lora`). A refused adapter is remembered with its
reason; a group that only refused adapters could serve fails with that reason.

At most `max_loras` adapters stay loaded (least recently used go first, never one a running
group uses); an adapter retention deregistered is unloaded once no group uses it, and a swap of
the full weights unloads them all (they applied on the old weights). Groups served by an adapter
are drained before such a swap (see `VersionFollower.swap_to`), so no adapter ever runs on other weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING

from redis.exceptions import RedisError

from rollq.canary import CanaryRefused, Tolerance, canary_of
from rollq.protocol import VersionEntry, WorkItem
from rollq.registry.safetensors_check import Schema
from rollq.registry.snapshots import Snapshots, check_adapter_version
from rollq.registry.versions import Registry
from rollq.worker.windows import Decision, Verdict, in_window

if TYPE_CHECKING:
    from rollq.engine.base import Engine, Generated
    from rollq.engine.vllm import Adapter
    from rollq.worker.heartbeat import Heartbeat
    from rollq.worker.stats import WorkerStats
    from rollq.worker.versions import VersionState

log = logging.getLogger("rollq.worker")


class ResidentAdapters:
    def __init__(self, engine: Engine, registry: Registry, snapshots: Snapshots,
                 base_schema: Schema | None, *, worker_id: str, heartbeat: Heartbeat,
                 versions: VersionState, stats: WorkerStats, tolerance: Tolerance | None = None):
        """`heartbeat`: shows the adapters pinned while they load; `versions`: told of refusals
        and canary checks; `stats`: each load's time; `tolerance`: the operator's for canaries."""
        self.engine = engine
        self.registry = registry
        self.snapshots = snapshots
        self.base_schema = base_schema
        self.worker_id = worker_id
        self.heartbeat = heartbeat
        self.versions = versions
        self.stats = stats
        self.tolerance = tolerance
        self.capacity = engine.max_loras
        self.max_rank = engine.max_lora_rank
        self.entries: dict[int, VersionEntry] = {}
        """Registered adapter versions, as last read."""
        self.full: set[int] = set()
        """Registered full versions, as last read."""
        self.read_at: int | None = None
        """The newest version when `entries` was read."""
        self.loaded: OrderedDict[int, Adapter] = OrderedDict()
        """In the engine, least recently used first."""
        self.refused: dict[int, str] = {}
        self.users: Counter[int] = Counter()
        """Groups that chose (and then run on) each adapter version: never unloaded under them."""
        self.serving: set[int] = set()
        """`id` of each group item choosing or running on an adapter: a swap drains them."""
        self._loading: dict[int, asyncio.Future] = {}
        self._settling: set[asyncio.Future] = set()
        """Unpins and evictions after a load (held here: the loop keeps only weak references)."""

    async def refresh(self, newest: int | None) -> None:
        """Read the registry's versions; unload adapters it no longer holds that nobody uses."""
        entries = await self.registry.entries()
        self.entries = {e.version: e for e in entries if e.kind == "adapter"}
        self.full = {e.version for e in entries if e.kind == "full"}
        self.read_at = newest
        for version in [v for v in self.loaded if v not in self.entries and not self.users[v]]:
            log.info("adapter version %d is no longer registered; unloading it", version)
            await self._unload(version)

    async def decide(self, item: WorkItem, newest: int | None) -> Verdict | None:
        """SERVE with the newest adapter version the window admits, loaded; FAIL if only adapters
        this worker refused could serve the window; None: the full version's rules decide."""
        if newest is not None and newest != self.read_at:
            await self.refresh(newest)
        engine = self.engine
        base = engine.version
        top = max(newest or 0, base)
        candidates = sorted((v for v, e in self.entries.items() if e.base == base
                             and v not in self.refused and in_window(item, v, top)), reverse=True)
        for version in candidates:
            # Held from here: not unloaded while loading or running, and a swap drains it.
            self.users[version] += 1
            self.serving.add(id(item))
            try:
                ready = await self.load(version)
            except BaseException:
                self.release(item, version)
                raise
            if ready and not engine.swapping and engine.version == base:
                return Verdict(Decision.SERVE, version=version)
            self.release(item, version)
        return self._refusal(item, newest)

    async def generate(self, item: WorkItem, version: int) -> Generated:
        """Generate a group `decide` chose `version` for (and holds: this releases it)."""
        try:
            return await self.engine.generate_group(item, self.loaded[version])
        finally:
            self.release(item, version)
            await self._evict()

    def release(self, item: WorkItem, version: int) -> None:
        self.users[version] -= 1
        self.serving.discard(id(item))

    async def load(self, version: int) -> bool:
        """Load `version` once (concurrent callers share the load); False if refused or gone."""
        if version in self.loaded:
            self.loaded.move_to_end(version)
            return True
        if version in self.refused or version not in self.entries:
            return False
        loading = self._loading.get(version)
        if loading is None:
            loading = self._loading[version] = asyncio.ensure_future(self._load(self.entries[version]))
            loading.add_done_callback(lambda _: self._loading.pop(version, None))
        return await asyncio.shield(loading)

    async def _load(self, entry: VersionEntry) -> bool:
        from rollq.engine.vllm import Adapter

        version, began = entry.version, time.monotonic()
        # Pinned while its files are copied: retention cannot delete them under the copy. The
        # private snapshot is what the engine reads, so the pin goes once it is loaded.
        if await self.registry.pin(version, self.worker_id, self.heartbeat.ttl_s) is None:
            self.entries.pop(version, None)  # retired meanwhile
            return False
        self.heartbeat.holds.add(version)
        snapshot, loaded = self.snapshots.new(version), False
        try:
            await asyncio.to_thread(check_adapter_version, entry, self.base_schema, self.max_rank,
                                    snapshot)
            canary = canary_of(entry)
            adapter = Adapter(version, entry.base, str(snapshot))
            await self.engine.add_adapter(adapter)
            if canary is not None:  # before any group may choose it (it is not `loaded` yet)
                try:
                    verdict = await self.engine.check_adapter(adapter, canary, self.tolerance)
                except CanaryRefused as e:
                    if e.verdict is not None:
                        self.versions.checked(version, e.verdict, adapter=True)
                    with contextlib.suppress(Exception):
                        await self.engine.remove_adapter(version)
                    raise
                self.versions.checked(version, verdict, adapter=True)
            loaded = True
        except RedisError:
            self.snapshots.drop(snapshot)
            raise
        except Exception as e:  # a hostile or wrong adapter: refused for good, the worker goes on
            self.snapshots.drop(snapshot)
            self.refused[version] = f"adapter version {version} refused: {e}"
            self.versions.refuse(version, self.refused[version])
            log.error("%s; still serving version %d", self.refused[version], self.engine.version)
            return False
        finally:
            if not loaded:
                await self._unpin(version)
        self.loaded[version] = adapter
        self.stats.adapter_loaded(version, time.monotonic() - began)
        # Servable from here: the unpin, the log line (rich's handler: ~0.5 ms) and any eviction
        # (an engine call) run after the groups waiting for it have started.
        settling = asyncio.ensure_future(self._settle(entry))
        self._settling.add(settling)
        settling.add_done_callback(self._settling.discard)
        return True

    async def _settle(self, entry: VersionEntry) -> None:
        version = entry.version
        await self._unpin(version)
        log.info("adapter version %d loaded (on version %d)", version, entry.base)
        self.heartbeat.soon()  # the adapters loaded and the load's time, at once
        await self._evict()

    async def _unpin(self, version: int) -> None:
        await self.heartbeat.release(version)

    async def _evict(self) -> None:
        """Keep at most `capacity` adapters loaded, the least recently used going first."""
        while len(self.loaded) > self.capacity:
            idle = next((v for v in self.loaded if not self.users[v]), None)
            if idle is None:
                return
            await self._unload(idle)

    async def _unload(self, version: int) -> None:
        adapter = self.loaded.pop(version, None)
        if adapter is None:  # unloaded meanwhile (an eviction and a refresh both chose it)
            return
        try:
            await self.engine.remove_adapter(version)
        except Exception as e:  # the engine keeps a spare adapter: harmless, and said
            log.warning("unloading adapter version %d: %s", version, e)
        self.snapshots.drop(adapter.path)

    async def rebase(self) -> None:
        """After a swap of the full weights: adapters of the old weights go (none is in use: a
        swap drains groups served by adapters). Only those: the gate reopened before this runs,
        so a group may already be running on an adapter of the new weights."""
        base = self.engine.version
        for version in [v for v, adapter in self.loaded.items() if adapter.base != base]:
            await self._unload(version)

    def _refusal(self, item: WorkItem, newest: int | None) -> Verdict | None:
        """FAIL when the window is closed (no later version can enter it), holds no full
        version and every adapter version in it is one this worker refused."""
        lo, hi = item.min_version, item.max_version
        if hi is None or newest is None or hi > newest or lo <= 0:
            return None
        refused = sorted(v for v in self.refused if lo <= v <= hi)
        others = self.full | (self.entries.keys() - self.refused.keys())
        if not refused or any(lo <= v <= hi for v in others):
            return None
        return Verdict(Decision.FAIL, "; ".join(self.refused[v] for v in refused))

