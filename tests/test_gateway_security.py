"""Issue 20 over real HTTP: publishing by path cannot escape the policy's weight root (links,
another policy's store, FIFOs, dot ids), header bombs and deeply nested bodies are 400s, and the
gateway keeps answering. A real gateway, a real redis-server, real files."""

from __future__ import annotations

import asyncio
import os
import struct
import time

import aiohttp
import pytest
import torch
from safetensors.torch import save_file
from yarl import URL


def weights(d, value: float = 1.0):
    d.mkdir(parents=True)
    save_file({"w": torch.full((4,), value)}, str(d / "model.safetensors"))
    return d


async def publish(http: aiohttp.ClientSession, policy: str, version: int, path, headers=None,
                  copy: bool = False) -> tuple[int, dict]:
    body = {"version": version, "path": str(path), "copy": copy}
    async with http.post(f"/v1/policies/{policy}/versions", json=body, headers=headers) as r:
        return r.status, await r.json()


async def test_linked_weight_file_is_refused_over_http(make_gateway, policy, tmp_path):
    gw = await make_gateway()
    secret = weights(tmp_path / "secret", 7.0) / "model.safetensors"
    linked = gw.weight_root / policy / "ckpt"
    linked.mkdir(parents=True)
    (linked / "model.safetensors").symlink_to(secret)
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        for version, copy in ((1, True), (2, False)):
            status, body = await publish(http, policy, version, linked, copy=copy)
            assert status == 400, body
            assert body["error"]["field"] == "path"
            assert "model.safetensors: is a symbolic link" in body["error"]["message"]
        async with http.get(f"/v1/policies/{policy}/versions") as r:
            assert (await r.json())["versions"] == []
    stored = [p for p in gw.weight_root.rglob("*.safetensors") if not p.is_symlink()]
    assert stored == []  # nothing of the secret was copied into the store


async def test_weight_roots_are_per_policy(make_gateway, policy, tmp_path):
    """alice (policy p) publishes a copy into <store>/p/; mallory (policy `elsewhere`) may not
    register p's stored files as hers, nor anything outside <root>/elsewhere/."""
    gw = await make_gateway()
    async with aiohttp.ClientSession(gw.url) as http:
        mine = weights(gw.weight_root / policy / "ckpt-1")
        status, entry = await publish(http, policy, 1, mine, gw.headers("alice"), copy=True)
        assert status == 201, entry
        stored = entry["path"]
        assert stored.startswith(str(gw.weight_root / policy) + "/")
        status, body = await publish(http, "elsewhere", 1, stored, gw.headers("mallory"))
        assert status == 403, body
        assert body["error"]["field"] == "path"
        assert f"weight store of policy {policy!r}" in body["error"]["message"]
        at_root = weights(gw.weight_root / "shared")
        status, body = await publish(http, "elsewhere", 1, at_root, gw.headers("mallory"))
        assert status == 403 and "weight store of policy 'shared'" in body["error"]["message"]
        theirs = weights(gw.weight_root / "elsewhere" / "ckpt")
        status, entry = await publish(http, "elsewhere", 1, theirs, gw.headers("mallory"))
        assert status == 201 and entry["publisher"] == "mallory", entry
        status, body = await publish(http, policy, 2, "relative/dir", gw.headers("alice"))
        assert status == 400 and "absolute" in body["error"]["message"]


async def test_explicit_weight_roots_are_per_policy_too(make_gateway, policy, tmp_path):
    ckpts = tmp_path / "ckpts"
    gw = await make_gateway(weight_roots=[ckpts])
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        status, body = await publish(http, policy, 1, weights(ckpts / "loose"))
        assert status == 403, body
        assert f"outside the weight roots of policy {policy!r} ({ckpts / policy})" in body["error"]["message"]
        status, body = await publish(http, policy, 1, weights(ckpts / policy / "step-1"))
        assert status == 201, body
        status, body = await publish(http, policy, 2, weights(gw.weight_root / policy / "x"))
        assert status == 403, body  # the store is not a root unless named


