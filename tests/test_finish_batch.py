"""Finishing groups in batches (issue 13, part 3): groups that complete together are finished by
one script call, and the script fences every entry on its own; scripts are sent as bare EVALSHA
(no SCRIPT EXISTS round trip) and loaded when Redis has forgotten them. Real redis-server."""

import asyncio

from redis.exceptions import ResponseError

from rollq.engine.instant import InstantEngine
from rollq.protocol import GroupResult, encode
from rollq.queue.keys import Keys
from rollq.queue.names import DoneField, Group, JobState
from rollq.queue.work import WorkQueue
from rollq.worker.loop import Worker
from rollq.worker.limits import Limits


async def _calls(redis, command: str) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def _claimed(redis, client, policy, count: int):
    await client.submit([[i + 1] for i in range(count)], n=1)
    queue = WorkQueue(redis, Keys(policy), "w1", job_ttl_s=600)
    streams = await queue.streams()
    claimed = await queue.claim(streams, count)
    assert len(claimed) == count
    return queue, claimed


async def _finish_together(queue, claimed) -> list:
    results = [encode(GroupResult(c.job_id, c.group_index, "ok")) for c in claimed]
    return await asyncio.gather(*(queue.finish(c, "ok", r) for c, r in zip(claimed, results)),
                                return_exceptions=True)


async def test_a_batch_is_one_script_call_fenced_per_entry(redis, policy, make_client):
    client = make_client()
    queue, claimed = await _claimed(redis, client, policy, 4)
    stolen = claimed[1]
    await redis.xclaim(stolen.stream, Group.WORKERS, "thief", 0, [stolen.entry_id], justid=True)
    await redis.script_load(queue.scripts.finish.script)  # else the first call is NOSCRIPT, loaded, again
    before = await _calls(redis, "evalsha"), await _calls(redis, "script|exists")

    outcomes = await _finish_together(queue, claimed)

    assert outcomes == ["ok", "lost", "ok", "ok"]
    after = await _calls(redis, "evalsha"), await _calls(redis, "script|exists")
    assert after == (before[0] + 1, before[1])
    results = await client.take(4, timeout_s=1)
    assert sorted(r.group_index for r in results) == [0, 2, 3]  # nothing for the stolen entry
    pending = await redis.xpending_range(stolen.stream, Group.WORKERS, "-", "+", 10)
    assert [(p["message_id"].decode(), p["consumer"].decode()) for p in pending] == [
        (stolen.entry_id, "thief")]
    status = await client.status(claimed[0].job_id)
    assert (status.done, status.ok) == (3, 3)


async def test_a_group_finished_twice_in_one_batch_has_one_result(redis, policy, make_client):
    client = make_client()
    queue, [c] = await _claimed(redis, client, policy, 1)
    assert await _finish_together(queue, [c, c]) == ["ok", "lost"]
    assert len(await client.take(2, timeout_s=1)) == 1


async def test_an_error_in_one_entry_fails_only_that_entry(redis, policy, make_client):
    client = make_client()
    for i in range(3):  # three jobs: the broken key below belongs to one of them
        await client.submit([[i + 1]], n=1)
    queue = WorkQueue(redis, Keys(policy), "w1", job_ttl_s=600)
    claimed = await queue.claim(await queue.streams(), 3)
    broken = claimed[1]
    # Its job's done-marker hash is a string: HSETNX fails for that entry alone.
    await redis.set(Keys(policy).done("trainer", broken.job_id), "x")
    outcomes = await _finish_together(queue, claimed)
    assert outcomes[0] == "ok" and outcomes[2] == "ok"
    assert isinstance(outcomes[1], ResponseError) and "WRONGTYPE" in str(outcomes[1])
    assert sorted(r.job_id for r in await client.take(3, timeout_s=1)) == sorted(
        [claimed[0].job_id, claimed[2].job_id])


async def test_scripts_forgotten_by_redis_are_loaded_again(redis, policy, make_client):
    client = make_client()
    queue, claimed = await _claimed(redis, client, policy, 3)
    await redis.script_flush()
    assert await queue.renew(claimed) == []
    await redis.script_flush()
    assert await _finish_together(queue, claimed) == ["ok"] * 3
    assert len(await client.take(3, timeout_s=1)) == 3


# finish.lua takes a batch as one msgpack argument (bytes sent as msgpack str), reads ownership
# with one XPENDING per stream and counts each job once: the tests below hold what finishing the
# entries one by one would leave.

