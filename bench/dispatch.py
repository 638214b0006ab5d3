"""Dispatch benchmark: no-op groups end to end through rollq vs the bare-Redis limit, saq and arq.

All four move the same number of no-op jobs through one private redis-server (no persistence),
with one worker process and the producer/consumer in this process, in the same run:

- rollq: `rollq worker --engine instant` (max_inflight 256); the trainer submits jobs of 1,000
  groups and takes (acknowledges) every result.
- bare redis-py: the Redis commands a group needs without rollq's logic: XADD the item; a worker
  process XREADGROUPs 256 at a time and, per entry, XACK + XDEL + XADD of the result; the
  producer XREADGROUPs results and XACK + XDELs them. Pipelined throughout: the limit.
- saq, arq: the same number of no-op jobs, one worker process with concurrency 256.

    python bench/dispatch.py [--groups 20000] [--repeats 3]     # table + bench/results/dispatch.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as redis_async

from common import machine, stop_process, write_result

from rollq.client import RolloutClient
from rollq.harness.faults import RedisProcess
from rollq.queue.keys import Keys

HERE = Path(__file__).resolve().parent
BATCH = 256


def _spawn(args: list[str], env: dict | None = None) -> subprocess.Popen:
    # The checkout's rollq, not whichever one is installed (an editable install of another
    # checkout made the workers run that one's code).
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=HERE,
                            env=os.environ | {"PYTHONPATH": f"{HERE}:{HERE.parent}"} | (env or {}))


async def _wait(predicate, timeout_s: float = 60) -> None:
    give_up = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > give_up:
            raise TimeoutError("benchmark setup timed out")
        await asyncio.sleep(0.05)


async def rollq_run(url: str, groups: int, policy: str, *, workers: int = 1) -> float:
    procs = [_spawn([sys.executable, "-m", "rollq", "worker", "--redis-url", url, "--policy", policy,
                     "--engine", "instant", "--max-inflight", str(BATCH), "--poll-s", "0.05"])
             for _ in range(workers)]
    client = RolloutClient(url, policy=policy, trainer_id="bench", max_outstanding=10**7)
    try:
        await _wait(lambda: _at_least_members(client.redis, Keys(policy).workers, workers))
        began = time.perf_counter()
        for start in range(0, groups, 1000):
            await client.submit([[1]] * min(1000, groups - start), n=1, sampling={"max_tokens": 1})
        got = 0
        while got < groups:
            got += len(await client.take(min(5000, groups - got), timeout_s=30))
        return time.perf_counter() - began
    finally:
        for proc in procs:
            stop_process(proc, 10)
        await client.close()


async def _at_least_members(r, key: str, count: int) -> bool:
    return await r.zcard(key) >= count


async def bare_consumer(url: str, groups: int) -> None:
    """The worker side of the bare loop (run in its own process)."""
    r = redis_async.Redis.from_url(url)
    done = 0
    while done < groups:
        reply = await r.xreadgroup("w", "c", {"work": ">"}, count=BATCH, block=1000)
        entries = reply[0][1] if reply else []
        async with r.pipeline(transaction=False) as pipe:
            for entry_id, fields in entries:
                pipe.xack("work", "w", entry_id)
                pipe.xdel("work", entry_id)
                pipe.xadd("res", {"d": fields[b"d"]})
            await pipe.execute()
        done += len(entries)
    await r.aclose()


async def bare_run(url: str, groups: int) -> float:
    r = redis_async.Redis.from_url(url)
    await r.delete("work", "res")
    await r.xgroup_create("work", "w", id="0", mkstream=True)
    await r.xgroup_create("res", "t", id="0", mkstream=True)
    consumer = _spawn([sys.executable, str(HERE / "dispatch.py"), "--bare-consumer", url, str(groups)])
    await asyncio.sleep(1.0)  # its interpreter up
    try:
        began = time.perf_counter()
        for start in range(0, groups, 1000):
            async with r.pipeline(transaction=False) as pipe:
                for _ in range(min(1000, groups - start)):
                    pipe.xadd("work", {"d": b"\x97\xa3job\x00\xc4\x04\x01\x00\x00\x00\x01\x90\xcb"})
                await pipe.execute()
        got = 0
        while got < groups:
            reply = await r.xreadgroup("t", "t", {"res": ">"}, count=5000, block=1000)
            ids = [e for e, _ in reply[0][1]] if reply else []
            if ids:
                async with r.pipeline(transaction=False) as pipe:
                    pipe.xack("res", "t", *ids)
                    pipe.xdel("res", *ids)
                    await pipe.execute()
            got += len(ids)
        return time.perf_counter() - began
    finally:
        stop_process(consumer, 10)
        await r.aclose()


async def saq_run(url: str, groups: int) -> float:
    from saq import Queue

    worker = _spawn([sys.executable, "-m", "saq", "peers.settings"],
                    {"ROLLQ_BENCH_PEER": "saq", "ROLLQ_BENCH_REDIS_URL": url})
    queue = Queue.from_url(url)
    try:
        await queue.connect()
        await asyncio.sleep(2.0)  # its worker up
        began = time.perf_counter()
        await queue.map("noop", [{}] * groups, timeout=600)
        return time.perf_counter() - began
    finally:
        stop_process(worker, 10)
        await queue.disconnect()


async def arq_run(url: str, groups: int) -> float:
    from arq import create_pool
    from arq.connections import RedisSettings
    from peers import DONE_KEY

    host, port = url.split("//")[1].split("/")[0].split(":")
    pool = await create_pool(RedisSettings(host=host, port=int(port)))
    await pool.delete(DONE_KEY)
    worker = _spawn([sys.executable, "-m", "arq", "peers.ArqSettings"],
                    {"ROLLQ_BENCH_PEER": "arq", "ROLLQ_BENCH_REDIS_URL": url})
    try:
        await asyncio.sleep(2.0)
        began = time.perf_counter()
        for start in range(0, groups, 500):
            await asyncio.gather(*(pool.enqueue_job("noop_counted")
                                   for _ in range(min(500, groups - start))))
        await _wait(lambda: _at_least(pool, DONE_KEY, groups), timeout_s=600)
        return time.perf_counter() - began
    finally:
        stop_process(worker, 10)
        await pool.aclose()


async def _at_least(r, key: str, count: int) -> bool:
    return int(await r.get(key) or 0) >= count


async def main(groups: int, repeats: int) -> dict:
    sys.path.insert(0, str(HERE))
    runs: dict[str, list[float]] = {"bare redis-py": [], "rollq": [], "saq": [], "arq": []}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisProcess(Path(tmp), aof=False).start()
        try:
            for i in range(repeats):
                await server_flush(server.url)
                runs["bare redis-py"].append(groups / await bare_run(server.url, groups))
                runs["rollq"].append(groups / await rollq_run(server.url, groups, f"bench{i}"))
                await server_flush(server.url)
                runs["saq"].append(groups / await saq_run(server.url, groups))
                await server_flush(server.url)
                runs["arq"].append(groups / await arq_run(server.url, groups))
        finally:
            server.stop()
    medians = {name: statistics.median(rates) for name, rates in runs.items()}
    return {"groups": groups, "repeats": repeats, "groups_per_s": medians,
            "runs": runs, "rollq_vs_bare": medians["rollq"] / medians["bare redis-py"],
            "rollq_vs_saq": medians["rollq"] / medians["saq"],
            "rollq_vs_arq": medians["rollq"] / medians["arq"], "machine": machine()}


async def server_flush(url: str) -> None:
    r = redis_async.Redis.from_url(url)
    await r.flushall()
    await r.aclose()


def report(result: dict) -> None:
    print(f"dispatch: {result['groups']} no-op groups, median of {result['repeats']} ({result['machine']})")
    print(f"{'':16}{'groups/s':>12}{'rollq / this':>14}")
    rollq = result["groups_per_s"]["rollq"]
    for name, rate in result["groups_per_s"].items():
        print(f"{name:16}{rate:12.0f}{rollq / rate:13.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bare-consumer", nargs=2, metavar=("URL", "GROUPS"))
    args = parser.parse_args()
    if args.bare_consumer:
        asyncio.run(bare_consumer(args.bare_consumer[0], int(args.bare_consumer[1])))
    else:
        result = asyncio.run(main(args.groups, args.repeats))
        report(result)
        write_result("dispatch", result)
