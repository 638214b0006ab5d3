"""Streaming (issue 26): time to first streamed chunk, rollq's gateway vs vLLM's own server.

    python bench/streaming.py [--requests 8] [--tokens 64]   # table + bench/results/streaming.json

On the tiny random chat model of the tests (tests/models.py), with the same engine settings on
both sides: vLLM's server (`vllm.entrypoints.openai.api_server`), and a `rollq gateway` with one
`rollq worker --engine vllm` process and a private redis-server. Each request is a streamed chat
(`stream=True`, temperature 1, `ignore_eos`, `--tokens` tokens), sent one at a time, alternating
sides. Timed per request with aiohttp: the first `data:` event (TTFC), the first content delta,
and `[DONE]`. rollq streams a group once it is done (rollq/gateway/streaming.py), so its first
chunk comes after the whole completion: expect rollq's TTFC near vLLM's total time plus the
queue's round trip, and equal totals but for that round trip. Loopback only.
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

import aiohttp

from common import machine, stop_process, write_result
from gateway_soak import ROOT, start_gateway

sys.path.insert(0, str(ROOT / "tests"))
from models import make_chat_model  # noqa: E402 (the tests' tiny chat model, made the same way)

ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--enforce-eager", "--seed", "0"]
MESSAGES = [{"role": "system", "content": "w10 w11 w12"}, {"role": "user", "content": "w20 w21 w22 w23"}]


def start_vllm(model: Path, port: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                             str(model), "--served-model-name", "tiny", *ENGINE, "--host", "127.0.0.1",
                             "--port", str(port)],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
                            env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"})


def start_worker(redis_url: str, model: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rollq", "worker", "--policy", "tiny", "--redis-url",
                             redis_url, "--engine", "vllm", "--model", str(model), *ENGINE],
                            env=os.environ | {"PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1"},
                            cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)


async def timed(http: aiohttp.ClientSession, url: str, tokens: int) -> dict:
    body = dict(model="tiny", messages=MESSAGES, max_tokens=tokens, temperature=1.0, ignore_eos=True,
                stream=True, stream_options={"include_usage": True})
    start = time.perf_counter()
    first = content = None
    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            now = time.perf_counter() - start
            first = first if first is not None else now
            if content is None and b'"content":"' in line and b'"content":""' not in line:
                content = now
            if line.startswith(b"data: [DONE]"):
                return dict(first_chunk_s=first, first_content_s=content, done_s=now)
    raise AssertionError("stream ended without [DONE]")


async def ready(http: aiohttp.ClientSession, url: str, procs: list[subprocess.Popen]) -> None:
    give_up = time.monotonic() + 900
    while time.monotonic() < give_up:
        assert all(p.poll() is None for p in procs), "a server exited: see its log"
        try:  # a whole streamed request: the rollq side is ready once a worker answers
            await timed(http, url, 2)
            return
        except (aiohttp.ClientError, AssertionError):
            await asyncio.sleep(1)
    raise RuntimeError(f"{url} not ready")


async def measure(urls: dict[str, str], procs: list, requests: int, tokens: int) -> dict:
    runs: dict[str, list[dict]] = {side: [] for side in urls}
    async with aiohttp.ClientSession() as http:
        for url in urls.values():
            await ready(http, url, procs)
        for _ in range(requests):
            for side, url in urls.items():
                runs[side].append(await timed(http, url, tokens))
    return {side: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for side, rs in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    from rollq.harness.faults import RedisProcess, free_port

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = make_chat_model(tmp / "model")
        redis = RedisProcess(tmp / "redis").start()
        procs = []
        try:
            vllm_port, gw_port = free_port(), free_port()
            procs.append(start_vllm(model, vllm_port, tmp / "vllm.log"))
            procs.append(start_worker(redis.url, model, tmp / "worker.log"))
            procs.append(start_gateway(redis.url, gw_port, log=str(tmp / "gateway.log")))
            urls = {"vllm": f"http://127.0.0.1:{vllm_port}", "rollq": f"http://127.0.0.1:{gw_port}"}
            result = asyncio.run(measure(urls, procs, args.requests, args.tokens))
        finally:
            for proc in reversed(procs):
                stop_process(proc)
            redis.stop()
    result |= dict(requests=args.requests, tokens=args.tokens, machine=machine())
    print(f"{'':6} {'first chunk':>12} {'first content':>14} {'[DONE]':>8}   (median of {args.requests}, "
          f"{args.tokens} tokens)")
    for side in ("vllm", "rollq"):
        r = result[side]
        print(f"{side:6} {r['first_chunk_s'] * 1e3:10.1f}ms {r['first_content_s'] * 1e3:12.1f}ms "
              f"{r['done_s'] * 1e3:6.1f}ms")
    ours, theirs = result["rollq"], result["vllm"]
    print(f"rollq / vLLM first chunk: {ours['first_chunk_s'] / theirs['first_chunk_s']:.1f}x, "
          f"[DONE]: {ours['done_s'] / theirs['done_s']:.2f}x")
    print(write_result("streaming", result))


if __name__ == "__main__":
    main()
