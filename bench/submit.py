"""Submit latency: p50 / p99 of `RolloutClient.submit` for 1, 64 and 1,024 prompts of 512 tokens,
against a private redis-server without persistence and with AOF fsynced on every write (the
setting docs/reliability.md recommends), in the same run. No worker runs: this is the trainer's
cost of a submit, which is one Redis round trip whatever the batch size.

    python bench/submit.py [--calls 200]            # table + bench/results/submit.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

from common import machine, write_result

from rollq.client import RolloutClient
from rollq.harness.faults import RedisProcess

SIZES = (1, 64, 1024)
PROMPT_TOKENS = 512


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(url: str, calls: int) -> dict[int, dict[str, float]]:
    rng = random.Random(0)
    out = {}
    async with RolloutClient(url, policy="bench", trainer_id="submit", max_outstanding=10**7) as client:
        for size in SIZES:
            prompts = [[rng.randrange(150_000) for _ in range(PROMPT_TOKENS)] for _ in range(size)]
            await client.submit(prompts, n=8, sampling={"max_tokens": 64})  # warm: scripts loaded
            times = []
            for _ in range(max(20, calls // max(1, size // 64))):
                began = time.perf_counter()
                await client.submit(prompts, n=8, sampling={"max_tokens": 64})
                times.append(time.perf_counter() - began)
            await client.redis.flushall()
            out[size] = {"p50_ms": percentile(times, 0.5) * 1e3, "p99_ms": percentile(times, 0.99) * 1e3,
                         "calls": len(times)}
    return out


async def main(calls: int) -> dict:
    results = {}
    for name, aof in (("no persistence", False), ("AOF fsync always", True)):
        with tempfile.TemporaryDirectory() as tmp:
            server = RedisProcess(Path(tmp), aof=aof).start()
            try:
                results[name] = await measure(server.url, calls)
            finally:
                server.stop()
    return {"prompt_tokens": PROMPT_TOKENS, "latency": results, "machine": machine()}


def report(result: dict) -> None:
    print(f"submit latency, prompts of {result['prompt_tokens']} tokens ({result['machine']})")
    for name, sizes in result["latency"].items():
        cells = "  ".join(f"{size:>5} prompts: p50 {v['p50_ms']:6.2f} ms, p99 {v['p99_ms']:6.2f} ms"
                          for size, v in sizes.items())
        print(f"{name:18}{cells}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    result = asyncio.run(main(parser.parse_args().calls))
    report(result)
    write_result("submit", result)
