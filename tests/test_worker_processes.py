"""`rollq worker` processes on the instant engine: throughput, fairness, kills, stops, shutdown."""

import asyncio
import signal
from collections import Counter

from helpers import collect, wait_until

from rollq.engine.instant import expected_tokens


async def test_1000_groups_from_3_trainers_through_2_workers(make_client, spawn_worker):
    trainers = {name: make_client(name) for name in ("alice", "bob", "carol")}
    for _ in range(2):
        spawn_worker(max_inflight=16)
    sizes = {"alice": [100, 100, 134], "bob": [111, 111, 111], "carol": [333]}  # 1,000 groups
    jobs = {}
    for name, client in trainers.items():
        jobs[name] = [
            await client.submit([[len(name), step, i] for i in range(size)], n=2,
                                sampling={"max_tokens": 3})
            for step, size in enumerate(sizes[name])
        ]
    total = 0
    for name, client in trainers.items():
        results = await collect(client, sum(sizes[name]), timeout_s=120)
        total += len(results)
        keys = Counter((r.job_id, r.group_index) for r in results)
        assert max(keys.values()) == 1, "a group arrived twice"
        assert {j for j, _ in keys} == set(jobs[name]), "a result arrived on another trainer's stream"
        for r in results:
            assert r.status == "ok"
            assert r.samples[1].token_ids == expected_tokens(r.prompt, 1, 3, 32_000)
        assert await client.take(1, timeout_s=0.3) == []
    assert total == 1000


async def test_small_trainer_is_not_starved_by_a_backlog(make_client, spawn_worker):
    big, small = make_client("big"), make_client("small")
    for _ in range(2):
        spawn_worker(max_inflight=4, instant_delay_s=0.02)
    backlog = await big.submit([[1, i] for i in range(5000)], n=1, sampling={"max_tokens": 1})
    await wait_until(lambda: _done(big, backlog, 1), what="workers busy with the backlog")
    quick = await small.submit([[2, i] for i in range(10)], n=1, sampling={"max_tokens": 1})
    await small.wait(quick, timeout_s=60)
    done_of_backlog = (await big.status(backlog)).done
    assert done_of_backlog < 2500, f"the small job waited for {done_of_backlog} of 5000"


async def _done(client, job, at_least):
    return (await client.status(job)).done >= at_least


async def test_sigkilled_worker_groups_are_finished_by_the_other(make_client, spawn_worker):
    client = make_client()
    doomed = spawn_worker("doomed", max_inflight=8, instant_delay_s=1.0, lease_s=2)
    job = await client.submit([[i + 1] for i in range(60)], n=2, sampling={"max_tokens": 2})
    stream = client.keys.work("trainer")
    await wait_until(lambda: _pending_of(client, stream, "doomed", 8), what="doomed holds 8")
    doomed.signal(signal.SIGKILL)
    doomed.wait()
    spawn_worker("survivor", max_inflight=16, instant_delay_s=0.05, lease_s=2)
    results = await collect(client, 60, timeout_s=60)
    assert Counter(r.group_index for r in results) == Counter(range(60))
    assert {r.status for r in results} == {"ok"}
    by = Counter(r.worker_id for r in results)
    assert by["survivor"] >= 8 and by["survivor"] + by["doomed"] == 60
    assert (await client.status(job)).ok == 60
    assert await client.redis.xlen(stream) == 0  # nothing left pending


async def _pending_of(client, stream, consumer, count):
    info = await client.redis.xpending(stream, "workers")
    owners = {c["name"].decode(): c["pending"] for c in info["consumers"]}
    return owners.get(consumer, 0) >= count


async def test_stopped_worker_cannot_write_after_its_lease_was_taken(make_client, spawn_worker):
    client = make_client()
    sleeper = spawn_worker("sleeper", max_inflight=4, instant_delay_s=2.0, lease_s=1)
    await client.submit([[i + 1] for i in range(4)], n=1)
    stream = client.keys.work("trainer")
    await wait_until(lambda: _pending_of(client, stream, "sleeper", 4), what="sleeper holds 4")
    sleeper.signal(signal.SIGSTOP)
    await asyncio.sleep(1.5)  # past the lease
    spawn_worker("taker", max_inflight=4, instant_delay_s=0.5, lease_s=1)
    await wait_until(lambda: _pending_of(client, stream, "taker", 4), what="taker took over")
    sleeper.signal(signal.SIGCONT)  # wakes with its generation done and tries to finish
    results = await collect(client, 4, timeout_s=30)
    assert {r.worker_id for r in results} == {"taker"}
    assert Counter(r.group_index for r in results) == Counter(range(4))
    await asyncio.sleep(2.5)
    assert await client.take(1, timeout_s=0.5) == []
    assert "taken over" in sleeper.log or "result not written (lost)" in sleeper.log


async def test_sigterm_finishes_in_flight_then_hands_back_the_rest(make_client, spawn_worker):
    client = make_client()
    leaving = spawn_worker("leaving", max_inflight=4, instant_delay_s=3.0, lease_s=60, grace_s=0.5)
    await client.submit([[i + 1] for i in range(4)], n=1)
    stream = client.keys.work("trainer")
    await wait_until(lambda: _pending_of(client, stream, "leaving", 4), what="leaving holds 4")
    leaving.signal(signal.SIGTERM)
    assert leaving.wait(timeout_s=15) == 0
    assert "handed back 4 of 4 groups" in leaving.log
    spawn_worker("staying", max_inflight=4, lease_s=60)
    # Taken at once, not after the 60 s lease.
    results = await collect(client, 4, timeout_s=15)
    assert {r.worker_id for r in results} == {"staying"}


async def test_sigterm_with_time_to_finish_writes_results_itself(make_client, spawn_worker):
    client = make_client()
    leaving = spawn_worker("leaving", max_inflight=4, instant_delay_s=1.0, grace_s=10)
    await client.submit([[i + 1] for i in range(4)], n=1)
    stream = client.keys.work("trainer")
    await wait_until(lambda: _pending_of(client, stream, "leaving", 4), what="leaving holds 4")
    leaving.signal(signal.SIGTERM)
    assert leaving.wait(timeout_s=15) == 0
    results = await collect(client, 4, timeout_s=5)
    assert {r.worker_id for r in results} == {"leaving"}
