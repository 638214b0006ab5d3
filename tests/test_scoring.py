"""Scored rollouts (issue 30) through real `rollq scorer` processes and real Redis; generation by
the instant engine in a real `rollq worker` process (scoring is what is tested here)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import math
import signal
import time
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from redis.exceptions import ResponseError
from rich.console import Console
import scoring_rewards
from helpers import collect, wait_until
import scoring_fixtures

from rollq.protocol import InvalidInput
from rollq.queue.connection import connect
from rollq.queue.keys import Keys
from rollq.scoring import Completion
from rollq.scoring.pool import ChildPool
from rollq.scoring.records import JobTally, Tally, add_tally, live_scorers
from rollq.scoring.rewards import find_rewards
from rollq.scoring.scorer import Scorer
from rollq.status import policy_status, render

spawn_scorer = scoring_fixtures.spawn_scorer


async def _live(client, *ids):
    return {s.scorer_id for s in await live_scorers(client.redis, client.keys)} >= set(ids)


def _expected(name: str, result, inputs) -> list[float]:
    fn = getattr(scoring_rewards, name)
    return [fn(Completion(s.text, s.token_ids, s.finish_reason, i), inputs)
            for i, s in enumerate(result.samples)]


def _children(parent: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == parent:
                found.append(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def _settled(client, job: str, groups: int) -> None:
    """Every group counted once, and nothing left in or pending on the scoring stream."""
    status = await client.status(job)
    assert (status.ok + status.failed, status.done) == (groups, groups)
    stream = client.keys.scoring(client.trainer_id)
    assert await client.redis.xlen(stream) == 0
    assert (await client.redis.xpending(stream, "workers"))["pending"] == 0


async def test_a_scored_submit_before_any_scorer_waits_for_one_and_rewards_are_the_functions(
        make_client, spawn_worker, spawn_scorer, policy):
    """A queue takes work before its consumers start: a scored submit before any scorer is live
    is queued, generated, shown waiting to be scored (`rollq status`), and scored once a scorer
    starts (issue 43: it was refused). A reward no live scorer offers is refused only while
    a scorer started with --refuse-unoffered is live (the operator said so)."""
    client = make_client()
    spawn_worker()
    early = await client.submit([[1, 2]], n=2, reward="count", reward_inputs=[5], sampling={"max_tokens": 3})

    async def waiting():
        return [(q.trainer, q.waiting) for q in (await policy_status(client.redis, policy)).scoring] \
            == [("trainer", 1)]
    await wait_until(waiting, what="the generated group waiting for a scorer")
    shown = Console(file=io.StringIO(), width=200)
    render(await policy_status(client.redis, policy), shown)
    assert "no live scorer: 1 generated groups wait to be scored" in shown.file.getvalue()
    scorer = spawn_scorer(refuse_unoffered=True)
    [r] = await collect(client, 1, timeout_s=60)
    assert (r.job_id, r.status, r.rewards) == (early, "ok", _expected("count", r, 5))
    with pytest.raises(InvalidInput, match=r"offers 'nope'; on offer: acount \(v3\), .*count \(v7\)"):
        await client.submit([[1]], n=2, reward="nope")
    with pytest.raises(InvalidInput, match="reward_inputs.*2 entries for 3 groups"):
        await client.submit([[1], [2], [3]], n=2, reward="count", reward_inputs=[1, 2])

    sync_job = await client.submit([[i + 1, i + 2] for i in range(6)], n=3, reward="count",
                                   reward_inputs=list(range(6)), sampling={"max_tokens": 5})
    async_job = await client.submit([[i + 7] for i in range(4)], n=2, reward="acount",
                                    reward_inputs=[10, 20, 30, 40], sampling={"max_tokens": 3})
    results = await collect(client, 10, timeout_s=60)
    by_job = {job: sorted((r for r in results if r.job_id == job), key=lambda r: r.group_index)
              for job in (sync_job, async_job)}
    assert [r.group_index for r in by_job[sync_job]] == list(range(6))
    assert [r.group_index for r in by_job[async_job]] == list(range(4))
    for r in results:
        name, version, inputs = (("count", "7", r.group_index) if r.job_id == sync_job
                                 else ("acount", "3", 10 * (r.group_index + 1)))
        assert r.status == "ok" and len(r.samples) == (3 if name == "count" else 2)
        assert r.rewards == _expected("count", r, inputs) and len(set(r.rewards)) > 1  # acount's too
        assert (r.reward, r.reward_version, r.scorer_id) == (name, version, scorer.scorer_id)
        assert r.reward_errors == [] and 0 < r.reward_s < 30
    await _settled(client, sync_job, 6)
    await _settled(client, async_job, 4)
    assert not await client.take(1, timeout_s=0.5)  # delivered once


async def test_every_group_scored_exactly_once_through_a_scorer_sigkill(make_client, spawn_worker,
                                                                         spawn_scorer):
    client = make_client()
    spawn_worker(max_inflight=32)
    doomed = spawn_scorer("doomed", max_inflight=4, processes=2, lease_s=2,
                          env={"ROLLQ_TEST_SLOW_S": "5"})
    await wait_until(lambda: _live(client, "doomed"), timeout_s=60, what="the scorer's beat")
    job = await client.submit([[i + 1] for i in range(20)], n=2, reward="slow",
                              reward_inputs=list(range(20)), sampling={"max_tokens": 2})
    stream = client.keys.scoring("trainer")

    async def doomed_holds():
        try:
            info = await client.redis.xpending(stream, "workers")
        except ResponseError:  # NOGROUP: no scorer listed the stream yet
            return False
        return any(c["name"] == b"doomed" and c["pending"] >= 4 for c in info["consumers"])
    await wait_until(doomed_holds, timeout_s=30, what="the doomed scorer holding 4 groups")
    children = _children(doomed.proc.pid)
    assert children  # its reward processes, in 5 s calls
    doomed.proc.send_signal(signal.SIGKILL)
    doomed.proc.wait(10)
    await wait_until(lambda: not any(_running(pid) for pid in children), timeout_s=3,
                     what="the killed scorer's reward processes to die with it")
    survivor = spawn_scorer("survivor", max_inflight=8, processes=2, lease_s=2,
                            env={"ROLLQ_TEST_SLOW_S": "0.01"})
    results = await collect(client, 20, timeout_s=90)
    assert Counter(r.group_index for r in results) == Counter(range(20))
    assert {(r.status, r.scorer_id) for r in results} == {("ok", survivor.scorer_id)}
    for r in results:
        assert r.rewards == _expected("count", r, r.group_index)
    await _settled(client, job, 20)
    assert not await client.take(1, timeout_s=0.5)


async def test_raising_hanging_and_memory_hungry_rewards_leave_the_scorer_alive(
        make_client, spawn_worker, spawn_scorer):
    client = make_client()
    spawn_worker()
    scorer = spawn_scorer(processes=2, lease_s=3)  # beats every second
    await wait_until(lambda: _live(client, scorer.scorer_id), timeout_s=60, what="the scorer's beat")
    jobs = {name: await client.submit([[5]], n=2, reward=name, sampling={"max_tokens": 2})
            for name in ("boom", "hang", "hog")}
    failing = await client.submit([[6]], n=2, reward="boom", reward_errors="fail", sampling={"max_tokens": 2})
    by_job = {r.job_id: r for r in await collect(client, 4, timeout_s=60)}

    boom, hang, hog = (by_job[jobs[name]] for name in ("boom", "hang", "hog"))
    assert (boom.status, boom.rewards) == ("ok", [1.0, None])
    assert boom.reward_errors == ["", "ValueError: no answer found in sample 1"]
    assert (hang.status, hang.rewards, hang.reward_errors) == ("ok", [None, 1.0], ["timed out after 1 s", ""])
    assert (hog.status, hog.rewards) == ("ok", [None, 1.0])
    assert hog.reward_errors[0].startswith("MemoryError: the call needed more than 64 MB")
    failed = by_job[failing]
    assert failed.status == "failed" and len(failed.samples) == 2
    assert failed.reason == "reward 'boom' failed on sample 1: ValueError: no answer found in sample 1"
    assert (await client.status(failing)).failed == 1

    # Still alive, and still scoring: its pool replaced the child the timeout killed.
    assert scorer.proc.poll() is None
    job = await client.submit([[7]], n=2, reward="count", reward_inputs=[3])
    [r] = await collect(client, 1, timeout_s=30)
    assert (r.job_id, r.rewards) == (job, _expected("count", r, 3))

    async def counted():
        [state] = await live_scorers(client.redis, client.keys)
        return state.restarts >= 1 and state.reward_errors == 4 and state.scored == 5
    await wait_until(counted, what="the scorer's beat counting the errors and the restart")


async def test_dynamic_sampling_delivers_only_mixed_groups_and_counts_the_rest(
        make_client, spawn_worker, spawn_scorer):
    client = make_client()
    spawn_worker()
    scorer = spawn_scorer()
    await wait_until(lambda: _live(client, scorer.scorer_id), timeout_s=60, what="the scorer's beat")
    with pytest.raises(InvalidInput, match="dynamic_sampling: needs n >= 2"):
        await client.submit([[1]], n=1, reward="same_if", dynamic_sampling=1)
    inputs = ["same"] * 4 + ["varied"] * 6
    job = await client.submit([[i + 1] for i in range(10)], n=2, reward="same_if", reward_inputs=inputs,
                              dynamic_sampling=2, sampling={"max_tokens": 2})
    once = await client.submit([[1], [2]], n=2, reward="same_if", reward_inputs=["same", "varied"],
                               dynamic_sampling=0, sampling={"max_tokens": 2})
    results = await collect(client, 12, timeout_s=60)
    by = {(r.job_id, r.group_index): r for r in results}
    assert len(by) == 12
    for g in range(10):
        r = by[job, g]
        if g < 4:
            assert (r.status, r.samples, r.rewards) == ("filtered", [], [1.0, 1.0])
            assert r.reason == "rewards all equal (1) after 2 regeneration(s): filtered (dynamic sampling)"
        else:
            assert (r.status, r.rewards, len(r.samples)) == ("ok", [0.0, 1.0], 2)
    status = await client.status(job)
    assert (status.ok, status.filtered, status.resampled, status.done) == (6, 4, 8, 10)
    status = await client.status(once)
    assert (by[once, 0].status, by[once, 1].status) == ("filtered", "ok")
    assert (status.ok, status.filtered, status.resampled, status.done) == (1, 1, 0, 2)
    assert not await client.take(1, timeout_s=0.5)


async def test_a_malformed_scoring_entry_is_dead_lettered_and_a_cancelled_job_ends_cancelled(
        make_client, spawn_worker, spawn_scorer, tmp_path):
    client = make_client()
    spawn_worker()
    started = tmp_path / "rewards-started"
    started.mkdir()
    scorer = spawn_scorer(max_inflight=1, processes=1,
                          env={"ROLLQ_TEST_SLOW_S": "2", "ROLLQ_TEST_STARTED_DIR": str(started)})
    await wait_until(lambda: _live(client, scorer.scorer_id), timeout_s=60, what="the scorer's beat")
    job = await client.submit([[1], [2]], n=2, reward="slow", reward_inputs=[0, 1],
                              sampling={"max_tokens": 2})
    stream = client.keys.scoring("trainer")

    # The cancel must land while the first group's reward runs: the scorer reads the job's state
    # after its claim, so a group merely claimed (pending) may still see the cancel and end
    # `cancelled` (failed that way under load when the test waited for the claim alone).
    async def one_scoring_one_waiting():
        try:
            return any(started.iterdir()) and await client.redis.xlen(stream) == 2
        except ResponseError:
            return False
    await wait_until(one_scoring_one_waiting, what="the scorer scoring one group, the other waiting")
    assert await client.cancel(job) == 2
    await client.redis.xadd(stream, {"d": b"not a score item"})
    results = sorted(await collect(client, 3, timeout_s=60), key=lambda r: r.group_index)
    assert [(r.job_id, r.group_index) for r in results] == [("", -1), (job, 0), (job, 1)]
    junk, first, second = results
    assert junk.status == "failed" and junk.reason.startswith("scoring entry does not decode")
    assert (first.status, second.status) == ("ok", "cancelled")  # scored before the cancel, after
    assert (second.samples, second.reason) == ([], "job cancelled")  # as every cancelled result
    [(_, dead)] = await client.redis.xrange(client.keys.dead)
    assert dead[b"stream"].decode() == stream and dead[b"item"] == b"not a score item"
    status = await client.status(job)
    assert (status.ok, status.cancelled, status.done) == (1, 1, 2)
    assert scorer.proc.poll() is None


async def test_over_sampling_delivers_exactly_k_and_cancels_the_rest(make_client, spawn_worker,
                                                                     spawn_scorer):
    client = make_client()
    spawn_worker(instant_delay_s=0.3, max_inflight=4, lease_s=3)  # most groups wait or run
    scorer = spawn_scorer(lease_s=3)
    await wait_until(lambda: _live(client, scorer.scorer_id), timeout_s=60, what="the scorer's beat")
    with pytest.raises(InvalidInput, match=r"deliver: 11 must be an integer in \[1, 10\]"):
        await client.submit([[i + 1] for i in range(10)], n=2, reward="count", deliver=11)
    job = await client.submit([[i + 1] for i in range(10)], n=2, reward="count",
                              reward_inputs=list(range(10)), deliver=3, sampling={"max_tokens": 2})
    every = await client.submit([[i + 1] for i in range(2)], n=2, reward="count",
                                reward_inputs=[0, 1], deliver=2, sampling={"max_tokens": 2})
    results = await collect(client, 12, timeout_s=60)
    assert sorted(r.group_index for r in results if r.job_id == job) == list(range(10))
    ok = [r for r in results if r.status == "ok" and r.job_id == job]
    assert len(ok) == 3 and {r.status for r in results} == {"ok", "cancelled"}
    for r in ok:
        assert r.rewards == _expected("count", r, r.group_index)
    assert all(r.samples == [] for r in results if r.status == "cancelled")
    # It delivered all it was asked: `done`, as a trainer waiting for its jobs expects (issue 43:
    # it ended `cancelled`, also with deliver = groups), its other groups `cancelled`.
    status = await client.status(job)
    assert (status.state, status.ok, status.cancelled, status.done) == ("done", 3, 7, 10)
    status = await client.status(every)
    assert (status.state, status.ok, status.done) == ("done", 2, 2)
    assert await client.redis.hlen(client.keys.picked("trainer", job)) == 3
    assert not await client.take(1, timeout_s=0.5)


async def test_sigterm_hands_held_groups_back_at_once(make_client, spawn_worker, spawn_scorer):
    client = make_client()
    spawn_worker()
    leaving = spawn_scorer(max_inflight=2, lease_s=60, grace_s=0.5, env={"ROLLQ_TEST_SLOW_S": "30"})
    await wait_until(lambda: _live(client, leaving.scorer_id), timeout_s=60, what="the scorer's beat")
    job = await client.submit([[1], [2]], n=2, reward="slow", reward_inputs=[0, 1],
                              sampling={"max_tokens": 2})
    stream = client.keys.scoring("trainer")

    async def both_held():
        try:
            return (await client.redis.xpending(stream, "workers"))["pending"] == 2
        except ResponseError:
            return False
    await wait_until(both_held, what="the scorer holding both groups")
    leaving.proc.send_signal(signal.SIGTERM)
    assert await asyncio.to_thread(leaving.proc.wait, 30) == 0
    assert not await live_scorers(client.redis, client.keys)  # its record is gone with it
    # Handed back, not left to lapse (a 60 s lease): another scorer takes them at once.
    spawn_scorer(lease_s=60, env={"ROLLQ_TEST_SLOW_S": "0"})
    results = await collect(client, 2, timeout_s=20)
    assert sorted((r.job_id, r.group_index, r.status) for r in results) == [(job, 0, "ok"), (job, 1, "ok")]


async def test_a_lease_renewal_that_overlaps_a_requeue_leaves_the_scorer_scoring(
        make_client, make_worker, redis_url, policy, caplog):
    """Dynamic sampling's requeue takes a held entry off the scorer's pending list, as a finish
    and a hand-back do: a renewal whose round trip overlaps it must leave the requeue's own
    reply to decide (issue 43: it took the requeue for a take-over, looked the ended group up
    and the KeyError ended the scorer within seconds). In process, so that every renewal can
    be slowed by 50 ms (a slow network), which makes the overlap certain at a 1 s lease."""
    make_worker(max_inflight=16)
    redis = connect(redis_url)
    scorer = Scorer(redis, Keys(policy), find_rewards(scoring_fixtures.REWARDS),
                    ChildPool(scoring_fixtures.REWARDS, 1), scorer_id="s-renew", lease_s=1.0,
                    max_inflight=16)
    renew = scorer.queue.renew

    async def slow_renew(held):
        await asyncio.sleep(0.05)
        return await renew(held)
    scorer.queue.renew = slow_renew
    caplog.set_level(logging.WARNING, logger="rollq.scorer")
    running = asyncio.create_task(scorer.run())
    try:
        client = make_client()
        await wait_until(lambda: _live(client, "s-renew"), timeout_s=60, what="the scorer's beat")
        jobs = [await client.submit([[j + 1, g + 1] for g in range(10)], n=2, reward="same_if",
                                    reward_inputs=["same"] * 10, dynamic_sampling=3,
                                    sampling={"max_tokens": 2}) for j in range(4)]
        taking = asyncio.create_task(collect(client, 40, timeout_s=90))
        await asyncio.wait([taking, running], return_when=asyncio.FIRST_COMPLETED)
        if running.done():
            taking.cancel()
            await asyncio.gather(taking, return_exceptions=True)
            pytest.fail(f"the scorer ended: {running.exception()!r}")
        results = await taking
        assert Counter((r.job_id, r.group_index, r.status) for r in results) == Counter(
            (job, g, "filtered") for job in jobs for g in range(10))
        for job in jobs:
            status = await client.status(job)
            assert (status.filtered, status.resampled, status.done) == (10, 30, 10)
        assert not [r.getMessage() for r in caplog.records if "taken over" in r.getMessage()]
    finally:
        scorer.stop()
        await asyncio.wait_for(asyncio.gather(running, return_exceptions=True), 30)
        await redis.aclose()


async def test_a_non_finite_reward_is_an_error_with_its_reason_sync_and_async_alike(
        make_client, spawn_worker, spawn_scorer):
    """NaN and infinities are no rewards (no advantage comes from them): the sample gets None and
    the reason, and `reward_errors="fail"` fails the group, whether the reward runs in a child
    (JSON wrote NaN as null: None with no reason, not counted) or in the scorer's loop (NaN
    went to the trainer). Issue 43. 1e308 is finite: delivered as is."""
    client = make_client()
    spawn_worker()
    scorer = spawn_scorer(processes=1, lease_s=3)  # beats every second
    await wait_until(lambda: _live(client, scorer.scorer_id), timeout_s=60, what="the scorer's beat")
    cases = [(name, value, on_error) for name in ("weight", "aweight")
             for value, on_error in (("nan", "skip"), ("inf", "skip"), ("-inf", "fail"), ("1e308", "fail"))]
    jobs = {await client.submit([[3, 4]], n=2, reward=name, reward_inputs=[value], reward_errors=on_error,
                                sampling={"max_tokens": 2}): (name, value, on_error)
            for name, value, on_error in cases}
    by_case = {jobs[r.job_id]: r for r in await collect(client, len(cases), timeout_s=60)}
    for (name, value, on_error), r in by_case.items():
        if value == "1e308":
            assert (r.status, r.rewards, r.reward_errors) == ("ok", [1e308, 0.5], [])
            continue
        why = f"ValueError: returned {float(value)!r}: a reward must be a finite number"
        assert (r.rewards, r.reward_errors) == ([None, 0.5], [why, ""]), (name, value)
        if on_error == "fail":
            assert (r.status, r.reason) == ("failed", f"reward {name!r} failed on sample 0: {why}")
        else:
            assert r.status == "ok"

    async def counted():
        [state] = await live_scorers(client.redis, client.keys)
        return state.reward_errors == 6 and state.scored == 8
    await wait_until(counted, what="the scorer's beat counting six reward errors")



def _strict_json(body: str):
    """What a browser's JSON.parse accepts: no NaN, Infinity or -Infinity."""
    def refuse(word):
        raise ValueError(f"{word} in the JSON")
    return json.loads(body, parse_constant=refuse)


