"""Scored groups under faults: scorer SIGKILLs and a Redis SIGKILL + restart while two scorers
score (a reward of 0.1 s a sample), one group's lease lapsing four times, and a scorer's lost
replies (its read's, its finish's). Every group reaches its trainer once, scored; nothing is left
in or pending on the scoring stream. Generation by instant-engine workers."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal

import pytest
import scoring_fixtures
import scoring_rewards
from redis.exceptions import ResponseError

from helpers import drop_a_reply
from rollq.queue.connection import connect
from rollq.queue.keys import Keys
from rollq.scoring import Completion
from rollq.scoring.pool import ChildPool
from rollq.scoring.rewards import find_rewards
from rollq.scoring.records import live_scorers
from rollq.scoring.scorer import Scorer

spawn_scorer = scoring_fixtures.spawn_scorer


async def take_scored(client, expected: int, timeout_s: float) -> dict[int, list]:
    """Every result read until `expected` distinct groups arrived (and 2 s more, for any
    duplicate), by group index."""
    seen: dict[int, list] = {}
    give_up = asyncio.get_running_loop().time() + timeout_s
    while len(seen) < expected and asyncio.get_running_loop().time() < give_up:
        for r in await client.take(1000, timeout_s=1.0):
            seen.setdefault(r.group_index, []).append(r)
    for r in await client.take(1000, timeout_s=2.0):
        seen.setdefault(r.group_index, []).append(r)
    return seen


SCORER = dict(lease_s=2, max_inflight=8, processes=2, env={"ROLLQ_TEST_SLOW_S": "0.1"})


async def test_scorer_sigkills_and_a_redis_restart_score_every_group_once(
        durable_redis, make_client, spawn_worker, spawn_scorer, redis, policy):
    for _ in range(2):
        spawn_worker(instant_delay_s=0.0, lease_s=2.0, max_inflight=32)
    scorers = [spawn_scorer(**SCORER) for _ in range(2)]
    client = make_client(max_outstanding=10_000)

    async def two_live():
        return len(await live_scorers(client.redis, client.keys)) == 2
    while not await two_live():
        await asyncio.sleep(0.1)
    groups = 400
    await client.submit([[i + 1] for i in range(groups)], n=2, sampling={"max_tokens": 2}, job_id="scored",
                        reward="slow", reward_inputs=list(range(groups)))
    reading = asyncio.create_task(take_scored(client, groups, timeout_s=240))
    for fault in ("kill", "redis", "kill", "kill"):
        await asyncio.sleep(random.uniform(1.0, 2.5))
        assert not reading.done(), "every group was scored before this fault"
        if fault == "redis":
            await asyncio.to_thread(durable_redis.restart, 3.0)
            continue
        victim = scorers.pop(random.randrange(len(scorers)))
        victim.proc.send_signal(signal.SIGKILL)
        scorers.append(spawn_scorer(**SCORER))
    seen = await reading
    assert sorted(seen) == list(range(groups))
    assert [g for g, copies in seen.items() if len(copies) > 1] == []
    for g, [r] in seen.items():
        assert r.status == "ok", (g, r.status, r.reason)
        assert r.rewards == [scoring_rewards.count(Completion(s.text, s.token_ids, s.finish_reason, i), g)
                             for i, s in enumerate(r.samples)]
    status = await client.status("scored")
    assert (status.ok, status.done) == (groups, groups)
    stream = client.keys.scoring("trainer")
    assert await redis.xlen(stream) == 0
    assert (await redis.xpending(stream, "workers"))["pending"] == 0


async def test_a_group_outlives_four_lapsed_leases(make_client, spawn_worker, spawn_scorer, redis):
    """The previous test's faults, all landing on one group: its lease lapses four times (three
    holders SIGKILLed and a Redis restart, which lapses a held lease when another scorer reclaims
    it before its holder renews; here four kills, which always lapse it). A reward cannot take a
    scorer down (it runs in a child process or under a timeout), so these lapses are the pool's
    faults, not the group's: the fifth delivery still scores it (generation's cap is 3)."""
    spawn_worker(instant_delay_s=0.0, lease_s=2.0)
    client = make_client()
    stream = client.keys.scoring("trainer")
    holding = dict(SCORER, env={"ROLLQ_TEST_SLOW_S": "600"})  # a victim never finishes the group

    async def delivered(times: int) -> None:
        give_up = asyncio.get_running_loop().time() + 60
        while asyncio.get_running_loop().time() < give_up:
            pending = []
            with contextlib.suppress(ResponseError):  # NOGROUP: no group finished generating yet
                pending = await redis.xpending_range(stream, "workers", "-", "+", 1)
            if pending and pending[0]["times_delivered"] >= times:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"the group was not delivered {times} times")

    victim = spawn_scorer(**holding)
    while not await live_scorers(client.redis, client.keys):
        await asyncio.sleep(0.1)
    await client.submit([[1]], n=2, sampling={"max_tokens": 2}, job_id="scored", reward="slow",
                        reward_inputs=[0])
    for kill in range(4):
        victim = victim or spawn_scorer(**holding)
        await delivered(kill + 1)
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait()
        victim = None
    spawn_scorer(**SCORER)
    [r] = await client.take(1, timeout_s=30)
    assert (r.status, r.reason) == ("ok", "")


@pytest.fixture
async def run_scorer(redis_url, policy):
    """create(scorer_id, **Scorer settings) -> an in-process Scorer, running (its Redis client is
    `scorer.redis`, for a test to drop a reply on); stopped at teardown."""
    made: list[tuple[Scorer, asyncio.Task]] = []

    def create(scorer_id: str, **settings) -> Scorer:
        rewards = find_rewards(scoring_fixtures.REWARDS)
        scorer = Scorer(connect(redis_url), Keys(policy), rewards, ChildPool(scoring_fixtures.REWARDS, 1),
                        scorer_id=scorer_id, **settings)
        made.append((scorer, asyncio.create_task(scorer.run())))
        return scorer

    yield create
    for scorer, task in made:
        scorer.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 15)
        await scorer.redis.aclose()


async def score_one(client, inputs: int):
    """One group of job `scored` (reward "count"), submitted once a scorer is live: its result."""
    while not await live_scorers(client.redis, client.keys):
        await asyncio.sleep(0.1)
    await client.submit([[3]], n=2, sampling={"max_tokens": 2}, job_id="scored", reward="count",
                        reward_inputs=[inputs])
    [r] = await client.take(1, timeout_s=30)
    return r


async def test_a_lost_claim_reply_does_not_burn_a_scoring_delivery(make_client, make_worker, run_scorer,
                                                                   monkeypatch):
    """The scorer's read whose reply was lost delivered the group to its name, and redis-py's retry
    read nothing: the group is handed back refunded within a lease, as a worker's is (with one
    delivery allowed, a lapse would fail it)."""
    make_worker(lease_s=2.0)
    client = make_client()
    scorer = run_scorer("s-lost-read", max_deliveries=1, lease_s=2.0)
    claim, dropped = scorer.queue.claim, []

    async def a_read_whose_reply_was_lost(*args, **kwargs):
        got = await claim(*args, **kwargs)
        if got and not dropped:  # delivered to its name in Redis; the retry's reply: nothing
            dropped.extend(got)
            return []
        return got

    monkeypatch.setattr(scorer.queue, "claim", a_read_whose_reply_was_lost)
    r = await score_one(client, inputs=5)
    assert dropped, "no read reply was dropped: this tested nothing"
    assert (r.status, r.reason) == ("ok", "")
    assert r.rewards == [scoring_rewards.count(Completion(s.text, s.token_ids, s.finish_reason, i), 5)
                         for i, s in enumerate(r.samples)]
    assert await client.take(10, timeout_s=1.0) == []


async def test_a_lost_finish_reply_writes_the_scored_group_once(make_client, make_worker, run_scorer,
                                                                monkeypatch, redis):
    """The finish script ran (the result written, the entry acked) and its reply was lost:
    redis-py sends it again, and the fence makes the second a no-op: one result, counted once."""
    make_worker(lease_s=2.0)
    client = make_client()
    scorer = run_scorer("s-lost-finish", lease_s=2.0)
    dropped = drop_a_reply(monkeypatch, scorer.redis, "EVALSHA")
    r = await score_one(client, inputs=6)
    assert dropped, "no script reply was dropped: this tested nothing"
    assert (r.status, r.reason) == ("ok", "")
    assert await client.take(10, timeout_s=1.0) == []
    status = await client.status("scored")
    assert (status.ok, status.done) == (1, 1)
    stream = client.keys.scoring("trainer")
    assert (await redis.xpending(stream, "workers"))["pending"] == 0
