"""Leases as the worker reports them (issue 27, item 11 and the batch suspect): "taken over" is
logged only for a group another worker took, and a group lost (or a job cancelled) inside a batch
of the instant engine never strands the batch's other groups. Real redis-server, in-process
workers, the instant engine (these are tests of the queue under load)."""

import asyncio
import logging
import time

from rollq.queue.keys import Keys
from rollq.queue.names import Group

TAKEN_OVER = "was taken over"


def _takeovers(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if TAKEN_OVER in r.getMessage()]


async def test_no_takeover_warning_without_a_fault(make_client, make_worker, caplog):
    """Two workers, a 5 s lease, a trainer submitting as fast as it can: groups finish while
    their leases are being renewed, and none is reported taken over (there were 60 in 30 s)."""
    caplog.set_level(logging.WARNING, logger="rollq.worker")
    client = make_client(max_outstanding=100_000)
    workers = [make_worker(lease_s=5.0, max_inflight=64)[0] for _ in range(2)]
    submitted = got = 0
    until = time.monotonic() + 8  # > 4 renewals of each worker
    while time.monotonic() < until:
        # A steady backlog far below the quota: a submit waiting for room that only this loop's
        # takes make would never return (on an idle box the workers outran the 100,000 quota).
        if submitted - got < 2_000:
            await client.submit([[submitted + i + 1] for i in range(32)], n=1, sampling={"max_tokens": 1})
            submitted += 32
        got += len(await client.take(1000, timeout_s=0 if submitted - got < 2_000 else 0.05))
    while got < submitted:
        got += len(await client.take(submitted - got, timeout_s=30))
    assert got == submitted
    assert sum(w.stats.totals.reclaims for w in workers) == 0  # no fault: nothing lapsed
    assert _takeovers(caplog) == []


async def test_a_real_takeover_still_warns(redis, policy, make_client, make_worker, caplog):
    caplog.set_level(logging.WARNING, logger="rollq.worker")
    client = make_client()
    w, _ = make_worker(lease_s=60.0, delay_s=30.0)  # the group is generating while it is taken
    await client.submit([[1]], n=1)
    [key] = await _held(w, 1)
    await redis.xclaim(key[0], Group.WORKERS, "thief", 0, [key[1]], justid=True)
    await w._renew_once()
    assert len(_takeovers(caplog)) == 1
    assert key not in w._held  # dropped: no result of this worker for it
    assert await redis.xlen(Keys(policy).results("trainer")) == 0


async def _held(w, count: int) -> list[tuple[str, str]]:
    from helpers import wait_until

    await wait_until(lambda: len(w._held) >= count, what=f"{count} groups held")
    return list(w._held)


async def _gated_batch(w, client, prompts_by_job):
    """Claim one instant-engine batch whose finish waits on a gate (as a finish retrying through
    a Redis outage does): returns (gate, the batch task, its keys, job ids)."""
    entered, gate, real = asyncio.Event(), asyncio.Event(), w.server.finish_many

    async def held_up(finishing):
        entered.set()
        await gate.wait()
        return await real(finishing)

    w.server.finish_many = held_up
    jobs = [await client.submit(prompts, n=1) for prompts in prompts_by_job]
    await asyncio.wait_for(entered.wait(), 20)
    tasks = {h.task for h in w._held.values()}
    assert len(tasks) == 1, "one batch task holds every group"
    return gate, tasks.pop(), list(w._held), jobs


async def test_a_lost_lease_in_a_batch_leaves_its_other_groups_served(redis, policy, make_client,
                                                                    make_worker, caplog):
    caplog.set_level(logging.WARNING, logger="rollq.worker")
    client = make_client()
    w, _ = make_worker(lease_s=60.0, max_inflight=8)
    gate, batch, keys, _ = await _gated_batch(w, client, [[[1], [2], [3], [4]]])
    stolen = keys[0]
    await redis.xclaim(stolen[0], Group.WORKERS, "thief", 0, [stolen[1]], justid=True)
    await w._renew_once()
    gate.set()
    await asyncio.wait_for(asyncio.wait([batch]), 20)
    assert await redis.xlen(Keys(policy).results("trainer")) == 3
    results = await client.take(3, timeout_s=10)
    # The three groups still ours are written when the batch ends, not a lease later.
    assert sorted(r.prompt_ids[0] for r in results) == [2, 3, 4]
    assert len(_takeovers(caplog)) == 1


async def test_a_cancelled_job_in_a_batch_leaves_the_other_jobs_served(redis, policy, make_client,
                                                                     make_worker):
    client = make_client()
    w, _ = make_worker(lease_s=60.0, max_inflight=8)
    gate, batch, _, (cancelled_job, other_job) = await _gated_batch(w, client, [[[1], [2]], [[3], [4]]])
    await client.cancel(cancelled_job)
    await w._renew_once()
    gate.set()
    await asyncio.wait_for(asyncio.wait([batch]), 20)
    assert await redis.xlen(Keys(policy).results("trainer")) == 4
    results = await client.take(4, timeout_s=10)
    assert sorted((r.job_id, r.group_index) for r in results) == sorted(
        [(cancelled_job, 0), (cancelled_job, 1), (other_job, 0), (other_job, 1)])
    assert all(r.status == "ok" for r in results if r.job_id == other_job)
