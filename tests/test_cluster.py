"""rollq on a real 3-primary / 3-replica Redis Cluster (tests/cluster_fixtures.py): the queue,
worker processes, the registry, the gateway and `rollq status` through `redis+cluster://`.
Workers run the instant engine: these tests are about Redis, not generation.

Every fixture of tests/conftest.py that takes `redis_url` gets the cluster's URL here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import uuid
from collections import Counter

import aiohttp
import numpy as np
import pytest
import redis as redis_sync
from cluster_fixtures import ClusterProcesses, shared_cluster, submit_through_failovers
from conftest import WorkerProcess
from helpers import collect, wait_until
from redis.asyncio import Redis, RedisCluster
from redis.cluster import key_slot
from redis.exceptions import NoPermissionError
from safetensors.numpy import save_file

from rollq.client import RolloutClient
from rollq.engine.instant import InstantEngine, expected_tokens
from rollq.protocol import pack_tokens
from rollq.queue import results
from rollq.queue.connection import Durability, connect, is_cluster, parse_url
from rollq.queue.keys import Keys
from rollq.queue.names import Group
from rollq.queue.work import WorkQueue
from rollq.security import trainer_acl
from rollq.status import policies, policy_status
from rollq.worker.loop import Worker
from rollq.worker.limits import Limits


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory) -> ClusterProcesses:
    return shared_cluster(request, tmp_path_factory)


@pytest.fixture(scope="module")
def redis_url(cluster) -> str:
    return cluster.url


def test_the_url_decides_single_node_or_cluster():
    one = parse_url("redis://u:pw@10.0.0.1:6380/0?socket_timeout=5&durable_replicas=1")
    assert (one.url, one.seeds, one.durability) == ("redis://u:pw@10.0.0.1:6380/0?socket_timeout=5", None,
                                                   Durability(1, 1000))
    many = parse_url("rediss+cluster://u:pw@a:7000,b:7001,[::1]:7002/?durable_timeout_ms=50")
    assert many.url == "rediss://u:pw@a:7000/"
    assert many.seeds == [("a", 7000), ("b", 7001), ("::1", 7002)]
    assert many.durability == Durability(0, 50)
    with pytest.raises(ValueError, match="durable_replica"):
        parse_url("redis://a:1/0?durable_replica=1")
    with pytest.raises(ValueError, match="host:port"):
        parse_url("redis+cluster://a,b:2/")
    one_client = connect("redis://127.0.0.1:1/0")
    assert isinstance(one_client, Redis) and not is_cluster(one_client)


async def test_submit_claim_finish_results_ack(cluster, redis, make_client, make_worker, policy):
    assert isinstance(redis, RedisCluster)
    client = make_client("alice")
    # Leases of 1.5 s renewed every 0.5 s while each group takes 1 s: renewals (a pipeline of
    # scripts) must work, or other claims would take the groups over.
    w, _ = make_worker("w1", lease_s=1.5, delay_s=1.0, max_inflight=20)
    job = await client.submit([[i, i + 1] for i in range(40)], n=2, sampling={"max_tokens": 3})
    results = await collect(client, 40, timeout_s=60)
    assert Counter(r.group_index for r in results) == Counter(range(40))
    for r in results:
        assert (r.status, r.worker_id) == ("ok", "w1")
        assert r.samples[1].token_ids == expected_tokens(r.prompt, 1, 3, 32_000)
    status = await client.status(job)
    assert (status.state, status.ok) == ("done", 40)
    assert await client.outstanding() == 0
    keys = client.keys
    assert await redis.xlen(keys.work("alice")) == 0 and await redis.xlen(keys.results("alice")) == 0
    assert w.stats.totals.reclaims == 0


async def test_scripts_come_back_on_a_node_that_forgot_them(cluster, redis, make_client, policy):
    """A promoted replica has no cached scripts: pipelined EVALSHA gets NOSCRIPT and is resent."""
    client = make_client("alice")
    await client.submit([[1], [2], [3]], n=1)
    queue = WorkQueue(redis, Keys(policy), "w", job_ttl_s=60)
    claimed = await queue.claim(await queue.streams(), 3)
    await redis.execute_command("SCRIPT FLUSH", target_nodes=RedisCluster.PRIMARIES)
    assert await queue.renew(claimed) == []
    await redis.execute_command("SCRIPT FLUSH", target_nodes=RedisCluster.PRIMARIES)
    assert await queue.release(claimed[:1]) == 1  # a script called alone
    claimed[:1] = await queue.reclaim(await queue.streams(), 60_000, 1)
    await redis.execute_command("SCRIPT FLUSH", target_nodes=RedisCluster.PRIMARIES)
    assert [await queue.finish(c, "failed", b"x") for c in claimed] == ["ok"] * 3
    assert (await client.status(claimed[0].job_id)).failed == 3


def _policy_on(cluster: ClusterProcesses, node_port: int) -> str:
    """A fresh policy name whose keys live on the node at `node_port`."""
    while True:
        name = f"t{uuid.uuid4().hex[:10]}"
        if cluster.primary_of(Keys(name).trainers).port == node_port:
            return name


async def test_status_asks_every_primary(cluster, redis, make_client, make_worker):
    primaries = sorted({cluster.primary_of(f"{{{i}}}").port for i in range(50)})
    assert len(primaries) == 3
    names = [_policy_on(cluster, port) for port in primaries]
    for name in names:
        await make_client("alice", policy=name).submit([[1]], n=1)
    found = await policies(redis)
    assert set(names) <= set(found)
    make_worker("w1", policy=names[0])
    await wait_until(lambda: _done_on(redis, names[0]), what="a worker finished the group")
    status = await policy_status(redis, names[1])
    assert [(q.trainer, q.waiting, q.outstanding) for q in status.queues] == [("alice", 1, 1)]
    out = subprocess.run([sys.executable, "-m", "rollq", "status", "--redis-url", cluster.url,
                          "--policy", names[1]], capture_output=True, text=True, timeout=60,
                         env=os.environ | {"COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    assert f"policy {names[1]}" in out.stdout and "alice" in out.stdout


async def _done_on(redis, policy: str) -> bool:
    return (await policy_status(redis, policy)).queues[0].results == 1


async def test_1000_groups_from_3_trainers_through_2_worker_processes(cluster, make_client, spawn_worker):
    trainers = {name: make_client(name) for name in ("alice", "bob", "carol")}
    for _ in range(2):
        spawn_worker(max_inflight=16)
    sizes = {"alice": [100, 100, 134], "bob": [111, 111, 111], "carol": [333]}  # 1,000 groups
    jobs = {name: [await client.submit([[len(name), step, i] for i in range(size)], n=2,
                                       sampling={"max_tokens": 3})
                   for step, size in enumerate(sizes[name])]
            for name, client in trainers.items()}
    for name, client in trainers.items():
        results = await collect(client, sum(sizes[name]), timeout_s=120)
        keys = Counter((r.job_id, r.group_index) for r in results)
        assert max(keys.values()) == 1, "a group arrived twice"
        assert {j for j, _ in keys} == set(jobs[name])
        assert all(r.status == "ok" and r.samples[1].token_ids == expected_tokens(r.prompt, 1, 3, 32_000)
                   for r in results)


async def test_publish_and_a_worker_follows(cluster, make_client, make_worker, tmp_path):
    client = make_client("alice", weight_store=str(tmp_path / "store"))
    w, _ = make_worker("w1")
    weights = tmp_path / "v1"
    weights.mkdir()
    save_file({"w": np.ones(4, dtype=np.float32)}, str(weights / "model.safetensors"))
    entry = await client.publish_weights(1, weights)
    assert await client.latest_version() == 1 and entry.version == 1
    await wait_until(lambda: w.engine.version == 1, what="the worker swapped to version 1")
    await client.submit([[1, 2]], n=1, min_version=1)
    [result] = await collect(client, 1)
    assert result.samples[0].versions == [(1, 0)]


async def test_gateway_submit_and_results(cluster, make_gateway, make_worker, policy):
    gw = await make_gateway()
    make_worker()
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        body = {"prompts": [[5, 6, 7], [8, 9]], "n": 2, "sampling": {"max_tokens": 4}, "job_id": "j1"}
        async with http.post(f"/v1/policies/{policy}/jobs", json=body) as r:
            assert r.status == 201, await r.text()
        results = []  # a read returns the unacknowledged results again first: ack as we go
        for _ in range(100):
            async with http.get(f"/v1/policies/{policy}/results", params={"wait_ms": 1000}) as r:
                got = (await r.json())["results"]
            ack = {"ids": [x["id"] for x in got]}
            async with http.post(f"/v1/policies/{policy}/results/ack", json=ack) as r:
                assert await r.json() == {"acked": len(got)}
            results += got
            if len(results) >= 2:
                break
        by_group = {x["group_index"]: x for x in results}
        assert sorted(by_group) == [0, 1] and len(results) == 2
        for index, prompt in ((0, [5, 6, 7]), (1, [8, 9])):
            assert [s["token_ids"] for s in by_group[index]["samples"]] == [
                expected_tokens(pack_tokens(prompt), j, 4, 32_000) for j in range(2)]
        async with http.get(f"/v1/policies/{policy}/jobs/j1") as r:
            assert (await r.json())["ok"] == 2
        async with http.get(f"/v1/policies/{policy}/status") as r:
            assert [q["trainer"] for q in (await r.json())["queues"]] == ["alice"]


async def _getkeys_calls(redis) -> int:
    """COMMAND GETKEYS calls so far, summed over every node (the client asks one of them)."""
    stats = await redis.info("commandstats", target_nodes=RedisCluster.ALL_NODES)
    return sum(int(node.get("cmdstat_command|getkeys", {}).get("calls", 0)) for node in stats.values())


async def test_stream_reads_are_routed_without_asking_the_server(cluster, redis, make_client, make_worker,
                                                                 policy):
    """redis-py asks a node `COMMAND GETKEYS` before each XREADGROUP and XREAD (their keys
    follow STREAMS) to find the slot: a round trip per claim, read and version poll. rollq's
    cluster client reads the stream keys itself."""
    client = make_client("alice")
    make_worker("w1", max_inflight=4)
    before = await _getkeys_calls(redis)
    for step in range(5):
        await client.submit([[step, i] for i in range(8)], n=1, sampling={"max_tokens": 2})
        await collect(client, 8, timeout_s=60)
    assert await _getkeys_calls(redis) - before == 0
    # A group and a consumer named like the keyword still route by the stream's key.
    stream = Keys(policy).work("odd")
    await redis.xgroup_create(stream, "streams", id="0", mkstream=True)
    await redis.xadd(stream, {"a": "1"})
    [[name, [(_, fields)]]] = await redis.xreadgroup("streams", "STREAMS", {stream: ">"}, count=5, noack=True)
    assert (name, fields) == (stream.encode(), {b"a": b"1"})


def test_every_key_of_a_policy_is_in_one_slot():
    """Every key Keys spells (each property, each method with sample arguments)."""
    import inspect

    keys = Keys("math")
    names = []
    for name, member in inspect.getmembers(Keys):
        if name.startswith("_") or name in (  # (parsers, not key names)
                "policy", "trainer_of", "trainer_of_results", "trainer_of_scoring", "route_of",
                "trainer_stream_rest", "record_of"):
            continue
        if isinstance(member, property):
            names.append(getattr(keys, name))
        elif callable(member):
            arity = len(inspect.signature(member).parameters) - 1
            names.append(getattr(keys, name)(*["a1"] * arity))
    assert len(names) >= 18
    assert len({key_slot(k.encode()) for k in names}) == 1


async def test_acl_users_on_every_node(cluster, redis, make_worker, policy):
    """`rollq acl` rules work on a cluster once set on every node (ACLs are per node), with the
    commands a cluster client needs (CLUSTER SLOTS, COMMAND) and WAIT for durability."""
    for rule in (trainer_acl(policy, "alice", "alice-pw"), trainer_acl(policy, "bob", "bob-pw")):
        await redis.execute_command("ACL", "SETUSER", *rule, target_nodes=RedisCluster.ALL_NODES)
    # The trainer is the first to run the submit script on its node (as after a failover, which
    # does not replicate the script cache): its client falls back to EVAL, which the trainer's
    # rules must allow (they did not: passed only after other tests had loaded the scripts).
    await redis.execute_command("SCRIPT", "FLUSH", target_nodes=RedisCluster.ALL_NODES)
    make_worker("w1")
    seeds = cluster.url.removeprefix("redis+cluster://")
    alice = RolloutClient(f"redis+cluster://alice:alice-pw@{seeds}?durable_replicas=1",
                          policy=policy, trainer_id="alice")
    try:
        await alice.submit([[1, 2]], n=1, sampling={"max_tokens": 2})
        [mine] = await alice.take(1, timeout_s=30)
        assert (mine.status, mine.prompt_ids) == ("ok", [1, 2])
        with pytest.raises(NoPermissionError):
            await alice.redis.xrange(Keys(policy).results("bob"))
    finally:
        await alice.close()
        for user in ("alice", "bob"):
            await redis.execute_command("ACL", "DELUSER", user, target_nodes=RedisCluster.ALL_NODES)


async def _pending(redis, stream: str, count: int) -> bool:
    return (await redis.xpending(stream, Group.WORKERS))["pending"] == count


class GatedEngine(InstantEngine):
    """Groups finish only once the gate opens: the test decides when results are written."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def generate_group(self, item):
        await self.gate.wait()
        return await super().generate_group(item)


