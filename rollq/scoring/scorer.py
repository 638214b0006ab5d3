"""`rollq scorer`: claims generated groups of scored jobs from the scoring streams, runs the
operator's reward on each sample, and writes each group to its trainer's result stream once.

The lease rules are the workers' (`queue/work.py`): a held entry is renewed every lease/3, an
entry idle for a lease is reclaimed by any scorer (a SIGKILLed one's), a finish is fenced (a
scorer that lost its lease writes nothing), and the group is counted done by that one finish
(a second copy ends DUP). A reward that raises, times out or runs out of memory gives its sample
no reward (or fails the group: the job's `on_error`); it never ends the scorer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollq.protocol import (GroupResult, InvalidInput, ScoreSpec, decode_item, decode_score_item, encode,
                            unpack_tokens)
from rollq.queue.connection import Backoff
from rollq.queue.keys import Keys
from rollq.queue.names import JobState, Reply
from rollq.queue.work import Claimed
from rollq.scoring import records
from rollq.scoring.pool import ChildPool, RewardError
from rollq.scoring.queue import ScoringQueue
from rollq.scoring.rewards import Completion, Reward, as_reward
from rollq.scoring.stats import ScoringStats

log = logging.getLogger("rollq.scorer")

STREAMS_REFRESH_S = 2.0
BLOCK_MS = 500
# Generation's cap is 3: there a group that takes its worker down (an engine crash) must not take
# the pool down with it. A reward cannot take a scorer down (it runs in a child process or under a
# timeout), so a scored group's lapsed leases are the pool's faults (scorer deaths, a Redis restart
# lapses every held lease at once), and the cap only stops a group that stalls every scorer's loop
# (an async reward that blocks it). 5 outlives three scorer kills and a Redis restart on one group.
MAX_DELIVERIES = 5


class Scorer:
    def __init__(self, redis: Redis, keys: Keys, rewards: dict[str, Reward], pool: ChildPool, *,
                 scorer_id: str, max_inflight: int = 16, lease_s: float = 30.0,
                 max_deliveries: int = MAX_DELIVERIES, job_ttl_s: int = 86_400, grace_s: float = 10.0,
                 refuse_unoffered: bool = False):
        self.redis, self.keys, self.rewards, self.pool = redis, keys, rewards, pool
        self.refuse_unoffered = refuse_unoffered
        self.scorer_id, self.max_inflight, self.lease_s = scorer_id, max_inflight, lease_s
        self.max_deliveries, self.grace_s = max_deliveries, grace_s
        self.queue = ScoringQueue(redis, keys, scorer_id, job_ttl_s=job_ttl_s)
        self._held: dict[tuple[str, str], tuple[Claimed, asyncio.Task]] = {}
        self._streams: list[str] = []
        self._stopping = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self.scored = self.reward_errors = 0
        self.stats = ScoringStats(scorer_id)

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        await self.pool.start()
        # A scorer (re)started while Redis is away waits for it, as a worker's claims do: `rollq
        # chaos` restarts a killed scorer, and one that met a Redis restart here exited with 1.
        backoff = Backoff(0.1, 2.0)
        while True:
            try:
                await self._beat()
                break
            except RedisError as e:
                if self._stopping.is_set():
                    await self.pool.close()
                    return
                log.warning("first beat: redis unreachable (%s: %s); retrying", type(e).__name__, e)
                await backoff.sleep()
        log.info("scorer %s offers %s", self.scorer_id,
                 ", ".join(f"{n} (v{r.spec.version})" for n, r in sorted(self.rewards.items())))
        feed = asyncio.create_task(self._feed_loop(), name="scorer-feed")
        renew = asyncio.create_task(self._renew_loop(), name="scorer-renew")
        tallying = asyncio.create_task(self.stats.run(self.redis, self.keys, self._beat),
                                       name="scorer-tally")
        stopping = asyncio.create_task(self._stopping.wait())
        try:
            # A loop that ends (it raised: a bug) ends the scorer, whose groups are handed back.
            done, _ = await asyncio.wait([stopping, feed, renew], return_when=asyncio.FIRST_COMPLETED)
            for task in done - {stopping}:
                task.result()
        finally:
            stopping.cancel()
            feed.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await feed
            await self._drain()
            renew.cancel()
            tallying.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renew
            with contextlib.suppress(asyncio.CancelledError):
                await tallying
            # Redis may be away as it stops: the beat expires by its TTL, the tallies are lost.
            with contextlib.suppress(RedisError):
                await self.stats.add(self.redis, self.keys, time.time())
                await records.remove(self.redis, self.keys, self.scorer_id)
            await self.pool.close()

    # --- claiming --------------------------------------------------------------------------

    async def _feed_loop(self) -> None:
        streams, refreshed, backoff = [], 0.0, Backoff(0.1, 2.0)
        while True:
            try:
                if time.monotonic() - refreshed > STREAMS_REFRESH_S or self.queue.stale:
                    streams, refreshed = await self.queue.streams(), time.monotonic()
                    self._streams = streams
                free = self.max_inflight - len(self._held)
                if free <= 0 or not streams:
                    self._slot_freed.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._slot_freed.wait(), STREAMS_REFRESH_S)
                    continue
                got = await self.queue.reclaim(streams, int(self.lease_s * 1000), free)
                if len(got) < free:
                    got += await self.queue.claim(streams, free - len(got), 0 if got else BLOCK_MS)
                backoff.reset()
            except RedisError as e:
                log.warning("claiming: redis unreachable (%s: %s); retrying", type(e).__name__, e)
                await backoff.sleep()
                continue
            for c in got:
                if c.key not in self._held:
                    self._held[c.key] = (c, asyncio.create_task(self._score(c)))

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            try:
                held = [c for c, _ in self._held.values() if not c.settling]
                for c in await self.queue.renew(held) if held else []:
                    found = self._held.get(c.key)
                    # Settling: its finish, hand-back or requeue raced the renewal, and that
                    # call's reply decides. Not held: its task ended while we renewed.
                    if c.settling or found is None or found[0] is not c:
                        continue
                    log.warning("lease of group %s/%s was taken over; dropping it", c.job_id, c.group_index)
                    c.taken_over = True
                    found[1].cancel()
                await self._hand_back_unheld()
                await self._beat()
            except RedisError as e:
                log.warning("renewing leases: redis unreachable (%s: %s)", type(e).__name__, e)

    async def _hand_back_unheld(self) -> None:
        """Entries delivered to this scorer by a read whose reply was lost go back, refunded,
        before their lease lapses (as a worker's do: `Worker._hand_back_unheld`)."""
        orphans = await self.queue.unheld(self._streams, set(self._held), int(self.lease_s * 500))
        if orphans:
            n = await self.queue.release(orphans, refund=True)
            log.warning("handed back %d groups delivered to this scorer by a lost read reply", n)

    async def _beat(self) -> None:
        state = records.ScorerState(
            self.scorer_id, {n: r.spec.version for n, r in self.rewards.items()}, time.time(),
            len(self._held), self.scored, self.reward_errors, self.pool.restarts, self.refuse_unoffered)
        await records.beat(self.redis, self.keys, state, ttl_s=self.lease_s)

    async def _drain(self) -> None:
        """Stop in stages: in-flight groups get `grace_s` to finish, the rest are handed back."""
        tasks = [t for _, t in self._held.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=self.grace_s)
        left = [c for c, t in self._held.values() if not t.done()]
        for _, t in self._held.values():
            t.cancel()
        if left:
            with contextlib.suppress(RedisError):
                await self.queue.release(left, error="", refund=True)

    # --- one group --------------------------------------------------------------------------

    async def _score(self, c: Claimed) -> None:
        try:
            result = await self._outcome(c)
            if result is not None:
                await self._finish(c, *result)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("group %s/%s: scoring failed unexpectedly; handing it back", c.job_id,
                          c.group_index)
            with contextlib.suppress(RedisError):
                await self.queue.release([c], error=f"{type(e).__name__}: {e}", refund=False)
        finally:
            held = self._held.get(c.key)
            if held is not None and held[0] is c:
                del self._held[c.key]
            self._slot_freed.set()

    async def _outcome(self, c: Claimed) -> tuple[GroupResult, str] | None:
        """The group's scored result and its dead-letter reason ('' for none); None: handed back."""
        try:
            spec, result, item = decode_score_item(c.data or b"")
        except InvalidInput as e:
            reason = f"scoring entry does not decode: {e}"
            return GroupResult("", -1, "failed", reason=reason, scorer_id=self.scorer_id), reason
        c.job_id, c.group_index = result.job_id, result.group_index
        if c.deliveries > self.max_deliveries:
            why = c.last_error or "its lease lapsed each time (scorer died or stalled)"
            reason = f"scoring gave up after {c.deliveries - 1} deliveries; last error: {why}"
            return msgspec.structs.replace(result, status="failed", reason=reason,
                                           scorer_id=self.scorer_id), reason
        # A group picked for delivery before its over-sampled job was cancelled (by that pick
        # or a later one) is still delivered: its scorer died before writing it.
        if ((await self.queue.job_states([c])).get(c.key) is JobState.CANCELLED
                and not (spec.deliver is not None and await self.queue.picked(c))):
            # Without its samples, as every `cancelled` result (the worker's carry none).
            return msgspec.structs.replace(result, status="cancelled", reason="job cancelled", samples=[],
                                           prompt_scores=None, scorer_id=self.scorer_id), ""
        found = self.rewards.get(spec.reward)
        if found is None:  # another scorer may offer it: a delivery counted, so it ends
            await self.queue.release([c], error=f"scorer {self.scorer_id} does not offer reward "
                                                f"{spec.reward!r}", refund=False)
            return None
        scored = await self._scored(spec, result, found)
        if spec.resample is None or scored.status != "ok" or not _uniform(scored.rewards):
            return await self._picked(c, spec, scored), ""
        if spec.attempt < spec.resample:
            await self._requeue(c, spec, item, scored)
            return None
        # Convert a uniform group --> `filtered`: a terminal result without its samples (its
        # advantages would all be 0), counted on the job.
        reason = (f"rewards all equal ({scored.rewards[0]:g}) after {spec.attempt} regeneration(s): "
                  "filtered (dynamic sampling)")
        return msgspec.structs.replace(scored, status="filtered", reason=reason, samples=[]), ""

    async def _picked(self, c: Claimed, spec: ScoreSpec, scored: GroupResult) -> GroupResult:
        """Over-sampling: the group as delivered, or `cancelled` once the job has its groups."""
        if spec.deliver is None or scored.status != "ok" or await self.queue.pick(c, spec.deliver):
            return scored
        return msgspec.structs.replace(scored, status="cancelled", samples=[],
                                       reason=f"over-sampled: the job delivered its {spec.deliver} groups")

    async def _requeue(self, c: Claimed, spec: ScoreSpec, item: bytes, scored: GroupResult) -> None:
        """The group, generated again (its item's `attempt` counts it), in place of its result."""
        work = decode_item(item)  # bytes a worker read and checked; checked again before queuing
        again = msgspec.structs.replace(work, score=msgspec.structs.replace(spec, attempt=spec.attempt + 1))
        reply = await self.queue.requeue(c, encode(again))
        if reply is Reply.OK:
            self.stats.resampled(self.keys.trainer_of_scoring(c.stream), scored)
        elif reply is Reply.LOST and not c.taken_over:
            log.warning("lease of group %s/%s was taken over; not queued again", c.job_id, c.group_index)

    async def _scored(self, spec: ScoreSpec, result: GroupResult, found: Reward) -> GroupResult:
        started = time.time()
        completions = [Completion(s.text, unpack_tokens(s.tokens), s.finish_reason, i)
                       for i, s in enumerate(result.samples)]
        outcomes = await asyncio.gather(*(self._call(found, c, spec.inputs) for c in completions))
        rewards = [value for value, _ in outcomes]
        errors = [error for _, error in outcomes]
        self.reward_errors += sum(1 for e in errors if e)
        fields = dict(rewards=rewards, reward_errors=errors if any(errors) else [],
                      reward=found.spec.name, reward_version=found.spec.version,
                      reward_s=time.time() - started, scorer_id=self.scorer_id)
        failed = next(((i, e) for i, e in enumerate(errors) if e), None)
        if failed is not None and spec.on_error == "fail":
            fields |= dict(status="failed", reason=f"reward {found.spec.name!r} failed on sample "
                                                   f"{failed[0]}: {failed[1]}")
        return msgspec.structs.replace(result, **fields)

    async def _call(self, found: Reward, completion: Completion, inputs) -> tuple[float | None, str]:
        timeout_s = found.spec.timeout_s
        try:
            if not found.is_async:
                return await self.pool.call(found.spec.name, completion, inputs, timeout_s), ""
            async with asyncio.timeout(timeout_s):
                return as_reward(await found.fn(completion, inputs)), ""
        except RewardError as e:
            return None, str(e)
        except TimeoutError:
            return None, f"timed out after {timeout_s:g} s"
        except Exception as e:  # the operator's async reward raised
            return None, f"{type(e).__name__}: {e}"[:1000]

    async def _finish(self, c: Claimed, result: GroupResult, dead_reason: str) -> None:
        """Write the result; through a Redis outage, retried while the lease would still hold
        (fencing makes a late or repeated write a no-op)."""
        payload, give_up, backoff = encode(result), time.monotonic() + self.lease_s, Backoff(0.1, 2.0)
        while True:
            try:
                reply = await self.queue.finish(c, result.status, payload, dead_reason=dead_reason)
                break
            except (RedisConnectionError, RedisTimeoutError) as e:
                if time.monotonic() > give_up:
                    raise
                log.warning("writing group %s/%s: redis unreachable (%s); retrying", c.job_id,
                            c.group_index, e)
                await backoff.sleep()
        if reply is Reply.OK:
            self.scored += 1
            self.stats.written(self.keys.trainer_of_scoring(c.stream), result)
        elif reply is Reply.LOST and not c.taken_over:
            log.warning("lease of group %s/%s was taken over; its score is dropped", c.job_id, c.group_index)
        elif reply is Reply.DUP:
            log.warning("group %s/%s: result not written (it had one already)", c.job_id, c.group_index)


def _uniform(rewards: list[float | None]) -> bool:
    return bool(rewards) and None not in rewards and len(set(rewards)) == 1


async def serve(redis_url: str, policy: str, target: str, *, scorer_id: str, processes: int,
                max_inflight: int, lease_s: float, grace_s: float,
                max_deliveries: int = MAX_DELIVERIES, refuse_unoffered: bool = False) -> None:
    """Run one scorer until SIGTERM/SIGINT."""
    import signal

    from rollq.queue.connection import connect
    from rollq.scoring.rewards import find_rewards

    rewards = find_rewards(target)
    redis = connect(redis_url)
    scorer = Scorer(redis, Keys(policy), rewards, ChildPool(target, processes), scorer_id=scorer_id,
                    max_inflight=max_inflight, lease_s=lease_s, grace_s=grace_s,
                    max_deliveries=max_deliveries, refuse_unoffered=refuse_unoffered)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, scorer.stop)
    try:
        await scorer.run()
    finally:
        await redis.aclose()
