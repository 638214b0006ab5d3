"""The scorers' side of the scoring streams: the workers' `WorkQueue` (claim, reclaim, renew,
finish, release: the same scripts, leases and fencing) over each trainer's scoring stream.

What differs: the streams (`Keys.scoring`, listed in `scoring_trainers`), and what a finish
counts: a scored group's work entry left its trainer's byte count when the worker finished it,
so a scoring entry's bytes count for nothing; and the group is counted done here (its job's
counters, DUP for a second copy), not when it was generated.
"""

from __future__ import annotations

from redis.exceptions import ResponseError

from rollq.queue import members
from rollq.queue.names import Group, Reply
from rollq.queue.work import Claimed, WorkQueue, _lua_string


class ScoringQueue(WorkQueue):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._grouped: set[str] = set()

    async def streams(self) -> list[str]:
        trainers = members.trainer_ids(self.keys.scoring_trainers,
                                       await self.redis.smembers(self.keys.scoring_trainers))
        streams = [self.keys.scoring(t) for t in trainers]
        for stream in streams:
            if stream not in self._grouped:
                await self.ensure_group(stream)
                self._grouped.add(stream)
        return streams

    async def ensure_group(self, stream: str) -> None:
        # MKSTREAM: a trainer's scoring stream may not exist yet (no group of it generated).
        try:
            await self.redis.xgroup_create(stream, Group.WORKERS, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def requeue(self, claimed: Claimed, item: bytes) -> Reply:
        """Dynamic sampling: ack the scoring entry and queue `item` (the group, to generate again)
        on its trainer's work stream, in one fenced script call: OK or LOST."""
        trainer, _, outstanding_bytes = self._trainer_keys(claimed.stream)
        job, _ = self._job_keys(claimed.stream, claimed.job_id or "-")
        # The entry leaves this scorer's pending list here, as by a finish or a hand-back: a
        # renewal that finds it gone raced this call, whose reply says whether it was ours.
        claimed.settling = True
        reply = await self.scripts.score_requeue(
            keys=[claimed.stream, self.keys.work(trainer), self.keys.errors, self.keys.trainers,
                  outstanding_bytes, job],
            args=[self.consumer, claimed.entry_id, trainer, claimed.job_id, claimed.group_index, item],
            client=self.redis)
        return Reply(reply.decode() if isinstance(reply, bytes) else reply)

    async def pick(self, claimed: Claimed, deliver: int) -> bool:
        """Over-sampling: may this group be delivered (`score_pick.lua`)?"""
        trainer = self._trainer_keys(claimed.stream)[0]
        job, _ = self._job_keys(claimed.stream, claimed.job_id or "-")
        return bool(await self.scripts.score_pick(
            keys=[self.keys.picked(trainer, claimed.job_id or "-"), job],
            args=[claimed.group_index, deliver, self.job_ttl_s], client=self.redis))

    async def picked(self, claimed: Claimed) -> bool:
        trainer = self._trainer_keys(claimed.stream)[0]
        return bool(await self.redis.hexists(self.keys.picked(trainer, claimed.job_id or "-"),
                                             str(claimed.group_index)))

    def _mine(self, stream: str) -> bool:
        return False  # nothing is routed to one scorer

    def _trainer_keys(self, stream: str) -> tuple[str, str, str]:
        found = self._by_stream.get(stream)
        if found is None:
            trainer = self.keys.trainer_of_scoring(stream)
            found = self._by_stream[stream] = (trainer, self.keys.results(trainer),
                                               self.keys.outstanding_bytes(trainer))
        return found

    def _finish_call(self, claimed: Claimed, status: str, payload: bytes,
                     dead_reason: str) -> tuple[tuple, tuple]:
        _, results, outstanding_bytes = self._trainer_keys(claimed.stream)
        job, done = self._job_keys(claimed.stream, claimed.job_id or "-")
        group = "" if claimed.group_index is None or not claimed.job_id else str(claimed.group_index)
        keys = (claimed.stream, results, job, done, outstanding_bytes)
        raw = claimed.data or b""
        args = (claimed.entry_id, group, status, _lua_string(payload), dead_reason, 0,
                _lua_string(raw) if dead_reason else "")
        return keys, args