async def test_payloads_and_dead_items_arrive_byte_for_byte(redis, policy, make_client):
    client = make_client()
    sizes = [0, 1, 31, 32, 255, 256, 65_535, 65_536, 300_000]  # each msgpack str header size
    queue, claimed = await _claimed(redis, client, policy, len(sizes) + 1)
    payloads = [bytes(range(256)) * (n // 256) + bytes(range(n % 256)) for n in sizes]
    *rest, dead = claimed
    dead.data = b"\xff\x00\xc4not utf-8 \x80"
    outcomes = await queue.finish_many([(c, "ok", p, "") for c, p in zip(rest, payloads)]
                                       + [(dead, "failed", b"\xc1", "bad item \u00e9")])
    assert outcomes == ["ok"] * len(claimed)
    entries = await redis.xrange(Keys(policy).results("trainer"))
    assert [fields[b"d"] for _, fields in entries] == payloads + [b"\xc1"]
    [(_, letter)] = await redis.xrange(Keys(policy).dead)
    assert (letter[b"item"], letter[b"reason"]) == (dead.data, "bad item \u00e9".encode())


async def test_a_batch_over_two_trainers_writes_each_trainers_own(redis, policy, make_client):
    alice, bob = make_client("alice"), make_client("bob")
    await alice.submit([[1], [2]], n=1)
    await bob.submit([[3]], n=1)
    keys = Keys(policy)
    before = [int(await redis.get(keys.outstanding_bytes(t))) for t in ("alice", "bob")]
    queue = WorkQueue(redis, keys, "w1", job_ttl_s=600)
    claimed = await queue.claim(await queue.streams(), 3)
    assert len({c.stream for c in claimed}) == 2
    outcomes = await _finish_together(queue, claimed)
    assert outcomes == ["ok"] * 3
    assert len(await alice.take(3, timeout_s=1)) == 2 and len(await bob.take(3, timeout_s=1)) == 1
    assert before[0] > 0 and before[1] > 0
    assert [int(await redis.get(keys.outstanding_bytes(t))) for t in ("alice", "bob")] == [0, 0]


async def test_entries_far_apart_among_many_held_are_still_ours(redis, policy, make_client):
    """The batch's ownership read covers its lowest to highest id; when this worker holds more
    there than the read returns, each entry is asked for on its own (not taken as lost)."""
    client = make_client()
    queue, claimed = await _claimed(redis, client, policy, 300)
    ends = [claimed[-1], claimed[0]]  # out of id order
    assert await _finish_together(queue, ends) == ["ok", "ok"]
    stolen = claimed[150]
    await redis.xclaim(stolen.stream, Group.WORKERS, "thief", 0, [stolen.entry_id], justid=True)
    assert await _finish_together(queue, [claimed[1], stolen, claimed[-2]]) == ["ok", "lost", "ok"]
    assert len(await client.take(10, timeout_s=1)) == 4


async def test_a_job_completed_within_one_batch_is_counted_as_one_by_one(redis, policy, make_client):
    client = make_client()
    queue, claimed = await _claimed(redis, client, policy, 4)
    statuses = ["ok", "failed", "ok", "expired"]
    outcomes = await queue.finish_many([(c, s, encode(GroupResult(c.job_id, c.group_index, s)), "")
                                        for c, s in zip(claimed, statuses)] + [(claimed[2], "ok", b"x", "")])
    assert outcomes == ["ok"] * 4 + ["lost"]
    status = await client.status(claimed[0].job_id)
    assert (status.state, status.done, status.ok, status.failed, status.expired) == ("done", 4, 2, 1, 1)
    assert status.finished_at > 0
    keys = Keys(policy)
    assert 0 < await redis.ttl(keys.job("trainer", claimed[0].job_id)) <= 600
    assert 0 < await redis.ttl(keys.done("trainer", claimed[0].job_id)) <= 600
    assert await redis.hgetall(keys.done("trainer", claimed[0].job_id)) == {
        str(c.group_index).encode(): s.encode() for c, s in zip(claimed, statuses)}


async def test_a_large_jobs_done_markers_are_a_hash_table_and_still_fence(redis, policy, make_client):
    """A job of more than 128 groups keeps its done markers in a hash table from the first one
    (a listpack's lookups cost O(groups) per marker; issue 43): the markers and exactly-once
    hold as before, a second entry for a finished group is a DUP; small jobs keep a listpack."""
    client = make_client()
    await client.submit([[i + 1] for i in range(200)], n=1)
    keys = Keys(policy)
    queue = WorkQueue(redis, keys, "w1", job_ttl_s=600)
    claimed = await queue.claim(await queue.streams(), 4)
    assert await _finish_together(queue, claimed) == ["ok"] * 4
    done = keys.done("trainer", claimed[0].job_id)
    assert await redis.object("encoding", done) == b"hashtable"
    assert await redis.hgetall(done) == {str(c.group_index).encode(): b"ok" for c in claimed} | {
        DoneField.ENCODING.encode(): DoneField.TABLE.encode()}
    again = claimed[0]  # a second entry for a group that has its result (as a duplicate would be)
    await redis.xadd(again.stream, {"j": again.job_id, "g": again.group_index, "d": again.data})
    *_, copy = await queue.claim(await queue.streams(), 300)  # the other 196, then the copy
    assert copy.group_index == again.group_index and copy.entry_id != again.entry_id
    assert await _finish_together(queue, [copy]) == ["dup"]
    assert len(await client.take(10, timeout_s=1)) == 4
    status = await client.status(again.job_id)
    assert (status.done, status.ok) == (4, 4)
    await client.submit([[1], [2]], n=1)
    small = await queue.claim(await queue.streams(), 2)
    assert await _finish_together(queue, small) == ["ok", "ok"]
    assert await redis.object("encoding", keys.done("trainer", small[0].job_id)) == b"listpack"


async def test_a_job_record_without_groups_fails_its_entries_alone(redis, policy, make_client):
    """As one by one: the broken job's entries are acknowledged and counted, then fail on the
    missing `groups` without a result; the other job's entry is finished."""
    client = make_client()
    await client.submit([[1], [2]], n=1)
    await client.submit([[3]], n=1)
    queue = WorkQueue(redis, Keys(policy), "w1", job_ttl_s=600)
    claimed = await queue.claim(await queue.streams(), 3)
    broken_job = claimed[0].job_id
    await redis.hdel(Keys(policy).job("trainer", broken_job), "groups")
    outcomes = await _finish_together(queue, claimed)
    assert [isinstance(o, ResponseError) for o in outcomes] == [True, True, False]
    assert outcomes[2] == "ok"
    assert [r.job_id for r in await client.take(3, timeout_s=1)] == [claimed[2].job_id]
    record = await redis.hgetall(Keys(policy).job("trainer", broken_job))
    assert (record[b"done"], record[b"ok"]) == (b"2", b"2")
    assert await redis.xpending(claimed[0].stream, Group.WORKERS) == {
        "pending": 0, "min": None, "max": None, "consumers": []}


async def test_a_claim_reads_the_state_of_the_jobs_of_the_claim_before(redis, policy, make_client):
    """A job's groups are claimed in a row: a claim reads the state of the previous claim's jobs
    in its own round trip, after its reads, so a cancel before the claim is seen without a
    round trip of its own; a job the claim did not read along is read apart."""
    client = make_client()
    job = await client.submit([[i + 1] for i in range(4)], n=1)
    queue = WorkQueue(redis, Keys(policy), "w1", job_ttl_s=600)
    streams = await queue.streams()
    first = await queue.claim(streams, 2)
    hgets = await _calls(redis, "hget")
    assert list((await queue.claimed_states(first)).values()) == [JobState.PENDING] * 2
    assert await _calls(redis, "hget") == hgets + 1
    await client.cancel(job)
    other = await client.submit([[9]], n=1)
    second = await queue.claim(streams, 3)
    hgets = await _calls(redis, "hget")
    states = await queue.claimed_states(second)
    assert await _calls(redis, "hget") == hgets + 1  # the other job's state only
    assert [(c.job_id, states[c.key]) for c in second] == [
        (job, JobState.CANCELLED), (job, JobState.CANCELLED), (other, JobState.PENDING)]
    assert await queue.job_states(second) == states  # the renewals' read: always its own


async def test_an_engine_that_answers_at_once_claims_half_its_slots_at_a_time(redis, policy):
    """One half's results are written while the other half is claimed: an instant engine's
    worker claims at most half of max_inflight at once; an engine that suspends, all of it."""
    queue = WorkQueue(redis, Keys(policy), "w1", job_ttl_s=600)

    def worker(engine: InstantEngine) -> Worker:
        return Worker(queue, engine,
                      Limits(max_inflight=8, lease_s=5, max_deliveries=3, grace_s=1, poll_s=0.1))

    assert worker(InstantEngine())._free_slots() == 4
    assert worker(InstantEngine(delay_s=0.01))._free_slots() == 8
