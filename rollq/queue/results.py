"""A trainer's result stream: read with a consumer group, acknowledge after use.

Unacknowledged results stay pending for the trainer's consumer and are read again first after a
restart or reconnect. Acknowledged results are deleted and leave the trainer's quota.

A read whose reply is lost (the connection dropped after Redis delivered the entries, and
redis-py retried the read, which then returned the *next* entries) leaves entries pending that
nobody was handed. Found by `rollq chaos`. The reader remembers what it handed out and, every
few seconds, looks for such orphans among this consumer's pending entries and reads them again.

Read is not handed: a caller that gives results out one at a time (`RolloutClient.results()`)
reads with `hand=False` and calls `hand` as it gives each one out. What was read but never handed
(the caller's loop broke mid-batch) is returned first by the next read, so it is neither stranded
(skipped as "handed") nor lost.
"""

from __future__ import annotations

import itertools
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from rollq.protocol import GroupResult, decode_result
from rollq.queue.connection import NotReplicated, check_replicated, durability, queue_wait
from rollq.queue.keys import Keys, base_trainer
from rollq.queue.names import Group, ResultField
from rollq.queue.scripts import Scripts, call_durably

log = logging.getLogger("rollq.client")

ACK_CHUNK = 1000
"""Ids per ack call (Lua's unpack has a stack limit)."""
_RESULT = ResultField.RESULT.encode()
ORPHAN_CHECK_S = 5.0
"""How often to look for pending entries never handed out, and how old they must be."""


