"""A trainer's result stream: read with a consumer group, acknowledge after use.

Unacknowledged results stay pending for the trainer's consumer and are read again first after a
restart or reconnect. Acknowledged results are deleted and leave the trainer's quota.

A read whose reply is lost (the connection dropped after Redis delivered the entries, and
redis-py retried the read, which then returned the *next* entries) leaves entries pending that
nobody was handed. Found by `rollq chaos`. The reader remembers what it handed out and, every
few seconds, looks for such orphans among this consumer's pending entries and reads them again.
"""

from __future__ import annotations

import time

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from rollq.protocol import GroupResult, decode_result
from rollq.queue.keys import TRAINER_GROUP, Keys
from rollq.queue.scripts import Scripts, call_durably

ACK_CHUNK = 1000
"""Ids per ack call (Lua's unpack has a stack limit)."""
ORPHAN_CHECK_S = 5.0
"""How often to look for pending entries never handed out, and how old they must be."""


class ResultReader:
    def __init__(self, redis: Redis, scripts: Scripts, keys: Keys, trainer: str, consumer: str):
        self.redis = redis
        self.scripts = scripts
        self.stream = keys.results(trainer)
        self.outstanding = keys.outstanding(trainer)
        self.consumer = consumer
        self._replaying = True
        self._cursor = "0"
        """While replaying: read pending entries after this id (so unacknowledged ones advance)."""
        self._group_ready = False
        self._handed: set[str] = set()
        """Entry ids handed to the caller and not acknowledged through this reader."""
        self._next_orphan_check = time.monotonic() + ORPHAN_CHECK_S

    async def _ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.stream, TRAINER_GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        self._group_ready = True

    async def read(self, count: int, block_ms: int | None) -> list[tuple[str, GroupResult]]:
        """Up to `count` results: first those read before but never acknowledged, then new ones."""
        if not self._group_ready:
            await self._ensure_group()
        if not self._replaying and time.monotonic() >= self._next_orphan_check:
            self._next_orphan_check = time.monotonic() + ORPHAN_CHECK_S
            if await self._has_orphans():
                self.replay()
        while True:
            start = self._cursor if self._replaying else ">"
            try:
                reply = await self.redis.xreadgroup(
                    TRAINER_GROUP, self.consumer, {self.stream: start}, count=count,
                    block=None if self._replaying else block_ms,
                )
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
                data = (fields or {}).get(b"d")
                if data is None:  # deleted after it was read: nothing to deliver
                    junk.append(entry_id)
                    continue
                if self._replaying and entry_id in self._handed:
                    continue  # handed out already by this reader, not acknowledged yet
                out.append((entry_id, decode_result(data)))
                self._handed.add(entry_id)
            if junk:
                await self.ack(junk)
            if out or not self._replaying:
                return out

    async def _has_orphans(self) -> bool:
        pending = await self.redis.xpending_range(self.stream, TRAINER_GROUP, "-", "+", 10_000,
                                                  consumername=self.consumer)
        ids = {p["message_id"].decode() for p in pending}
        if len(pending) < 10_000:
            self._handed &= ids  # the rest were acknowledged elsewhere (another connection)
        return any(p["time_since_delivered"] >= ORPHAN_CHECK_S * 1000
                   and p["message_id"].decode() not in self._handed for p in pending)

    async def ack(self, entry_ids: list[str]) -> int:
        self._handed.difference_update(entry_ids)
        acked = 0
        for i in range(0, len(entry_ids), ACK_CHUNK):
            acked += await call_durably(self.scripts.ack, self.redis, keys=[self.stream, self.outstanding],
                                        args=entry_ids[i:i + ACK_CHUNK])
        return acked

    def replay(self) -> None:
        """Read this consumer's unacknowledged results again (after a reconnect)."""
        self._replaying = True
        self._cursor = "0"
