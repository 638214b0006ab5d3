"""Episodes: prefix-cache hit rate of turns 2+ from vLLM's own counters, with two workers, with
and without affinity; and the time of a turn vs a fresh request of the same total length.

Two in-process workers, each with its own vLLM engine (a random Llama made on the spot: hidden
256, 2 layers, vocab 2048; float32, CPU), serve E episodes of T turns: a P-token prompt, then
each turn K new tokens and M sampled ones (EOS ignored, so every turn has the same length). The
hit rate is vLLM's `vllm:prefix_cache_hits / vllm:prefix_cache_queries` (tokens), read from each
engine's Prometheus stat logger (`AsyncLLM.logger_manager`; two engines in one process keep
their own counter objects), as the delta over the turns 2..T of all episodes. Affinity on: each
turn goes to the worker that served the previous one; off: to whichever worker claims it.

Then the same number of single requests, each a fresh prompt (random tokens: nothing cached) as
long as a turn's prompt, with the same M tokens to sample, and the mean time of each.

    python bench/episodes.py [--episodes 16] [--turns 4] [--prompt 128] [--new 8] [--sampled 16]
                             [--block-size 32]

vLLM caches whole KV blocks only: a turn hits the blocks its episode filled so far, so the hit
rate is below 100 % by the tokens of the last partial block plus the new ones (the CPU build's
default block is 128 tokens, 16 is refused there; the bench uses 32, where the partial block
costs little: pass `block_size` in the worker's engine arguments to serve episodes so).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from collections import Counter
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import make_llama, write_result  # noqa: E402

from rollq.harness.bench import episodes_table  # noqa: E402
from rollq.client import RolloutClient  # noqa: E402
from rollq.harness.faults import RedisProcess  # noqa: E402
from rollq.queue.connection import connect  # noqa: E402
from rollq.queue.keys import Keys  # noqa: E402
from rollq.queue.work import WorkQueue  # noqa: E402

VOCAB = 2048


def prefix_counters(engine) -> tuple[float, float]:
    """(queries, hits) in tokens, from the engine's vLLM Prometheus stat logger."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    for logger in engine.llm.logger_manager.stat_loggers:
        if isinstance(logger, PrometheusStatLogger):
            return (logger.counter_prefix_cache_queries[0]._value.get(),
                    logger.counter_prefix_cache_hits[0]._value.get())
    raise RuntimeError("vLLM runs without its Prometheus stat logger (log_stats off?)")


def counters(engines) -> tuple[float, float]:
    pairs = [prefix_counters(e) for e in engines]
    return sum(q for q, _ in pairs), sum(h for _, h in pairs)


async def run_episodes(client, engines, args, affinity: bool) -> dict:
    episodes = client.episodes(affinity=affinity)
    sampling = {"max_tokens": args.sampled, "temperature": 1.0, "extra": {"ignore_eos": True}}
    rng = random.Random(affinity)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(args.prompt)] for _ in range(args.episodes)]
    firsts = [t for [t] in await asyncio.gather(*(episodes.start(p, sampling=sampling) for p in prompts))]
    queries, hits = counters(engines)
    turn_s, moved = [], 0

    async def later_turns(first):
        nonlocal moved
        for _ in range(args.turns - 1):
            new = [rng.randrange(3, VOCAB) for _ in range(args.new)]
            began = time.perf_counter()
            turn = await episodes.turn(first.episode_id, new)
            turn_s.append(time.perf_counter() - began)
            moved += turn.worker_id != first.worker_id

    began = time.perf_counter()
    await asyncio.gather(*(later_turns(f) for f in firsts))
    wall = time.perf_counter() - began
    queries2, hits2 = counters(engines)
    lengths = [len((await episodes.get(f.episode_id)).tokens) for f in firsts]
    await episodes.close()
    return {"affinity": affinity, "hit_rate": (hits2 - hits) / max(1.0, queries2 - queries),
            "query_tokens": queries2 - queries, "hit_tokens": hits2 - hits,
            "turn_s_mean": statistics.mean(turn_s), "turns": len(turn_s), "wall_s": wall,
            "turns_elsewhere": moved, "final_tokens": statistics.mean(lengths),
            "episodes_per_worker": dict(Counter(f.worker_id for f in firsts))}


async def run_fresh(client, args) -> dict:
    """Single requests as long as the turns' prompts (random tokens: nothing cached), through the
    same path as a turn (an episode's first turn is one request), in the same waves."""
    rng = random.Random(7)
    episodes = client.episodes()
    sampling = {"max_tokens": args.sampled, "temperature": 1.0, "extra": {"ignore_eos": True}}
    lengths = [args.prompt + k * (args.sampled + args.new) for k in range(1, args.turns)]
    times = []

    async def one(length: int):
        prompt = [rng.randrange(3, VOCAB) for _ in range(length)]
        began = time.perf_counter()
        await episodes.start(prompt, sampling=sampling)
        times.append(time.perf_counter() - began)

    began = time.perf_counter()
    for length in lengths:  # E requests at a time, as the episodes' turns
        await asyncio.gather(*(one(length) for _ in range(args.episodes)))
    wall = time.perf_counter() - began
    await episodes.close()
    return {"request_s_mean": statistics.mean(times), "requests": len(times), "wall_s": wall}


async def main(args) -> dict:
    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine
    from rollq.worker.loop import Worker
    from rollq.worker.limits import Limits

    with tempfile.TemporaryDirectory() as tmp:
        model = make_llama(Path(tmp) / "model", hidden=256, layers=2, vocab=VOCAB, intermediate=512)
        redis = RedisProcess(Path(tmp), aof=False).start()
        extra = {"block_size": args.block_size} if args.block_size else {}
        settings = VLLMSettings(model=str(model), dtype="float32", max_model_len=1024, max_num_seqs=32,
                                enforce_eager=True, seed=0, engine_args=extra).validate()
        engines = [await VLLMEngine.start(settings) for _ in range(2)]
        block = engines[0].llm.vllm_config.cache_config.block_size
        workers, tasks, conns = [], [], []
        try:
            for i, engine in enumerate(engines):
                r = connect(redis.url)
                conns.append(r)
                queue = WorkQueue(r, Keys("bench"), f"w{i}", job_ttl_s=600)
                w = Worker(queue, engine, Limits(max_inflight=32, max_inflight_seqs=32, lease_s=30.0,
                                                 poll_s=0.1, max_deliveries=3, grace_s=1.0))
                workers.append(w)
                tasks.append(asyncio.create_task(w.run(None)))
            async with RolloutClient(redis.url, policy="bench", trainer_id="bench") as client:
                runs = [await run_episodes(client, engines, args, affinity=a) for a in (True, False)]
                fresh = await run_fresh(client, args)
        finally:
            for w in workers:
                w.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            for engine in engines:
                await engine.close()
            for r in conns:
                await r.aclose()
            redis.stop()
    return {"block_size": block, "episodes": args.episodes, "turns": args.turns, "prompt": args.prompt,
            "new": args.new, "sampled": args.sampled, "runs": runs, "fresh": fresh}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=8)
    parser.add_argument("--sampled", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=32,
                        help="vLLM's KV block size (0: the build's default, 128 on CPU)")
    result = asyncio.run(main(parser.parse_args()))
    print("\n".join(episodes_table(result)))
    print(write_result("episodes", result))