async def test_fifo_publishes_fail_at_once_and_the_gateway_keeps_answering(make_gateway, policy):
    gw = await make_gateway()
    d = gw.weight_root / policy / "fifo"
    d.mkdir(parents=True)
    fifo = d / "model.safetensors"
    os.mkfifo(fifo)
    try:
        async with aiohttp.ClientSession(gw.url, headers=gw.headers(),
                                         timeout=aiohttp.ClientTimeout(total=10)) as http:
            began = time.monotonic()
            replies = await asyncio.gather(*(publish(http, policy, v, d, copy=v % 2 == 0)
                                             for v in range(1, 9)))
            assert [status for status, _ in replies] == [400] * 8, replies
            assert all("model.safetensors: is not a regular file (a FIFO)" in body["error"]["message"]
                       for _, body in replies)
            for path in ("/health", "/static/uPlot.LICENSE"):
                async with http.get(path) as r:
                    assert r.status == 200
            print(f"8 FIFO publishes and 2 GETs in {time.monotonic() - began:.3f} s")
    finally:  # on the unfixed code, releases the threads blocked opening the FIFO
        for _ in range(64):
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # ENXIO: nobody is blocked any more
                break
            await asyncio.sleep(0.05)


async def test_header_bomb_publish_is_a_400(make_gateway, policy):
    gw = await make_gateway()
    d = gw.weight_root / policy / "bomb"
    d.mkdir(parents=True)
    raw = b'{"w":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        status, body = await publish(http, policy, 1, d)
        assert status == 400, body
        assert "model.safetensors: header is not a safetensors header" in body["error"]["message"]
        async with http.get("/health") as r:
            assert r.status == 200


async def test_dot_policy_cannot_write_outside_the_store(make_gateway, tmp_path):
    gw = await make_gateway(no_auth=True, tokens=None)
    source = weights(gw.weight_root / "src")
    before = sorted(p for p in tmp_path.rglob("*"))
    async with aiohttp.ClientSession() as http:
        for name in ("%2E%2E", "%2E", "a%0A"):
            url = URL(f"{gw.url}/v1/policies/{name}/versions", encoded=True)
            async with http.post(url, json={"version": 1, "path": str(source), "copy": True}) as r:
                assert r.status in (400, 404), await r.text()
                if r.status == 400:
                    assert (await r.json())["error"]["field"] == "policy"
    assert sorted(p for p in tmp_path.rglob("*")) == before


@pytest.mark.parametrize("depth", [1_000, 100_000])
async def test_deeply_nested_body_is_a_400(make_gateway, policy, depth):
    gw = await make_gateway()
    body = b'{"prompts": [[1]], "meta": {"a": ' + b"[" * depth + b"]" * depth + b"}}"
    headers = gw.headers() | {"Content-Type": "application/json"}
    async with (aiohttp.ClientSession(gw.url, headers=headers) as http,
                http.post(f"/v1/policies/{policy}/jobs", data=body) as r):
        assert r.status == 400, await r.text()
        error = (await r.json())["error"]
    assert "nested too deeply" in error["message"]


# --- 5. slow clients -------------------------------------------------------------------------

