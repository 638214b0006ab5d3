"""Swap: time from `publish_weights` to a worker serving the new version, for a checkpoint of
~445 MB (a random float32 Llama: hidden 1024, 8 layers, vocab 8192), split into phases, vs a raw
sequential read of the same files.

A `rollq worker --engine vllm` process serves version 0; this process publishes versions 1, 2, ...
(alternating two checkpoints, as a trainer would publish new weights) into a weight store on
local disk, and right after each publish submits a one-token probe group with
`min_version` = the new version: its result marks the moment the worker serves it. Phases:

- store: `publish_weights` copying the files into the store, fsyncing and hashing them (trainer).
- verify: the worker re-reading and hashing the files, checking headers and shapes.
- drain, pause, load, resume: the worker's swap (`rollq_worker_swap_phase_seconds`).

The raw read is the same files read once, sequentially, just before each publish (page cache as
warm as the swap finds it). Reported: end to end, each phase, and the effective bandwidth
(checkpoint bytes / end to end) as a fraction of the raw read's.

    python bench/swap.py [--repeats 3]              # table + bench/results/swap.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import make_llama, write_result

from rollq.client import RolloutClient
from rollq.faults import RedisProcess
from rollq.queue.keys import Keys
from rollq.worker.heartbeat import live_workers

MODEL = dict(hidden=1024, layers=8, vocab=8192, intermediate=2816)
POLICY = "swap"


def raw_read(files: list[Path]) -> float:
    began = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(8 << 20):
                pass
    return time.perf_counter() - began


async def wait_worker(client: RolloutClient, worker: subprocess.Popen, timeout_s: float = 900) -> None:
    give_up = time.monotonic() + timeout_s
    while not await client.redis.exists(Keys(POLICY).workers):
        if worker.poll() is not None or time.monotonic() > give_up:
            raise RuntimeError("the rollq worker did not start")
        await asyncio.sleep(0.5)


async def last_swap(client: RolloutClient, version: int, timeout_s: float = 30) -> dict[str, float]:
    """The worker's phase times for `version`, from its heartbeat (beats every lease_s / 3)."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        for w in await live_workers(client.redis, Keys(POLICY)):
            if w.version == version and w.totals.last_swap:
                return w.totals.last_swap
        await asyncio.sleep(0.2)
    raise RuntimeError(f"no heartbeat reported the swap to version {version}")


async def main(repeats: int) -> dict:
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoints = [make_llama(tmp / f"ckpt{i}", seed=i, **MODEL) for i in range(2)]
        files = sorted(checkpoints[1].glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        redis = RedisProcess(tmp, extra=["--appendonly", "no"]).start()
        worker = subprocess.Popen(
            [sys.executable, "-m", "rollq", "worker", "--engine", "vllm", "--redis-url", redis.url,
             "--policy", POLICY, "--model", str(checkpoints[0]), "--dtype", "float32",
             "--max-model-len", "256", "--max-num-seqs", "8", "--enforce-eager", "--poll-s", "0.1",
             "--lease-s", "1.5"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            async with RolloutClient(redis.url, policy=POLICY, trainer_id="bench",
                                     weight_store=str(tmp / "store")) as client:
                await wait_worker(client, worker)
                for version in range(1, repeats + 1):
                    source = checkpoints[version % 2]
                    raw_s = raw_read(sorted(source.glob("*.safetensors")))
                    began = time.perf_counter()
                    await client.publish_weights(version, source, keep=2)
                    store_s = time.perf_counter() - began
                    await client.submit([[1, 5, 6]], n=1, sampling={"max_tokens": 1}, min_version=version)
                    [probe] = await client.take(1, timeout_s=300)
                    total_s = time.perf_counter() - began
                    if probe.status != "ok" or probe.samples[0].versions[0][0] != version:
                        raise RuntimeError(f"probe not served by version {version}: {probe}")
                    phases = {"store": store_s, **await last_swap(client, version)}
                    runs.append({"total_s": total_s, "raw_read_s": raw_s, "phases": phases})
                    print(f"version {version}: {total_s:.2f} s end to end, raw read {raw_s:.2f} s, "
                          + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items()), flush=True)
        finally:
            worker.terminate()
            try:
                worker.wait(60)
            except subprocess.TimeoutExpired:
                worker.kill()
            redis.stop()
    total = statistics.median(r["total_s"] for r in runs)
    raw = statistics.median(r["raw_read_s"] for r in runs)
    phases = {k: statistics.median(r["phases"].get(k, 0.0) for r in runs) for k in runs[0]["phases"]}
    return {"bytes": size, "repeats": repeats, "model": MODEL, "total_s": total, "raw_read_s": raw,
            "phases_s": phases, "swap_gb_per_s": size / total / 1e9, "raw_gb_per_s": size / raw / 1e9,
            "ratio": raw / total, "runs": runs}


def report(r: dict) -> None:
    print(f"swap: {r['bytes'] / 1e6:.0f} MB checkpoint, median of {r['repeats']}")
    print(f"publish -> serving {r['total_s']:.2f} s ({r['swap_gb_per_s']:.2f} GB/s); raw read "
          f"{r['raw_read_s']:.3f} s ({r['raw_gb_per_s']:.2f} GB/s); ratio {r['ratio']:.3f}")
    print("  " + ", ".join(f"{k} {v:.2f} s" for k, v in r["phases_s"].items()))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    result = asyncio.run(main(parser.parse_args().repeats))
    report(result)
    write_result("swap", result)
