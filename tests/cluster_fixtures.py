"""A real 3-primary / 3-replica Redis Cluster on free loopback ports, for tests/test_cluster.py.

Each node is a `rollq.faults.RedisProcess` (AOF fsynced on every write, SIGKILL and restart on
the same port and directory), started with cluster mode on; `redis-cli --cluster create` joins
them. A short node timeout makes a killed primary's replica take over within a few seconds.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis as redis_sync
from redis.cluster import key_slot

from rollq.faults import RedisProcess

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
    def __init__(self, workdir: Path, *, primaries: int = 3, replicas: int = 1):
        if shutil.which("redis-cli") is None:
            raise RuntimeError("redis-cli is not installed (apt-get install redis-server)")
        self.replicas = replicas
        self.nodes: list[RedisProcess] = []
        for _ in range(primaries * (1 + replicas)):
            port = free_cluster_port()
            self.nodes.append(RedisProcess(workdir / str(port), port=port, extra=[
                "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", str(NODE_TIMEOUT_MS)]))

    @property
    def url(self) -> str:
        """Three seed nodes: the client still finds the cluster when one of them is down."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:3]) + "/"

    def start(self, timeout_s: float = 60) -> ClusterProcesses:
        for node in self.nodes:
            node.start()
        subprocess.run(["redis-cli", "--cluster", "create",
                        *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                       check=True, capture_output=True, timeout=timeout_s)
        self.wait_healthy(timeout_s)
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

    def fail_over_by_kill(self, key: str, timeout_s: float = 60) -> RedisProcess:
        """SIGKILL the primary of `key`'s slot, wait until a replica serves it, then restart the
        killed node (as a supervisor would): it rejoins as a replica. Returns the new primary."""
        old = self.primary_of(key)
        old.kill()
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
