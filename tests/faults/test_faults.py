"""The guarantees under faults: worker SIGKILLs, Redis SIGKILL + restart, a frozen Redis, killed
client connections, a paused worker under a backlog. Worker processes use the instant engine
(these tests are about the queue, not generation) against a durable redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
from collections import Counter

from redis.exceptions import ConnectionError as RedisConnectionError

from rollq.queue.keys import Keys
from rollq.queue.names import Group

WORKER = dict(instant_delay_s=0.1, lease_s=2.0, max_inflight=4, grace_s=1.0)


async def take_all(client, expected: int, timeout_s: float) -> Counter:
    """Read results until `expected` distinct groups arrived; count every (job, group) seen."""
    seen: Counter = Counter()
    give_up = asyncio.get_running_loop().time() + timeout_s
    while len(seen) < expected and asyncio.get_running_loop().time() < give_up:
        for r in await client.take(1000, timeout_s=1.0):
            assert r.status == "ok", (r.job_id, r.group_index, r.status, r.reason)
            seen[(r.job_id, r.group_index)] += 1
    # Anything still coming would be a duplicate: give it a moment to show.
    for r in await client.take(1000, timeout_s=2.0):
        seen[(r.job_id, r.group_index)] += 1
    return seen


async def assert_nothing_pending(redis, policy: str, trainer: str = "trainer") -> None:
    stream = Keys(policy).work(trainer)
    if not await redis.exists(stream):  # emptied, and pruned with its trainer (queue/prune.py)
        return
    assert (await redis.xpending(stream, Group.WORKERS))["pending"] == 0
    assert await redis.xlen(stream) == 0


async def test_worker_churn_2000_groups_3_workers_5_sigkills(make_client, spawn_worker, redis, policy):
    client = make_client(max_outstanding=10_000)
    await client.submit([[i + 1] for i in range(2000)], n=1, sampling={"max_tokens": 2}, job_id="churn")
    workers = [spawn_worker(**WORKER) for _ in range(3)]
    reading = asyncio.create_task(take_all(client, 2000, timeout_s=180))
    for _ in range(5):
        await asyncio.sleep(random.uniform(2.0, 4.0))
        victim = workers.pop(random.randrange(len(workers)))
        victim.signal(signal.SIGKILL)
        workers.append(spawn_worker(**WORKER))
    seen = await reading
    assert len(seen) == 2000 and set(seen.values()) == {1}, [k for k, v in seen.items() if v > 1][:5]
    assert {g for _, g in seen} == set(range(2000))
    await assert_nothing_pending(redis, policy)


async def submit_all(client, count: int, prefix: str) -> list[str]:
    """One single-group job per submit, each with its own id; returns those acknowledged."""
    acknowledged = []
    for i in range(count):
        job_id = f"{prefix}{i}"
        await client.submit([[i % 1000 + 1, 7]], n=1, sampling={"max_tokens": 2}, job_id=job_id)
        acknowledged.append(job_id)
    return acknowledged


async def test_redis_sigkill_and_restart_3_times_during_5000_submits(durable_redis, make_client,
                                                                     spawn_worker, redis, policy):
    for _ in range(2):
        spawn_worker(**WORKER | {"instant_delay_s": 0.0, "max_inflight": 32})
    client = make_client(max_outstanding=100_000)
    submitting = asyncio.create_task(submit_all(client, 5000, "s"))
    # The last outage (15 s) outlasts redis-py's own retries: the client and the workers must
    # reconnect by themselves.
    for down_s in (0.0, 0.5, 15.0):
        await asyncio.sleep(random.uniform(0.5, 1.5))
        assert not submitting.done(), "the submits ended before this fault"
        await asyncio.to_thread(durable_redis.restart, down_s)
    acknowledged = await submitting
    seen = await take_all(client, 5000, timeout_s=120)
    assert {job for job, _ in seen} == set(acknowledged) and len(acknowledged) == 5000
    assert set(seen.values()) == {1}, [k for k, v in seen.items() if v > 1][:5]
    await assert_nothing_pending(redis, policy)


async def test_redis_frozen_for_10_s_loses_and_doubles_nothing(durable_redis, make_client, spawn_worker,
                                                               redis, policy):
    for _ in range(2):
        spawn_worker(**WORKER)
    client = make_client(max_outstanding=10_000)
    await client.submit([[i + 1] for i in range(400)], n=1, sampling={"max_tokens": 2}, job_id="frozen")
    await asyncio.sleep(1.5)
    durable_redis.pause()
    await asyncio.sleep(10)
    durable_redis.resume()
    seen = await take_all(client, 400, timeout_s=120)
    assert len(seen) == 400 and set(seen.values()) == {1}
    await assert_nothing_pending(redis, policy)


async def test_killed_connections_during_1000_submits_make_exactly_1000_jobs(make_client, redis, policy):
    client = make_client(max_outstanding=10_000)
    kills = 0

    async def killer():
        nonlocal kills
        while True:
            await asyncio.sleep(0.02)
            with contextlib.suppress(RedisConnectionError):
                kills += await redis.client_kill_filter(_type="normal", skipme=True)

    killing = asyncio.create_task(killer())
    try:
        acknowledged = await submit_all(client, 1000, "k")
    finally:
        killing.cancel()
        await asyncio.gather(killing, return_exceptions=True)
    keys = Keys(policy)
    jobs = [k async for k in redis.scan_iter(match=keys.job("trainer", "*"), count=1000)]
    entries = await redis.xrange(keys.work("trainer"))
    assert kills > 10, "the test killed too few connections to mean anything"
    assert len(acknowledged) == len(jobs) == len(entries) == 1000


async def test_backlog_behind_a_paused_worker_loses_no_pending_entry(make_client, spawn_worker, redis,
                                                                     policy):
    """Streams are never trimmed (entries are deleted one by one when finished), so a backlog of
    any size behind a stalled worker survives; the quota bounds how large it gets."""
    # No engine delay: what is tested is the backlog, not its service time (4 groups per 0.1 s
    # made the drain of 3,000 groups 75 s).
    worker = spawn_worker(**WORKER | {"instant_delay_s": 0.0})
    client = make_client(max_outstanding=10_000)
    await client.submit([[1, 2]], n=1, sampling={"max_tokens": 2})
    await client.take(1, timeout_s=30)
    worker.signal(signal.SIGSTOP)
    for batch in range(3):
        await client.submit([[batch + 1, i + 1] for i in range(1000)], n=1, sampling={"max_tokens": 2})
    assert await redis.xlen(Keys(policy).work("trainer")) == 3000
    worker.signal(signal.SIGCONT)
    seen = await take_all(client, 3000, timeout_s=120)
    assert len(seen) == 3000 and set(seen.values()) == {1}
    await assert_nothing_pending(redis, policy)


async def test_a_wiped_redis_is_served_again_without_a_crash_loop(make_client, spawn_worker, redis):
    """FLUSHALL + SCRIPT FLUSH (a Redis replaced by an empty one): consumer groups are recreated
    and scripts reloaded where they are missing; the worker keeps running."""
    worker = spawn_worker(**WORKER)
    client = make_client()
    await client.submit([[1]], n=1, sampling={"max_tokens": 2})
    assert len(await client.take(1, timeout_s=30)) == 1
    await redis.flushall()
    await redis.script_flush()
    await client.submit([[2], [3]], n=1, sampling={"max_tokens": 2})
    got = await client.take(2, timeout_s=30)
    assert sorted(r.prompt_ids for r in got) == [[2], [3]]
    assert worker.proc.poll() is None and "Traceback" not in worker.log
