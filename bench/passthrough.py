"""Pass-through: the same prompt groups through rollq end to end vs straight into one AsyncLLM.

256 prompts x n=8 x 64 tokens (ignore_eos, so every sample is 64 tokens), temperature 1 with the
sampled token's logprob (what RL needs), on a random Llama made here, with the same engine
settings on both sides:

- raw: `AsyncLLM` in a child process, all 256 requests at once, `SamplingParams` as rollq builds
  them (FINAL_ONLY, no detokenizing).
- rollq: a `rollq worker --engine vllm` process, a private redis-server (no persistence), the
  trainer (`RolloutClient`: submit, then take every result) in this process.

The two alternate, each engine started once (start-up and warm-up are not timed). Reported:
completion tokens/s of each (median of the repeats), rollq / raw, and rollq's CPU seconds per
1,000 groups: the worker process without its engine core, the redis-server and the trainer,
next to the raw frontend's own CPU seconds for the same groups.

    python bench/passthrough.py [--repeats 3] [--prompts 256]   # table + bench/results/passthrough.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import HERE, cpu_seconds, make_llama, stop_process, write_result

from rollq.client import RolloutClient
from rollq.config import VLLMSettings
from rollq.faults import RedisProcess
from rollq.queue.keys import Keys

N, MAX_TOKENS, PROMPT_TOKENS = 8, 64, 32
MODEL = dict(hidden=256, layers=4, vocab=4096, intermediate=688)
MAX_NUM_SEQS = 256
MARK = "@passthrough "
"""Prefix of the raw child's replies on stdout, which vLLM's logs share."""


def settings(model: Path) -> VLLMSettings:
    return VLLMSettings(model=str(model), dtype="float32", max_model_len=256, max_num_seqs=MAX_NUM_SEQS,
                        enforce_eager=True, seed=0).validate()


def prompts(count: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[1] + [rng.randrange(3, MODEL["vocab"]) for _ in range(PROMPT_TOKENS - 1)]
            for _ in range(count)]


SAMPLING = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "extra": {"ignore_eos": True}}


# --- raw: one AsyncLLM, driven from a child process ----------------------------------------

async def raw_serve(model: Path, count: int) -> None:
    """The raw side: for each 'go' line on stdin, one timed run; a JSON line on stdout each."""
    from rollq.engine.vllm import VLLMEngine, sampling_params
    from rollq.protocol import Sampling

    engine = await VLLMEngine.start(settings(model))
    params = sampling_params(Sampling(**SAMPLING), N)
    batch = prompts(count)

    async def one(i: int, prompt: list[int], run: int) -> int:
        async for out in engine.llm.generate({"prompt_token_ids": prompt}, params, request_id=f"{run}-{i}"):
            final = out
        return sum(len(c.token_ids) for c in final.outputs)

    print(f"{MARK}ready", flush=True)
    for run, _ in enumerate(sys.stdin):
        cpu0, began = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i, p, run) for i, p in enumerate(batch))))
        elapsed, cpu1 = time.perf_counter() - began, resource.getrusage(resource.RUSAGE_SELF)
        cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
        print(MARK + json.dumps({"seconds": elapsed, "tokens": tokens, "cpu_s": cpu}), flush=True)
    await engine.close()


class Raw:
    def __init__(self, model: Path, count: int):
        self.proc = subprocess.Popen([sys.executable, str(HERE / "passthrough.py"), "--raw", str(model),
                                      str(count)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, cwd=HERE)
        if self._reply() != "ready":
            raise RuntimeError("the raw AsyncLLM process did not start")

    def _reply(self) -> str:
        """The child's next marked line (vLLM logs to the same stdout)."""
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return line[len(MARK):].strip()
        raise RuntimeError("the raw AsyncLLM process exited")

    def run(self) -> dict:
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return json.loads(self._reply())

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# --- rollq: worker process + redis-server + trainer ----------------------------------------

