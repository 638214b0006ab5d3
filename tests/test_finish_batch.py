"""Finishing groups in batches (issue 13, part 3): groups that complete together are finished by
one script call, and the script fences every entry on its own; scripts are sent as bare EVALSHA
(no SCRIPT EXISTS round trip) and loaded when Redis has forgotten them. Real redis-server."""

import asyncio

from redis.exceptions import ResponseError

from rollq.protocol import GroupResult, encode
from rollq.queue.keys import Keys
from rollq.queue.names import Group
from rollq.queue.work import WorkQueue


async def _calls(redis, command: str) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def _claimed(redis, client, policy, count: int):
    await client.submit([[i + 1] for i in range(count)], n=1)
    queue = WorkQueue(redis, Keys(policy), "w1", job_ttl_s=600)
    streams = await queue.streams()
    claimed = await queue.claim(streams, count)
    assert len(claimed) == count
    return queue, claimed


async def _finish_together(queue, claimed) -> list:
    results = [encode(GroupResult(c.job_id, c.group_index, "ok")) for c in claimed]
    return await asyncio.gather(*(queue.finish(c, "ok", r) for c, r in zip(claimed, results)),
                                return_exceptions=True)


async def test_a_batch_is_one_script_call_fenced_per_entry(redis, policy, make_client):
    client = make_client()
    queue, claimed = await _claimed(redis, client, policy, 4)
    stolen = claimed[1]
    await redis.xclaim(stolen.stream, Group.WORKERS, "thief", 0, [stolen.entry_id], justid=True)
    await redis.script_load(queue.scripts.finish.script)  # else the first call is NOSCRIPT, loaded, again
    before = await _calls(redis, "evalsha"), await _calls(redis, "script|exists")

    outcomes = await _finish_together(queue, claimed)

    assert outcomes == ["ok", "lost", "ok", "ok"]
    after = await _calls(redis, "evalsha"), await _calls(redis, "script|exists")
    assert after == (before[0] + 1, before[1])
    results = await client.take(4, timeout_s=1)
    assert sorted(r.group_index for r in results) == [0, 2, 3]  # nothing for the stolen entry
    pending = await redis.xpending_range(stolen.stream, Group.WORKERS, "-", "+", 10)
    assert [(p["message_id"].decode(), p["consumer"].decode()) for p in pending] == [
        (stolen.entry_id, "thief")]
    status = await client.status(claimed[0].job_id)
    assert (status.done, status.ok) == (3, 3)


async def test_a_group_finished_twice_in_one_batch_has_one_result(redis, policy, make_client):
    client = make_client()
    queue, [c] = await _claimed(redis, client, policy, 1)
    assert await _finish_together(queue, [c, c]) == ["ok", "lost"]
    assert len(await client.take(2, timeout_s=1)) == 1


async def test_an_error_in_one_entry_fails_only_that_entry(redis, policy, make_client):
    client = make_client()
    for i in range(3):  # three jobs: the broken key below belongs to one of them
        await client.submit([[i + 1]], n=1)
    queue = WorkQueue(redis, Keys(policy), "w1", job_ttl_s=600)
    claimed = await queue.claim(await queue.streams(), 3)
    broken = claimed[1]
    # Its job's done-marker hash is a string: HSETNX fails for that entry alone.
    await redis.set(Keys(policy).done("trainer", broken.job_id), "x")
    outcomes = await _finish_together(queue, claimed)
    assert outcomes[0] == "ok" and outcomes[2] == "ok"
    assert isinstance(outcomes[1], ResponseError) and "WRONGTYPE" in str(outcomes[1])
    assert sorted(r.job_id for r in await client.take(3, timeout_s=1)) == sorted(
        [claimed[0].job_id, claimed[2].job_id])


async def test_scripts_forgotten_by_redis_are_loaded_again(redis, policy, make_client):
    client = make_client()
    queue, claimed = await _claimed(redis, client, policy, 3)
    await redis.script_flush()
    assert await queue.renew(claimed) == []
    await redis.script_flush()
    assert await _finish_together(queue, claimed) == ["ok"] * 3
    assert len(await client.take(3, timeout_s=1)) == 3
