"""Issue 20, item 1: concurrent maximal bodies cannot all be decoded at once. The gateway runs
as its own process (`python -m rollq gateway`), so its peak RSS (VmHWM) is its own; the bound
is on memory, not time. About 30 s on a loaded 2-core box."""

from __future__ import annotations

import sys
from pathlib import Path

import aiohttp
from conftest import reserved_port
from helpers import wait_until

from rollq.queue.keys import Keys

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.gateway_soak import (big_body, concurrent_big_submits, start_gateway,  # noqa: E402
                                start_worker, vm_kib)
from bench.common import stop_process  # noqa: E402

MAX_BODY = 16 * 1024 * 1024


async def test_eight_concurrent_maximal_bodies_peak_like_four(redis_url, policy):
    port = reserved_port()
    gateway = start_gateway(redis_url, port, "--max-body-bytes", str(MAX_BODY))
    url = f"http://127.0.0.1:{port}"
    try:
        body = big_body(MAX_BODY)
        base = vm_kib(gateway.pid)
        assert await concurrent_big_submits(url, policy, 1, body) == [201]
        one = vm_kib(gateway.pid) - base
        statuses = await concurrent_big_submits(url, policy, 8, body)
        eight = vm_kib(gateway.pid) - base
    finally:
        stop_process(gateway)
    print(f"\npeak RSS above idle: one {MAX_BODY >> 20} MiB submit {one / 1024:.0f} MiB, "
          f"eight at once {eight / 1024:.0f} MiB (idle {base / 1024:.0f} MiB)")
    assert statuses == [201] * 8  # waited their turn, none refused
    # At most 4 x max_body_bytes are read and decoded at once (the default budget): 8 bodies
    # peak like 4 (plus slack for the allocator), not like 8.
    assert eight < 5.5 * one, (one, eight)


async def test_reading_maximal_results_is_bounded(redis_url, redis, policy):
    """The review's case: `count=16` of maximal groups (n=1024 x 4,096 tokens), as JSON."""
    port = reserved_port()
    gateway = start_gateway(redis_url, port)
    worker = start_worker(redis_url, policy)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession(url) as http:
            job = {"prompts": [[7, i] for i in range(3)], "n": 1024, "sampling": {"max_tokens": 4096}}
            async with http.post(f"/v1/policies/{policy}/jobs", json=job) as r:
                assert r.status == 201

            async def all_done() -> bool:
                return await redis.xlen(Keys(policy).results("anonymous")) == 3

            await wait_until(all_done, timeout_s=120, what="3 maximal results")
            base = vm_kib(gateway.pid)
            async with http.get(f"/v1/policies/{policy}/results", params={"count": "16"}) as r:
                got = len((await r.json())["results"])
            above = (vm_kib(gateway.pid) - base) / 1024
    finally:
        stop_process(gateway)
        stop_process(worker)
    print(f"\ncount=16 of 3 maximal results: {got} in the reply, peak RSS {above:.0f} MiB above idle")
    assert got == 1  # one is already past max_reply_bytes (16 MiB)
    assert above < 600