async def test_the_dashboard_is_valid_json_whatever_the_tallies_hold(make_gateway, make_client, policy):
    """Tallies of non-finite sums (an older scorer's NaN, or two rewards of 1e308 whose sum
    overflows) read back at the gateway's start and as they come: /api/dashboard stays JSON a
    browser parses, the figures that are not numbers shown as null (issue 43: one NaN broke the
    dashboard for every observer of every policy, also after a gateway restart)."""
    client = make_client()  # (its Redis connection adds the tallies)
    bad = [JobTally("nan", "j1", {"ok": 1}, rewards=2, total=math.nan, squares=math.nan, scored=1,
                    reward_s=math.nan),
           JobTally("big", "j2", {"ok": 1}, rewards=2, total=1e308 * 2, squares=math.inf, scored=1,
                    reward_s=0.01)]
    buckets = [0] * 15
    await add_tally(client.redis, client.keys, Tally("old-scorer", time.time() - 60, bad, buckets))
    gw = await make_gateway(policies=[policy])
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        async def scoring():
            async with http.get("/api/dashboard") as r:
                assert r.status == 200
                found = _strict_json(await r.text())["policies"].get(policy)
            return found and found["scoring"]

        async def shows(*trainers):
            found = await scoring()
            return bool(found) and set(trainers) <= set(found["series"]["rewards"]) | set(found["trainers"])
        await wait_until(lambda: shows("nan", "big"), what="the tallies read back")
        # As they come, in the per-second series too.
        await add_tally(client.redis, client.keys, Tally("s", time.time(), bad, buckets))

        async def shows_live():
            found = await scoring()
            return {"nan", "big"} <= set(found["series"]["rewards"])
        await wait_until(shows_live, what="the new tallies in the series")
        found = await scoring()
        async with http.get("/metrics") as r:  # Prometheus' text has NaN and +Inf: written as such
            assert r.status == 200
            assert f'rollq_reward_stddev{{policy="{policy}",trainer="nan"}} NaN' in await r.text()
    figures = found["trainers"]
    assert (figures["nan"]["mean"], figures["nan"]["std"], figures["nan"]["rewards"]) == (None, None, 4)
    assert (figures["big"]["mean"], figures["big"]["std"]) == (None, None)
    assert set(found["series"]["rewards"]["nan"]["mean"]) == {None}


async def test_a_scorer_started_while_redis_is_away_waits_for_it(tmp_path, policy):
    """`rollq chaos` restarts a killed scorer, sometimes while Redis restarts too: its first beat
    must wait for Redis, as a worker's claims do (it exited with 1, ConnectionError, before the
    fix of f80e087; seen failing with that retry loop removed)."""
    from rollq.harness.faults import RedisProcess

    server = RedisProcess(tmp_path / "redis", aof=False)  # its port reserved, not started yet
    redis = connect(server.url)
    scorer = Scorer(redis, Keys(policy), find_rewards(scoring_fixtures.REWARDS),
                    ChildPool(scoring_fixtures.REWARDS, 1), scorer_id="s-early", lease_s=5.0)
    running = asyncio.create_task(scorer.run())
    try:
        await asyncio.sleep(1.5)  # several tries of its first beat
        assert not running.done(), running.exception()
        server.start()
        async def beating():
            return "s-early" in {s.scorer_id for s in await live_scorers(redis, Keys(policy))}

        await wait_until(beating, timeout_s=20, what="the scorer's first beat")
    finally:
        scorer.stop()
        await asyncio.wait_for(asyncio.gather(running, return_exceptions=True), 30)
        await redis.aclose()
        server.stop()

