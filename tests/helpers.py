"""Small helpers shared by tests."""

from __future__ import annotations

import asyncio
import time


async def wait_until(predicate, timeout_s: float = 20, what: str = "condition"):
    """Poll an async or sync predicate until it is truthy."""
    give_up = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.05)


async def collect(client, count: int, timeout_s: float = 60) -> list:
    """Exactly `count` results from a client (fails on fewer), acknowledged."""
    got = await client.take(count, timeout_s=timeout_s, ack="manual")
    assert len(got) == count, f"expected {count} results, got {len(got)}"
    await client.ack(got)
    return got


def drop_a_reply(monkeypatch, redis, command: str, pick=lambda reply: True) -> list:
    """Drop the reply to the next `command` sent on `redis` whose reply `pick` picks, after Redis
    ran it, as a connection lost in flight would: redis-py's retry sends the command again.
    Returns the dropped replies (a test asserts one was, else it tested nothing)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    parse, dropped = redis.parse_response, []

    async def parse_then_drop(connection, command_name, **options):
        reply = await parse(connection, command_name, **options)
        if command_name == command and not dropped and pick(reply):
            dropped.append(reply)
            raise RedisConnectionError("the connection dropped before the reply was read")
        return reply

    monkeypatch.setattr(redis, "parse_response", parse_then_drop)
    return dropped


async def turn_queued(redis, keys, submitter: str, record_key: str) -> bool:
    """An episode's running turn has its job queued (the record names the turn's job, whose
    record exists), not just begun. Not the submitter's outstanding count: a result answered
    before its ack (the start's) holds that count up a moment longer."""
    from rollq.queue.names import EpisodeField

    job = await redis.hget(record_key, EpisodeField.TURN_JOB)
    return bool(job) and bool(await redis.exists(keys.job(submitter, job.decode())))
