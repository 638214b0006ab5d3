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
