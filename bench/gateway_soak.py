"""Gateway soak (issue 20): one hostile trainer against a gateway while another uses it.

    python bench/gateway_soak.py [--slow 2000] [--big 8] [--seconds 60]

The gateway runs as its own process (`python -m rollq gateway`), so its peak RSS (`VmHWM`) is
its own. For `--seconds`: `--slow` connections that send half a request head and stall,
`--big` concurrent maximal submit bodies (`--max-body-bytes`, resent as each ends), and reads of
large results (n=1024 groups, `count=16`) by trainer `hostile`; meanwhile trainer `small`
submits one-prompt jobs and reads each result through the gateway (an instant-engine worker
process answers them). Reports `small`'s p50/p99 submit-to-result latency, the gateway's peak
RSS and /health's worst latency, and checks the first two against their bounds (below; exit
status 1 past either); writes bench/results/gateway_soak.json. Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

try:
    from common import stop_process, write_result  # run as a script: bench/ is on the path
except ImportError:  # imported by the tests as bench.gateway_soak
    from bench.common import stop_process, write_result

ROOT = Path(__file__).resolve().parent.parent

SMALL_P99_BOUND_S = 20.0
"""`small`'s p99 submit-to-result latency allowed: 2x the worst measured with 16 MiB bodies on the
shared 2-core box (4.1-9.8 s over 7 runs at load 5-11). Starvation is what it catches."""
RSS_PER_BODY_CAP = 48
"""The gateway's peak RSS allowed, in multiples of `--max-body-bytes`: 768 MiB at 16 MiB (measured
525-592 MiB: idle ~60, four bodies read, one decoded at a time at ~9x its size, one maximal
result encoded)."""


def bounds(max_body: int) -> dict[str, float]:
    return {"small_p99_ms": SMALL_P99_BOUND_S * 1000,
            "gateway_peak_rss_mib": RSS_PER_BODY_CAP * max_body / 2**20}


def past_bounds(result: dict, max_body: int) -> list[str]:
    """The measured values over their bound, as `name value > bound` lines."""
    return [f"{name} {result[name]:.0f} > {bound:.0f}" for name, bound in bounds(max_body).items()
            if not result[name] <= bound]


def vm_kib(pid: int, field: str = "VmHWM") -> int:
    """A process's memory in KiB from /proc: VmHWM is its peak resident set, VmRSS the current."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def start_gateway(redis_url: str, port: int, *flags: str, log: str = os.devnull) -> subprocess.Popen:
    """`rollq gateway` on a loopback port (`--no-auth` unless `--tokens` is among `flags`), as a
    child process; returns once /health is 200."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    auth = [] if "--tokens" in flags else ["--no-auth"]
    with open(log, "wb") as out:  # a file, not a pipe: a pipe nobody reads would fill and block it
        proc = subprocess.Popen([sys.executable, "-m", "rollq", "gateway", *auth, "--host",
                                 "127.0.0.1", "--port", str(port), "--redis-url", redis_url, *flags],
                                env=env, cwd=ROOT, stdout=out, stderr=out)
    _wait_healthy(f"http://127.0.0.1:{port}", proc)
    return proc


def start_worker(redis_url: str, policy: str) -> subprocess.Popen:
    """An instant-engine worker process (no model: the soak is about the gateway)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "rollq", "worker", "--policy", policy, "--redis-url",
                             redis_url, "--engine", "instant", "--max-inflight", "64"],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """Blocking on purpose: called before any event loop of the caller's runs requests."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"gateway not healthy within {timeout_s} s")


def big_body(max_bytes: int) -> bytes:
    """A valid submit body of just under `max_bytes`: many long prompts of 6-digit token ids
    (the costliest JSON per byte to decode into lists of ints)."""
    prompt = "[" + ",".join(["123456"] * 30_000) + "]"
    count = (max_bytes - 200) // (len(prompt) + 1)
    return ('{"prompts":[' + ",".join([prompt] * count) + '],"n":1,"sampling":{"max_tokens":1}}').encode()


async def post_big(url: str, policy: str, body: bytes, trainer_headers: dict) -> int:
    headers = {"Content-Type": "application/json", **trainer_headers}
    # A stream, not bytes: aiohttp warns that one big write would stall the caller's loop.
    async with aiohttp.ClientSession() as http, \
            http.post(f"{url}/v1/policies/{policy}/jobs", data=io.BytesIO(body), headers=headers) as r:
        await r.read()
        return r.status


async def concurrent_big_submits(url: str, policy: str, count: int, body: bytes) -> list[int]:
    return await asyncio.gather(*(post_big(url, policy, body, {}) for _ in range(count)))


async def slow_connections(port: int, count: int) -> list[asyncio.StreamWriter]:
    """Connections that send half a request head and then nothing."""
    writers = []
    for _ in range(count):
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:  # out of file descriptors, say: fewer slow connections, still a soak
            break
        writer.write(b"POST /v1/policies/p/jobs HTTP/1.1\r\nHost: x\r\nContent-Le")
        writers.append(writer)
    return writers


async def health_worst_ms(url: str, stop: asyncio.Event, every_s: float = 0.02) -> list[float]:
    """Latencies of /health polled until `stop`, each on a fresh connection (as a probe does)."""
    times = []
    while not stop.is_set():
        began = time.perf_counter()
        async with aiohttp.ClientSession() as http, http.get(f"{url}/health") as r:
            assert r.status == 200
        times.append((time.perf_counter() - began) * 1000)
        await asyncio.sleep(every_s)
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


# --- the soak --------------------------------------------------------------------------------

def write_tokens(path: Path, policy: str) -> dict[str, dict[str, str]]:
    """Bearer headers of the two trainers, `hostile` and `small`."""
    tokens = {name: secrets.token_hex(16) for name in ("hostile", "small")}
    path.write_text(json.dumps({t: {"trainer": name, "policies": [policy]} for name, t in tokens.items()}))
    return {name: {"Authorization": f"Bearer {t}"} for name, t in tokens.items()}


async def big_bodies(url: str, policy: str, count: int, body: bytes, headers: dict,
                     stop: asyncio.Event) -> list[int]:
    """`count` maximal submits at once, each sent again as it ends, until `stop`."""
    async def one() -> list[int]:
        statuses = []
        while not stop.is_set():
            statuses.append(await post_big(url, policy, body, headers))
        return statuses
    return [s for got in await asyncio.gather(*(one() for _ in range(count))) for s in got]


async def large_reads(url: str, policy: str, headers: dict, groups: int, stop: asyncio.Event) -> int:
    """Queue `groups` maximal groups (n=1024 x 4,096 tokens), then read `count=16` of them
    again and again, never acknowledging: the same big results, every time."""
    job = {"prompts": [[7, i] for i in range(groups)], "n": 1024, "sampling": {"max_tokens": 4096}}
    reads = 0
    async with aiohttp.ClientSession(url, headers=headers) as http:
        async with http.post(f"/v1/policies/{policy}/jobs", json=job) as r:
            assert r.status == 201, await r.text()
        while not stop.is_set():
            async with http.get(f"/v1/policies/{policy}/results", params={"count": "16", "wait_ms": "1000"},
                                headers={"Accept": "application/msgpack"}) as r:
                await r.read()
                reads += r.status == 200
    return reads


async def small_jobs(url: str, policy: str, headers: dict, stop: asyncio.Event) -> list[float]:
    """One-prompt jobs, one at a time: submit, wait for the result, acknowledge. Seconds each."""
    latencies = []
    async with aiohttp.ClientSession(url, headers=headers) as http:
        while not stop.is_set():
            began = time.perf_counter()
            async with http.post(f"/v1/policies/{policy}/jobs",
                                 json={"prompts": [[1, 2, 3]], "sampling": {"max_tokens": 8}}) as r:
                assert r.status == 201, await r.text()
                job_id = (await r.json())["job_id"]
            got, give_up = [], time.monotonic() + 120
            while not got:
                if time.monotonic() > give_up:
                    raise AssertionError(f"small job {job_id} not answered within 120 s")
                async with http.get(f"/v1/policies/{policy}/results", params={"wait_ms": "2000"}) as r:
                    got = [x for x in (await r.json())["results"]]
                async with http.post(f"/v1/policies/{policy}/results/ack",
                                     json={"ids": [x["id"] for x in got]}) as r:
                    assert r.status == 200
                got = [x for x in got if x["job_id"] == job_id]
            latencies.append(time.perf_counter() - began)
    return latencies


async def soak(url: str, port: int, policy: str, headers: dict, *, slow: int, big: int, max_body: int,
               large_groups: int, seconds: float) -> dict:
    stop = asyncio.Event()
    writers = await slow_connections(port, slow)
    tasks = [asyncio.create_task(c) for c in (
        small_jobs(url, policy, headers["small"], stop), health_worst_ms(url, stop),
        big_bodies(url, policy, big, big_body(max_body), headers["hostile"], stop),
        large_reads(url, policy, headers["hostile"], large_groups, stop))]
    await asyncio.sleep(seconds)
    stop.set()
    small, health, bigs, reads = await asyncio.gather(*tasks)
    for w in writers:
        w.close()
    return {"slow_connections": len(writers), "big_submits": len(bigs),
            "big_statuses": {str(s): bigs.count(s) for s in sorted(set(bigs))}, "large_reads": reads,
            "small_jobs": len(small), "small_p50_ms": percentile(small, 0.5) * 1000,
            "small_p99_ms": percentile(small, 0.99) * 1000, "health_polls": len(health),
            "health_max_ms": max(health), "seconds": seconds}


def run(args: argparse.Namespace) -> dict:
    from rollq.harness.faults import RedisProcess, free_port

    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisProcess(Path(tmp) / "redis", extra=["--appendfsync", "everysec"]).start()
        headers = write_tokens(Path(tmp) / "tokens.json", args.policy)
        port = free_port()
        gateway = start_gateway(redis.url, port, "--tokens", str(Path(tmp) / "tokens.json"),
                                "--max-body-bytes", str(args.max_body), "--max-connections",
                                str(args.max_connections), log=str(Path(tmp) / "gateway.log"))
        worker = start_worker(redis.url, args.policy)
        try:
            idle = vm_kib(gateway.pid)
            result = asyncio.run(soak(f"http://127.0.0.1:{port}", port, args.policy, headers,
                                      slow=args.slow, big=args.big, max_body=args.max_body,
                                      large_groups=args.large_groups, seconds=args.seconds))
            result |= {"gateway_idle_rss_mib": idle / 1024, "max_body_bytes": args.max_body,
                       "gateway_peak_rss_mib": vm_kib(gateway.pid) / 1024}
            result |= {"bounds": bounds(args.max_body), "past_bounds": past_bounds(result, args.max_body)}
        finally:
            stop_process(gateway)
            stop_process(worker)
            redis.stop()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slow", type=int, default=2000)
    parser.add_argument("--big", type=int, default=8)
    parser.add_argument("--max-body", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--max-connections", type=int, default=4096)
    parser.add_argument("--large-groups", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--policy", default="soak")
    result = run(parser.parse_args())
    print(json.dumps(result, indent=1))
    print(f"wrote {write_result('gateway_soak', result)}")
    if result["past_bounds"]:
        sys.exit(f"past the soak's bounds: {'; '.join(result['past_bounds'])}")


if __name__ == "__main__":
    main()
