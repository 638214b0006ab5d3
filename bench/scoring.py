"""Scoring overhead: groups delivered per second without a reward, and with a no-op reward
scored by a `rollq scorer` (sync: in its child processes; async: in its event loop), in the
same run against the same instant-engine worker process and a private redis-server.

    python bench/scoring.py [--groups 2000] [--n 4] [--processes 2]

A ratio, not a target: the 2 cores are shared by the worker, the scorer, its children, Redis
and this trainer. `rollq bench scoring` runs it and renders its table (rollq/harness/bench.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_result  # noqa: E402

from rollq.children import stop_child  # noqa: E402
from rollq.client import RolloutClient  # noqa: E402
from rollq.harness.faults import RedisProcess  # noqa: E402
from rollq.scoring.records import live_scorers  # noqa: E402

REWARDS = str(Path(__file__).with_name("scoring_rewards.py"))


async def delivered_per_s(client: RolloutClient, groups: int, n: int, reward: str | None) -> float:
    prompts = [[i % 1000 + 1, 7] for i in range(groups)]
    started = time.perf_counter()
    await client.submit(prompts, n=n, sampling={"max_tokens": 8}, reward=reward,
                        reward_inputs=None if reward is None else [None] * groups)
    got = 0
    while got < groups:
        got += len(await client.take(groups - got, timeout_s=60))
    return groups / (time.perf_counter() - started)


async def main(groups: int, n: int, processes: int) -> dict:
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisProcess(Path(tmp) / "redis", aof=False).start()
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        common = ["--redis-url", redis.url, "--policy", "bench"]
        procs = [subprocess.Popen([sys.executable, "-m", "rollq", "--log-level", "warning", "worker", *common,
                                   "--engine", "instant", "--max-inflight", "256"], env=env,
                                  start_new_session=True),
                 subprocess.Popen([sys.executable, "-m", "rollq", "--log-level", "warning", "scorer", *common,
                                   "--rewards", REWARDS, "--processes", str(processes),
                                   "--max-inflight", "64"], env=env, start_new_session=True)]
        client = RolloutClient(redis.url, trainer_id="bench", policy="bench", max_outstanding=100_000)
        try:
            while not await live_scorers(client.redis, client.keys):
                await asyncio.sleep(0.1)
            await delivered_per_s(client, 100, n, None)  # warm-up
            plain = await delivered_per_s(client, groups, n, None)
            sync = await delivered_per_s(client, groups, n, "noop")
            async_ = await delivered_per_s(client, groups, n, "noop_async")
        finally:
            await client.close()
            for p in procs:
                stop_child(p, 5)
            redis.stop()
    return {"groups": groups, "n": n, "processes": processes, "plain_groups_per_s": plain,
            "sync_noop_groups_per_s": sync, "async_noop_groups_per_s": async_,
            "sync_overhead_ms_per_group": 1000 * (1 / sync - 1 / plain),
            "async_overhead_ms_per_group": 1000 * (1 / async_ - 1 / plain),
            "load": [load_at_start, os.getloadavg()[0]]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=2000)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--processes", type=int, default=2)
    a = parser.parse_args()
    result = asyncio.run(main(a.groups, a.n, a.processes))
    print(result)
    write_result("scoring", result)
