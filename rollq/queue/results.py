"""A trainer's result stream: read with a consumer group, acknowledge after use.

Unacknowledged results stay pending for the trainer's consumer and are read again first after a
restart or reconnect. Acknowledged results are deleted and leave the trainer's quota.
"""

from __future__ import annotations

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from rollq.protocol import GroupResult, decode_result
from rollq.queue.keys import TRAINER_GROUP, Keys
from rollq.queue.scripts import Scripts

ACK_CHUNK = 1000
"""Ids per ack call (Lua's unpack has a stack limit)."""


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
        while True:
            start = self._cursor if self._replaying else ">"
            try:
                reply = await self.redis.xreadgroup(
                    TRAINER_GROUP, self.consumer, {self.stream: start}, count=count,
                    block=None if self._replaying else block_ms,
                )
            except ResponseError as e:
                if "NOGROUP" not in str(e):
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
                data = (fields or {}).get(b"d")
                if data is None:  # deleted after it was read: nothing to deliver
                    junk.append(entry_id.decode())
                    continue
                out.append((entry_id.decode(), decode_result(data)))
            if junk:
                await self.ack(junk)
            if out or not self._replaying:
                return out

    async def ack(self, entry_ids: list[str]) -> int:
        acked = 0
        for i in range(0, len(entry_ids), ACK_CHUNK):
            acked += await self.scripts.ack(keys=[self.stream, self.outstanding],
                                            args=entry_ids[i:i + ACK_CHUNK], client=self.redis)
        return acked

    def replay(self) -> None:
        """Read this consumer's unacknowledged results again (after a reconnect)."""
        self._replaying = True
        self._cursor = "0"
