"""Issue 20, item 3 / acceptance 2: the gateway's /health stays under 100 ms while hostile
publishes make it check a 16 MiB forged safetensors header (the costliest known: 4,300-digit
integers, ~0.5 s of msgspec decode under the GIL). The gateway is its own process; /health is
polled over a kept-alive connection every 10 ms throughout.

Bound: p99 < 100 ms and max < 250 ms, not max < 100 ms: on the shared 2-core box one poll now
and then waits for the scheduler, not for the gateway (measured after the fix, 12 runs at load
up to 15: p99 9-29 ms, max 12-149 ms). Before the header check moved to helper processes
(gateway/files.py) it ran in a thread of the gateway: p99 461-550 ms, max 563 ms; and starting
the helpers on the event loop cost one poll 241 ms."""

from __future__ import annotations

import asyncio
import struct
import sys
import time
from pathlib import Path

import pytest
import aiohttp
from conftest import reserved_port

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.common import stop_process  # noqa: E402
from bench.gateway_soak import percentile, start_gateway  # noqa: E402

pytestmark = pytest.mark.alone  # wall-clock bounds: run after the parallel part, alone on the machine

HEADER_CAP = 16 * 1024 * 1024


def forged_header(size: int = HEADER_CAP) -> bytes:
    """Tensors whose 32 dims are each 4,300 nines, as many as fit `size`."""
    dims = ",".join(["9" * 4300] * 32)
    one = '"t%d":{"dtype":"F32","shape":[' + dims + '],"data_offsets":[0,4]}'
    body, i = [], 0
    while sum(map(len, body)) + len(one) + 20 < size - 2:
        body.append(one % i)
        i += 1
    raw = ("{" + ",".join(body) + "}").encode()
    return raw + b" " * (size - len(raw))  # padded to the cap, as a header may be


def children(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def poll_health(http: aiohttp.ClientSession, stop: asyncio.Event) -> list[float]:
    times = []
    while not stop.is_set():
        began = time.perf_counter()
        async with http.get("/health") as r:
            assert r.status == 200
        times.append((time.perf_counter() - began) * 1000)
        await asyncio.sleep(0.01)
    return times


async def test_health_answers_during_a_hostile_publish(redis_url, policy, tmp_path):
    store = tmp_path / "store"
    bad = store / policy / "bad"
    bad.mkdir(parents=True)
    raw = forged_header()
    (bad / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"\0" * 4)
    port = reserved_port()
    gateway = start_gateway(redis_url, port, "--weight-store", str(store))
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as http:
            stop = asyncio.Event()
            poller = asyncio.create_task(poll_health(http, stop))
            await asyncio.sleep(0.5)
            began = time.perf_counter()
            for version in (1, 2, 3):
                body = {"version": version, "path": str(bad)}
                async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as pub, \
                        pub.post(f"/v1/policies/{policy}/versions", json=body) as r:
                    assert r.status == 400 and (await r.json())["error"]["field"] == "path"
            publishing = time.perf_counter() - began
            stop.set()
            times = await poller
        helpers = children(gateway.pid)  # the header checks' processes (and their resource tracker)
    finally:
        stop_process(gateway)
    assert helpers, "the publishes ran in no helper process"
    # The resource tracker leaves when its pipe closes, after the gateway: a moment later.
    give_up = time.monotonic() + 10
    while [pid for pid in helpers if alive(pid)] and time.monotonic() < give_up:
        time.sleep(0.1)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:200] for pid in helpers if alive(pid)}
    assert not left, f"helper processes outlived the gateway by 10 s: {left}"
    worst, p99 = max(times), percentile(times, 0.99)
    print(f"\n/health during 3 hostile publishes ({publishing:.1f} s): {len(times)} polls, "
          f"p50 {percentile(times, 0.5):.1f} ms, p99 {p99:.1f} ms, max {worst:.1f} ms")
    assert len(times) >= 10
    assert p99 < 100 and worst < 250
