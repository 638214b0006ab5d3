"""Gateway soak (issue 20): one hostile trainer against a gateway while another uses it.

    python bench/gateway_soak.py [--slow 2000] [--big 8] [--seconds 60]

The gateway runs as its own process (`python -m rollq gateway`), so its peak RSS (`VmHWM`) is
its own. For `--seconds`: `--slow` connections that send half a request head and stall,
`--big` concurrent maximal submit bodies (`--max-body-bytes`, resent as each ends), and reads of
large results (n=1024 groups, `count=16`) by trainer `hostile`; meanwhile trainer `small`
submits one-prompt jobs and reads each result through the gateway (an instant-engine worker
process answers them). Reports `small`'s p50/p99 submit-to-result latency, the gateway's peak
RSS and /health's worst latency; writes bench/results/gateway_soak.json. Loopback only.
"""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent


def vm_kib(pid: int, field: str = "VmHWM") -> int:
    """A process's memory in KiB from /proc: VmHWM is its peak resident set, VmRSS the current."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for pid {pid}")


def start_gateway(redis_url: str, port: int, *flags: str, log: str = os.devnull) -> subprocess.Popen:
    """`rollq gateway --no-auth` on a loopback port, as a child process; returns once /health is 200."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(log, "wb") as out:  # a file, not a pipe: a pipe nobody reads would fill and block it
        proc = subprocess.Popen([sys.executable, "-m", "rollq", "gateway", "--no-auth", "--host",
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
