"""Redis ACL users per trainer (the recipe in docs/reliability.md) and TLS through the URL."""

from __future__ import annotations

import asyncio
import subprocess
import uuid

import pytest
import redis.asyncio as redis_async
from redis.exceptions import AuthenticationError, ConnectionError, NoPermissionError, ResponseError

from rollq.client import RolloutClient
from rollq.engine.instant import InstantEngine
from rollq.harness.faults import RedisProcess
from rollq.queue.connection import connect
from rollq.queue.keys import Keys
from rollq.queue.work import WorkQueue
from rollq.security import trainer_acl, worker_acl
from rollq.worker.loop import Worker
from rollq.worker.limits import Limits


async def served_worker(url: str, policy: str):
    redis = connect(url)
    worker = Worker(WorkQueue(redis, Keys(policy), f"w-{uuid.uuid4().hex[:6]}", job_ttl_s=600),
                    InstantEngine(),
                    Limits(max_inflight=4, lease_s=5, max_deliveries=3, grace_s=1, poll_s=0.1))
    return worker, asyncio.create_task(worker.run()), redis


class AclUsers:
    """Trainers alice, bob and mallory and a worker as `rollq acl` makes them (passwords
    `<name>-pw`); what a test opens through it is closed after the test."""

    def __init__(self, port: int, policy: str, admin):
        self.url = f"redis://{{}}@127.0.0.1:{port}/0"
        self.policy = policy
        self.admin = admin
        self._clients: list[RolloutClient] = []
        self._workers: list[tuple[Worker, asyncio.Task, object]] = []

    def client(self, user: str, trainer_id: str | None = None) -> RolloutClient:
        client = RolloutClient(self.url.format(f"{user}:{user}-pw"), policy=self.policy,
                               trainer_id=trainer_id or user)
        self._clients.append(client)
        return client

    async def worker(self) -> Worker:
        worker, task, redis = await served_worker(self.url.format("worker:worker-pw"), self.policy)
        self._workers.append((worker, task, redis))
        return worker

    async def close(self) -> None:
        for worker, task, redis in self._workers:
            worker.stop()
            worker.stop()
            await asyncio.wait_for(task, 30)
            await redis.aclose()
        for client in self._clients:
            await client.close()
        await self.admin.aclose()


@pytest.fixture
async def acl(durable_redis, policy):
    admin = redis_async.Redis(port=durable_redis.port)
    for name in ("alice", "bob", "mallory"):
        await admin.execute_command("ACL", "SETUSER", *trainer_acl(policy, name, f"{name}-pw"))
    await admin.execute_command("ACL", "SETUSER", *worker_acl(policy, "worker", "worker-pw"))
    users = AclUsers(durable_redis.port, policy, admin)
    try:
        yield users
    finally:
        await users.close()


async def test_acl_trainer_users_reach_only_their_own_streams(acl, durable_redis, policy):
    await acl.admin.execute_command("ACL", "SETUSER", "default", "on", ">admin-pw")
    durable_redis.password = "admin-pw"
    anonymous = redis_async.Redis(port=durable_redis.port)
    with pytest.raises(AuthenticationError):
        await anonymous.get("anything")
    await anonymous.aclose()

    await acl.worker()
    alice, bob = acl.client("alice"), acl.client("bob")
    await alice.submit([[1, 2]], n=2, sampling={"max_tokens": 3})
    await bob.submit([[3, 4]], n=1, sampling={"max_tokens": 3})
    [mine] = await alice.take(1, timeout_s=30)
    assert mine.status == "ok" and mine.prompt_ids == [1, 2]
    keys = Keys(policy)
    with pytest.raises(NoPermissionError):  # bob's results are not alice's to read...
        await alice.redis.xrange(keys.results("bob"))
    with pytest.raises(NoPermissionError):  # ...nor his work stream to write
        await alice.redis.xadd(keys.work("bob"), {"d": b"x"})
    posing = acl.client("alice", trainer_id="bob")
    with pytest.raises((NoPermissionError, ResponseError), match="(?i)noperm|permission"):
        await posing.submit([[5]], n=1)  # the submit script touches bob's keys
    with pytest.raises((NoPermissionError, ResponseError), match="(?i)noperm|permission"):
        await posing.take(1, timeout_s=1)
    [theirs] = await bob.take(1, timeout_s=30)
    assert theirs.prompt_ids == [3, 4]


