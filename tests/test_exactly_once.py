"""Regression tests for the queue bugs an adversarial review proved (issue 12), real redis-server.

Each test names the bug it holds down; each failed on the code before its fix.
"""

import asyncio
import time

import pytest
from helpers import collect, wait_until

from rollq.protocol import InvalidInput, QueueFull, check_id
from rollq.queue.keys import Keys
from rollq.queue.names import Group


async def test_worker_that_lost_every_lease_at_full_capacity_claims_again(make_client, make_worker,
                                                                          redis, policy):
    """Bug 1: a lost lease must free its slot, or a busy worker never claims again."""
    client = make_client()
    worker, _ = make_worker(max_inflight=1, lease_s=1.0, delay_s=2.0)
    await client.submit([[1]], n=1)
    stream = client.keys.work("trainer")
    await wait_until(lambda: len(worker._held) == 1, what="the worker holds the group")
    # Another worker takes the group over (as after a stall past the lease) and finishes it.
    [(entry_id, _)] = await redis.xrange(stream)
    await redis.xclaim(stream, Group.WORKERS, "thief", 0, [entry_id], justid=True)
    await redis.xack(stream, Group.WORKERS, entry_id)
    await wait_until(lambda: not worker._held, what="the worker drops the lost group")
    await client.submit([[2], [3]], n=1)
    results = await collect(client, 2, timeout_s=15)
    assert sorted(r.prompt_ids for r in results) == [[2], [3]]


async def test_reclaim_is_fair_across_trainers(make_client, make_worker, redis, policy):
    """Bug 3: groups passed back again and again (an unpublished min_version) by one trainer
    must not starve another trainer's lapsed group out of reclaim."""
    waiting, other = make_client("a"), make_client("b")
    await waiting.submit([[i] for i in range(8)], n=1, min_version=5)
    await other.submit([[42]], n=1)
    keys = Keys(policy)
    # b's group is held by a worker that died: its lease lapses, only reclaim can deliver it.
    stream_b = keys.work("b")
    [[_, [(entry_id, _)]]] = await redis.xreadgroup(Group.WORKERS, "dead-worker", {stream_b: ">"},
                                                     count=1)
    make_worker(max_inflight=4, lease_s=0.5)
    [result] = await collect(other, 1, timeout_s=15)
    assert result.prompt_ids == [42] and result.status == "ok"


async def test_job_ids_belong_to_their_trainer(make_client, make_worker):
    """Bug 4: the same job_id from two trainers is two jobs; neither sees the other's."""
    alice, bob = make_client("alice"), make_client("bob")
    assert await alice.submit([[1]], n=1, job_id="step-1") == "step-1"
    assert await bob.submit([[2], [3]], n=1, job_id="step-1") == "step-1"
    make_worker()
    [a] = await collect(alice, 1)
    got_b = await collect(bob, 2)
    assert a.prompt_ids == [1]
    assert sorted(r.prompt_ids for r in got_b) == [[2], [3]]
    assert (await alice.status("step-1")).groups == 1
    assert (await bob.status("step-1")).groups == 2
    carol = make_client("carol")
    for call in (carol.status("step-1"), carol.cancel("step-1"), carol.wait("step-1", timeout_s=1)):
        with pytest.raises(KeyError):
            await call


async def test_submit_against_the_operators_cap_waits_without_spinning(make_client, redis, policy):
    """Bug 5: QueueFull carries the effective cap; waiting polls gently; a job larger than the
    cap is refused at once."""
    client = make_client(max_outstanding=100)
    await redis.set(Keys(policy).quota("trainer"), 2)
    await client.submit([[1], [2]], n=1)
    with pytest.raises(QueueFull, match="quota of 2") as full:
        await client.submit([[3]], n=1, wait=False)
    assert full.value.limit == 2
    before = (await redis.info("commandstats"))["cmdstat_evalsha"]["calls"]
    started = time.monotonic()
    with pytest.raises(QueueFull):
        await client.submit([[3]], n=1, timeout_s=1.5)
    assert time.monotonic() - started >= 1.4
    scripts = (await redis.info("commandstats"))["cmdstat_evalsha"]["calls"] - before
    assert scripts <= 10, f"{scripts} enqueue scripts in 1.5 s: busy-spinning"
    started = time.monotonic()
    with pytest.raises(QueueFull, match="can never fit"):
        await client.submit([[4], [5], [6]], n=1)  # wait=True, no timeout: must not wait forever
    assert time.monotonic() - started < 1.0


