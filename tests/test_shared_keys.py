"""A trainer's Redis user (`rollq acl`) against the keys other processes read: the policy's shared
sets and hashes (trainers, bounded jobs, episodes, routed streams, scoring trainers) and its own
keys that every worker reads (its work stream, counters, job records). Per key, every write a
trainer could try that would give the key the wrong type is refused by the ACL, and every entry
it may write, however malformed, is skipped by its readers: the workers keep serving another
trainer (plain and pinned submits), `rollq status`, retention and the scorers' listing go on
(review-turn4/prove_acl_routed_kills_workers.py: one HSET into `routed` ended every worker)."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import NoPermissionError

from rollq.client import RolloutClient
from rollq.queue import gap
from rollq.queue.keys import Keys
from rollq.registry.retention import retain
from rollq.scoring.queue import ScoringQueue
from rollq.security import trainer_acl
from rollq.status import policy_status

JUNK = b"\xff\xfe:x"
"""Not UTF-8, and a ':' where no id has one."""


WRONG, ENTRY, SUBMIT = "wrong type", "entry", "submit"
"""What an attack is: a write that would give the key another type (the ACL must refuse it), or
an entry of the right type, maybe malformed (its readers must skip it); or alice's submit of a
job (`SUBMIT`, job id), queued for the worker."""


def _attacks(k: Keys) -> dict[str, list[tuple]]:
    """Per key, alice's commands, in order: those that would create the key with another type
    first (it does not exist yet), then malformed entries."""
    routed = k.routed_work("alice", "w1", 3)
    return {
        "trainers": [(WRONG, "ZADD", k.trainers, 1, "x"), (WRONG, "HSET", k.trainers, "x", 1),
                     (ENTRY, "SADD", k.trainers, JUNK, "a:b:c", "x" * 300, "~", "a~b")],
        # review-turn4/prove_acl_routed_kills_workers.py's ZADD first.
        "bounded-jobs": [(ENTRY, "ZADD", k.bounded_jobs, 1, "junk"), (WRONG, "HSET", k.bounded_jobs, "x", 1),
                         (ENTRY, "HSET", k.job("alice", "j"), "state", "pending", "min_version", "abc",
                          "max_version", "x"),
                         (ENTRY, "ZADD", k.bounded_jobs, 1, JUNK, 1, k.work("bob"), 1, k.job("alice", "j"),
                          1, k.job("alice", "a:b"), 1, k.versions)],
        # A set left by an older rollq (or made by a trainer's SADD): read and added to as one.
        "bounded-jobs set": [(ENTRY, "SADD", k.bounded_jobs, JUNK, k.work("bob")),
                             (WRONG, "HSET", k.bounded_jobs, "x", 1)],
        "episodes": [(WRONG, "SADD", k.episodes, "x"), (WRONG, "HSET", k.episodes, "x", 1),
                     (ENTRY, "HSET", k.episode("alice", "e"), "state", "running", "version", "abc"),
                     (ENTRY, "ZADD", k.episodes, 10**12, JUNK, 10**12, k.work("bob"), 10**12,
                      k.episode("alice", "e"), 10**12, k.versions)],
        "routed": [(WRONG, "SADD", k.routed, "x"), (WRONG, "ZADD", k.routed, 1, "x"),
                   # review-turn4/prove_acl_routed_kills_workers.py's field first
                   (ENTRY, "HSET", k.routed, f"{k.work('alice')}~x:nobody:junk", 1, routed, "soon",
                    f"{routed}:4", 1, JUNK, 1, f"{k.work('alice')}:w1:1e3", 1, k.work("alice"), 1,
                    k.routed_work("alice", "w1", 4), "nan", k.routed_work("alice", "w2", 5), "inf",
                    k.routed_work("alice", "w3", 6), int(time.time()))],  # (well formed)
        "scoring-trainers": [(WRONG, "ZADD", k.scoring_trainers, 1, "x"),
                             (WRONG, "HSET", k.scoring_trainers, "x", 1),
                             (ENTRY, "SADD", k.scoring_trainers, JUNK, "a:b", "a~b")],
        # The gap's readers (`queue/gap.py`: rollq status, the gateway) list and sum them.
        "gap-trainers": [(WRONG, "ZADD", k.gap_trainers, 1, "x"), (WRONG, "HSET", k.gap_trainers, "x", 1),
                         (ENTRY, "SADD", k.gap_trainers, JUNK, "a:b", "a~b", "bob", "alice")],
        "own gap record": [(WRONG, "SADD", k.gap("alice"), "x"), (WRONG, "SET", k.gap("alice~x~y"), "x"),
                           (WRONG, "XADD", k.gap("alice"), "*", "x", 1),
                           (ENTRY, "SADD", k.gap_trainers, "alice"),
                           (ENTRY, "HSET", k.gap("alice"), JUNK, 1, "1:w:n", "abc", "x:w:n", 1, "1:w:abs",
                            "inf", "1:w:k3", -5, "1:w:x:n", 1, "2:w:n", 4, "2:w:abs", 2.0),
                           (ENTRY, "HINCRBYFLOAT", k.gap("alice"), "2:w:r", 4.0)],
        "own work stream": [(WRONG, "SET", k.work("alice"), "x"), (WRONG, "HSET", k.work("alice"), "x", 1),
                            (WRONG, "SADD", k.work("alice~x~y"), "x"),
                            (ENTRY, "SADD", k.trainers, "alice", "alice~x~y")],
        # Every worker reads the state of the jobs it claims groups of.
        "own job record": [(SUBMIT, "j"),
                           (ENTRY, "HSET", k.job("alice", "j"), "state", "junk", "groups", "x"),
                           (SUBMIT, "k"), (ENTRY, "HSET", k.job("alice", "k"), "state", b"\xff")],
        "own counters": [(WRONG, "HSET", k.outstanding("alice~x~y"), "x", 1),
                         (WRONG, "ZADD", k.outstanding_bytes("alice"), 1, "x"),
                         (ENTRY, "SET", k.outstanding("alice"), "abc"),
                         (ENTRY, "SADD", k.trainers, "alice", "alice~x~y")],
    }


ATTACKED = sorted(_attacks(Keys("p")))


@pytest.fixture
async def users(redis, redis_url, policy):
    """Trainer users alice and bob of this test's policy, as `rollq acl` makes them."""
    names = [f"alice-{policy}", f"bob-{policy}"]
    made = []
    for name, trainer in zip(names, ("alice", "bob")):
        rules = trainer_acl(policy, trainer, f"{trainer}-pw")
        await redis.execute_command("ACL", "SETUSER", name, *rules[1:])
        made.append(RolloutClient(redis_url.replace("redis://", f"redis://{name}:{trainer}-pw@"),
                                  policy=policy, trainer_id=trainer))
    yield made
    for client in made:
        await client.close()
    for name in names:
        await redis.execute_command("ACL", "DELUSER", name)