async def test_acl_trainer_users_run_episodes_on_their_own_keys(acl, policy):
    """A trainer limited by `rollq acl` runs episodes (its derived trainer's streams, a routed
    turn, its episode records, the shared episode listing), and another trainer's episode
    records stay NOPERM."""
    worker = await acl.worker()
    alice, bob = acl.client("alice"), acl.client("bob")
    episodes, theirs = alice.episodes(), bob.episodes()
    try:
        [first] = await episodes.start([1, 2], sampling={"max_tokens": 3})
        turn = await episodes.turn(first.episode_id, [4])  # routed to the worker that served turn 1
        assert turn.worker_id == worker.worker_id
        episode = await episodes.end(first.episode_id)
        assert episode.turns == 2 and episode.tokens == [1, 2, *first.tokens, 4, *turn.tokens]
        [other] = await theirs.start([7], sampling={"max_tokens": 2})
        with pytest.raises(NoPermissionError):
            await alice.redis.hgetall(Keys(policy).episode("bob", other.episode_id))
    finally:
        await episodes.close()
        await theirs.close()


async def test_acl_trainer_users_read_their_own_conversations_only(acl, policy):
    """The gateway (here: an unrestricted client) writes conversation records; a trainer under
    `rollq acl` reads its own with `RolloutClient.conversation`, another's is NOPERM."""
    from rollq import conversations
    from rollq.protocol import GroupResult, Sample, pack_floats, pack_tokens

    sample = Sample(pack_tokens([5]), pack_floats([-0.5]), "stop", versions=[(0, 0)])
    result = GroupResult("chatcmpl-1", 0, "ok", samples=[sample], prompt=pack_tokens([1, 2]))
    for trainer in ("alice", "bob"):
        gateway = RolloutClient(f"redis://127.0.0.1:{acl.admin.connection_pool.connection_kwargs['port']}/0",
                                policy=policy, trainer_id=trainer)
        try:
            await conversations.append(gateway, "c1", "chatcmpl-1", conversations.Prior(),
                                       [{"role": "user", "content": "x"}], {"role": "assistant"}, result)
        finally:
            await gateway.close()
    alice = acl.client("alice")
    assert (await alice.conversation("c1")).tokens == [1, 2, 5]
    with pytest.raises(NoPermissionError):
        await alice.redis.hgetall(Keys(policy).conversation("bob", "c1"))


async def test_acl_trainer_cannot_touch_another_trainers_jobs_quota_or_claim_order(acl, policy):
    """Under `rollq acl`, each attack of a trainer with direct Redis access on another trainer's
    jobs, done markers, quota, results or place in the claim order is NOPERM or has no effect."""
    keys = Keys(policy)
    alice, mallory = acl.client("alice"), acl.client("mallory")
    await alice.submit([[1]], n=1, job_id="step-1")
    await mallory.submit([[2]], n=1, job_id="step-1")  # its own step-1: a job of its own
    m = mallory.redis
    attacks = [
        m.srem(keys.trainers, "alice"), m.delete(keys.trainers), m.delete(keys.bounded_jobs),
        m.hset(keys.job("alice", "step-1"), "state", "cancelled"),
        m.hset(keys.done("alice", "step-1"), "0", "ok"), m.set(keys.quota("alice"), 0),
        m.set(keys.outstanding("alice"), 10**9), m.xadd(keys.results("alice"), {"d": b"x"}),
        m.eval("return redis.call('SREM', KEYS[1], 'alice')", 1, keys.trainers),
        m.scan(0, match=f"{keys.every_key}"),
    ]
    for attack in attacks:
        # (The EVAL is let through and its SREM refused: "can't run this command".)
        with pytest.raises((NoPermissionError, ResponseError),
                           match="(?i)noperm|permission|can.t (access|run)"):
            await attack
    assert await acl.admin.sismember(keys.trainers, "alice")
    assert await acl.admin.hget(keys.job("alice", "step-1"), "state") == b"pending"
    with pytest.raises(KeyError):
        await _status_of(mallory, "alice")
    await acl.worker()
    [mine] = await alice.take(1, timeout_s=30)
    assert mine.status == "ok" and mine.prompt_ids == [1]
    [theirs] = await mallory.take(1, timeout_s=30)
    assert theirs.prompt_ids == [2]


