"""Delivery of results to trainers: what is acknowledged when, and what comes back after a break,
a bad ack or a restart (issue 12). Real redis-server, in-process workers on the instant engine."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
from helpers import wait_until

from rollq.client import SyncRolloutClient
from rollq.engine.instant import InstantEngine
from rollq.protocol import GroupResult, InvalidInput
from rollq.queue.connection import connect
from rollq.queue.keys import Keys
from rollq.queue.names import Group
from rollq.queue.results import ResultReader
from rollq.queue.work import WorkQueue
from rollq.worker.loop import Worker
from rollq.worker.limits import Limits


@contextlib.contextmanager
def _worker_thread(redis_url: str, policy: str):
    """An instant-engine worker on its own event loop, for tests of the sync client."""
    stop = threading.Event()

    async def run():
        redis = connect(redis_url)
        worker = Worker(WorkQueue(redis, Keys(policy), "sync-w", job_ttl_s=60), InstantEngine(),
                        Limits(max_inflight=4, lease_s=5, max_deliveries=3, grace_s=1, poll_s=0.1))
        task = asyncio.create_task(worker.run())
        while not stop.is_set():
            await asyncio.sleep(0.05)
        worker.stop()
        await task
        await redis.aclose()

    thread = threading.Thread(target=asyncio.run, args=(run(),))
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


async def _ten_results(client, make_worker) -> None:
    """Ten finished groups waiting in the trainer's result stream, none read yet."""
    make_worker()
    await client.submit([[i + 1] for i in range(10)], n=1, sampling={"max_tokens": 2})
    stream = client.keys.results(client.trainer_id)

    async def all_written() -> bool:
        return await client.redis.xlen(stream) == 10

    await wait_until(all_written, what="10 results")


async def test_ack_deletes_only_the_ids_it_acknowledged(make_client, make_worker, redis):
    """Bug 6: acking a read id plus an unread one must not delete the unread result."""
    client = make_client()
    await _ten_results(client, make_worker)
    stream = client.keys.results("trainer")
    reader = ResultReader(redis, client.scripts, client.keys, "trainer", "trainer")
    [(read_id, _)] = await reader.read(1, None)
    unread_id = next(e.decode() for e, _ in await redis.xrange(stream) if e.decode() != read_id)
    assert await reader.ack([read_id, unread_id]) == 1
    assert await redis.xlen(stream) == 9  # only the acknowledged entry is gone
    assert [e.decode() for e, _ in await redis.xrange(stream, unread_id, unread_id)] == [unread_id]
    assert await client.outstanding() == 9
    # The unread result is still delivered, and acking it then brings the quota to 0.
    rest = await reader.read(10, None)
    assert unread_id in {e for e, _ in rest} and len(rest) == 9
    assert await reader.ack([e for e, _ in rest]) == 9
    assert await client.outstanding() == 0 and await redis.xlen(stream) == 0


async def test_breaking_out_of_results_strands_nothing(make_client, make_worker, redis):
    """Bug 2: break after 3 of a batch of 10; the same client gets the other 7 next, once."""
    client = make_client(max_outstanding=10)
    await _ten_results(client, make_worker)
    first = []
    async for result in client.results(batch=10):
        first.append(result.group_index)
        if len(first) == 3:
            break
    rest = await client.take(7, timeout_s=2)
    assert sorted(first + [r.group_index for r in rest]) == list(range(10))
    await client.ack()
    assert await client.outstanding() == 0
    new_job = await client.submit([[1]] * 10, wait=False)  # the quota is free again (QueueFull before)
    pending = await redis.xpending(client.keys.results("trainer"), Group.TRAINER)
    assert pending["pending"] == 0
    # And a restarted trainer (a new client) is handed nothing twice: only the 10 new ones.
    again = await make_client().take(10, timeout_s=5)
    assert len(again) == 10 and {r.job_id for r in again} == {new_job}


def test_breaking_out_of_sync_results_loses_nothing(redis_url, policy, tmp_path):
    """Bug 2, sync client: results() acked each batch before handing it out; break after 3 and
    the other 7 were gone for good."""
    with _worker_thread(redis_url, policy), \
            SyncRolloutClient(redis_url, policy=policy, trainer_id="sync") as client:
        job = client.submit([[i + 1] for i in range(10)], n=1, sampling={"max_tokens": 2})
        assert client.wait(job, timeout_s=10).ok == 10
        first = []
        for result in client.results(batch=10):
            first.append(result.group_index)
            if len(first) == 3:
                break
        rest = client.take(7, timeout_s=2)
        assert sorted(first + [r.group_index for r in rest]) == list(range(10))


async def test_manual_results_stay_pending_until_acked_and_survive_a_restart(make_client, make_worker):
    client = make_client()
    await _ten_results(client, make_worker)
    got = await client.take(4, timeout_s=5, ack="manual")
    more = await client.take(6, timeout_s=5, ack="manual")  # a manual read acknowledges nothing
    assert len(got) == 4 and len(more) == 6 and await client.outstanding() == 10
    assert all(r.entry_id for r in got + more)
    assert await client.ack(got[:2]) == 2 and await client.ack(got[:2]) == 0
    # A restarted trainer (same trainer_id) is handed each unacknowledged result once.
    again = await make_client().take(8, timeout_s=5, ack="manual")
    assert sorted(r.entry_id for r in again) == sorted(r.entry_id for r in got[2:] + more)
    assert await client.ack(again) == 8 and await client.outstanding() == 0


async def test_auto_acknowledges_a_batch_when_the_next_is_asked_for(make_client, make_worker):
    client = make_client()
    await _ten_results(client, make_worker)
    first = await client.take(4, timeout_s=5)
    # Not acknowledged yet: a trainer that crashed now would get these 4 again on restart.
    assert await client.outstanding() == 10
    second = await client.take(6, timeout_s=5)  # asking for more acknowledges the first 4
    assert len(second) == 6 and await client.outstanding() == 6
    restarted = await make_client().take(6, timeout_s=5, ack="manual")
    assert sorted(r.group_index for r in restarted) == sorted(r.group_index for r in second)
    assert not {r.group_index for r in first} & {r.group_index for r in second}


async def test_ack_mode_and_ack_arguments_are_checked(make_client):
    client = make_client()
    with pytest.raises(InvalidInput, match="ack='later' must be 'auto' or 'manual'"):
        await client.take(1, timeout_s=0.1, ack="later")
    with pytest.raises(InvalidInput, match="without entry_id"):
        await client.ack([GroupResult("j", 0, "ok")])  # made by hand, never read
    assert await client.ack() == 0 and await client.ack(["1-0"]) == 0