class Rollq:
    def __init__(self, model: Path, redis: RedisProcess):
        s = settings(model)
        self.redis = redis
        self.policy = "passthrough"
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "rollq", "worker", "--engine", "vllm", "--redis-url", redis.url,
             "--policy", self.policy, "--model", s.model, "--dtype", s.dtype,
             "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
             "--enforce-eager", "--seed", str(s.seed), "--poll-s", "0.2"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    async def wait_ready(self, client: RolloutClient, timeout_s: float = 600) -> None:
        give_up = time.monotonic() + timeout_s
        while not await client.redis.exists(Keys(self.policy).workers):
            if self.worker.poll() is not None or time.monotonic() > give_up:
                raise RuntimeError("the rollq worker did not start")
            await asyncio.sleep(0.5)

    async def run(self, client: RolloutClient, batch: list[list[int]]) -> dict:
        redis_pid = self.redis.proc.pid
        before = (cpu_seconds(self.worker.pid), cpu_seconds(redis_pid), cpu_seconds(os.getpid()))
        began = time.perf_counter()
        await client.submit(batch, n=N, sampling=SAMPLING)
        results = await client.take(len(batch), timeout_s=600)
        elapsed = time.perf_counter() - began
        after = (cpu_seconds(self.worker.pid), cpu_seconds(redis_pid), cpu_seconds(os.getpid()))
        if len(results) != len(batch) or any(r.status != "ok" for r in results):
            raise RuntimeError(f"rollq returned {len(results)} of {len(batch)} groups, or failures")
        tokens = sum(len(s.token_ids) for r in results for s in r.samples)
        worker, redis, trainer = (b - a for a, b in zip(before, after))
        return {"seconds": elapsed, "tokens": tokens, "cpu_s": worker + redis + trainer,
                "cpu_worker_s": worker, "cpu_redis_s": redis, "cpu_trainer_s": trainer}

    def close(self) -> None:
        stop_process(self.worker)


async def main(repeats: int, count: int) -> dict:
    runs: dict[str, list[dict]] = {"raw AsyncLLM": [], "rollq": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_llama(Path(tmp) / "model", **MODEL)
        redis = RedisProcess(Path(tmp), aof=False).start()
        raw = Raw(model, count)
        rollq = Rollq(model, redis)
        try:
            async with RolloutClient(redis.url, policy=rollq.policy, trainer_id="bench",
                                     max_outstanding=10**7) as client:
                await rollq.wait_ready(client)
                batch = prompts(count)
                for _ in range(repeats):
                    runs["raw AsyncLLM"].append(raw.run())
                    runs["rollq"].append(await rollq.run(client, batch))
        finally:
            raw.close()
            rollq.close()
            redis.stop()
    per_s = {name: statistics.median(r["tokens"] / r["seconds"] for r in rs) for name, rs in runs.items()}
    cpu_per_1k = {name: statistics.median(r["cpu_s"] for r in rs) / count * 1000 for name, rs in runs.items()}
    return {"prompts": count, "n": N, "max_tokens": MAX_TOKENS, "model": MODEL, "repeats": repeats,
            "tokens_per_s": per_s, "ratio": per_s["rollq"] / per_s["raw AsyncLLM"],
            "cpu_s_per_1k_groups": cpu_per_1k, "runs": runs}


def report(r: dict) -> None:
    print(f"pass-through: {r['prompts']} prompts x n={r['n']} x {r['max_tokens']} tokens, "
          f"median of {r['repeats']}")
    for name, rate in r["tokens_per_s"].items():
        print(f"{name:14}{rate:10.0f} tok/s   CPU {r['cpu_s_per_1k_groups'][name]:6.1f} s per 1,000 groups")
    print(f"rollq / raw = {r['ratio']:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--raw", nargs=2, metavar=("MODEL", "PROMPTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw:
        asyncio.run(raw_serve(Path(args.raw[0]), int(args.raw[1])))
    else:
        result = asyncio.run(main(args.repeats, args.prompts))
        report(result)
        write_result("passthrough", result)