def refuses_connections(port: int) -> bool:
    try:
        redis_sync.Redis(port=port, socket_connect_timeout=0.5).ping()
    except redis_sync.ConnectionError:
        return True
    return False


async def test_a_failover_under_a_group_is_a_warning_not_a_traceback(cluster, make_client, policy, caplog):
    """A group whose result cannot be written while its primary fails over is handed back with
    a one-line warning: a traceback per group (rendered by rich: seconds each on a loaded box)
    would stall the worker's event loop just when it must ride the failover out."""
    caplog.set_level(logging.WARNING, "rollq.worker")
    # No client-side retries. The groups finish only after their primary is killed, and its
    # replica is frozen until the worker has given up writing: the writes fail for longer than
    # the 1 s lease the worker retries them within. (Before, groups finished at a moment chosen
    # by a timer and a fast failover could let the retried writes through: flaky.)
    r = connect(cluster.url, retries=0)
    engine = GatedEngine()
    worker = Worker(WorkQueue(r, Keys(policy), "w1", job_ttl_s=600), engine,
                    Limits(max_inflight=4, lease_s=1.0, max_deliveries=5, grace_s=1.0, poll_s=0.1))
    task = asyncio.create_task(worker.run())

    def handed_back() -> bool:
        return any("handing it back" in x.getMessage() for x in caplog.records if x.name == "rollq.worker")

    try:
        client = make_client("alice")
        await client.submit([[1, 2], [3, 4]], n=1, sampling={"max_tokens": 2})
        await wait_until(lambda: _pending(r, Keys(policy).work("alice"), 2),
                         what="the worker holds both groups")
        primary = cluster.primary_of(Keys(policy).trainers)
        replica = cluster.replica_of(primary)
        replica.pause()
        try:
            failing_over = asyncio.create_task(
                asyncio.to_thread(cluster.fail_over_by_kill, Keys(policy).trainers))
            await wait_until(lambda: asyncio.to_thread(refuses_connections, primary.port),
                             what="the primary killed")
            engine.gate.set()
            await wait_until(handed_back, what="a group handed back")
        finally:
            replica.resume()
        await failing_over
        results = await collect(client, 2, timeout_s=60)
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)
        await r.aclose()
    assert sorted(x.group_index for x in results) == [0, 1] and {x.status for x in results} == {"ok"}
    ours = [x for x in caplog.records if x.name == "rollq.worker"]
    assert any("redis unreachable" in x.getMessage() and "handing it back" in x.getMessage() for x in ours), \
        [x.getMessage() for x in ours]
    assert [x.getMessage() for x in ours if x.exc_info] == []


