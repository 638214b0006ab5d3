"""Serving one claimed group: from its decoded item to a terminal result written by `finish`, or
a hand-back. The worker (`worker/loop.py`) claims, holds and cancels groups; this decides each
group's version, runs the engine and writes the result.

Per group: too many deliveries or an undecodable payload → dead letter; cancelled job →
`cancelled`; deadline passed → `expired`; no version in the window can ever serve it → `failed`;
another worker (or a version not yet loaded here) can → handed back, refunded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollq.engine.base import Engine, GroupError, VersionWithdrawn
from rollq.images import SERVING_FOR
from rollq.protocol import GroupResult, InvalidInput, Sample, WorkItem, decode_item, encode, peek_header
from rollq.queue.connection import Backoff
from rollq.queue.names import JobState, Reply
from rollq.queue.work import Claimed, WorkQueue
from rollq.queue.workers import live_workers, recently_pinned
from rollq.worker.admission import Admission
from rollq.worker.heartbeat import Heartbeat
from rollq.worker.limits import Limits
from rollq.worker.stats import WorkerStats
from rollq.worker.versions import VersionState
from rollq.worker.windows import Decision, Verdict, decide, in_window

WAIT_SWAP_RECHECK_S = 5.0
"""A group waiting for this worker's swap re-checks its window at least this often."""
PEERS_CACHE_S = 2.0

log = logging.getLogger("rollq.worker")
_SERVE = Verdict(Decision.SERVE)


