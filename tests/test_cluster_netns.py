"""A trainer and a worker process in network namespaces of their own, reaching a Redis Cluster
over veth pairs (not loopback), and the trainer's link cut for 3 s while it submits.

Needs root and iproute2 (skipped otherwise). Every namespace, link and process is removed again.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid

import pytest
from cluster_fixtures import ClusterProcesses

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="network namespaces need root and iproute2")

SUBNET = "10.213"
"""Addresses used here: the cluster at .0.1, namespace k at .k.2 via .k.1."""

TRAINER = """
import asyncio, json, sys
from rollq.client import RolloutClient

async def main(url, policy, jobs):
    async with RolloutClient(url, policy=policy, trainer_id="t", reconnect_s=60) as client:
        for i in range(jobs):
            await client.submit([[i + 1, g] for g in range(4)], n=1, job_id=f"j{i}")
            print("submitted", i, flush=True)
            await asyncio.sleep(0.02)
        got = await client.take(4 * jobs, timeout_s=90)
        print(json.dumps(sorted([r.job_id, r.group_index] for r in got)), flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
"""


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class Namespaces:
    """A link holding the cluster's address, and namespaces joined to it by veth pairs."""

    def __init__(self):
        self.tag = uuid.uuid4().hex[:5]
        self.names: list[str] = []
        # A veth pair with both ends here stands in for a dummy link (no dummy module in
        # containers): an address that stays up whichever namespace's link is cut.
        self.dummy = f"rqd{self.tag}"
        ip("link", "add", self.dummy, "type", "veth", "peer", "name", f"rqe{self.tag}")
        ip("addr", "add", f"{SUBNET}.0.1/32", "dev", self.dummy)
        ip("link", "set", self.dummy, "up")
        ip("link", "set", f"rqe{self.tag}", "up")

    def add(self, k: int) -> str:
        name, host_end, ns_end = f"rq{k}{self.tag}", f"rqh{k}{self.tag}", f"rqn{k}{self.tag}"
        ip("netns", "add", name)
        self.names.append(name)
        ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        ip("link", "set", ns_end, "netns", name)
        ip("addr", "add", f"{SUBNET}.{k}.1/24", "dev", host_end)
        ip("link", "set", host_end, "up")
        ip("-n", name, "addr", "add", f"{SUBNET}.{k}.2/24", "dev", ns_end)
        ip("-n", name, "link", "set", ns_end, "up")
        ip("-n", name, "link", "set", "lo", "up")
        ip("-n", name, "route", "add", "default", "via", f"{SUBNET}.{k}.1")
        return name

    def link(self, k: int, state: str) -> None:
        ip("link", "set", f"rqh{k}{self.tag}", state)

    def remove(self) -> None:
        for name in self.names:  # a namespace takes its veth ends with it
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", self.dummy], capture_output=True)


@pytest.fixture
def namespaces():
    try:
        made = Namespaces()
    except subprocess.CalledProcessError as e:  # root without CAP_NET_ADMIN (some containers)
        pytest.skip(f"cannot make network links here: {e.stderr.decode().strip()}")
    try:
        yield made
    finally:
        made.remove()


def test_trainer_and_worker_in_namespaces_ride_out_a_cut_link(namespaces, tmp_path):
    trainer_ns, worker_ns = namespaces.add(1), namespaces.add(2)
    cluster = ClusterProcesses(tmp_path / "cluster", host=f"{SUBNET}.0.1").start()
    policy, jobs = f"t{uuid.uuid4().hex[:10]}", 150
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen(["ip", "netns", "exec", worker_ns, sys.executable, "-m", "rollq",
                                   "worker", "--redis-url", cluster.url, "--policy", policy,
                                   "--engine", "instant", "--poll-s", "0.1", "--lease-s", "5"],
                                  stdout=log, stderr=log, env=env)
        trainer = subprocess.Popen(["ip", "netns", "exec", trainer_ns, sys.executable, "-c", TRAINER,
                                    cluster.url, policy, str(jobs)], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True, env=env)
        try:
            for line in trainer.stdout:
                if line.startswith("submitted 30"):
                    break
            namespaces.link(1, "down")  # packets vanish: no reset, no error, just silence
            began = time.monotonic()
            probe = subprocess.run(["ip", "netns", "exec", trainer_ns, sys.executable, "-c",
                                    "import socket; socket.create_connection("
                                    f"('{SUBNET}.0.1', {cluster.nodes[0].port}), 1)"], capture_output=True)
            time.sleep(max(0.0, 3 - (time.monotonic() - began)))
            namespaces.link(1, "up")
            assert probe.returncode != 0, "the trainer still reached Redis through a cut link"
            out, err = trainer.communicate(timeout=180)
        finally:
            for proc in (trainer, worker):
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
            cluster.stop()
    assert trainer.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    expected = sorted([f"j{i}", g] for i in range(jobs) for g in range(4))
    assert got == expected, (tmp_path / "worker.log").read_text()[-2000:]
