"""Scale: Redis memory per queued group, groups/s with 1, 2 and 4 worker processes, and what
submit and finish cost while 1k ... 1M groups wait in the queue. One private redis-server
without persistence; no vLLM (the instant engine: no-op groups).

- memory: `used_memory` before and after queueing 10,000 groups of 512-token prompts (n=8),
  per group, next to the prompt's raw token bytes (512 x 4 bytes).
- workers: 20,000 no-op groups end to end with 1, 2 and 4 `rollq worker --engine instant`
  processes (the same measurement as bench/dispatch.py). This machine has 2 cores.
- depth: with Q groups queued ahead (16-token prompts), the p50 of a 64-prompt `submit`, and the
  per-group cost of claiming and finishing 256-group batches with the worker's own `WorkQueue`
  (claim, finish batched in one pipeline) in this process.

    python bench/scale.py [--depths 1000,10000,100000,1000000]   # table + bench/results/scale.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path

from common import write_result
from dispatch import rollq_run, server_flush

from rollq.client import RolloutClient
from rollq.faults import RedisProcess
from rollq.protocol import GroupResult, encode
from rollq.queue.keys import Keys
from rollq.queue.work import WorkQueue

PROMPT_TOKENS, N = 512, 8
FILL_BATCH = 10_000
CLAIM = 256


async def used_memory(client: RolloutClient) -> int:
    return int((await client.redis.info("memory"))["used_memory"])


async def memory_per_group(url: str, groups: int = 10_000) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(150_000) for _ in range(PROMPT_TOKENS)] for _ in range(1000)]
    async with RolloutClient(url, policy="memory", trainer_id="bench", max_outstanding=10**7) as client:
        await client.submit(prompts[:1], n=N)  # the stream, group and job keys exist: not counted
        before = await used_memory(client)
        for _ in range(groups // len(prompts)):
            await client.submit(prompts, n=N, sampling={"max_tokens": 64})
        after = await used_memory(client)
    per_group = (after - before) / groups
    raw = PROMPT_TOKENS * 4
    return {"groups": groups, "prompt_tokens": PROMPT_TOKENS, "bytes_per_group": per_group,
            "raw_token_bytes": raw, "ratio": per_group / raw}


async def fill(client: RolloutClient, count: int) -> None:
    prompt = [1] + [7] * 15
    for start in range(0, count, FILL_BATCH):
        await client.submit([prompt] * min(FILL_BATCH, count - start), n=1, sampling={"max_tokens": 1})


async def costs_at_depth(url: str, depth: int, rounds: int = 20) -> dict:
    policy = f"depth{depth}"
    async with RolloutClient(url, policy=policy, trainer_id="bench", max_outstanding=10**7) as client:
        await fill(client, depth + rounds * CLAIM)  # what the rounds claim: `depth` stays queued
        submits = []
        for _ in range(rounds):
            began = time.perf_counter()
            await client.submit([[1, 2, 3, 4] * 4] * 64, n=1, sampling={"max_tokens": 1})
            submits.append(time.perf_counter() - began)
        queue = WorkQueue(client.redis, Keys(policy), "bench-worker", job_ttl_s=3600)
        streams = await queue.streams()
        for stream in streams:
            await queue.ensure_group(stream)
        per_group = []
        for _ in range(rounds):
            began = time.perf_counter()
            claimed = await queue.claim(streams, CLAIM)
            results = [encode(GroupResult(c.job_id or "", c.group_index or 0, "ok")) for c in claimed]
            outcomes = await asyncio.gather(*(queue.finish(c, "ok", r) for c, r in zip(claimed, results)))
            per_group.append((time.perf_counter() - began) / max(1, len(claimed)))
            if set(outcomes) != {"ok"}:
                raise RuntimeError(f"finish returned {set(outcomes)}")
        queued = await client.redis.xlen(Keys(policy).work("bench"))
        await client.redis.flushall()
    return {"depth": depth, "queued_at_end": queued,
            "submit64_p50_ms": statistics.median(submits) * 1e3,
            "claim_finish_us_per_group": statistics.median(per_group) * 1e6}


async def main(depths: list[int], groups: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisProcess(Path(tmp), aof=False).start()
        try:
            memory = await memory_per_group(server.url)
            await server_flush(server.url)
            workers = {}
            for count in (1, 2, 4):
                workers[count] = groups / await rollq_run(server.url, groups, f"scale{count}", workers=count)
                await server_flush(server.url)
                print(f"{count} worker(s): {workers[count]:,.0f} groups/s", flush=True)
            depth = []
            for d in depths:
                depth.append(await costs_at_depth(server.url, d))
                print(f"depth {d:,}: {depth[-1]}", flush=True)
        finally:
            server.stop()
    first, last = depth[0], depth[-1]
    return {"memory": memory, "workers_groups_per_s": workers, "workers_groups": groups, "depth": depth,
            "submit_growth": last["submit64_p50_ms"] / first["submit64_p50_ms"],
            "finish_growth": last["claim_finish_us_per_group"] / first["claim_finish_us_per_group"]}


def report(r: dict) -> None:
    m = r["memory"]
    print(f"memory: {m['bytes_per_group']:,.0f} B per queued group of {m['prompt_tokens']} tokens "
          f"(raw {m['raw_token_bytes']:,} B): {m['ratio']:.2f}x")
    print("workers: " + ", ".join(f"{k}: {v:,.0f} groups/s" for k, v in r["workers_groups_per_s"].items()))
    for d in r["depth"]:
        print(f"depth {d['depth']:>9,}: submit(64) p50 {d['submit64_p50_ms']:.2f} ms, claim+finish "
              f"{d['claim_finish_us_per_group']:.0f} us/group")
    low, high = r["depth"][0]["depth"], r["depth"][-1]["depth"]
    print(f"growth {low:,} -> {high:,}: submit {r['submit_growth']:.2f}x, "
          f"claim+finish {r['finish_growth']:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="1000,10000,100000,1000000")
    parser.add_argument("--groups", type=int, default=20_000, help="no-op groups for the worker scaling")
    args = parser.parse_args()
    result = asyncio.run(main([int(d) for d in args.depths.split(",")], args.groups))
    report(result)
    write_result("scale", result)