class GroupServer:
    """What serving a group needs, and nothing of how groups are claimed or held."""

    def __init__(self, queue: WorkQueue, engine: Engine, *, versions: VersionState,
                 admission: Admission, stats: WorkerStats, heartbeat: Heartbeat, limits: Limits):
        self.queue = queue
        self.engine = engine
        self.worker_id = queue.consumer
        self.versions = versions
        self.admission = admission
        self.stats = stats
        self.heartbeat = heartbeat
        self.limits = limits
        self._engine_slots = asyncio.Semaphore(limits.max_inflight)
        self._peers: tuple[float, set[int]] = (0.0, set())
        self._refused_everywhere: dict[int, str] = {}
        """The registry's marks of versions every live worker's canary refused (read with peers)."""

    def ending(self, c: Claimed, item: WorkItem | str, job_state: JobState | None) -> tuple[str, str] | None:
        """May this claimed group be served now? The one place that decides (the worker asks it
        too, before batching groups): None if it may, else the (status, reason) it ends with
        unserved: `dead` (delivered too often; an undecodable payload), `cancelled`, `expired`."""
        if c.deliveries > self.limits.max_deliveries:
            why = c.last_error or "its lease lapsed each time (worker died or stalled)"
            return "dead", f"gave up after {c.deliveries - 1} deliveries; last error: {why}"
        if isinstance(item, str):
            return "dead", item
        if job_state is JobState.CANCELLED:
            return "cancelled", ""
        if item.deadline and item.deadline <= time.time():
            return "expired", "deadline passed before generation"
        return None

    async def serve(self, c: Claimed, item: WorkItem | str, job_state: JobState | None) -> None:
        """`item`: the decoded payload, or why it could not be decoded."""
        status, reason = self.ending(c, item, job_state) or ("", "")
        if status == "dead":
            if isinstance(item, str) and c.deliveries <= self.limits.max_deliveries:
                header = peek_header(c.data) if c.data is not None else None
                if header is not None and c.job_id is None:
                    c.job_id, c.group_index = header.job_id, header.group_index
            return await self._fail(c, reason, dead=True)
        c.job_id, c.group_index = item.job_id, item.group_index
        # Whose images it may read: the stream's trainer, never one the item names (a task each).
        SERVING_FOR.set(self.queue.keys.trainer_of(c.stream))
        if status == "cancelled":
            return await self.finish(c, cancelled(c, self.worker_id, prompt=item.prompt))
        if status == "expired":
            return await self.finish(c, GroupResult(status="expired", reason=reason, job_id=item.job_id,
                                                    group_index=item.group_index, prompt=item.prompt,
                                                    worker_id=self.worker_id))
        result = await self._generate(c.key, item)
        if result is None:  # another worker (or a later version) serves it
            await self.release_quietly([c], error="", refund=True)
            return
        await self.finish(c, result)

    async def generate_at_once(self, item: WorkItem) -> GroupResult:
        started = time.time()
        partial = dict(job_id=item.job_id, group_index=item.group_index, prompt=item.prompt,
                       worker_id=self.worker_id)
        try:
            generated = await self.engine.generate_group(item)
        except GroupError as e:
            return GroupResult(status="failed", reason=str(e), **partial)
        return self._generated(item, generated, started, partial)

    async def _generate(self, key: tuple[str, str], item: WorkItem) -> GroupResult | None:
        """Generate the group under a version in its window; None: hand it back."""
        deadline = item.deadline - time.time() if item.deadline else None
        partial = dict(job_id=item.job_id, group_index=item.group_index, prompt=item.prompt,
                       worker_id=self.worker_id)
        started = time.time()
        try:
            # (no Timeout object without a deadline: it showed in the per-group profile)
            async with asyncio.timeout(deadline) if deadline is not None else contextlib.nullcontext():
                while True:
                    async with self._engine_slots, self.admission.generation(key, item):
                        verdict = self.serve_loaded(item) or await self._decide(item)
                        if verdict.decision is Decision.SERVE:
                            started = time.time()
                            generated = await (self.engine.generate_group(item) if verdict.version is None
                                               else self.versions.adapters.generate(item, verdict.version))
                            break
                    if verdict.decision is Decision.WAIT_SWAP:
                        await self.admission.changed(WAIT_SWAP_RECHECK_S)
                        continue
                    if verdict.decision is Decision.PASS:
                        return None
                    return GroupResult(status="failed", reason=verdict.reason, **partial)
        except TimeoutError:
            return GroupResult(status="expired", reason="deadline passed during generation", **partial)
        except VersionWithdrawn as e:  # served again from the start, on an accepted version
            log.warning("group %s/%s handed back: %s", item.job_id, item.group_index, e)
            return None
        except GroupError as e:
            return GroupResult(status="failed", reason=str(e), **partial)
        return self._generated(item, generated, started, partial)

    def _generated(self, item: WorkItem, generated, started: float, partial: dict) -> GroupResult:
        outside = _outside_window(item, generated.samples)
        if outside:  # must never happen: refuse to deliver rather than mislabel
            log.error("group %s/%s: %s", item.job_id, item.group_index, outside)
            return GroupResult(status="failed", reason=f"internal error: {outside}", **partial)
        partial["prompt"] = generated.prompt
        return GroupResult(status="ok", samples=generated.samples, prompt_scores=generated.prompt_scores,
                           image_tokens=generated.image_tokens, prompt_drift=generated.prompt_drift,
                           prompt_drift_at=generated.prompt_drift_at,
                           queued_s=max(0.0, started - item.submitted_at),
                           generation_s=time.time() - started, finished_at=time.time(), **partial)

    def serve_loaded(self, item: WorkItem) -> Verdict | None:
        """SERVE when the loaded version is in the window and nothing needs reading to know it
        (most groups: no coroutine for them); None: ask `_decide`."""
        versions = self.versions
        if item.max_staleness is not None or versions.adapters is not None or versions.suspended:
            return None
        loaded, newest = self.engine.version, versions.newest
        if in_window(item, loaded, loaded if newest is None else max(newest, loaded)):
            return _SERVE
        return None

    async def _decide(self, item: WorkItem) -> Verdict:
        versions = self.versions
        if versions.suspended:  # serving none (`--canary-refusal none`): another worker may
            return Verdict(Decision.PASS)
        newest = versions.newest
        if item.max_staleness is not None:  # "newest" must be exact when staleness is bounded
            newest = await versions.read_newest()
        if versions.adapters is not None:  # an adapter version in the window is newer than `loaded`
            verdict = await versions.adapters.decide(item, newest)
            if verdict is not None:
                return verdict
        loaded = self.engine.version
        if in_window(item, loaded, loaded if newest is None else max(newest, loaded)):
            return Verdict(Decision.SERVE)
        return decide(item, loaded=loaded, pinned=self.limits.pinned, newest=newest,
                      pinned_elsewhere=await self._pinned_peers(), cannot_load=versions.loadable_not(),
                      refused_everywhere=self._refused_everywhere,
                      target=self.heartbeat.target)

    async def _pinned_peers(self) -> set[int]:
        at, versions = self._peers
        if time.monotonic() - at > PEERS_CACHE_S:
            peers = [w for w in await live_workers(self.queue.redis, self.queue.keys)
                     if w.worker_id != self.worker_id]
            # Pinned peers serve their version forever; a follower swapping to a version will
            # serve it until it moves on (issue 21: do not fail what it is about to load).
            versions = {w.version for w in peers if w.pinned} | {w.target for w in peers
                                                                  if w.target is not None}
            # A pinned worker that is restarting has no heartbeat: its version stays servable
            # for a grace period, so groups only it can serve wait instead of failing.
            versions |= await recently_pinned(self.queue.redis, self.queue.keys)
            self._refused_everywhere = await self.versions.registry.refused_everywhere()
            self._peers = (time.monotonic(), versions)
        return versions

    async def _fail(self, c: Claimed, reason: str, *, dead: bool) -> None:
        log.warning("group %s/%s failed: %s", c.job_id, c.group_index, reason)
        result = GroupResult(c.job_id or "", -1 if c.group_index is None else c.group_index,
                             "failed", reason=reason, worker_id=self.worker_id)
        await self.finish(c, result, dead_reason=reason if dead else "")

    async def finish(self, c: Claimed, result: GroupResult, dead_reason: str = "") -> None:
        await self.finish_many([(c, result, dead_reason)])

    async def finish_many(self, finishing: list[tuple[Claimed, GroupResult, str]]) -> None:
        """Write the results; through a Redis outage, retried while the leases would still hold
        (fencing makes a late or repeated write a no-op)."""
        if not finishing:
            return
        calls = [(c, result.status, encode(result), dead_reason) for c, result, dead_reason in finishing]
        give_up, backoff = time.monotonic() + self.limits.lease_s, Backoff(0.1, 2.0)
        c = finishing[0][0]
        while True:
            try:
                outcomes = await self.queue.finish_many(calls)
                break
            except (RedisConnectionError, RedisTimeoutError) as e:
                if time.monotonic() > give_up:
                    raise
                log.warning("writing %d results (group %s/%s, ...): redis unreachable (%s); "
                            "retrying", len(calls), c.job_id, c.group_index, e)
                await backoff.sleep()
        newest = max(self.versions.newest or 0, self.engine.version)
        for (c, result, dead_reason), outcome in zip(finishing, outcomes):
            if outcome is Reply.LOST and not c.taken_over:  # (the renewal warned already)
                log.warning("lease of group %s/%s was taken over; its result is dropped", c.job_id,
                            c.group_index)
            elif outcome is Reply.DUP:
                log.warning("group %s/%s: result not written (it had one already)", c.job_id,
                            c.group_index)
            elif outcome is Reply.OK:
                self.stats.result(result, newest, dead=bool(dead_reason))

    async def release_quietly(self, items: list[Claimed], *, error: str, refund: bool) -> int:
        try:
            return await self.queue.release(items, error=error, refund=refund)
        except RedisError as e:
            log.warning("could not hand back %d groups (%s); their leases will lapse", len(items), e)
            return 0


def decode(c: Claimed) -> WorkItem | str:
    """The entry's work item, or why it has none (its group is dead-lettered with that)."""
    if c.data is None:
        return "work entry has no payload field 'd'"
    try:
        return decode_item(c.data)
    except InvalidInput as e:
        return str(e)


def cancelled(c: Claimed, worker_id: str, prompt: bytes = b"") -> GroupResult:
    """The result of a group whose job was cancelled (before it started or while it ran);
    group index -1 when the entry never named one, as for other failures."""
    return GroupResult(c.job_id or "", -1 if c.group_index is None else c.group_index, "cancelled",
                       reason="job cancelled", prompt=prompt, worker_id=worker_id)


def _outside_window(item: WorkItem, samples: list[Sample]) -> str:
    for i, sample in enumerate(samples):
        for version, _ in sample.versions:
            if version < item.min_version or (item.max_version is not None
                                              and version > item.max_version):
                return (f"sample {i} has tokens of version {version}, outside "
                        f"[{item.min_version}, {item.max_version}]")
    return ""

