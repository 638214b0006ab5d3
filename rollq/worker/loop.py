"""The consume loop: claim groups fairly, keep the engine busy, hold leases, write results.

Every claimed entry ends in exactly one of: a result written by `finish` (ok, failed, expired,
cancelled; dead-lettered when malformed or delivered too often), a `release` back to the pool
(shutdown, engine death, unexpected error), or a lost lease (someone else took it over: this
worker drops it without writing anything).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollq.engine.base import Engine, EngineDead
from rollq.images import ImageLoader
from rollq.protocol import GroupResult, WorkItem
from rollq.queue.connection import Backoff, unreachable
from rollq.queue.names import JobState
from rollq.queue.work import Claimed, WorkQueue
from rollq.registry.versions import Registry
from rollq.worker.admission import Admission
from rollq.worker.heartbeat import Heartbeat
from rollq.worker.limits import Limits
from rollq.worker.resident import ResidentAdapters
from rollq.worker.stats import WorkerStats
from rollq.worker.versions import VersionState
from rollq.worker.serving import GroupServer, cancelled, decode

log = logging.getLogger("rollq.worker")

STREAMS_REFRESH_S = 0.1
"""Most time between two readings of the streams to claim from (at most `poll_s`): a trainer that
went idle left the trainers set (`WorkQueue.prune_trainers`), and its next submit must be seen
as soon as a blocked read would have seen it."""


@dataclass
class _Held:
    claimed: Claimed
    task: asyncio.Task
    batch: bool = False
    """The task serves other groups too (`_run_batch`): it is never cancelled for this one."""


class Worker:
    def __init__(
        self,
        queue: WorkQueue,
        engine: Engine,
        limits: Limits,
        *,
        stats: WorkerStats | None = None,
        versions: VersionState | None = None,
    ):
        """`limits`: its knobs, shared with its group server.
        `stats`: made before the worker, e.g. to serve its /metrics before the engine starts.
        `versions`: the version state its VersionFollower writes (default: a worker that never
        swaps, e.g. a pinned one)."""
        self.queue = queue
        self.engine = engine
        self.worker_id = queue.consumer
        self.limits = limits
        self._typical_n: int | None = None
        if getattr(engine, "images", None) is not None:  # engines that take images read them here
            engine.images.loader = ImageLoader(queue.redis, queue.keys)
        self.heartbeat = Heartbeat(queue.redis, queue.keys, self.worker_id, ttl_s=3 * limits.lease_s)
        self.registry = Registry(queue.redis, queue.keys, queue.scripts)
        self.admission = Admission()
        self.stats = stats or WorkerStats(queue.keys.policy)
        self.versions = versions or VersionState(self.registry)
        self.follower = None
        """The VersionFollower `run` was given (None: pinned, or not following)."""
        self.server = GroupServer(queue, engine, versions=self.versions, admission=self.admission,
                                  stats=self.stats, heartbeat=self.heartbeat, limits=limits)
        self._redis_error, self._redis_error_at = "", 0.0
        self._held: dict[tuple[str, str], _Held] = {}
        self._slot_freed = asyncio.Event()
        self._stopping = asyncio.Event()
        self._hurry = asyncio.Event()
        self._fatal: BaseException | None = None
        self._streams: list[str] = []
        self._next_refresh = self._next_reclaim = 0.0

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # Read-only views for the heartbeat, logs and tests; `versions` is written by its owner.
    @property
    def newest(self) -> int | None:
        return self.versions.newest

    @property
    def cannot_load(self) -> set[int]:
        return self.versions.cannot_load

    @property
    def adapters(self) -> ResidentAdapters | None:
        return self.versions.adapters

    @property
    def state(self) -> str:
        if self._stopping.is_set():
            return "stopping"
        return "suspended" if self.versions.suspended and self.versions.swap == "serving" \
            else self.versions.swap

    @property
    def last_error(self) -> str:
        """The newer of this worker's last Redis error and its last version error."""
        v = self.versions
        return v.last_error if v.error_at >= self._redis_error_at else self._redis_error

    def stop(self) -> None:
        """First call: stop claiming and shut down in stages. Second call: skip the grace period."""
        if self._stopping.is_set():
            self._hurry.set()
        self._stopping.set()

    async def run(self, follower=None) -> int:
        """Serve until stopped; returns the process exit code (non-zero if the engine died).

        `follower`: a VersionFollower that swaps the engine as new versions are published.
        """
        log.info("worker %s serving policy %r with version %d%s", self.worker_id,
                 self.queue.keys.policy, self.engine.version, " (pinned)" if self.limits.pinned else "")
        renewing = asyncio.create_task(self._renew_loop(), name="renew")
        beating = asyncio.create_task(self._beat_on_change(), name="beat-on-change")
        self.follower = follower
        following = [asyncio.create_task(follower.run(), name="follow-versions")] if follower else []
        try:
            with contextlib.suppress(RedisError):  # Redis may be down: the renew loop beats again
                await self._beat()
            await self._feed_loop()
            await self._drain()
        finally:
            # Also on cancellation: nothing held may stay pending for a full lease.
            self._stopping.set()
            await self._release_held()
            if following:  # it ends by itself within poll_s (see VersionFollower.run)
                await asyncio.wait(following, timeout=self.limits.poll_s + 2)
            background = [renewing, beating, *following]
            for task in background:
                task.cancel()
            # Bounded: a worker asked to stop must exit even if a library swallows a cancel.
            _, stuck = await asyncio.wait(background, timeout=5.0)
            for task in stuck:
                log.warning("background task %s did not stop: %s", task.get_name(),
                            "".join(str(f) for f in task.get_stack(limit=3)))
            await self.heartbeat.remove()
        if self._fatal:
            log.error("worker %s stopped: engine failed: %s", self.worker_id, self._fatal)
            return 1
        log.info("worker %s stopped cleanly", self.worker_id)
        return 0

    # --- claiming ----------------------------------------------------------------------------

    async def _feed_loop(self) -> None:
        """Claim while there is room; a Redis outage pauses claiming (with backoff), never ends it."""
        backoff = Backoff(0.1, 5.0)
        while not self._stopping.is_set():
            try:
                if not await self._feed_once():
                    break
                backoff.reset()
            except (RedisConnectionError, RedisTimeoutError) as e:
                self._redis_error, self._redis_error_at = f"redis unreachable: {e}", time.monotonic()
                log.warning("redis unreachable (%s); claiming again in %.1f s", e, backoff.delay)
                await _first(self._stopping.wait(), timeout=backoff.next())

    async def _feed_once(self) -> bool:
        """One round of claiming; False when the worker must stop."""
        if not self.engine.alive:
            self._fatal = EngineDead("the engine died")
            self._stopping.set()
            return False
        if self.versions.suspended:  # its canary refused the newest version: serve none until one passes
            await _first(self._stopping.wait(), timeout=self.limits.poll_s)
            return True
        free = self._free_slots()
        if free <= 0:
            self._slot_freed.clear()
            # Bounded: a missed wake-up must cost a poll, never the worker.
            await _first(self._slot_freed.wait(), self._stopping.wait(), timeout=max(self.limits.poll_s, 1.0))
            return True
        now = time.monotonic()
        if now >= self._next_refresh or self.queue.stale:
            self._streams = await self.queue.streams()
            self._next_refresh = now + min(self.limits.poll_s, STREAMS_REFRESH_S)
        if not self._streams:
            await _first(self._stopping.wait(), timeout=min(self.limits.poll_s, STREAMS_REFRESH_S))
            return True
        claimed: list[Claimed] = []
        if now >= self._next_reclaim:
            claimed = await self.queue.reclaim(self._streams, int(self.limits.lease_s * 1000), free)
            self.stats.reclaimed(len(claimed))
            # Jittered: workers started together with one lease reclaimed in lockstep, and one
            # that cannot serve a group (a pinned worker, another version) took it back before
            # the worker that could every time, releasing it again: it waited 5 minutes.
            self._next_reclaim = now + min(self.limits.lease_s / 2, 5.0) * random.uniform(0.5, 1.0)
        block_ms = 0 if claimed else int(min(self.limits.poll_s, STREAMS_REFRESH_S) * 1000)
        claimed += await self.queue.claim(self._streams, free - len(claimed), block_ms)
        if self._stopping.is_set() and claimed:
            await self.queue.release(claimed)
            return False
        await self._start(claimed)
        return True

    def _free_slots(self) -> int:
        """Groups to claim now: up to max_inflight, and while their samples leave the engine room.

        With a sequence budget (vLLM's max_num_seqs), groups are admitted while the running
        samples do not fill it, so the engine stays saturated without this worker hoarding
        groups that wait inside the engine while other workers idle.

        An engine that answers at once (`Engine.at_once`) serves a claim's groups within one
        turn, and what is left to wait for is Redis: it gets half the slots a claim, so one half's
        results are written while the other half is claimed and generated (no-op groups: +27 %
        groups/s for one worker draining a queue, +14 % in bench/dispatch.py).
        """
        free = self.limits.max_inflight - len(self._held)
        if self.engine.at_once:
            free = min(free, max(1, self.limits.max_inflight // 2))
        if self.limits.max_inflight_seqs is None:
            return free
        room = self.limits.max_inflight_seqs - sum(h.claimed.n for h in self._held.values())
        if room <= 0:
            return 0
        if self._typical_n is None:  # nothing seen yet: one group, then size by its n
            return min(free, 1)
        return min(free, -(-room // self._typical_n))

    async def _start(self, claimed: list[Claimed]) -> None:
        # A group this worker already runs can come back from reclaim when a renewal was late
        # (the entry looked lapsed but is still ours): it must not run twice.
        claimed = [c for c in claimed if c.key not in self._held]
        if not claimed:
            return
        # Decoded once here: the group's n sizes the claims, the item is what is served.
        items = [decode(c) for c in claimed]
        for c, item in zip(claimed, items):
            if isinstance(item, WorkItem):
                c.n = self._typical_n = item.n
                c.score = item.score
        states = await self.queue.claimed_states(claimed)
        at_once, engine_at_once = [], self.engine.at_once
        for c, item in zip(claimed, items):
            state = states.get(c.key)
            if engine_at_once and self._at_once(c, item, state):
                at_once.append((c, item))
                continue
            task = asyncio.create_task(self._run_group(c, item, state))
            self._held[c.key] = _Held(c, task)
        if at_once:
            task = asyncio.create_task(self._run_batch(at_once))
            for c, _ in at_once:
                self._held[c.key] = _Held(c, task, batch=True)

    def _at_once(self, c: Claimed, item: WorkItem | str, job_state: JobState | None) -> bool:
        """May this group be served in one task with others of its claim? When the engine
        answers at once (`Engine.at_once`: it never suspends) and nothing before it may wait:
        the gate is open, the group may be served at all (`GroupServer.ending`: not to be
        dead-lettered, cancelled, nor past its deadline) and the loaded version serves it. Then
        a batch of groups is generated within one event loop turn (no swap nor cancellation can
        come between), and finished with one call."""
        return (self.admission.is_open and self.server.ending(c, item, job_state) is None
                and self.server.serve_loaded(item) is not None)

    # --- one group ---------------------------------------------------------------------------

    async def _run_group(self, c: Claimed, item: WorkItem | str, job_state: JobState | None) -> None:
        engine_died = False
        try:
            await self.server.serve(c, item, job_state)
        except EngineDead as e:
            # Stays held: shutdown hands it back, counted as a delivery, with the error.
            engine_died = True
            self._fatal = e
            self._stopping.set()
            self._hurry.set()
        except Exception as e:  # a bug or Redis trouble: hand it back, counted, with the error
            if unreachable(e):
                # One line: under a failover every held group lands here at once, and a rendered
                # traceback each would stall the event loop that must ride the failover out.
                log.warning("group %s/%s: redis unreachable (%s: %s); handing it back", c.job_id,
                            c.group_index, type(e).__name__, e)
            else:
                log.exception("group %s/%s failed unexpectedly; handing it back", c.job_id, c.group_index)
            self.stats.error()
            await self.server.release_quietly([c], error=f"{type(e).__name__}: {e}", refund=False)
        finally:
            # Also when cancelled (a lost lease, a cancelled job): a slot that is never given
            # back leaves a full worker waiting to claim forever.
            held = self._held.get(c.key)
            if not engine_died and held is not None and held.claimed is c:  # not a later claim's
                del self._held[c.key]
            self._slot_freed.set()

    async def _run_batch(self, batch: list[tuple[Claimed, WorkItem]]) -> None:
        """Groups `_at_once` chose: generated one after the other (the engine answers at once),
        then finished together. Each group ends as it would in `_run_group`."""
        finishing: list[tuple[Claimed, GroupResult, str]] = []
        handed_back: list[tuple[Claimed, str]] = []
        engine_died = False
        try:
            for c, item in batch:
                c.job_id, c.group_index = item.job_id, item.group_index
                try:
                    finishing.append((c, await self.server.generate_at_once(item), ""))
                except EngineDead:
                    raise
                except Exception as e:
                    log.exception("group %s/%s failed unexpectedly; handing it back", c.job_id,
                                  c.group_index)
                    self.stats.error()
                    handed_back.append((c, f"{type(e).__name__}: {e}"))
            for c, error in handed_back:
                await self.server.release_quietly([c], error=error, refund=False)
            await self.server.finish_many(finishing)
        except EngineDead as e:
            # They stay held: shutdown hands them back, counted as a delivery, with the error.
            engine_died = True
            self._fatal = e
            self._stopping.set()
            self._hurry.set()
            return
        except Exception as e:
            log.warning("%d groups: %s: %s; handing them back", len(finishing), type(e).__name__, e)
            self.stats.error()
            await self.server.release_quietly([c for c, *_ in finishing], error=f"{type(e).__name__}: {e}",
                                        refund=False)
        finally:
            for c, _ in batch:
                held = self._held.get(c.key)
                if not engine_died and held is not None and held.claimed is c:
                    del self._held[c.key]
            self._slot_freed.set()

    # --- leases, cancellation, shutdown ------------------------------------------------------

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.limits.lease_s / 3)
            try:
                await self._renew_once()
                await self._beat()
            except RedisError as e:
                log.warning("lease renewal failed (%s); fencing protects the results", e)

    async def _beat_on_change(self) -> None:
        changed = self.heartbeat.changed
        while True:
            await changed.wait()
            changed.clear()
            try:
                await self._beat()
            except RedisError as e:  # the renewal loop beats again
                log.warning("heartbeat failed (%s)", e)

    async def _beat(self) -> None:
        self.stats.inflight.set(len(self._held))
        self.stats.version.set(self.engine.version)
        await self.heartbeat.beat(version=self.engine.version, inflight=len(self._held),
                                  state=self.state, last_error=self.last_error, pinned=self.limits.pinned,
                                  totals=self.stats.totals, capacity=self.limits.max_inflight,
                                  max_model_len=getattr(self.engine, "max_model_len", None),
                                  canaries=list(self.versions.canaries))

    async def _renew_once(self) -> None:
        await self._hand_back_unheld()
        held = list(self._held.values())
        if not held:
            return
        for c in await self.queue.renew([h.claimed for h in held]):
            h = self._held.get(c.key)
            # Settling: its finish or hand-back ran first (the renewal raced it), and that call's
            # reply tells whether it was still ours. Not held: it ended while we renewed.
            if c.settling or h is None or h.claimed is not c:
                continue
            log.warning("lease of group %s/%s was taken over; dropping it", c.job_id, c.group_index)
            c.taken_over = True
            if h.batch:
                continue  # the batch's finish is fenced per entry: it writes nothing for this one
            del self._held[c.key]
            h.task.cancel()
        states = await self.queue.job_states([h.claimed for h in held])
        for h in held:
            # A batch's groups were all generated at once, before the cancellation was seen:
            # the batch writes their results (cancelling it would strand its other jobs' groups).
            if (states.get(h.claimed.key) is JobState.CANCELLED and not h.batch
                    and self._held.get(h.claimed.key) is h):
                h.task.cancel()
                await asyncio.gather(h.task, return_exceptions=True)
                c = h.claimed
                await self.server.finish(c, cancelled(c, self.worker_id))
                self._held.pop(c.key, None)
                self._slot_freed.set()

    async def _hand_back_unheld(self) -> None:
        """Entries delivered to this worker by a read whose reply was lost go back, refunded,
        before their lease lapses: a takeover would count a delivery that never happened.
        Half a lease idle: held entries are renewed every third of one."""
        orphans = await self.queue.unheld(self._streams, set(self._held), int(self.limits.lease_s * 500))
        if orphans:
            n = await self.queue.release(orphans, refund=True)
            log.warning("handed back %d groups delivered to this worker by a lost read reply", n)

    async def _drain(self) -> None:
        running = [h.task for h in self._held.values() if not h.task.done()]
        if running and not self._hurry.is_set():
            log.info("stopping: waiting up to %.0f s for %d groups", self.limits.grace_s, len(running))
            await _first(asyncio.wait(running), self._hurry.wait(), timeout=self.limits.grace_s)

    async def _release_held(self) -> None:
        left = list(self._held.values())
        self._held.clear()
        for h in left:
            h.task.cancel()
        await asyncio.gather(*(h.task for h in left), return_exceptions=True)
        if left:
            error = f"EngineDead: {self._fatal}" if self._fatal else ""
            n = await self.server.release_quietly([h.claimed for h in left], error=error,
                                            refund=self._fatal is None)
            log.info("handed back %d of %d groups for other workers", n, len(left))









async def _first(*aws, timeout: float | None = None) -> None:
    """Wait until the first of `aws` completes (or `timeout`), cancelling the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