async def test_a_durable_read_is_not_handed_out_twice_by_a_failover(cluster, make_worker, policy):
    """A read records the delivery (a write). If the primary dies before its replica holds that,
    the promoted replica hands the same result out again. With durability the reader WAITs
    behind its read before handing results out, so the delivery happens where it survives."""
    make_worker("w1")
    trainer = RolloutClient(cluster.url + "?durable_replicas=1&durable_timeout_ms=5000", policy=policy,
                            trainer_id="alice", reconnect_s=60)
    try:
        await trainer.submit([[1, 2]], n=1, sampling={"max_tokens": 2}, job_id="before")
        await collect(trainer, 1, timeout_s=30)  # the trainer's group exists, replicated
        await trainer.submit([[1, 2]], n=1, sampling={"max_tokens": 2}, job_id="during")
        stream = Keys(policy).results("alice")
        primary = cluster.primary_of(stream)
        replica = cluster.replica_of(primary)
        with redis_sync.Redis(port=replica.port) as r:  # the result is on the replica
            r.execute_command("READONLY")
            await wait_until(lambda: r.xlen(stream) == 1, what="the result on the replica")
        # The replica lags 2 s, then its primary dies. In that window other writes fill the
        # replication socket (else the replica reads the read's delivery from its buffer when
        # it resumes), then the trainer reads.
        failover = asyncio.create_task(asyncio.to_thread(cluster.fail_over_by_kill, stream, lag_s=2.0))
        await asyncio.sleep(0.3)
        with redis_sync.Redis(port=primary.port) as r:
            for i in range(48):
                r.set(f"{{{policy}}}filler{i}", b"x" * 1_000_000)
        first = await trainer.take(1, timeout_s=60)
        await failover
        again = await trainer.take(1, timeout_s=3)
    finally:
        await trainer.close()
    assert [r.job_id for r in first] == ["during"]
    assert again == [], "the same result was handed out twice"