class ResultReader:
    def __init__(self, redis: Redis, scripts: Scripts, keys: Keys, trainer: str, consumer: str):
        self.redis = redis
        self.scripts = scripts
        self.stream = keys.results(trainer)
        # A derived id's results leave its base trainer's quota too (`Keys.outstanding`).
        self.outstanding = list(dict.fromkeys([keys.outstanding(trainer),
                                               keys.outstanding(base_trainer(trainer))]))
        self.consumer = consumer
        self._replaying = True
        self._cursor = "0"
        """While replaying: read pending entries after this id (so unacknowledged ones advance)."""
        self._group_ready = False
        self._handed: set[str] = set()
        """Entry ids handed to the caller and not acknowledged through this reader."""
        self._unhanded: dict[str, GroupResult] = {}
        """Read from Redis, not handed to the caller yet (in stream order)."""
        self._next_orphan_check = time.monotonic() + ORPHAN_CHECK_S

    async def _ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, Group.TRAINER, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    async def read(self, count: int, block_ms: int | None, *, hand: bool = True,
                   ) -> list[tuple[str, GroupResult]]:
        """Up to `count` results not handed out yet: first those read but never handed, then those
        read before but never acknowledged (after a restart or reconnect), then new ones.

        `hand`: mark them all handed out; else the caller calls `hand` for each it gives out.
        """
        entries = self._unhanded_first(count) or await self._read_redis(count, block_ms)
        if hand:
            for entry_id, _ in entries:
                self.hand(entry_id)
        return entries

    def hand(self, entry_id: str) -> bool:
        """Mark one result read by `read(hand=False)` as given to the caller. False: it had been
        handed out already (another loop over the same reader) or acknowledged: skip it."""
        if self._unhanded.pop(entry_id, None) is None:
            return False
        self._handed.add(entry_id)
        return True

    @property
    def handed(self) -> set[str]:
        """Ids handed out and not acknowledged through this reader."""
        return set(self._handed)

    def _unhanded_first(self, count: int) -> list[tuple[str, GroupResult]]:
        return list(itertools.islice(self._unhanded.items(), count))

    async def _read_redis(self, count: int, block_ms: int | None) -> list[tuple[str, GroupResult]]:
        if not self._group_ready:
            await self._ensure_group()
        if not self._replaying and time.monotonic() >= self._next_orphan_check:
            self._next_orphan_check = time.monotonic() + ORPHAN_CHECK_S
            if await self._has_orphans():
                self.replay()
        while True:
            start = self._cursor if self._replaying else ">"
            try:
                reply = await self._xreadgroup(start, count, None if self._replaying else block_ms)
            except ResponseError as e:
                # UNBLOCKED: the stream was deleted while we blocked on it (a wiped Redis).
                if not str(e).startswith(("NOGROUP", "UNBLOCKED")):
                    raise
                await self._ensure_group()
                continue
            entries = reply[0][1] if reply else []
            if self._replaying and not entries:
                self._replaying = False
                continue
            if self._replaying:
                self._cursor = entries[-1][0].decode()
            out, junk = [], []
            for entry_id, fields in entries:
                entry_id = entry_id.decode()
                data = (fields or {}).get(_RESULT)
                if data is None:  # deleted after it was read: nothing to deliver
                    junk.append(entry_id)
                    continue
                if entry_id in self._handed or entry_id in self._unhanded:
                    continue  # replayed, but this reader holds it already
                result = decode_result(data)
                result.entry_id = entry_id
                out.append((entry_id, result))
                self._unhanded[entry_id] = result
            if junk:
                await self.ack(junk)
            if out or not self._replaying:
                return out

    async def _xreadgroup(self, start: str, count: int, block_ms: int | None):
        """XREADGROUP; with durability (a URL's `durable_replicas`), WAIT behind it on the same
        connection. A read is a write (it records the delivery): a primary that died before its
        replica held that would leave the results undelivered on the promoted replica, which hands
        them out again. Once a replica holds the delivery it holds the entries read too."""
        wanted = durability(self.redis)
        if not wanted.replicas:
            return await self.redis.xreadgroup(Group.TRAINER, self.consumer, {self.stream: start},
                                               count=count, block=block_ms)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xreadgroup(Group.TRAINER, self.consumer, {self.stream: start}, count=count, block=block_ms)
            queue_wait(pipe, self.stream, wanted)
            reply, replicas = await pipe.execute(raise_on_error=False)
        if isinstance(reply, Exception):
            raise reply
        if reply and reply[0][1]:
            try:
                check_replicated(replicas, wanted)
            except NotReplicated as e:
                # Handed out all the same, as a worker's unreplicated result is kept: a failover
                # in this moment may hand them out again (docs/reliability.md).
                log.warning("results read from %s: %s", self.stream, e)
        return reply

    async def _has_orphans(self) -> bool:
        try:
            pending = await self.redis.xpending_range(self.stream, Group.TRAINER, "-", "+", 10_000,
                                                      consumername=self.consumer)
        except ResponseError as e:
            # The group is gone (a wiped Redis, or made just before a primary died): the read
            # makes it again, and nothing is pending in a new group.
            if not str(e).startswith("NOGROUP"):
                raise
            self._group_ready = False
            return False
        ids = {p["message_id"].decode() for p in pending}
        if len(pending) < 10_000:
            self._handed &= ids  # the rest were acknowledged elsewhere (another connection)
        return any(p["time_since_delivered"] >= ORPHAN_CHECK_S * 1000
                   and p["message_id"].decode() not in self._handed
                   and p["message_id"].decode() not in self._unhanded for p in pending)

    async def ack(self, entry_ids: list[str]) -> int:
        """Acknowledge results by id; returns how many were pending (ids never read, or
        acknowledged already, are left alone)."""
        self._handed.difference_update(entry_ids)
        for entry_id in entry_ids:
            self._unhanded.pop(entry_id, None)
        acked = 0
        for i in range(0, len(entry_ids), ACK_CHUNK):
            acked += await call_durably(self.scripts.ack, self.redis, keys=[self.stream, *self.outstanding],
                                        args=entry_ids[i:i + ACK_CHUNK])
        return acked

    def replay(self) -> None:
        """Read this consumer's unacknowledged results again (after a reconnect)."""
        self._replaying = True
        self._cursor = "0"
