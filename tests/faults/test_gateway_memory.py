"""Issue 20, item 1: concurrent maximal bodies cannot all be decoded at once. The gateway runs
as its own process (`python -m rollq gateway`), so its peak RSS (VmHWM) is its own; the bound
is on memory, not time. About 30 s on a loaded 2-core box."""

from __future__ import annotations

import sys
from pathlib import Path

from conftest import reserved_port

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.gateway_soak import big_body, concurrent_big_submits, start_gateway, vm_kib  # noqa: E402
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
