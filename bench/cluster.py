"""Redis Cluster numbers for docs/reliability.md and docs/scaling.md, on a private 3+3 cluster
(tests/cluster_fixtures.py):

1. failovers: a trainer submits (4 submitters, jobs of 4 groups) while a worker process serves
   and the policy's primary is SIGKILLed 3 times (at once, or after its replica lagged 2 s);
   counted without and with durable_replicas=1.
2. submit latency without and with `WAIT 1` (no failover; jobs of 4 groups, n=8).
3. per group: Redis commands, CPU time, network bytes and memory on the policy's primary for
   2,000 groups submitted, served (instant engine), read and acknowledged.

    PYTHONPATH=. python bench/cluster.py [--failovers-only]   # prints JSON, writes bench/results/cluster.json
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import redis as redis_sync

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from cluster_fixtures import ClusterProcesses, submit_through_failovers  # noqa: E402

from rollq.bench import results_dir  # noqa: E402
from rollq.client import RolloutClient  # noqa: E402
from rollq.engine.instant import InstantEngine  # noqa: E402
from rollq.queue.connection import connect  # noqa: E402
from rollq.queue.keys import Keys  # noqa: E402
from rollq.queue.work import WorkQueue  # noqa: E402
from rollq.worker.loop import Worker  # noqa: E402

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
                        max_inflight=64, lease_s=30, max_deliveries=3, grace_s=1, poll_s=0.1)
        task = asyncio.create_task(worker.run())
        got = await client.take(groups, timeout_s=600)
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


async def main() -> None:
    out = {}
    log_dir = results_dir()  # the worker logs of the failover runs stay for a look
    log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cluster = ClusterProcesses(Path(tmp) / "cluster").start()
        try:
            if "--failovers-only" not in sys.argv:
                out["per_group"] = await per_group(cluster)
                out["latency"] = [await latency(cluster, d) for d in (False, True)]
            out["failovers"] = [await failovers(cluster, d, log_dir, lag)
                                for lag in (0.0, 2.0) for d in (False, True)]
        finally:
            cluster.stop()
    print(json.dumps(out, indent=1))
    name = "cluster-failovers.json" if "--failovers-only" in sys.argv else "cluster.json"
    (results_dir() / name).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
