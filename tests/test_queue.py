"""Queue transitions against a real redis-server, with in-process workers on the instant engine."""

import asyncio
import os
import sys

import msgspec
import pytest
from helpers import collect, wait_until

from rollq.engine.instant import FAIL_TOKEN, expected_tokens
from rollq.protocol import InvalidInput, QueueFull, Sampling, WorkItem, encode, pack_tokens
from rollq.queue.keys import Keys
from rollq.queue.work import WorkQueue

PROMPTS = [[1, 2, 3], [4, 5], [6]]


async def test_results_match_their_prompts_and_arrive_once(make_client, make_worker):
    client = make_client()
    make_worker()
    job = await client.submit(PROMPTS, n=3, sampling={"max_tokens": 4}, meta={"step": 7})
    results = await collect(client, 3)
    assert sorted(r.group_index for r in results) == [0, 1, 2]
    for r in results:
        assert r.status == "ok" and r.job_id == job
        assert r.prompt_ids == PROMPTS[r.group_index]
        assert [s.token_ids for s in r.samples] == [
            expected_tokens(r.prompt, i, 4, 32_000) for i in range(3)]
    status = await client.wait(job, timeout_s=5)
    assert (status.state, status.done, status.ok, status.meta) == ("done", 3, 3, {"step": 7})
    assert await client.take(1, timeout_s=0.3) == []
    assert await client.outstanding() == 0


async def test_submit_of_256_prompts_of_512_tokens_is_one_round_trip(make_client, redis):
    client = make_client()
    await client.submit([[1]], n=1)  # loads the script once
    sent = []
    original = client.redis.execute_command

    async def counting(*args, **kwargs):
        sent.append(args[0])
        return await original(*args, **kwargs)

    client.redis.execute_command = counting
    before = await redis.info("commandstats")
    await client.submit([[7] * 512 for _ in range(256)], n=8, sampling={"max_tokens": 64})
    after = await redis.info("commandstats")
    assert sent == ["EVALSHA"]
    # Server side: one more script call; the 256 XADDs ran inside it.
    assert after["cmdstat_evalsha"]["calls"] - before["cmdstat_evalsha"]["calls"] == 1
    assert after["cmdstat_xadd"]["calls"] - before.get("cmdstat_xadd", {"calls": 0})["calls"] == 256
    assert await redis.xlen(client.keys.work("trainer")) == 1 + 256


async def test_idempotent_submit_with_job_id(make_client, make_worker, redis):
    client = make_client()
    first = await client.submit(PROMPTS, n=2, job_id="step-1")
    again = await client.submit(PROMPTS, n=2, job_id="step-1")
    assert first == again == "step-1"
    assert await redis.xlen(client.keys.work("trainer")) == 3
    make_worker()
    await collect(client, 3)
    assert await client.take(1, timeout_s=0.5) == []


async def test_trl_style_repeated_prompts_become_groups(make_client, make_worker):
    client = make_client()
    make_worker()
    await client.submit([[1, 2]] * 4 + [[3]] * 4, n=4, repeated=True)
    results = await collect(client, 2)
    assert sorted(r.prompt_ids for r in results) == [[1, 2], [3]]
    assert all(len(r.samples) == 4 for r in results)
    with pytest.raises(InvalidInput, match=r"prompts\[5\].*differs from prompts\[4\]"):
        await client.submit([[1]] * 4 + [[2]] + [[3]] * 3, n=4, repeated=True)
    with pytest.raises(InvalidInput, match="not a multiple of n=4"):
        await client.submit([[1]] * 6, n=4, repeated=True)


@pytest.mark.parametrize("prompts, n, sampling, field, limit", [
    ([[1]], 0, None, "n", "between 1 and 1024"),
    ([[1] * 131_073], 1, None, "prompts[0]", "the limit is 131072"),
    ([[1], []], 1, None, "prompts[1]", "at least one token"),
    ([[1], [2**40]], 1, None, "prompts[1]", "int32"),
    ([], 1, None, "prompts", "empty"),
    ([[1]], 1, {"max_tokens": -1}, "sampling.max_tokens", "between 1 and 131072"),
    ([[1]], 1, {"top_k": "big"}, "sampling", "sampling.top_k"),
])
async def test_client_validation_names_field_and_limit(make_client, prompts, n, sampling, field,
                                                       limit):
    client = make_client()
    with pytest.raises(InvalidInput) as e:
        await client.submit(prompts, n=n, sampling=sampling)
    assert e.value.field == field and limit in str(e.value)
    assert await client.outstanding() == 0


