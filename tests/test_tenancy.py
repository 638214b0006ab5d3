"""One trainer, one share (issue 27, items 6 and 7): the ids rollq derives from a trainer (its
`Episodes` objects, the gateway's completions for it) count against the trainer's own quota and
fair share, and trainers with nothing queued leave the trainers set, so a claim costs the same
whatever the number of trainers ever seen. Real redis-server; the instant engine where a worker
runs (these are tests of the queue)."""

import asyncio
import logging

import pytest

from rollq.protocol import QueueFull, derived_trainer_id
from rollq.queue.keys import Keys
from rollq.queue.names import EpisodeField
from rollq.queue.prune import expire_results
from rollq.queue.work import WorkQueue

from helpers import collect, wait_until


def _derived(trainer: str, owner: str) -> str:
    return derived_trainer_id(trainer, "episodes", owner)


async def test_a_claim_shares_by_trainer_not_by_stream(redis, policy, make_client):
    """Trainer a submits through four ids (itself and three derived), b through one: a claim of
    10 takes 5 of each trainer's groups, not 8 of a's and 2 of b's."""
    for trainer in ["a", _derived("a", "x"), _derived("a", "y"), _derived("a", "z"), "b"]:
        await make_client(trainer).submit([[i + 1] for i in range(20)], n=1)
    queue = WorkQueue(redis, Keys(policy), "w1", job_ttl_s=600)
    for _ in range(3):  # whatever the rotation
        claimed = await queue.claim(await queue.streams(), 10)
        by_base = [queue.keys.trainer_of(c.stream).split("~")[0] for c in claimed]
        assert sorted(by_base) == ["a"] * 5 + ["b"] * 5


async def test_derived_ids_count_against_the_base_trainers_quota_and_cap(redis, policy, make_client):
    keys = Keys(policy)
    await redis.set(keys.quota("a"), 5)  # the operator caps a
    a, episodes = make_client("a"), make_client(_derived("a", "x"))
    await episodes.submit([[1], [2], [3]], n=1)
    with pytest.raises(QueueFull, match="trainer 'a' has 3 outstanding groups"):
        await a.submit([[4], [5], [6]], n=1, wait=False)
    await a.submit([[4], [5]], n=1)
    with pytest.raises(QueueFull, match=r"trainer 'a' \(with 'a~episodes~x'\) has 5 outstanding"):
        await episodes.submit([[7]], n=1, wait=False)
    assert [int(await redis.get(keys.outstanding(t))) for t in ("a", _derived("a", "x"))] == [5, 3]


async def test_a_derived_ids_acknowledged_results_free_the_base_trainers_quota(
        redis, policy, make_client, make_worker):
    keys = Keys(policy)
    await redis.set(keys.quota("a"), 2)
    a, episodes = make_client("a"), make_client(_derived("a", "x"))
    await episodes.submit([[1], [2]], n=1)
    make_worker()
    got = await episodes.take(2, timeout_s=20, ack="manual")
    assert len(got) == 2
    with pytest.raises(QueueFull):
        await a.submit([[3]], n=1, wait=False)  # results count until acknowledged
    await episodes.ack(got)
    assert [int(await redis.get(keys.outstanding(t))) for t in ("a", _derived("a", "x"))] == [0, 0]
    await a.submit([[3], [4]], n=1, wait=False)


async def test_episodes_objects_buy_no_larger_share_of_a_worker(redis, policy, make_client, make_worker):
    """The review's script: trainer a runs episodes through 4 `Episodes` objects, b submits plain
    groups, both keep a backlog, one worker serves them: each gets about half (a had 80 %)."""
    logging.getLogger("rollq").setLevel(logging.ERROR)
    a, b = make_client("a"), make_client("b")
    await b.submit([[1000 + i] for i in range(200)], n=1, sampling={"max_tokens": 2})
    objects = [a.episodes() for _ in range(4)]
    starts = [asyncio.create_task(ep.start([i, j], sampling={"max_tokens": 2}, episode_id=f"e{i}-{j}"))
              for i, ep in enumerate(objects) for j in range(50)]
    keys = Keys(policy)
    await wait_until(lambda: redis.get(keys.outstanding("a")), what="a's episodes queued")
    await wait_until(async_equal(redis, keys.outstanding("a"), 200), what="all 200 starts queued")
    w, task = make_worker(delay_s=0.05, max_inflight=4)
    served_b = 0
    while served_b < 40:  # well before either backlog runs out
        served_b = await redis.xlen(keys.results("b"))
        await asyncio.sleep(0.05)
    w.stop()
    w.stop()
    await asyncio.wait_for(task, 30)
    served_a = 0  # (the episodes' results are read and deleted by their routers: count the jobs)
    for i, ep in enumerate(objects):
        for j in range(50):
            running, applied = await redis.hmget(keys.episode("a", f"e{i}-{j}.0"), EpisodeField.TURN_JOB,
                                                 EpisodeField.LAST_TURN_JOB)
            job = (running or applied or b"").decode()  # the start's job id: `<id>.t0<hex>`
            served_a += int(await redis.hget(keys.job(ep._submitter.trainer_id, job), "done") or 0)
    share_b = await redis.xlen(keys.results("b")) / (served_a + await redis.xlen(keys.results("b")))
    assert 0.4 <= share_b <= 0.6, (served_a, share_b)
    for t in starts:
        t.cancel()
    await asyncio.gather(*starts, return_exceptions=True)
    for ep in objects:
        await ep.close()