async def _half_sent(port: int, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    return reader, writer


async def _closed_within(reader: asyncio.StreamReader, timeout_s: float) -> bytes | None:
    """What the server sent before closing, or None if it kept the connection open."""
    try:
        async with asyncio.timeout(timeout_s):
            return await reader.read()
    except TimeoutError:
        return None
    except ConnectionResetError:
        return b""


async def test_half_sent_requests_are_closed_by_the_timeouts(make_gateway, policy):
    """200 requests whose headers never end and 20 whose bodies never end: the gateway closes
    each within its timeout (a 408 for the bodies) and answers /health meanwhile."""
    gw = await make_gateway(header_timeout_s=1.0, body_timeout_s=1.0)
    port = URL(gw.url).port
    headers = f"POST /v1/policies/{policy}/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
    body = (f"{headers}{gw.tokens['alice']}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n{\"prompts\": ")
    began = time.monotonic()
    slow_headers = [await _half_sent(port, headers.encode()) for _ in range(200)]
    slow_bodies = [await _half_sent(port, body.encode()) for _ in range(20)]
    async with aiohttp.ClientSession(gw.url) as http, http.get("/health") as r:
        assert r.status == 200
    closed = await asyncio.gather(*(_closed_within(r, 10) for r, _ in slow_headers + slow_bodies))
    took = time.monotonic() - began
    for _, writer in slow_headers + slow_bodies:
        writer.close()
    assert None not in closed, f"{closed.count(None)} connections still open after {took:.1f} s"
    assert all(b" 408 " in reply.split(b"\r\n")[0] for reply in closed[200:]), closed[200:][:2]
    print(f"220 half-sent requests closed in {took:.1f} s")


async def test_connections_beyond_the_cap_are_turned_away(make_gateway):
    gw = await make_gateway(max_connections=50, header_timeout_s=30.0)
    port = URL(gw.url).port
    idle = [await _half_sent(port, b"GET /health HTTP/1.1\r\n") for _ in range(80)]
    replies = await asyncio.gather(*(_closed_within(r, 5) for r, _ in idle))
    turned_away = [r for r in replies if r is not None]
    assert 30 - 5 <= len(turned_away) <= 30, len(turned_away)  # a burst may overshoot a little
    assert all(r.startswith(b"HTTP/1.1 503 ") for r in turned_away), turned_away[:2]
    for _, writer in idle:
        writer.close()
    async with aiohttp.ClientSession(gw.url) as http:
        for _ in range(50):  # the slots free up once the idle sockets are closed
            async with http.get("/health") as r:
                if r.status == 200:
                    break
            await asyncio.sleep(0.1)
        assert r.status == 200


async def test_the_header_timeout_spares_slow_handlers(make_gateway, policy):
    """A long poll outlives the header timeout: it bounds waiting for a request, not answering."""
    gw = await make_gateway(header_timeout_s=0.5)
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        began = time.monotonic()
        async with http.get(f"/v1/policies/{policy}/results", params={"wait_ms": "2000"}) as r:
            assert r.status == 200 and (await r.json())["results"] == []
        assert time.monotonic() - began >= 2.0
        async with http.get("/health") as r:  # the same kept-alive connection or a new one
            assert r.status == 200


# --- 6. sampling.extra reaches vLLM's SamplingParams: only an allow-list does ----------------

@pytest.mark.parametrize("extra, field, message", [
    ({"prompt_logprobs": -1}, "sampling.extra.prompt_logprobs", "not allowed"),
    ({"logit_bias": {"1": 100}}, "sampling.extra.logit_bias", "not allowed"),
    ({"extra_args": {"x": 1}}, "sampling.extra.extra_args", "not allowed"),
    ({"ignore_eos": 1}, "sampling.extra.ignore_eos", "must be a bool"),
    ({"min_tokens": 9}, "sampling.extra.min_tokens", "between 0 and max_tokens=8"),
])
async def test_sampling_extra_takes_only_allowed_keys(make_gateway, policy, extra, field, message):
    gw = await make_gateway()
    jobs = f"/v1/policies/{policy}/jobs"
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        body = {"prompts": [[1]], "sampling": {"max_tokens": 8, "extra": extra}}
        async with http.post(jobs, json=body) as r:
            assert r.status == 400, await r.text()
            error = (await r.json())["error"]
        assert error["field"] == field and message in error["message"]
        fine = {"max_tokens": 8, "extra": {"ignore_eos": True, "min_tokens": 8, "skip_special_tokens": False}}
        async with http.post(jobs, json={"prompts": [[1]], "sampling": fine}) as r:
            assert r.status == 201, await r.text()


async def test_a_request_while_redis_is_unreachable_is_a_503_without_a_traceback(make_gateway, policy,
                                                                               tmp_path, caplog):
    """Redis down (restarting, a network fault) is neither the caller's fault nor the gateway's: a
    503 with Retry-After, which clients retry, and one warning line, not a 500 with a traceback."""
    from rollq.harness.faults import RedisProcess

    redis = RedisProcess(tmp_path / "redis", aof=False).start()
    try:
        gw = await make_gateway(redis_url=redis.url, policies=[policy])
    finally:
        redis.kill()  # (the gateway checks Redis at start-up)
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        for path in (f"/v1/policies/{policy}/episodes/e1.0", f"/v1/policies/{policy}/status"):
            async with http.get(path) as r:
                body = await r.json()
                assert r.status == 503 and r.headers["Retry-After"] == "1", (path, r.status, body)
                assert "Redis is unreachable" in body["error"]["message"]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
