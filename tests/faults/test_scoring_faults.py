"""Scored groups under faults: scorer SIGKILLs and a Redis SIGKILL + restart while two scorers
score (a reward of 0.1 s a sample). Every group reaches its trainer once, scored; nothing is
left in or pending on the scoring stream. Generation by instant-engine worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal

import scoring_fixtures
import scoring_rewards
from redis.exceptions import ResponseError

from rollq.scoring import Completion
from rollq.scoring.records import live_scorers

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
    [r] = await client.take(10, timeout_s=30)
    assert (r.status, r.reason) == ("ok", "")