@pytest.mark.parametrize("key", ATTACKED)
async def test_a_trainers_writes_to_a_key_others_read_stop_no_one(key, users, redis, policy, make_worker):
    keys = Keys(policy)
    alice, bob = users
    for kind, *command in _attacks(keys)[key]:
        if kind == SUBMIT:
            await alice.submit([[9]], n=1, sampling={"max_tokens": 2}, job_id=command[0])
            continue
        try:
            await alice.redis.execute_command(*command)
        except NoPermissionError:
            continue  # refused by the ACL
        assert kind == ENTRY, f"{command[:2]} was let through: it gives the key another type"
    await policy_status(redis, policy)  # as written (a worker would soon prune some of it)
    _, task = make_worker("w1")
    # Another trainer is served, also with a version bound (listed in bounded-jobs).
    await bob.submit([[1, 2]], n=1, sampling={"max_tokens": 2}, job_id="plain")
    await bob.submit([[3]], n=1, sampling={"max_tokens": 2}, max_version=5, job_id="bounded")
    got = await bob.take(2, timeout_s=20)
    assert sorted((r.job_id, r.status) for r in got) == [("bounded", "ok"), ("plain", "ok")]
    await asyncio.sleep(0.3)  # the worker lists its streams again (every 0.1 s) and prunes
    assert not task.done(), task.exception() if task.done() else ""
    await bob.submit([[4]], n=1, sampling={"max_tokens": 2}, job_id="after")
    [after] = await bob.take(1, timeout_s=20)
    assert after.status == "ok"
    assert not task.done()
    if key == "routed":  # the worker dropped what it skipped, and kept the well-formed field
        assert await redis.hkeys(keys.routed) == [keys.routed_work("alice", "w3", 6).encode()]
    if key == "trainers":  # the same for the trainers set (well-formed ids leave when pruned)
        assert not {JUNK, b"a:b:c", b"~", b"a~b"} & await redis.smembers(keys.trainers)
    # `rollq status` (and the gateway's /status), retention and the scorers' listing read them.
    status = await policy_status(redis, policy)
    assert all(":" not in q.trainer for q in status.queues + status.scoring)
    await retain(redis, keys, None, keep=1)  # (bob's bounded job is done: it leaves the listing)
    assert keys.job("bob", "bounded").encode() not in await _listed(redis, keys.bounded_jobs)
    view = await gap.read(redis, keys)
    assert all(":" not in w.worker and w.tokens > 0 for w in view.workers), view
    if key == "own gap record":  # the well-formed figures alone
        assert [(w.version, w.worker, w.tokens, w.mean_abs) for w in view.workers] == [(2, "w", 4, 0.5)]
    streams = await ScoringQueue(redis, keys, "s1", job_ttl_s=600).streams()
    assert all(keys.trainer_of_scoring(s) in ("alice", "bob") for s in streams), streams


async def _listed(redis, key: str) -> list[bytes]:
    return await (redis.smembers(key) if await redis.type(key) == b"set" else redis.zrange(key, 0, -1))


async def test_a_bounded_job_is_listed_until_it_ends_then_retention_drops_it(make_client, redis, policy):
    """What retention keeps a job's versions by: its key in `bounded-jobs` with its deadline."""
    keys = Keys(policy)
    client = make_client("alice")
    job = await client.submit([[1]], n=1, max_version=3, deadline_s=60)
    deadline = await redis.zscore(keys.bounded_jobs, keys.job("alice", job))
    assert 0 < deadline - time.time() <= 60
    await client.submit([[1]], n=1, max_version=3, job_id="forever")
    assert await redis.zscore(keys.bounded_jobs, keys.job("alice", "forever")) == float("inf")
    await client.cancel(job)
    await retain(redis, keys, None, keep=1)
    assert await redis.zrange(keys.bounded_jobs, 0, -1) == [keys.job("alice", "forever").encode()]