async def test_a_consumer_group_lost_with_its_primary_is_made_again(cluster, redis, make_client,
                                                                     make_worker, policy, monkeypatch):
    """A trainer's consumer group made just before its primary died is gone on the promoted
    replica (as on a wiped Redis): the periodic look for orphaned results must make it again,
    not fail the trainer's read with NOGROUP."""
    monkeypatch.setattr(results, "ORPHAN_CHECK_S", 0.2)
    make_worker("w1")
    trainer = make_client("alice")
    await trainer.submit([[1]], n=1, sampling={"max_tokens": 2})
    await collect(trainer, 1, timeout_s=30)
    await redis.xgroup_destroy(Keys(policy).results("alice"), Group.TRAINER)
    await asyncio.sleep(0.3)  # the next read looks for orphans first
    await trainer.submit([[2]], n=1, sampling={"max_tokens": 2})
    [again] = await collect(trainer, 1, timeout_s=30)
    assert again.prompt_ids == [2]


async def test_durable_submits_survive_three_failovers(cluster, policy, tmp_path, request):
    """Primaries SIGKILLed while 3 trainers submit and 3 workers serve, each time after its
    replica lagged: with `durable_replicas=1` every acknowledged submit survives, and every
    group gets its result once. (Without it some are lost: docs/reliability.md has the counts.)"""
    url = cluster.url + "?durable_replicas=1&durable_timeout_ms=2000"
    workers = request.node.spawned_workers = [
        WorkerProcess(url, policy, tmp_path, f"fw{i}", engine="instant", poll_s=0.1, lease_s=2,
                      max_inflight=16) for i in range(3)]
    try:
        # The replica lags 1 s before each kill: without WAIT, submits acknowledged in that
        # second are lost with the primary (bench/cluster.py counts them). The first kill
        # waits for the three workers' heartbeats to say they serve.
        count = await submit_through_failovers(cluster, url, policy, failovers=3, lag_s=1.0,
                                               trainers=3, submitters=6, workers=3)
    finally:
        for worker in workers:
            worker.close()
    print(f"acknowledged {len(count.acknowledged)} submits, lost {len(count.lost_jobs)}, "
          f"unanswered groups {count.missing_results}, duplicates {count.duplicates}")
    assert len(count.acknowledged) > 20
    assert count.lost_jobs == []
    assert count.missing_results == 0
    assert count.duplicates == 0, count.twice
