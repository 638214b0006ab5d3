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
- trainers seen: the same claim + finish cost after 1 and after 1,500 trainers came and went
  (each an id derived from one trainer, as an `Episodes` object is: one group submitted, served
  and acknowledged), once the workers' prune has run: a claim reads every listed trainer's
  stream, so what the trainers set keeps decides it (issue 27; target <= 1.3x).

    python bench/scale.py [--depths 1000,10000,100000,1000000] [--seen 1,1500]
    # table + bench/results/scale.json
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
from rollq.harness.faults import RedisProcess
from rollq.protocol import GroupResult, derived_trainer_id, encode
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


async def claim_finish_rounds(queue: WorkQueue, rounds: int) -> list[float]:
    """Seconds per group of `rounds` claims of CLAIM groups, each finished in one batch."""
    per_group = []
    for _ in range(rounds):
        began = time.perf_counter()
        streams = await queue.streams()
        claimed = await queue.claim(streams, CLAIM)
        results = [encode(GroupResult(c.job_id or "", c.group_index or 0, "ok")) for c in claimed]
        outcomes = await asyncio.gather(*(queue.finish(c, "ok", r) for c, r in zip(claimed, results)))
        per_group.append((time.perf_counter() - began) / max(1, len(claimed)))
        if set(outcomes) != {"ok"}:
            raise RuntimeError(f"finish returned {set(outcomes)}")
    return per_group


async def costs_with_trainers_seen(url: str, seen: int, rounds: int = 20, depth: int = 10_000) -> dict:
    """Claim + finish per group (listing the streams each round, as a worker does) after `seen`
    trainers came and went: the first is the one whose `depth` groups are claimed."""
    policy = f"seen{seen}"
    async with RolloutClient(url, policy=policy, trainer_id="bench", max_outstanding=10**7) as client:
        gone = [RolloutClient(policy=policy, redis=client.redis,
                              trainer_id=derived_trainer_id("bench", "episodes", f"o{i}"))
                for i in range(seen - 1)]
        for c in gone:
            await c.submit([[1, 2]], n=1, sampling={"max_tokens": 1})
        queue = WorkQueue(client.redis, Keys(policy), "bench-worker", job_ttl_s=3600)
        while True:  # serve them, as workers would
            claimed = await queue.claim(await queue.streams(), CLAIM)
            if not claimed:
                break
            await queue.finish_many([(c, "ok", encode(GroupResult(c.job_id or "", c.group_index or 0,
                                                                  "ok")), "") for c in claimed])
        for c in gone:  # each reads and acknowledges its result, and goes
            got = await c.take(1, timeout_s=10, ack="manual")
            await c.ack(got)
        await fill(client, depth + rounds * CLAIM)
        fresh = WorkQueue(client.redis, Keys(policy), "bench-worker-2", job_ttl_s=3600)
        listed = len(await fresh.streams())  # (its first listing prunes)
        per_group = await claim_finish_rounds(fresh, rounds)
        await client.redis.flushall()
    return {"seen": seen, "streams_listed": listed,
            "claim_finish_us_per_group": statistics.median(per_group) * 1e6}


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


async def main(depths: list[int], groups: int, seen: list[int]) -> dict:
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
            # Interleaved, three times each, medians: the machine is shared and noisy.
            runs: dict[int, list[dict]] = {n: [] for n in seen}
            for _ in range(3):
                for n in seen:
                    runs[n].append(await costs_with_trainers_seen(server.url, n))
                    print(f"trainers seen {n:,}: {runs[n][-1]}", flush=True)
            trainers = [{"seen": n, "streams_listed": max(x["streams_listed"] for x in runs[n]),
                         "claim_finish_us_per_group": statistics.median(
                             x["claim_finish_us_per_group"] for x in runs[n])} for n in seen]
        finally:
            server.stop()
    first, last = depth[0], depth[-1]
    return {"memory": memory, "workers_groups_per_s": workers, "workers_groups": groups, "depth": depth,
            "submit_growth": last["submit64_p50_ms"] / first["submit64_p50_ms"],
            "finish_growth": last["claim_finish_us_per_group"] / first["claim_finish_us_per_group"],
            "trainers_seen": trainers,
            "seen_growth": (trainers[-1]["claim_finish_us_per_group"]
                            / trainers[0]["claim_finish_us_per_group"])}


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
    for t in r["trainers_seen"]:
        print(f"trainers seen {t['seen']:>6,}: {t['streams_listed']} streams listed, claim+finish "
              f"{t['claim_finish_us_per_group']:.0f} us/group")
    print(f"growth with trainers seen: {r['seen_growth']:.2f}x (target <= 1.3)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depths", default="1000,10000,100000,1000000")
    parser.add_argument("--groups", type=int, default=20_000, help="no-op groups for the worker scaling")
    parser.add_argument("--seen", default="1,1500", help="trainers seen, fewest first")
    args = parser.parse_args()
    result = asyncio.run(main([int(d) for d in args.depths.split(",")], args.groups,
                              [int(n) for n in args.seen.split(",")]))
    report(result)
    write_result("scale", result)
