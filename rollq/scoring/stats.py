"""A scorer's tally of what it scored, added to the pool's score-tallies stream each second
(`records.Tally`): the gateway's live reward figures per trainer and job, its scoring time and
its filtered and resampled counts. Kept in plain numbers on the scoring path; a tally lost with a
SIGKILLed scorer loses at most its last second of figures, never a group."""

from __future__ import annotations

import asyncio
import bisect
import logging
import time
from collections.abc import Awaitable, Callable

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rollq.protocol import GroupResult
from rollq.queue.keys import Keys
from rollq.scoring.records import REWARD_S_BUCKETS, JobTally, Tally, add_job_tally, add_tally

log = logging.getLogger("rollq.scorer")

TALLY_EVERY_S = 1.0


class ScoringStats:
    def __init__(self, scorer_id: str):
        self.scorer_id = scorer_id
        self._jobs: dict[tuple[str, str], JobTally] = {}
        self._reward_s = [0] * (len(REWARD_S_BUCKETS) + 1)

    def written(self, trainer: str, result: GroupResult) -> None:
        """A result the scorer wrote (its finish said OK)."""
        job = self._job(trainer, result.job_id)
        job.written[result.status] = job.written.get(result.status, 0) + 1
        self._rewards(job, result)

    def resampled(self, trainer: str, scored: GroupResult) -> None:
        """A uniform group queued to be generated again (dynamic sampling)."""
        job = self._job(trainer, scored.job_id)
        job.resampled += 1
        self._rewards(job, scored)

    def _job(self, trainer: str, job_id: str) -> JobTally:
        job = self._jobs.get((trainer, job_id))
        if job is None:
            job = self._jobs[trainer, job_id] = JobTally(trainer, job_id, {})
        return job

    def _rewards(self, job: JobTally, result: GroupResult) -> None:
        if not result.reward:  # not scored: cancelled, undecodable, given up
            return
        for value in result.rewards:
            if value is None:
                job.missing += 1
            else:
                job.rewards += 1
                job.total += value
                job.squares += value * value
        job.scored += 1
        job.reward_s += result.reward_s
        self._reward_s[bisect.bisect_left(REWARD_S_BUCKETS, result.reward_s)] += 1

    def take(self, now: float) -> Tally | None:
        """What was tallied since the last take (None: nothing)."""
        if not self._jobs:
            return None
        tally = Tally(self.scorer_id, now, list(self._jobs.values()), self._reward_s)
        self._jobs, self._reward_s = {}, [0] * (len(REWARD_S_BUCKETS) + 1)
        return tally

    def put_back(self, tally: Tally) -> None:
        """A tally that could not be added: counted again in the next one."""
        for old in tally.jobs:
            add_job_tally(self._job(old.trainer, old.job_id), old)
        self._reward_s = [a + b for a, b in zip(self._reward_s, tally.reward_s)]

    async def add(self, redis: Redis, keys: Keys, now: float) -> bool:
        """Add what was tallied (True: there was something, and it was added)."""
        tally = self.take(now)
        if tally is None:
            return False
        try:
            await add_tally(redis, keys, tally)
            return True
        except RedisError as e:
            self.put_back(tally)
            log.warning("adding the scoring tally: redis unreachable (%s)", e)
            return False

    async def run(self, redis: Redis, keys: Keys, beat: Callable[[], Awaitable[None]]) -> None:
        """Add a tally every second with anything in it, then `beat` (the scorer's heartbeat:
        its counts move as it scores, not every lease/3); cancel to end, `add` once more after.

        Just after each whole second, so that a tally covers one second of the clock (the one
        before its `at`) and the gateway lays them out per second, one per scorer each."""
        while True:
            await asyncio.sleep(TALLY_EVERY_S - time.time() % TALLY_EVERY_S + 0.01)
            try:
                if await self.add(redis, keys, time.time()):
                    await beat()
            except RedisError:  # the tally is kept for the next; the renewal loop beats again
                pass
            except Exception:  # a bug in the figures must never stop the scoring (nor its stop)
                log.exception("scoring tally failed; scoring goes on")
