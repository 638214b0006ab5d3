"""A per-trainer quota on the bytes of queued prompts (issue 20): the group quota alone let one
trainer queue 65,536 groups of 512 KiB prompts (~32 GiB) in Redis."""

from __future__ import annotations

import asyncio

import pytest

from rollq.protocol import QueueFull
from rollq.queue.keys import Keys
from rollq.queue.names import Group
from rollq.queue.work import Claimed, WorkQueue
from rollq.security import trainer_acl

PROMPT = list(range(4000))
"""16,000 bytes of packed token ids: each item is a little more."""


async def queued_bytes(redis, policy: str, trainer: str) -> int:
    return int(await redis.get(Keys(policy).outstanding_bytes(trainer)) or 0)


async def work_item_bytes(redis, policy: str, trainer: str) -> int:
    entries = await redis.xrange(Keys(policy).work(trainer))
    return sum(len(fields[b"d"]) for _, fields in entries)


async def test_bytes_of_queued_items_are_counted_and_capped(make_client, redis, policy):
    client = make_client("alice", max_outstanding_bytes=100_000)
    await client.submit([PROMPT] * 4, wait=False)
    assert await queued_bytes(redis, policy, "alice") == await work_item_bytes(redis, policy, "alice")
    assert 64_000 < await queued_bytes(redis, policy, "alice") < 100_000
    with pytest.raises(QueueFull, match="bytes") as full:
        await client.submit([PROMPT] * 4, wait=False)
    assert full.value.byte_limit == 100_000 and not full.value.never_fits
    assert "100000" in str(full.value)
    assert await redis.xlen(Keys(policy).work("alice")) == 4  # nothing of the refused job was added
    other = make_client("bob", max_outstanding_bytes=100_000)  # the counter is per trainer
    await other.submit([PROMPT] * 4, wait=False)


async def test_a_job_bigger_than_the_byte_quota_can_never_fit(make_client):
    client = make_client("alice", max_outstanding_bytes=10_000)
    with pytest.raises(Exception, match="max_outstanding_bytes"):
        await client.submit([PROMPT], wait=True, timeout_s=1)


async def test_finish_gives_the_bytes_back_and_never_below_zero(make_client, redis, policy):
    """finish.lua gives an entry's bytes back to the counter when it finishes the entry."""
    keys, queue = Keys(policy), WorkQueue(redis, Keys(policy), "w1", job_ttl_s=600)
    client = make_client("alice", max_outstanding_bytes=100_000)
    await client.submit([PROMPT] * 2, wait=False)
    reply = await redis.xreadgroup(Group.WORKERS, "w1", {keys.work("alice"): ">"}, count=2)
    entries = reply[0][1]

    async def finish(entry_id, raw):
        return await queue.finish(Claimed(keys.work("alice"), entry_id.decode(), raw, None, None), "ok", b"r")

    before = await queued_bytes(redis, policy, "alice")
    (id1, f1), (id2, f2) = entries
    assert await finish(id1, f1[b"d"]) == "ok"
    assert await queued_bytes(redis, policy, "alice") == before - len(f1[b"d"])
    assert await finish(id1, f1[b"d"]) == "lost"  # not ours any more: nothing given back twice
    assert await queued_bytes(redis, policy, "alice") == before - len(f1[b"d"])
    await redis.set(keys.outstanding_bytes("alice"), 5)  # drift (say, a hand-edited counter)
    assert await finish(id2, f2[b"d"]) == "ok"
    assert await queued_bytes(redis, policy, "alice") == 0


async def test_an_empty_work_stream_resets_the_byte_count(make_client, make_worker, redis, policy):
    """Bytes of items that left the stream without being counted off (a worker that does not
    pass the counter, an item finished with its payload unknown) cannot block a trainer."""
    client = make_client("alice", max_outstanding_bytes=50_000)
    make_worker()
    for _ in range(3):  # 3 x 32 KB through a 50 KB quota: each job drains before the next
        await client.submit([PROMPT] * 2, wait=False)
        got = await client.take(2, timeout_s=30)
        assert [r.status for r in got] == ["ok", "ok"]
        for _ in range(100):
            if await redis.xlen(Keys(policy).work("alice")) == 0:
                break
            await asyncio.sleep(0.05)


async def test_a_worker_gives_the_bytes_back(make_client, make_worker, redis, policy):
    client = make_client("alice", max_outstanding_bytes=100_000)
    make_worker()
    await client.submit([PROMPT] * 3, wait=False)
    assert len(await client.take(3, timeout_s=30)) == 3
    for _ in range(100):
        if await redis.xlen(Keys(policy).work("alice")) == 0:
            break
        await asyncio.sleep(0.05)
    assert await queued_bytes(redis, policy, "alice") == 0


def test_a_trainers_acl_reaches_its_own_byte_counter(policy):
    keys = Keys(policy)
    rules = " ".join(trainer_acl(policy, "alice", "pw"))
    selectors = [s.split(")")[0].split() for s in rules.split("(")[1:]]
    scripts = next(s for s in selectors if "+evalsha" in s)
    strings = next(s for s in selectors if "+set" in s)
    assert f"~{keys.outstanding_bytes('alice')}" in strings  # its client reads it
    assert f"~{keys.outstanding_bytes('alice')}" in scripts  # the submit script declares it
    assert keys.outstanding_bytes("bob") not in rules
