"""Redis Cluster numbers for docs/reliability.md and docs/scaling.md, on a private 3+3 cluster
(tests/cluster_fixtures.py):

1. failovers: a trainer submits (4 submitters, jobs of 4 groups) while a worker process serves
   and the policy's primary is SIGKILLed 3 times (at once, or after its replica lagged 2 s);
   counted without and with durable_replicas=1.
2. submit latency without and with `WAIT 1` (no failover; jobs of 4 groups, n=8).
3. per group: Redis commands, CPU time, network bytes and memory on the policy's primary for
   2,000 groups submitted, served (instant engine), read and acknowledged.
4. cluster vs one node, same run: the dispatch and scale workloads (below) alternately against
   one redis-server with one replica and against the cluster's primary of the policy (a
   different shard each repeat), Redis-side cost per group as ratios cluster / one node, and
   each shard's capacity (groups/s one core carries; dispatch groups/s measured).

    PYTHONPATH=. python bench/cluster.py [--parts per_group,latency,vs_one_node,failovers]
        [--failovers-only | --vs-one-node] [--repeats 6] [--groups 10000]
    # prints JSON (and the comparison's table); writes bench/results/cluster.json when every
    # part ran, else cluster-<parts>.json (cluster-failovers.json, cluster-vs-one-node.json)
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import redis as redis_sync

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from cluster_fixtures import ClusterProcesses, submit_through_failovers  # noqa: E402

from common import machine, stop_process  # noqa: E402
from dispatch import _at_least_members, _spawn, _wait  # noqa: E402
from scale import fill  # noqa: E402

from rollq.harness.bench import results_dir  # noqa: E402
from rollq.client import RolloutClient  # noqa: E402
from rollq.harness.faults import RedisProcess  # noqa: E402
from rollq.engine.instant import InstantEngine  # noqa: E402
from rollq.queue.connection import connect  # noqa: E402
from rollq.queue.keys import Keys  # noqa: E402
from rollq.queue.work import WorkQueue  # noqa: E402
from rollq.worker.loop import Worker  # noqa: E402
from rollq.worker.limits import Limits  # noqa: E402

DURABLE = "?durable_replicas=1&durable_timeout_ms=2000"


def _ms(values: list[float], q: float) -> float:
    return round(statistics.quantiles(values, n=100)[int(q) - 1] * 1000, 2)


async def failovers(cluster: ClusterProcesses, durable: bool, log_dir: Path, lag_s: float) -> dict:
    url = cluster.url + (DURABLE if durable else "")
    policy = f"fo{uuid.uuid4().hex[:8]}"
    with open(log_dir / f"{policy}.log", "w") as log:
        worker = subprocess.Popen([sys.executable, "-m", "rollq", "worker", "--redis-url", url,
                                   "--policy", policy, "--engine", "instant", "--lease-s", "2",
                                   "--max-inflight", "16", "--poll-s", "0.1"], stdout=log, stderr=log)
        try:
            count = await submit_through_failovers(cluster, url, policy, failovers=3, lag_s=lag_s)
        finally:
            worker.kill()
            worker.wait()
    return dict(durable=durable, replica_lag_s=lag_s, acknowledged_jobs=len(count.acknowledged),
                lost_jobs=len(count.lost_jobs),
                lost_groups=sum(count.acknowledged[j] for j in count.lost_jobs),
                missing_results=count.missing_results, duplicates=count.duplicates,
                submit_p50_ms=_ms(count.submit_s, 50), submit_p99_ms=_ms(count.submit_s, 99))


async def latency(cluster: ClusterProcesses, durable: bool, submits: int = 400) -> dict:
    url = cluster.url + (DURABLE if durable else "")
    prompts = [[7] * 256 for _ in range(4)]
    took = []
    async with RolloutClient(url, policy=f"lat{uuid.uuid4().hex[:8]}", trainer_id="t") as client:
        for _ in range(submits):
            began = time.perf_counter()
            await client.submit(prompts, n=8, sampling={"max_tokens": 16})
            took.append(time.perf_counter() - began)
    return dict(durable=durable, submits=submits, p50_ms=_ms(took, 50), p99_ms=_ms(took, 99))


async def per_group(cluster: ClusterProcesses, groups: int = 2000, per_job: int = 100) -> dict:
    """Commands, CPU, bytes and memory of the policy's primary per group, whole life cycle."""
    policy = f"pg{uuid.uuid4().hex[:8]}"
    primary = cluster.primary_of(Keys(policy).trainers)
    admin = redis_sync.Redis(port=primary.port, decode_responses=True)
    admin.config_resetstat()
    before = admin.info("all")
    prompt, n, max_tokens = [7] * 256, 8, 512
    async with RolloutClient(cluster.url, policy=policy, trainer_id="t", max_outstanding=groups) as client:
        for j in range(groups // per_job):
            await client.submit([prompt] * per_job, n=n, sampling={"max_tokens": max_tokens}, job_id=f"j{j}")
        queued = admin.memory_usage(Keys(policy).work("t"), samples=0)
        used_queued = admin.info("memory")["used_memory"] - before["used_memory"]
        redis = connect(cluster.url)
        worker = Worker(WorkQueue(redis, Keys(policy), "w", job_ttl_s=600), InstantEngine(),
                        Limits(max_inflight=64, lease_s=30, max_deliveries=3, grace_s=1, poll_s=0.1))
        task = asyncio.create_task(worker.run())
        got = await client.take(groups, timeout_s=600)
        await client.ack()  # take acknowledges at its next call: the whole life cycle needs it now
        worker.stop()
        await task
        await redis.aclose()
    after = admin.info("all")
    calls = {k.removeprefix("cmdstat_"): v["calls"] for k, v in after.items()
             if k.startswith("cmdstat_") and isinstance(v, dict)}
    cpu = sum(after[k] - before[k] for k in ("used_cpu_user", "used_cpu_sys"))
    admin.close()
    return dict(groups=groups, results=len(got), prompt_tokens=len(prompt), n=n, max_tokens=max_tokens,
                commands_per_group={k: round(v / groups, 3) for k, v in sorted(calls.items())},
                commands_total_per_group=round(sum(calls.values()) / groups, 2),
                cpu_ms_per_group=round(cpu / groups * 1000, 4),
                net_in_bytes_per_group=round((after["total_net_input_bytes"]
                                              - before["total_net_input_bytes"]) / groups),
                net_out_bytes_per_group=round((after["total_net_output_bytes"]
                                               - before["total_net_output_bytes"]) / groups),
                repl_out_bytes_per_group=round((after.get("total_net_repl_output_bytes", 0)
                                                - before.get("total_net_repl_output_bytes", 0)) / groups),
                work_stream_bytes_per_queued_group=round(queued / groups),
                used_memory_per_queued_group=round(used_queued / groups))

# Cluster vs one node, same run.
#
# dispatch: no-op groups (1-token prompt, n=1) submitted in jobs of 1,000 while one
#   `rollq worker --engine instant` (max_inflight 256) serves them, as bench/dispatch.py.
# scale: 16-token groups queued ahead in jobs of 10,000 (bench/scale.py's fill), then drained
#   by 2 worker processes, as bench/scale.py's depth and worker-count shapes.
# In both the trainer takes (reads and acknowledges) every result.

WORKLOADS = {"dispatch": dict(workers=1, prefill=False), "scale": dict(workers=2, prefill=True)}
ADMIN = Counter({"config|resetstat": 1, "info": 1})
"""This benchmark's own commands to the measured node (the reset, the first INFO): not counted."""
SENT: Counter = Counter()
"""(port, command) -> commands this process's asyncio clients sent (count_sent)."""


def count_sent() -> None:
    """Count every command redis-py's asyncio connections pack (pipelines pack each command),
    by the server port it goes to: what clients send, which `INFO commandstats` (counting also
    the commands run inside scripts) cannot tell apart."""
    from redis.asyncio.connection import AbstractConnection

    pack = AbstractConnection.pack_command
    if getattr(pack, "counted", False):
        return

    def counted(self, *args):
        name = args[0].decode() if isinstance(args[0], bytes) else str(args[0])
        SENT[(getattr(self, "port", 0), name.lower())] += 1
        return pack(self, *args)

    counted.counted = True
    AbstractConnection.pack_command = counted


def counted_worker(out: str, args: list[str]) -> None:
    """`rollq worker ARGS` with its sent commands written to `out` as it exits."""
    from rollq.cli import main as cli

    count_sent()
    atexit.register(lambda: Path(out).write_text(json.dumps([[p, c, n] for (p, c), n in SENT.items()])))
    cli(["worker", *args])


class OneNode:
    """One redis-server feeding one replica, both with AOF fsynced on every write like the
    cluster's nodes: what the cluster's primary does for its shard, without the cluster."""

    def __init__(self, workdir: Path):
        self.primary = RedisProcess(workdir / "primary")
        self.replica = RedisProcess(workdir / "replica",
                                    extra=["--replicaof", "127.0.0.1", str(self.primary.port)])
        self.url = self.primary.url

    def start(self, timeout_s: float = 30) -> OneNode:
        self.primary.start()
        self.replica.start()
        give_up = time.monotonic() + timeout_s
        with redis_sync.Redis(port=self.primary.port, decode_responses=True) as r:
            while r.info("replication").get("slave0", {}).get("state") != "online":
                if time.monotonic() > give_up:
                    raise RuntimeError(f"the replica did not sync; log: {self.replica.workdir / 'redis.log'}")
                time.sleep(0.1)
        return self

    def stop(self) -> None:
        self.replica.stop()
        self.primary.stop()


def cluster_primaries(cluster: ClusterProcesses) -> list[RedisProcess]:
    with redis_sync.Redis(port=cluster.nodes[0].port) as r:
        ports = {int(primary[1]) for _, _, primary, *_ in r.execute_command("CLUSTER", "SLOTS")}
    return [n for n in cluster.nodes if n.port in ports]


def policy_on(cluster: ClusterProcesses, node: RedisProcess, prefix: str) -> str:
    """A fresh policy name whose slot `node` serves."""
    while True:
        policy = f"{prefix}{uuid.uuid4().hex[:8]}"
        if cluster.primary_of(Keys(policy).trainers) is node:
            return policy


async def serve(url: str, policy: str, groups: int, *, workers: int, prefill: bool,
                tmp: Path) -> tuple[float, Counter]:
    """One workload: seconds from the workers' registration to the last result acknowledged,
    and the commands the worker processes sent."""
    outs = [tmp / f"{policy}-{i}.json" for i in range(workers)]
    client = RolloutClient(url, policy=policy, trainer_id="bench", max_outstanding=10**7)
    procs = []
    try:
        if prefill:
            await fill(client, groups)
        procs = [_spawn([sys.executable, str(HERE / "cluster.py"), "--counted-worker", str(out),
                         "--redis-url", url, "--policy", policy, "--engine", "instant",
                         "--max-inflight", "256", "--poll-s", "0.05"],
                        {"PYTHONPATH": f"{HERE}:{HERE.parent}"}) for out in outs]
        await _wait(lambda: _at_least_members(client.redis, Keys(policy).workers, workers))
        began = time.perf_counter()
        for start in range(0, groups if not prefill else 0, 1000):
            await client.submit([[1]] * min(1000, groups - start), n=1, sampling={"max_tokens": 1})
        got = 0
        while got < groups:
            got += len(await client.take(min(5000, groups - got), timeout_s=60))
        await client.ack()  # take acknowledges a batch at the next call: the last one now
        took = time.perf_counter() - began
    finally:
        for proc in procs:
            stop_process(proc, 20)
        await client.close()
    sent = Counter()
    for out in outs:
        sent.update({(port, name): n for port, name, n in json.loads(out.read_text())})
    return took, sent


def _cpu(info: dict, suffixes: tuple[str, ...] = ("", )) -> float:
    return sum(info[f"used_cpu_{k}{s}"] for k in ("user", "sys") for s in suffixes)


def _costs(pairs: list[tuple[dict, dict]], sent: Counter, groups: int, idle: float, window: float) -> dict:
    """Per group, summed over nodes' (before, after) INFO: commands (all, and sent by clients),
    bytes, CPU (and CPU less `idle` us/s over `window` s)."""
    calls, net, cpu, cpu_main = Counter(), Counter(), 0.0, 0.0
    for before, after in pairs:
        calls += Counter({k.removeprefix("cmdstat_"): v["calls"] for k, v in after.items()
                          if k.startswith("cmdstat_") and isinstance(v, dict)}) - ADMIN
        net += Counter({k: after[k] - before[k] for k in ("total_net_input_bytes", "total_net_output_bytes",
                                                          "total_net_repl_output_bytes")})
        cpu += _cpu(after) - _cpu(before)
        cpu_main += _cpu(after, ("_main_thread",)) - _cpu(before, ("_main_thread",))
    return dict(commands=round(calls.total() / groups, 3), sent=round(sent.total() / groups, 3),
                net_in_bytes=round(net["total_net_input_bytes"] / groups, 1),
                net_out_bytes=round(net["total_net_output_bytes"] / groups, 1),
                repl_out_bytes=round(net["total_net_repl_output_bytes"] / groups, 1),
                cpu_us=round(cpu / groups * 1e6, 2), cpu_main_us=round(cpu_main / groups * 1e6, 2),
                cpu_busy_us=round((cpu - idle * 1e-6 * window) / groups * 1e6, 2),
                commands_by_name={k: round(v / groups, 3) for k, v in sorted(calls.items())},
                sent_by_name={k: round(v / groups, 3) for k, v in sorted(sent.items())})


async def measure(target: str, url: str, nodes: list[RedisProcess], policy: str, workload: str, groups: int,
                  idle: dict[int, float], tmp: Path) -> dict:
    """Redis-side cost per group of `workload` on the primaries `nodes`, the first of them
    holding `policy` (a cluster client also sends some commands to the other primaries: the
    `COMMAND GETKEYS` of each XREADGROUP goes to the node it first connected to)."""
    admins = [redis_sync.Redis(port=n.port, decode_responses=True) for n in nodes]
    for admin in admins:
        admin.config_resetstat()
    before, window = [a.info("all") for a in admins], time.monotonic()
    SENT.clear()
    took, worker_sent = await serve(url, policy, groups, tmp=tmp, **WORKLOADS[workload])
    after, window = [a.info("all") for a in admins], time.monotonic() - window
    for admin in admins:
        admin.close()
    sent = SENT + worker_sent
    by_port = [Counter({c: n for (p, c), n in sent.items() if p == node.port}) for node in nodes]
    everywhere = _costs(list(zip(before, after)), sum(by_port, Counter()), groups,
                        sum(idle[n.port] for n in nodes), window)
    primary = _costs([(before[0], after[0])], by_port[0], groups, idle[nodes[0].port], window)
    return dict(target=target, workload=workload, port=nodes[0].port, groups=groups, seconds=round(took, 3),
                window_s=round(window, 3), groups_per_s=round(groups / took),
                busy=round(primary["cpu_main_us"] * 1e-6 * groups / took, 3), **everywhere,
                policy_primary=primary)


COMPARED = ("commands", "sent", "net_in_bytes", "net_out_bytes", "cpu_us", "cpu_busy_us")


async def idle_cpu(node: RedisProcess, seconds: float = 3.0) -> float:
    """CPU microseconds per second a node spends with no client work (its cron; a cluster
    node's also gossip with every other node)."""
    with redis_sync.Redis(port=node.port, decode_responses=True) as admin:
        before = _cpu(admin.info("cpu"))
        await asyncio.sleep(seconds)
        return round((_cpu(admin.info("cpu")) - before) / seconds * 1e6, 1)


def summarize(runs: list[dict], idle: dict[int, float]) -> dict:
    """Medians per workload and target of the costs on every primary, cluster / one-node ratios
    against the 1.3x target, and each shard's capacity (1 s of its main thread / its
    main-thread CPU per group). `cpu_busy_us`: CPU per group less what the nodes spend idle."""
    out = {}
    for workload in WORKLOADS:
        med = {t: {k: statistics.median(r[k] for r in runs if r["target"] == t and r["workload"] == workload)
                   for k in (*COMPARED, "cpu_main_us", "repl_out_bytes", "groups_per_s", "window_s")}
               for t in ("one node", "cluster")}
        ratios = {k: round(med["cluster"][k] / med["one node"][k], 3) for k in COMPARED}
        primary = {k: statistics.median(r["policy_primary"][k] for r in runs
                                        if r["target"] == "cluster" and r["workload"] == workload)
                   for k in COMPARED}
        out[workload] = dict(medians=med, ratios=ratios, within_1_3={k: v <= 1.3 for k, v in ratios.items()},
                             cluster_policy_primary=primary,
                             policy_primary_ratios={k: round(primary[k] / med["one node"][k], 3)
                                                    for k in COMPARED})
    shards = {}
    for r in runs:
        if r["target"] == "cluster":
            shards.setdefault(r["port"], {}).setdefault(r["workload"], []).append(r)
    for port, by_workload in shards.items():
        shards[port] = {workload: dict(
            runs=len(rs), cpu_main_us=statistics.median(r["policy_primary"]["cpu_main_us"] for r in rs),
            capacity_groups_per_s=round(1e6 / statistics.median(r["policy_primary"]["cpu_main_us"]
                                                                for r in rs)),
            measured_groups_per_s=statistics.median(r["groups_per_s"] for r in rs),
            busy=statistics.median(r["busy"] for r in rs), idle_cpu_us_per_s=idle[port])
            for workload, rs in by_workload.items()}
    out["shards"] = shards
    return out


async def vs_one_node(tmp: Path, cluster: ClusterProcesses, repeats: int, groups: int) -> dict:
    count_sent()  # the trainer's commands
    one = OneNode(tmp / "one").start()
    try:
        shards = cluster_primaries(cluster)
        # Unmeasured, so both compare in steady state: a node first meets rollq's scripts here.
        # (A cluster node without a script answers a whole pipeline NOSCRIPT and gets it again
        # as EVALs with the script's source; a single node's pipeline sends SCRIPT LOAD first.)
        for url, node in [(one.url, one.primary)] + [(cluster.url, s) for s in shards]:
            policy = policy_on(cluster, node, "warm") if url == cluster.url else "warm"
            await serve(url, policy, 1000, tmp=tmp, **WORKLOADS["dispatch"])
        idle = {node.port: await idle_cpu(node) for node in [one.primary, *shards]}
        runs = []
        for i in range(repeats):
            shard = shards[i % len(shards)]
            targets = [("one node", one.url, one.primary), ("cluster", cluster.url, shard)]
            for target, url, node in targets if i % 2 == 0 else targets[::-1]:
                for workload in WORKLOADS:
                    policy = (policy_on(cluster, node, workload) if target == "cluster"
                              else f"{workload}{uuid.uuid4().hex[:8]}")
                    nodes = [node] if target == "one node" else [node, *(s for s in shards if s is not node)]
                    runs.append(await measure(target, url, nodes, policy, workload, groups, idle, tmp))
                    r = runs[-1]
                    print(f"{target:8} {workload:8} port {r['port']}: {r['commands']} commands "
                          f"({r['sent']} sent), {r['cpu_us']} us CPU, in {r['net_in_bytes']} B, out "
                          f"{r['net_out_bytes']} B per group; {r['groups_per_s']} groups/s", flush=True)
    finally:
        one.stop()
    load = os.getloadavg()
    return dict(groups=groups, repeats=repeats, load_average=[round(x, 2) for x in load],
                idle_cpu_us_per_s=idle, summary=summarize(runs, idle), runs=runs)


def report(r: dict) -> None:
    print(f"cluster vs one node: {r['groups']:,} groups per run, {r['repeats']} repeats, "
          f"load {r['load_average']}")
    for workload in WORKLOADS:
        s = r["summary"][workload]
        one, cluster = s["medians"]["one node"], s["medians"]["cluster"]
        print(workload + ": " + "; ".join(
            f"{k} {one[k]:,.1f} -> {cluster[k]:,.1f} = {v:.3f}x{'' if v <= 1.3 else ' MISSED'}"
            for k, v in s["ratios"].items()))
    for port, shard in r["summary"]["shards"].items():
        print(f"shard {port}: " + "; ".join(
            f"{w} {v['cpu_main_us']:.1f} us/group -> {v['capacity_groups_per_s']:,} groups/s per core "
            f"(measured {v['measured_groups_per_s']:,.0f} groups/s at {v['busy']:.0%} busy)"
            for w, v in shard.items()))


PARTS = ("per_group", "latency", "vs_one_node", "failovers")


async def main(parts: list[str], repeats: int, groups: int) -> None:
    out = {}
    log_dir = results_dir()  # the worker logs of the failover runs stay for a look
    log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ClusterProcesses(Path(tmp) / "cluster").start()
        try:
            if "per_group" in parts:
                out["per_group"] = await per_group(cluster)
            if "latency" in parts:
                out["latency"] = [await latency(cluster, d) for d in (False, True)]
            if "vs_one_node" in parts:
                out["vs_one_node"] = await vs_one_node(Path(tmp), cluster, repeats, groups)
            if "failovers" in parts:
                out["failovers"] = [await failovers(cluster, d, log_dir, lag)
                                    for lag in (0.0, 2.0) for d in (False, True)]
        finally:
            cluster.stop()
    out["date"], out["machine"] = time.strftime("%Y-%m-%d %H:%M"), machine()
    print(json.dumps({k: v for k, v in out.items() if k != "vs_one_node"}, indent=1))
    if "vs_one_node" in out:
        report(out["vs_one_node"])
    name = "cluster" if list(parts) == list(PARTS) else "cluster-" + "-".join(parts).replace("_", "-")
    (results_dir() / f"{name}.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--counted-worker"]:  # a worker process of vs_one_node
        counted_worker(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"some of {','.join(PARTS)}")
    parser.add_argument("--failovers-only", action="store_true", help="--parts failovers")
    parser.add_argument("--vs-one-node", action="store_true", help="--parts vs_one_node")
    parser.add_argument("--repeats", type=int, default=6, help="of vs_one_node (a shard each, in turn)")
    parser.add_argument("--groups", type=int, default=10_000, help="per workload run of vs_one_node")
    args = parser.parse_args()
    parts = (["failovers"] if args.failovers_only else ["vs_one_node"] if args.vs_one_node
             else args.parts.split(","))
    if set(parts) - set(PARTS):
        parser.error(f"unknown parts {sorted(set(parts) - set(PARTS))}; there are {', '.join(PARTS)}")
    asyncio.run(main([p for p in PARTS if p in parts], args.repeats, args.groups))