async def test_quota_raises_or_waits_for_room(make_client, make_worker):
    client = make_client(max_outstanding=10)
    await client.submit([[1]] * 8)
    with pytest.raises(QueueFull, match="8 outstanding groups; 5 more would pass its quota of 10"):
        await client.submit([[2]] * 5, wait=False)
    with pytest.raises(QueueFull):
        await client.submit([[2]] * 5, timeout_s=0.3)
    with pytest.raises(InvalidInput, match="can never fit"):
        await client.submit([[2]] * 11)
    waiting = asyncio.create_task(client.submit([[2]] * 5))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    make_worker()
    await collect(client, 8)  # acknowledging results makes room
    await asyncio.wait_for(waiting, 10)
    assert len(await collect(client, 5)) == 5


async def test_server_side_quota_caps_the_client(make_client, redis):
    client = make_client(max_outstanding=100)
    await redis.set(client.keys.quota("trainer"), 3)
    with pytest.raises(QueueFull, match="quota of 3"):
        await client.submit([[1]] * 4, wait=False)


async def test_cancel_ends_pending_groups_cancelled(make_client, make_worker):
    client = make_client()
    job = await client.submit([[i + 1] for i in range(20)], n=2)
    assert await client.cancel(job) == 20
    make_worker()
    results = await collect(client, 20)
    assert {r.status for r in results} == {"cancelled"}
    status = await client.wait(job, timeout_s=5)
    assert (status.state, status.cancelled, status.ok) == ("cancelled", 20, 0)
    with pytest.raises(KeyError, match="no job 'nope'"):
        await client.cancel("nope")


async def test_cancel_aborts_groups_in_flight(make_client, make_worker):
    client = make_client()
    make_worker(delay_s=30, lease_s=0.9)
    job = await client.submit([[1], [2], [3]], n=1)
    await wait_until(lambda: client.redis.xpending(client.keys.work("trainer"), "workers"),
                     what="groups claimed")
    await client.cancel(job)
    results = await collect(client, 3, timeout_s=10)  # long before the 30 s generation ends
    assert {r.status for r in results} == {"cancelled"}


async def test_deadline_expires_waiting_and_running_groups(make_client, make_worker):
    client = make_client()
    waiting = await client.submit([[1], [2]], deadline_s=0.2)
    await asyncio.sleep(0.4)
    make_worker(delay_s=5)
    running = await client.submit([[3]], deadline_s=1.0)
    results = {r.job_id: r for r in await collect(client, 3, timeout_s=10)}
    assert results[waiting].status == "expired"
    assert "before generation" in results[waiting].reason
    assert results[running].status == "expired"
    assert "during generation" in results[running].reason
    assert (await client.status(waiting)).expired == 2


async def test_engine_group_error_fails_only_that_group(make_client, make_worker):
    client = make_client()
    make_worker()
    await client.submit([[FAIL_TOKEN, 1], [5, 6]], n=2)
    results = {r.group_index: r for r in await collect(client, 2)}
    assert results[0].status == "failed" and "FAIL_TOKEN" in results[0].reason
    assert results[1].status == "ok"


async def test_finish_is_fenced_to_the_lease_holder(redis, policy, make_client):
    """A worker whose lease was taken over cannot write a result; the new holder can, once."""
    client = make_client()
    await client.submit([[1, 2]], n=1)
    keys = Keys(policy)
    a = WorkQueue(redis, keys, "worker-a", job_ttl_s=60)
    b = WorkQueue(redis, keys, "worker-b", job_ttl_s=60)
    streams = await a.streams()
    [held_by_a] = await a.claim(streams, 1)
    await asyncio.sleep(0.05)
    [held_by_b] = await b.reclaim(streams, lease_ms=10, count=5)
    assert held_by_b.deliveries == 2
    assert await a.renew([held_by_a]) == [held_by_a]  # a learns it lost the lease
    assert await a.finish(held_by_a, "ok", b"from-a") == "lost"
    assert await b.finish(held_by_b, "ok", encode_ok(held_by_b)) == "ok"
    assert await b.finish(held_by_b, "ok", encode_ok(held_by_b)) == "lost"  # acked already
    [result] = await collect(client, 1)
    assert result.worker_id == "worker-b"


