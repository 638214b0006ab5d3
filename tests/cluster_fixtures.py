"""A real 3-primary / 3-replica Redis Cluster on free loopback ports, for tests/test_cluster.py.

Each node is a `rollq.harness.faults.RedisProcess` (AOF fsynced on every write, SIGKILL and restart on
the same port and directory), started with cluster mode on; `redis-cli --cluster create` joins
them. A short node timeout makes a killed primary's replica take over within a few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import shutil
import socket
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis as redis_sync
from redis.cluster import key_slot

from rollq.client import RolloutClient
from rollq.harness.faults import RedisProcess
from rollq.queue.keys import Keys
from rollq.queue.workers import live_workers

NODE_TIMEOUT_MS = 1500
"""How long a primary may be silent before its replica takes over (redis default: 15 s)."""


def free_cluster_port() -> int:
    """A free port P with P + 10000 (the cluster bus) free too; Redis refuses P > 55535."""
    while True:
        port = random.randint(20_000, 45_000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10_000))
            return port
        except OSError:
            continue


class ClusterProcesses:
    def __init__(self, workdir: Path, *, primaries: int = 3, replicas: int = 1, host: str = "127.0.0.1"):
        """`host`: also listen on, and announce, this address (e.g. a veth end that processes in
        other network namespaces reach); loopback stays for the fixture's own checks."""
        if shutil.which("redis-cli") is None:
            raise RuntimeError("redis-cli is not installed (apt-get install redis-server)")
        self.replicas, self.host = replicas, host
        self.nodes: list[RedisProcess] = []
        for _ in range(primaries * (1 + replicas)):
            port = free_cluster_port()
            extra = ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                     "--cluster-node-timeout", str(NODE_TIMEOUT_MS)]
            if host != "127.0.0.1":
                # No password on these test nodes: protected mode would refuse the other address.
                extra += ["--bind", "127.0.0.1", host, "--cluster-announce-ip", host,
                          "--protected-mode", "no"]
            self.nodes.append(RedisProcess(workdir / str(port), port=port, extra=extra))

    @property
    def url(self) -> str:
        """Three seed nodes: the client still finds the cluster when one of them is down."""
        return "redis+cluster://" + ",".join(f"{self.host}:{n.port}" for n in self.nodes[:3]) + "/"

    def start(self, timeout_s: float = 60) -> ClusterProcesses:
        try:
            for node in self.nodes:
                node.start()
            subprocess.run(["redis-cli", "--cluster", "create",
                            *(f"{self.host}:{n.port}" for n in self.nodes),
                            "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                           check=True, capture_output=True, timeout=timeout_s)
            self.wait_healthy(timeout_s)
        except BaseException:  # no node may outlive a failed start
            self.stop()
            raise
        return self

    def _client(self, node: RedisProcess) -> redis_sync.Redis:
        return redis_sync.Redis(port=node.port, socket_timeout=2, decode_responses=True)

    def _info(self, node: RedisProcess, section: str) -> dict:
        with self._client(node) as r:
            return r.info(section)

    def wait_healthy(self, timeout_s: float = 60) -> None:
        """Every node up and `cluster_state:ok`, every primary with its replicas in sync."""
        give_up = time.monotonic() + timeout_s
        while True:
            try:
                if self._healthy():
                    return
            except (redis_sync.ConnectionError, redis_sync.TimeoutError,
                    redis_sync.exceptions.BusyLoadingError):
                pass
            if time.monotonic() > give_up:
                raise RuntimeError("the redis cluster did not become healthy; logs under "
                                   f"{self.nodes[0].workdir.parent}")
            time.sleep(0.1)

    def _healthy(self) -> bool:
        for node in self.nodes:
            with self._client(node) as r:
                if "cluster_state:ok" not in r.execute_command("CLUSTER", "INFO"):
                    return False
        primaries = [n for n in self.nodes if self._info(n, "replication")["role"] == "master"]
        return len(primaries) == len(self.nodes) // (1 + self.replicas) and all(
            self._replicas_online(p) == self.replicas for p in primaries)

    def _replicas_online(self, primary: RedisProcess) -> int:
        info = self._info(primary, "replication")
        return sum(1 for k, v in info.items()
                   if k.startswith("slave") and isinstance(v, dict) and v.get("state") == "online")

    def primary_of(self, key: str) -> RedisProcess:
        """The node that serves `key`'s slot now, as a running node sees it."""
        slot = key_slot(key.encode())
        asked = next(n for n in self.nodes if n.proc is not None and n.proc.poll() is None)
        with self._client(asked) as r:
            for start, end, primary, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return next(n for n in self.nodes if n.port == int(primary[1]))
        raise RuntimeError(f"no node serves slot {slot}")

    def replica_of(self, primary: RedisProcess) -> RedisProcess:
        port = int(self._info(primary, "replication")["slave0"]["port"])
        return next(n for n in self.nodes if n.port == port)

    def fail_over_by_kill(self, key: str, *, lag_s: float = 0.0, timeout_s: float = 60) -> RedisProcess:
        """SIGKILL the primary of `key`'s slot, wait until a replica serves it, then restart the
        killed node (as a supervisor would): it rejoins as a replica. Returns the new primary.

        `lag_s`: first freeze the replica that long (SIGSTOP), so that it lags as a replica on a
        busy or distant host does; what the primary acknowledged meanwhile and could not hand
        to the replica's socket dies with it. On loopback a replica is otherwise microseconds
        behind and a kill loses nothing measurable."""
        old = self.primary_of(key)
        replica = self.replica_of(old) if lag_s else None
        if replica is not None:
            replica.pause()
            time.sleep(lag_s)
        old.kill()
        if replica is not None:
            replica.resume()
        give_up = time.monotonic() + timeout_s
        while (new := self.primary_of(key)) is old:
            if time.monotonic() > give_up:
                raise RuntimeError(f"no replica took over from port {old.port}")
            time.sleep(0.1)
        old.start()
        self.wait_healthy(timeout_s)
        return new

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


_SHARED = pytest.StashKey[ClusterProcesses]()


def shared_cluster(request, tmp_path_factory) -> ClusterProcesses:
    """One cluster for the whole test session (a start costs seconds): started by the first
    module that asks, stopped when pytest ends. Each module's `cluster` fixture returns it
    (a fixture defined here and imported by two modules would be two fixtures, two clusters)."""
    nodes = request.config.stash.get(_SHARED, None)
    if nodes is None:
        nodes = ClusterProcesses(tmp_path_factory.mktemp("cluster")).start()
        request.config.stash[_SHARED] = nodes
        request.config.add_cleanup(nodes.stop)
    return nodes


@dataclass
class FailoverCount:
    """What a trainer lost while primaries were killed under it."""

    acknowledged: dict[str, int] = field(default_factory=dict)
    """Job id -> groups, for every submit that returned."""
    lost_jobs: list[str] = field(default_factory=list)
    """Acknowledged submits whose job record is gone (their groups never come)."""
    missing_results: int = 0
    """Groups of surviving jobs without a result when the run ended."""
    duplicates: int = 0
    """Results delivered more than once."""
    twice: dict[tuple[str, int], list[tuple[str, str]]] = field(default_factory=dict)
    """(job, group) -> (result entry id, worker) of each delivery, for the groups delivered
    more than once: one entry read twice (a lost delivery) or a group generated twice."""
    submit_s: list[float] = field(default_factory=list)
    """Latency of each acknowledged submit."""


async def submit_through_failovers(cluster: ClusterProcesses, url: str, policy: str, *, failovers: int,
                                   lag_s: float = 0.0, submitters: int = 4, groups: int = 4,
                                   trainers: int = 1, workers: int = 1, settle_s: float = 60,
                                   workers_timeout_s: float = 120) -> FailoverCount:
    """Trainers (`trainer0`.., fed by `submitters` tasks round-robin, job ids `<submitter>-<i>`)
    submit and read results while the primary of the policy's slot is SIGKILLed `failovers`
    times, each time after its replica lagged `lag_s`. The first kill waits until `workers`
    workers' heartbeats show them serving `policy` (a worker still starting would meet the
    failover in its own start-up, which is not what this counts). Then count what was lost."""
    count, received, seen = FailoverCount(), Counter(), {}
    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(
            RolloutClient(url, policy=policy, trainer_id=f"trainer{t}", reconnect_s=120))
            for t in range(trainers)]
        await _wait_serving(clients[0], workers, workers_timeout_s)
        owner: dict[str, RolloutClient] = {}

        async def submit(k: int) -> None:
            client = clients[k % trainers]
            for i in itertools.count():
                if stop.is_set():
                    return
                began = time.monotonic()
                job = await client.submit([[k + 1, i, g] for g in range(groups)], n=1, job_id=f"{k}-{i}")
                count.submit_s.append(time.monotonic() - began)
                count.acknowledged[job], owner[job] = groups, client

        async def read(client: RolloutClient) -> None:
            async for result in client.results(block_s=0.5):
                received[(result.job_id, result.group_index)] += 1
                seen.setdefault((result.job_id, result.group_index), []).append(
                    (result.entry_id, result.worker_id))

        readers = [asyncio.create_task(read(c)) for c in clients]
        senders = [asyncio.create_task(submit(k)) for k in range(submitters)]
        for _ in range(failovers):
            await asyncio.sleep(1.0)  # traffic before each kill
            await asyncio.to_thread(cluster.fail_over_by_kill, Keys(policy).trainers, lag_s=lag_s)
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*senders)
        for job in count.acknowledged:
            if await _job_gone(owner[job], job):
                count.lost_jobs.append(job)
        expected = {(j, g) for j, n in count.acknowledged.items() if j not in count.lost_jobs
                    for g in range(n)}
        give_up = time.monotonic() + settle_s
        while not expected <= set(received) and time.monotonic() < give_up:
            await asyncio.sleep(0.2)
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    count.missing_results = len(expected - set(received))
    count.duplicates = sum(n - 1 for n in received.values())
    count.twice = {k: v for k, v in seen.items() if len(v) > 1}
    return count


async def _wait_serving(client: RolloutClient, workers: int, timeout_s: float) -> None:
    give_up = time.monotonic() + timeout_s
    while True:
        beats = await live_workers(client.redis, client.keys)
        serving = [b for b in beats if b.state == "serving" and time.time() - b.at < 10]
        if len(serving) >= workers:
            return
        if time.monotonic() > give_up:
            raise RuntimeError(f"{len(serving)} of {workers} workers serving {client.keys.policy} "
                               f"after {timeout_s} s: {beats}")
        await asyncio.sleep(0.2)


async def _job_gone(client: RolloutClient, job_id: str) -> bool:
    try:
        await client.status(job_id)
    except KeyError:
        return True
    return False
