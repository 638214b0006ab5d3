"""Issue 20, item 1 over real HTTP: one trainer cannot make the gateway hold unbounded bytes.
Replies of results are bounded by bytes (`max_reply_bytes`, at least one result each), and
request bodies in flight by `max_body_bytes_in_flight`. A real gateway, a worker (instant
engine: these are about the gateway's memory, not generation), a real redis-server."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
from gateway_fixtures import sse_events

BUDGET = 64 * 1024
JOB = {"prompts": [[i, 1, 2] for i in range(12)], "n": 4, "sampling": {"max_tokens": 600}}
"""12 results of 2,400 tokens with their logprobs: ~50 KB of JSON each."""


async def submitted(http: aiohttp.ClientSession, policy: str) -> None:
    async with http.post(f"/v1/policies/{policy}/jobs", json=JOB) as r:
        assert r.status == 201, await r.text()


async def test_a_batch_of_results_is_bounded_by_bytes(make_gateway, make_worker, policy):
    gw = await make_gateway(max_reply_bytes=BUDGET)
    make_worker()
    seen: list[str] = []
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        await submitted(http, policy)
        for accept in ["application/json", "application/msgpack"] * 20:
            if len(seen) == 12:
                break
            params = {"count": "12", "wait_ms": "2000"}
            async with http.get(f"/v1/policies/{policy}/results", params=params,
                                headers={"Accept": accept}) as r:
                body = await r.read()
            batch = (msgspec.json.decode if "json" in accept else msgspec.msgpack.decode)(body)["results"]
            assert batch, "a batch has at least one result"
            assert len(body) <= BUDGET or len(batch) == 1, (len(body), len(batch))
            assert all(len(x["samples"]) == 4 and len(x["samples"][0]["token_ids"]) == 600 for x in batch)
            seen += [x["id"] for x in batch]
            ids = {"ids": [x["id"] for x in batch]}
            async with http.post(f"/v1/policies/{policy}/results/ack", json=ids) as r:
                assert (await r.json())["acked"] == len(batch)
    assert len(seen) == len(set(seen)) == 12  # all of them, none twice, across several batches


async def test_one_result_bigger_than_the_budget_still_comes(make_gateway, make_worker, policy):
    gw = await make_gateway(max_reply_bytes=BUDGET)
    make_worker()
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        async with http.post(f"/v1/policies/{policy}/jobs", json={
                "prompts": [[1]], "n": 8, "sampling": {"max_tokens": 2000}}) as r:
            assert r.status == 201
        async with http.get(f"/v1/policies/{policy}/results", params={"wait_ms": "5000"}) as r:
            body = await r.read()
        [result] = msgspec.json.decode(body)["results"]
        assert len(body) > BUDGET and len(result["samples"]) == 8


async def test_the_stream_writes_every_result_and_reads_few_at_a_time(make_gateway, make_worker, policy):
    gw = await make_gateway(max_reply_bytes=BUDGET)
    make_worker()
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        await submitted(http, policy)
        async with http.get(f"/v1/policies/{policy}/results/stream", params={"ack": "auto"}) as r:
            events = await asyncio.wait_for(sse_events(r, 12), 60)
        assert sorted(e["group_index"] for e in events) == list(range(12))


async def test_a_body_beyond_the_budget_waits_then_gets_a_503(make_gateway, policy):
    """A completions request (no worker: it waits) holds the whole budget with its body; the
    next body waits body_timeout_s for room, then gets a 503; room comes back when it leaves."""
    gw = await make_gateway(max_body_bytes=65_536, body_bytes_in_flight=65_536, body_timeout_s=1.0)
    held = msgspec.json.encode({"model": policy, "prompt": [[1, 2, 3]], "max_tokens": 1, "timeout_s": 60})
    held = held[:-1] + b" " * (65_536 - len(held)) + b"}"  # JSON whitespace: exactly the budget
    async with aiohttp.ClientSession(gw.url, headers=gw.headers("alice")) as http:
        holder = asyncio.create_task(http.post("/v1/completions", data=held,
                                               headers={"Content-Type": "application/json"}))
        await asyncio.sleep(0.5)
        async with http.post(f"/v1/policies/{policy}/jobs", json=JOB) as r:
            assert r.status == 503 and r.headers["Retry-After"] == "1"
            assert "retry" in (await r.json())["error"]["message"]
        holder.cancel()  # the caller leaves: its handler is cancelled and gives the bytes back
        await asyncio.gather(holder, return_exceptions=True)
        await asyncio.sleep(0.5)
        async with http.post(f"/v1/policies/{policy}/jobs", json=JOB) as r:
            assert r.status == 201