def encode_ok(claimed):
    from rollq.protocol import GroupResult
    return encode(GroupResult(claimed.job_id, claimed.group_index, "ok", worker_id="worker-b"))


async def test_a_group_is_delivered_once_even_if_enqueued_twice(redis, policy, make_client,
                                                                make_worker):
    client = make_client()
    job = await client.submit([[9]], n=1)
    stream = client.keys.work("trainer")
    [(_, fields)] = await redis.xrange(stream)
    await redis.xadd(stream, fields)  # the same group again, e.g. a replayed write
    make_worker()
    [result] = await collect(client, 1)
    assert result.job_id == job
    await wait_until(lambda: _len_zero(redis, stream), what="both entries consumed")
    assert await client.take(1, timeout_s=0.5) == []


async def _len_zero(redis, stream):
    return await redis.xlen(stream) == 0


async def test_dead_letter_after_max_deliveries_carries_last_error(redis, policy, make_client,
                                                                   make_worker):
    client = make_client()
    await client.submit([[3, 4]], n=1)
    keys = Keys(policy)
    ghost = WorkQueue(redis, keys, "ghost", job_ttl_s=60)
    [held] = await ghost.claim(await ghost.streams(), 1)
    await ghost.release([held], error="EngineDead: engine core died", refund=False)
    make_worker(max_deliveries=1)
    [result] = await collect(client, 1)
    assert result.status == "failed"
    assert "gave up after 1 deliveries; last error: EngineDead: engine core died" in result.reason
    [(_, dead)] = await redis.xrange(keys.dead)
    assert dead[b"stream"] == keys.work("trainer").encode()
    assert b"EngineDead" in dead[b"reason"]


async def test_released_groups_are_taken_at_once_and_not_counted(redis, policy, make_client,
                                                                 make_worker):
    client = make_client()
    await client.submit([[5]], n=1)
    keys = Keys(policy)
    leaving = WorkQueue(redis, keys, "leaving", job_ttl_s=60)
    [held] = await leaving.claim(await leaving.streams(), 1)
    assert await leaving.release([held]) == 1
    make_worker(max_deliveries=1, lease_s=60)  # a lapsed lease would take a minute
    [result] = await collect(client, 1, timeout_s=10)
    assert result.status == "ok"


MALFORMED = {
    "garbage bytes": ({b"d": b"\xc1\xc1\xc1"}, "malformed work item"),
    "wrong type": ({b"j": b"j1", b"g": b"0", b"d": msgspec.msgpack.encode(
        ["j1", 0, pack_tokens([1]), "eight", [], 1.0])}, "at `$.n`"),
    "oversized": ({b"d": b"\x00" * (2 * 1024 * 1024 + 1)}, "the limit is 2097152"),
    "no payload": ({b"j": b"j2", b"g": b"0"}, "no payload field 'd'"),
    "bad values": ({b"d": encode(WorkItem("j3", 0, pack_tokens([1]), 0, Sampling(), 1.0))},
                   "n=0 must be an integer between 1 and 1024"),
    "pickle": ({b"d": b"\x80\x04\x95cos\nsystem\n(S'touch /tmp/rollq-pwned'\ntR."},
               "malformed work item"),
    # A group field of digits that int() refuses: the claim once raised on it, at every attempt.
    "group not ascii digits": ({b"j": b"j4", b"g": "\u00b2".encode(), b"d": b"\xc1"},
                               "malformed work item"),
}


async def test_malformed_items_are_dead_lettered_and_the_worker_keeps_serving(
        redis, policy, make_client, make_worker):
    client = make_client()
    await client.submit([[1]], n=1)  # creates the stream and its consumer group
    [_] = await collect_after_worker(client, make_worker)
    stream = client.keys.work("trainer")
    for fields, _ in MALFORMED.values():
        await redis.xadd(stream, fields)
    good = await client.submit([[2, 3]], n=2)
    results = await collect(client, len(MALFORMED) + 1)
    failed = sorted(r.reason for r in results if r.status == "failed")
    assert len(failed) == len(MALFORMED)
    for _, expected in MALFORMED.values():
        assert any(expected in reason for reason in failed), expected
    assert [r.job_id for r in results if r.status == "ok"] == [good]
    assert await redis.xlen(Keys(policy).dead) == len(MALFORMED)
    assert await redis.xlen(stream) == 0


async def collect_after_worker(client, make_worker):
    make_worker()
    return await collect(client, 1)