async def test_acl_trainer_users_store_images_within_their_own_budget(acl, policy):
    """Under `rollq acl`, a trainer stores images (its own image keys and holds), the same image
    another stored is its own copy, and no trainer can delete an image or touch another's holds."""
    from vlm import encoded, noise_image

    from rollq.images import digest_of

    image = encoded(noise_image(3, (64, 64)))
    keys = Keys(policy)
    alice, mallory = acl.client("alice"), acl.client("mallory")
    await acl.worker()
    await alice.submit([[1]], n=1, images=[[image]])
    await mallory.upload_image(image)
    [mine] = await alice.take(1, timeout_s=30)
    assert mine.status in ("ok", "failed") and mine.prompt_ids == [1]  # (no VLM: it may fail)
    m = mallory.redis
    for attack in (m.delete(keys.image("alice", digest_of(image))),
                   m.unlink(keys.image("alice", digest_of(image))),
                   m.zrange(keys.image_holds("alice"), 0, -1), m.set(keys.image_bytes("alice"), 0),
                   m.set(keys.trainers, "x")):
        with pytest.raises(NoPermissionError):
            await attack
    for trainer in ("alice", "mallory"):
        assert await acl.admin.get(keys.image_bytes(trainer)) == str(len(image)).encode()
        assert await acl.admin.strlen(keys.image(trainer, digest_of(image))) == len(image)


async def test_acl_trainer_cannot_delete_shorten_overwrite_or_read_anothers_image(acl, policy):
    """The docs' promise "no trainer can delete an image another named", against every command
    that could: DEL, EXPIRE to 0 (review-turn3/acl_images.py: it was allowed), PEXPIRE, SET ... EX 1
    (a replacement that expires), SET ... GET (reads the bytes), GETDEL, GETEX, RENAME. The image
    stays with its TTL and bob's submits naming it are accepted and served."""
    from vlm import encoded, noise_image

    from rollq.images import ImageRef, digest_of

    image = encoded(noise_image(5, (16, 16)))
    bob, mallory = acl.client("bob"), acl.client("mallory")
    ref = await bob.upload_image(image)
    key = Keys(policy).image("bob", ref.digest)
    ttl = await acl.admin.ttl(key)
    assert ttl > 86_400
    await mallory.upload_image(image)  # mallory knows the bytes: she still reaches only her copy
    attacks = [("DEL", key), ("EXPIRE", key, 0), ("PEXPIRE", key, 1), ("EXPIREAT", key, 1),
               ("SET", key, b"x", "EX", 1), ("SET", key, image, "GET"), ("GETDEL", key),
               ("GETEX", key, "EX", 1), ("RENAME", key, Keys(policy).image("mallory", "x")),
               ("GET", key), ("STRLEN", key)]
    for attack in attacks:
        with pytest.raises((NoPermissionError, ResponseError), match="(?i)noperm|permission"):
            await mallory.redis.execute_command(*attack)
    assert await acl.admin.get(key) == image and await acl.admin.ttl(key) >= ttl - 5
    await acl.worker()
    await bob.submit([[1]], n=1, images=[[ImageRef(digest_of(image))]], job_id="named")
    [served] = await bob.take(1, timeout_s=30)
    assert served.job_id == "named" and "not stored" not in served.reason


FUNCTION = "#!lua name=x\nredis.register_function('f', function() return 1 end)"
SERVER_COMMANDS = [("SCRIPT", "FLUSH"), ("SCRIPT", "KILL"), ("FUNCTION", "LOAD", FUNCTION),
                   ("FUNCTION", "FLUSH"), ("FUNCTION", "LIST"), ("MEMORY", "STATS"), ("DBSIZE",),
                   ("CLIENT", "LIST"), ("KEYS", "*"), ("FLUSHALL",), ("CONFIG", "GET", "*"),
                   ("SHUTDOWN",), ("MONITOR",)]


