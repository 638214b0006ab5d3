"""Issue 28, acceptance 2: while one trainer sends each hostile body the gateway renders, walks or
decodes (a trusted template's loop bomb and string bomb, an 8 MB episode message, a chat body
nested 500 deep, 16 MiB chat and completion prompts), /health keeps answering (p99 < 100 ms),
the gateway's memory stays bounded, and another trainer's small chat requests keep being served.
The gateway is its own process (`--tokenizer`, `--trust-request-chat-template`, so the bombs do
run: in the render helpers), with an instant-engine worker; /health is polled over a kept-alive
connection every 10 ms. Bounds as test_gateway_health.py's (p99 < 100 ms, max < 250 ms: on the
shared box a poll now and then waits for the scheduler, not for the gateway)."""

from __future__ import annotations

import asyncio
import io
import json
import sys
import time
from pathlib import Path

import pytest
import aiohttp
from conftest import reserved_port
from gateway_fixtures import write_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.common import stop_process  # noqa: E402
from bench.gateway_soak import percentile, start_gateway, start_worker  # noqa: E402

pytestmark = pytest.mark.alone  # wall-clock bounds: run after the parallel part, alone on the machine

RSS_BOUND_MB = 400
"""Growth of the gateway's resident memory over the whole run (helpers not counted: they are
other processes, each within its 1 GiB address-space limit)."""


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def hostile(policy: str) -> list[tuple[str, str, bytes]]:
    """(what, path, body) of each hostile request type."""
    user = [{"role": "user", "content": "w10"}]
    episodes = f"/v1/policies/{policy}/episodes"
    deep = "[" * 500 + "]" * 500
    loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}w10"
    big = "{% set s = 'x' * 2000000000 %}{{ s|length }}{{ (s ~ s)|length }}"
    mib16 = 16 * 1024 * 1024
    return [
        ("template loop bomb", episodes,
         json.dumps({"messages": user, "chat_template_kwargs": {"chat_template": loop}}).encode()),
        ("template string bomb", episodes,
         json.dumps({"messages": user, "chat_template_kwargs": {"chat_template": big}}).encode()),
        ("8 MB episode message", episodes,
         json.dumps({"messages": [{"role": "user", "content": "w10 " * (2 * 1024 * 1024)}]}).encode()),
        ("chat nested 500 deep", "/v1/chat/completions",
         f'{{"model":"{policy}","max_tokens":1,"messages":[{{"role":"user","content":"w10","x":{deep}}}]}}'
         .encode()),
        ("16 MiB chat prompt", "/v1/chat/completions",
         json.dumps({"model": policy, "messages": [{"role": "user", "content": "w10 " * (mib16 // 4)}]})
         .encode()),
        ("16 MiB completion prompt (ids)", "/v1/completions",
         json.dumps({"model": policy, "prompt": [10] * (mib16 // 4)}).encode()),
        ("16 MiB completion prompt (text)", "/v1/completions",
         json.dumps({"model": policy, "prompt": "w10 " * (mib16 // 4)}).encode()),
    ]


async def poll_health(http: aiohttp.ClientSession, stop: asyncio.Event, pid: int,
                      rss: list[float], stamps: list[float]) -> list[float]:
    """/health's times in ms; the gateway's RSS (MB) sampled at each poll into `rss`."""
    times = []
    while not stop.is_set():
        rss.append(rss_mb(pid))
        began = time.perf_counter()
        async with http.get("/health") as r:
            assert r.status == 200
        times.append((time.perf_counter() - began) * 1000)
        stamps.append(began)
        await asyncio.sleep(0.01)
    return times


async def small_chats(http: aiohttp.ClientSession, policy: str, stop: asyncio.Event) -> int:
    """Another trainer's small chat requests, one after another: how many were served."""
    served = 0
    body = {"model": policy, "max_tokens": 2, "messages": [{"role": "user", "content": "w10"}]}
    while not stop.is_set():
        async with http.post("/v1/chat/completions", json=body) as r:
            assert r.status == 200, await r.text()
        served += 1
    return served


async def test_health_and_small_chats_during_hostile_renders(redis_url, policy, tmp_path):
    from models import make_chat_model

    tokens = write_tokens(tmp_path / "tokens.json", policy)
    port = reserved_port()
    gateway = start_gateway(redis_url, port, "--tokens", str(tmp_path / "tokens.json"),
                            "--tokenizer", str(make_chat_model(tmp_path / "chat")),
                            "--trust-request-chat-template", log=str(tmp_path / "gateway.log"))
    worker = start_worker(redis_url, policy)
    url = f"http://127.0.0.1:{port}"
    outcomes = []
    try:
        before, rss, stamps = rss_mb(gateway.pid), [], []
        async with aiohttp.ClientSession(url) as probe, \
                aiohttp.ClientSession(url, headers={"Authorization": f"Bearer {tokens['alice']}"}) as alice:
            async with alice.post("/v1/chat/completions", json={  # served once before the clock starts
                    "model": policy, "max_tokens": 1, "messages": [{"role": "user", "content": "w10"}],
                    "timeout_s": 60}) as r:
                assert r.status == 200, await r.text()
            async with alice.post(f"/v1/policies/{policy}/episodes", json={  # the render helpers are up
                    "messages": [{"role": "user", "content": "w10"}], "sampling": {"max_tokens": 1}}) as r:
                assert r.status == 201, await r.text()
            requests = hostile(policy)  # built before the clock: 70 MB of JSON would stall this loop
            stop = asyncio.Event()
            poller = asyncio.create_task(poll_health(probe, stop, gateway.pid, rss, stamps))
            chats = asyncio.create_task(small_chats(alice, policy, stop))
            headers = {"Authorization": f"Bearer {tokens['bob']}", "Content-Type": "application/json"}
            async with aiohttp.ClientSession(url, headers=headers) as bob:
                for what, path, body in requests:
                    began = time.perf_counter()
                    async with bob.post(path, data=io.BytesIO(body)) as r:
                        error = (await r.json())["error"]
                    outcomes.append((what, r.status, error["field"], time.perf_counter() - began,
                                     began, error["message"][:80]))
            stop.set()
            times, served = await poller, await chats
        after, peak = rss_mb(gateway.pid), max(rss)
        log = (tmp_path / "gateway.log").read_text()
    finally:
        stop_process(worker)
        stop_process(gateway)
    p99, worst = percentile(times, 0.99), max(times)
    print(f"\n/health during {len(outcomes)} hostile requests: {len(times)} polls, p50 "
          f"{percentile(times, 0.5):.1f} ms, p99 {p99:.1f} ms, max {worst:.1f} ms; small chats served: "
          f"{served}; gateway RSS {before:.0f} MB before, peak {peak:.0f} MB, {after:.0f} MB after")
    for what, status, field, took, began, message in outcomes:
        during = [t for t, at in zip(times, stamps) if began <= at <= began + took] or [0.0]
        print(f"  {what:32} {status} {field:10} {took:5.2f} s, /health max {max(during):5.1f} ms  {message}")
    assert all(status == 400 and field for _, status, field, *_ in outcomes), outcomes
    assert "Traceback" not in log
    assert served >= len(outcomes)
    assert peak - before < RSS_BOUND_MB
    assert len(times) >= 10
    assert p99 < 100 and worst < 250