def test_sync_client_for_trainers_that_are_not_async(redis_url, policy):
    import threading

    from rollq.client import SyncRolloutClient

    def serve() -> None:  # a worker on its own loop, for the synchronous caller's sake
        import asyncio

        from rollq.engine.instant import InstantEngine
        from rollq.queue.connection import connect
        from rollq.queue.keys import Keys
        from rollq.worker.loop import Worker
        from rollq.worker.limits import Limits

        async def run() -> None:
            redis = connect(redis_url)
            worker = Worker(WorkQueue(redis, Keys(policy), "sync-w", job_ttl_s=60), InstantEngine(),
                            Limits(max_inflight=4, lease_s=5, max_deliveries=3, grace_s=1, poll_s=0.1))
            task = asyncio.create_task(worker.run())
            while not stop.is_set():
                await asyncio.sleep(0.05)
            worker.stop()
            await task
            await redis.aclose()

        asyncio.run(run())

    stop = threading.Event()
    thread = threading.Thread(target=serve)
    thread.start()
    try:
        with SyncRolloutClient(redis_url, policy=policy, trainer_id="sync") as client:
            job = client.submit([[1, 2], [3]], n=2, sampling={"max_tokens": 2})
            assert client.wait(job, timeout_s=10).ok == 2
            results = client.take(2, timeout_s=5)
            assert sorted(r.group_index for r in results) == [0, 1]
            assert client.status(job).state == "done"
    finally:
        stop.set()
        thread.join(10)


async def test_status_shows_versions_workers_and_queues(make_client, make_worker, redis_url,
                                                        policy, tmp_path):
    import asyncio as aio

    client = make_client("alice", weight_store=str(tmp_path / "store"))
    make_worker("w-status", delay_s=30, max_inflight=2, lease_s=1.0)
    await client.submit([[i + 1] for i in range(5)], n=1)
    await wait_until(lambda: client.redis.exists(client.keys.worker("w-status")), what="heartbeat")
    proc = await aio.create_subprocess_exec(
        sys.executable, "-m", "rollq", "status", "--redis-url", redis_url, "--policy", policy,
        stdout=aio.subprocess.PIPE, env=os.environ | {"COLUMNS": "200"})
    out = (await proc.communicate())[0].decode()
    assert proc.returncode == 0, out
    assert f"policy {policy}: newest version -" in out
    assert "w-status" in out and "serving" in out
    # alice: 2 running on the worker, 3 waiting, 5 outstanding
    assert any([cell.strip() for cell in line.split("│")[1:6]] == ["alice", "3", "2", "0", "5"]
               for line in out.splitlines() if "alice" in line), out


async def test_results_of_a_lost_read_reply_are_read_again(make_client, make_worker, redis, monkeypatch):
    """A read whose reply was lost (redis-py retried it after the connection dropped) leaves
    results pending that nobody was handed; the reader finds and delivers them."""
    from rollq.queue import results
    from rollq.queue.names import Group

    monkeypatch.setattr(results, "ORPHAN_CHECK_S", 0.2, raising=False)
    client = make_client()
    make_worker()
    await client.submit([[1], [2], [3]], n=1, sampling={"max_tokens": 2})
    first = await collect(client, 1)
    await wait_until(lambda: redis.xlen(client.keys.results("trainer")), what="more results")
    await asyncio.sleep(0.5)
    # What the lost reply delivered: pending for the trainer's consumer, never handed out.
    lost = await redis.xreadgroup(Group.TRAINER, "trainer", {client.keys.results("trainer"): ">"})
    assert lost and len(lost[0][1]) == 2
    rest = await collect(client, 2, timeout_s=10)
    assert sorted(r.group_index for r in first + rest) == [0, 1, 2]


async def test_the_instant_engine_serves_a_text_prompt_as_its_utf8_bytes():
    """(It raised TypeError: pack_tokens takes token ids, not bytes.)"""
    from rollq.engine.instant import InstantEngine
    from rollq.protocol import unpack_tokens

    item = WorkItem("text", 0, b"", 2, Sampling(max_tokens=3), 0.0, text="héllo")
    generated = await InstantEngine().generate_group(item)
    assert unpack_tokens(generated.prompt) == list("héllo".encode())
    assert [unpack_tokens(s.tokens) for s in generated.samples] == [
        expected_tokens(pack_tokens(list("héllo".encode())), i, 3, 32_000) for i in range(2)]