async def test_completions_trainer_ids_cannot_collide_with_a_trainer():
    """Bug 7: the gateway's derived trainer id is unambiguous, whatever the trainer id's length."""
    from rollq.protocol import MAX_ID_CHARS, check_trainer_id, derived_trainer_id

    def completions_trainer(trainer, gateway):
        return check_trainer_id("trainer_id", derived_trainer_id(trainer, "completions", gateway))

    long = "t" * MAX_ID_CHARS
    derived = {completions_trainer(t, "gw1") for t in (long, long[:-1], "a", "a.completions")}
    assert len(derived) == 4
    for trainer in (long, long[:-1], "a"):
        assert completions_trainer(trainer, "gw1") != trainer
    assert completions_trainer(long, "gw1") != completions_trainer(long, "gw2")
    with pytest.raises(InvalidInput):  # no chosen id may look derived
        check_id("trainer", "a~completions~gw1")


async def test_worker_never_reclaims_a_group_it_already_holds(make_client, make_worker):
    """Suspected, proven: a worker whose renewal is late could reclaim its own held entry and
    run the group twice in two tasks (the slot count then goes wrong)."""
    client = make_client()
    worker, _ = make_worker(max_inflight=4, lease_s=1.0, delay_s=2.5)
    calls = []
    generate = worker.engine.generate_group

    async def counting(item):
        calls.append(item.group_index)
        return await generate(item)

    worker.engine.generate_group = counting

    async def late_renewals(held):  # the lease lapses while the worker still holds the group
        return []

    worker.queue.renew = late_renewals
    await client.submit([[1]], n=1)
    [result] = await collect(client, 1, timeout_s=10)
    assert result.status == "ok"
    assert calls == [0], f"the group ran {len(calls)} times"
    assert await client.take(1, timeout_s=0.5) == []


async def test_a_lost_claim_reply_does_not_burn_a_delivery(make_client, make_worker, redis):
    """Suspected, proven: when the reply to a claim (or reclaim) is lost and redis-py retries the
    read, the entries it delivered sit pending on the worker's name with nobody serving them;
    their lease lapses and the takeover counts one more delivery, so connection churn could
    dead-letter a healthy group. The worker hands such orphans back, refunded, within a lease."""
    client = make_client()
    await client.submit([[8]], n=1)
    stream = client.keys.work("trainer")
    # The reply of the worker's read is lost: the entry is delivered to it, and it never knows.
    delivered = await redis.xreadgroup(Group.WORKERS, "w-lost-reply", {stream: ">"}, count=1)
    assert delivered and delivered[0][1]
    make_worker("w-lost-reply", max_deliveries=1, lease_s=2.0)
    [result] = await collect(client, 1, timeout_s=15)
    assert result.status == "ok", result.reason


async def test_groups_only_a_pinned_worker_can_serve_survive_its_restart(make_client, make_worker):
    """Suspected, proven: while the only worker pinned to v1 restarts after a crash (its
    heartbeat expired), a follower on v3 failed `exact_version=1` groups for good. A version a
    pinned worker served recently stays servable for a grace period (a clean stop ends it at
    once): such groups wait for the worker to come back."""
    from rollq.engine.instant import InstantEngine

    client = make_client()
    pinned, running = make_worker("pinned-1", engine=InstantEngine(version=1), pinned=True,
                                  lease_s=1.0)
    make_worker(engine=InstantEngine(version=3), follow=False, lease_s=1.0)
    await client.submit([[1]], n=1, exact_version=1)
    [before] = await collect(client, 1, timeout_s=15)
    assert before.status == "ok" and before.samples[0].versions == [(1, 0)]
    async def crashed():  # a crashed worker never removes its heartbeat: it expires
        pass

    pinned.heartbeat.remove = crashed
    pinned.stop()
    pinned.stop()
    await asyncio.wait_for(running, 30)
    await client.submit([[2]], n=1, exact_version=1)
    # Past the heartbeat's expiry (3 leases): only the pinned-version mark speaks for v1 now.
    assert await client.take(1, timeout_s=5) == [], "failed while the pinned worker restarted"
    make_worker("pinned-1", engine=InstantEngine(version=1), pinned=True, lease_s=1.0)
    [after] = await collect(client, 1, timeout_s=15)
    assert after.status == "ok" and after.samples[0].versions == [(1, 0)]