def async_equal(redis, key: str, value: int):
    async def check():
        return int(await redis.get(key) or 0) == value
    return check


async def test_trainers_that_left_are_pruned_and_cost_a_claim_nothing(redis, policy, make_client,
                                                                    make_worker):
    """300 short-lived derived ids (an `Episodes` object each, used once): once idle they leave
    the trainers set with every key of theirs, and a claim reads as many streams as before."""
    keys = Keys(policy)
    make_worker(max_inflight=16)
    queue = WorkQueue(redis, keys, "probe", job_ttl_s=600)

    async def streams_a_claim_reads() -> set[str]:
        return set(await queue.streams())

    baseline = await streams_a_claim_reads()
    derived = [_derived("t", f"o{i}") for i in range(300)]
    for trainer in derived:
        await make_client(trainer).submit([[2]], n=1)
    for trainer in derived:
        c = make_client(trainer)
        await collect(c, 1, timeout_s=20)  # read and acknowledged
    await wait_until(lambda: _only(redis, keys.trainers, set()), timeout_s=30, what="derived ids pruned")
    # Result streams emptied after their trainer left the set go with the results' retention.
    assert [t for t in derived if await redis.xlen(keys.results(t))] == []  # all read
    await expire_results(redis, queue.scripts, keys, ttl_s=0, limit=1000)
    leftover = [k for t in derived for k in (keys.work(t), keys.results(t), keys.outstanding(t),
                                             keys.outstanding_bytes(t)) if await redis.exists(k)]
    assert leftover == []
    assert await streams_a_claim_reads() == baseline == set()
    # A pruned trainer that comes back is listed and served again.
    again = make_client(derived[0])
    await again.submit([[3]], n=1)
    assert len(await again.take(1, timeout_s=20)) == 1


async def _only(redis, key: str, members: set[str]) -> bool:
    return {m.decode() for m in await redis.smembers(key)} <= members


async def test_results_nobody_reads_are_dropped_and_leave_the_base_trainers_quota(
        redis, policy, make_client, make_worker):
    """An `Episodes` object that died with results unread (a fresh owner: nobody can recover
    them) must not hold its trainer's quota for good: after the retention (`job_ttl_s` since the
    last result written) they are dropped and counted off."""
    keys = Keys(policy)
    gone = make_client(_derived("a", "gone"))
    await gone.submit([[1], [2], [3]], n=1)
    await make_client("a").submit([[4]], n=1)
    make_worker()
    await wait_until(lambda: _xlen_is(redis, keys.results(_derived("a", "gone")), 3), what="3 results")
    assert int(await redis.get(keys.outstanding("a"))) == 4
    scripts = WorkQueue(redis, keys, "probe", job_ttl_s=600).scripts
    assert await expire_results(redis, scripts, keys, ttl_s=600) == 0  # within the retention: kept
    written = {keys.results(_derived("a", "gone")).encode(): b"3", keys.results("a").encode(): b"1"}
    assert await redis.hgetall(keys.results_written) == written  # (the gateway's live rates)
    dropped = await expire_results(redis, scripts, keys, ttl_s=0)
    assert dropped == 4  # a's own unread result too
    assert not await redis.hgetall(keys.results_written)  # the streams' counts went with them
    assert not await redis.exists(keys.results(_derived("a", "gone")), keys.outstanding("a"),
                                  keys.outstanding(_derived("a", "gone")))


async def _xlen_is(redis, key: str, n: int) -> bool:
    return await redis.xlen(key) == n