@pytest.mark.parametrize("user", ["alice", "worker"])
async def test_acl_users_run_no_server_commands(acl, durable_redis, user):
    """Neither a trainer nor a worker user may run commands that act on the whole server: load
    persistent code (FUNCTION), flush every client's scripts, read memory or key counts, list
    clients or keys (review-turn3/acl_images.py: FUNCTION LOAD, SCRIPT FLUSH, MEMORY STATS and
    DBSIZE were allowed). Only a trainer also lacks SCAN; the worker user's (`rollq status`) is
    what it needs."""
    r = redis_async.Redis(port=durable_redis.port, username=user, password=f"{user}-pw")
    try:
        for command in SERVER_COMMANDS + ([("SCAN", 0)] if user == "alice" else []):
            with pytest.raises(NoPermissionError):
                await r.execute_command(*command)
        assert await acl.admin.execute_command("FUNCTION", "LIST") == []
    finally:
        await r.aclose()


async def test_acl_publisher_publishes_and_retires_versions(acl, policy, tmp_path):
    """A `--publisher` trainer user publishes versions and its retention (keep=1) retires the
    old ones, with the publisher's commands only; it still runs no server command."""
    import torch

    await acl.admin.execute_command("ACL", "SETUSER", *trainer_acl(policy, "pub", "pub-pw",
                                                                   publisher=True))
    pub = RolloutClient(acl.url.format("pub:pub-pw"), policy=policy, trainer_id="pub",
                        weight_store=str(tmp_path / "store"))
    acl._clients.append(pub)
    await acl.worker()
    await acl.admin.acl_log_reset()
    await pub.submit([[1]], n=1, max_staleness=0, job_id="bounded")  # retention reads its window
    [done] = await pub.take(1, timeout_s=30, ack="manual")
    await pub.ack([done])  # finished: retention drops it from the bounded jobs (SREM)
    for version in (1, 2, 3):
        await pub.publish_weights(version, {"w": torch.full((4,), float(version))}, keep=1)
    assert [e.version for e in await pub.registry.entries()] == [3]
    assert await acl.admin.zscore(Keys(policy).bounded_jobs, Keys(policy).job("pub", "bounded")) is None
    log = await acl.admin.acl_log()
    assert not [e for e in log if e["username"] == "pub"], log  # nothing it needed was refused
    for command in (("FUNCTION", "LOAD", FUNCTION), ("SCRIPT", "FLUSH"), ("DBSIZE",)):
        with pytest.raises(NoPermissionError):
            await pub.redis.execute_command(*command)


async def _status_of(client: RolloutClient, trainer: str):
    """A client posing as another trainer cannot read that trainer's job record."""
    posing = RolloutClient(redis=client.redis, policy=client.keys.policy, trainer_id=trainer)
    try:
        return await posing.status("step-1")
    except (NoPermissionError, ResponseError) as e:
        raise KeyError(str(e)) from None


def make_ca(directory, name: str) -> None:
    """A CA (ca.pem) and a server certificate for 127.0.0.1 signed by it, with openssl."""
    directory.mkdir(parents=True)
    run = lambda *args: subprocess.run(["openssl", *args], cwd=directory, check=True,  # noqa: E731
                                       capture_output=True)
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "2", "-subj", f"/CN={name}")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "2", "-extfile", "san.ext")


async def test_tls_only_redis_plaintext_and_wrong_ca_fail_right_ca_works(tmp_path, policy):
    make_ca(tmp_path / "tls", "rollq test CA")
    make_ca(tmp_path / "other", "someone else's CA")
    server = RedisProcess(tmp_path / "redis", tls_dir=tmp_path / "tls").start()
    try:
        plain = redis_async.Redis(port=server.port, socket_timeout=2)
        with pytest.raises(ConnectionError):
            await plain.ping()
        await plain.aclose()
        wrong = redis_async.Redis.from_url(
            f"rediss://127.0.0.1:{server.port}/0?ssl_ca_certs={tmp_path / 'other' / 'ca.pem'}")
        with pytest.raises(ConnectionError, match="(?i)certificate verify failed"):
            await wrong.ping()
        await wrong.aclose()

        worker, task, worker_redis = await served_worker(server.url, policy)
        async with RolloutClient(server.url, policy=policy, trainer_id="t") as client:
            await client.submit([[7, 8]], n=1, sampling={"max_tokens": 2})
            [result] = await client.take(1, timeout_s=30)
        assert result.status == "ok" and result.prompt_ids == [7, 8]
        worker.stop()
        worker.stop()
        await asyncio.wait_for(task, 30)
        await worker_redis.aclose()
    finally:
        server.stop()
