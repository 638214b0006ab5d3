"""The gateway's own API over real HTTP: a gateway, a worker (instant engine: these tests are
about the HTTP surface, not generation) and a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import sys
from pathlib import Path

import aiohttp
import msgspec
import pytest
from conftest import reserved_port
from gateway_fixtures import sse_events
from helpers import wait_until
from prometheus_client.parser import text_string_to_metric_families

from rollq.engine.instant import expected_tokens
from rollq.protocol import pack_tokens


async def test_submit_stream_ack_status(make_gateway, make_worker, policy):
    gw = await make_gateway()
    make_worker()
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        body = {"prompts": [[5, 6, 7], [8, 9]], "n": 2, "sampling": {"max_tokens": 4}, "job_id": "j1"}
        async with http.post(f"/v1/policies/{policy}/jobs", json=body) as r:
            assert r.status == 201, await r.text()
            assert await r.json() == {"job_id": "j1", "groups": 2}
        async with http.get(f"/v1/policies/{policy}/results/stream") as r:
            assert r.headers["Content-Type"] == "text/event-stream"
            events = await sse_events(r, 2)
        by_group = {e["group_index"]: e for e in events}
        assert sorted(by_group) == [0, 1]
        for index, prompt in ((0, [5, 6, 7]), (1, [8, 9])):
            result = by_group[index]
            assert result["status"] == "ok" and result["prompt_token_ids"] == prompt
            assert [s["token_ids"] for s in result["samples"]] == [
                expected_tokens(pack_tokens(prompt), j, 4, 32_000) for j in range(2)]
            assert all(s["versions"] == [[0, 0]] for s in result["samples"])
        # Not acknowledged yet: a new connection gets them again, first.
        async with http.get(f"/v1/policies/{policy}/results") as r:
            assert sorted(x["id"] for x in (await r.json())["results"]) == sorted(e["id"] for e in events)
        ack = {"ids": [e["id"] for e in events]}
        async with http.post(f"/v1/policies/{policy}/results/ack", json=ack) as r:
            assert await r.json() == {"acked": 2}
        async with http.get(f"/v1/policies/{policy}/results") as r:
            assert (await r.json())["results"] == []
        async with http.get(f"/v1/policies/{policy}/jobs/j1") as r:
            job = await r.json()
        assert (job["state"], job["done"], job["ok"], job["trainer_id"]) == ("done", 2, 2, "alice")


async def test_msgpack_in_and_out(make_gateway, make_worker, policy):
    gw = await make_gateway()
    make_worker()
    headers = gw.headers() | {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}
    async with aiohttp.ClientSession(gw.url, headers=headers) as http:
        body = msgspec.msgpack.encode({"prompts": [[1, 2]], "sampling": {"max_tokens": 3}})
        async with http.post(f"/v1/policies/{policy}/jobs", data=body) as r:
            assert r.status == 201 and r.content_type == "application/msgpack"
            job_id = msgspec.msgpack.decode(await r.read())["job_id"]
        results = []
        while not results:
            async with http.get(f"/v1/policies/{policy}/results", params={"wait_ms": "1000"}) as r:
                results = msgspec.msgpack.decode(await r.read())["results"]
        assert results[0]["job_id"] == job_id and len(results[0]["samples"][0]["token_ids"]) == 3


async def test_errors_name_the_field_and_the_reason(make_gateway, policy):
    gw = await make_gateway()
    jobs = f"/v1/policies/{policy}/jobs"
    async with aiohttp.ClientSession(gw.url) as http:
        async def call(method, path, trainer=None, headers=None, **kw):
            headers = (gw.headers(trainer) if trainer else {}) | (headers or {})
            async with http.request(method, path, headers=headers, **kw) as r:
                return r.status, (await r.json()).get("error")

        status, error = await call("POST", jobs, json={"prompts": [[1]]})
        assert status == 401 and "bearer token" in error["message"]
        async with http.post(jobs, headers={"Authorization": "Bearer not-a-token-of-ours"},
                             json={"prompts": [[1]]}) as r:
            assert r.status == 401 and (await r.json())["error"]["message"] == "invalid bearer token"
        status, error = await call("POST", jobs, "mallory", json={"prompts": [[1]]})
        assert status == 403 and error["field"] == "policy" and "mallory" in error["message"]
        status, error = await call("POST", jobs, "alice", json={"prompts": [[1]], "n": 0})
        assert status == 400 and error["field"] == "n" and "between 1 and 1024" in error["message"]
        status, error = await call("POST", jobs, "alice", json={"prompts": [[1]],
                                                                "sampling": {"max_tokens": 10**9}})
        assert status == 400 and error["field"] == "sampling.max_tokens"
        status, error = await call("POST", jobs, "alice", json={"prompts": [[1]], "temprature": 1})
        assert status == 400 and "temprature" in error["message"]
        status, error = await call("POST", jobs, "alice", json={"prompts": "not a list"})
        assert status == 400 and error["field"] == "prompts"
        status, error = await call("POST", jobs, "alice", data=b"{",
                                   headers={"Content-Type": "application/json"})
        assert status == 400 and "not valid JSON" in error["message"]
        status, error = await call("POST", f"/v1/policies/{policy}/results/ack", "alice", json={"ids": ["x"]})
        assert status == 400 and error["field"] == "ids[0]"
        # Another trainer's job is not yours to see or cancel.
        status, _ = await call("POST", jobs, "alice", json={"prompts": [[1]], "job_id": "alices"})
        assert status == 201
        status, error = await call("DELETE", f"{jobs}/alices", "bob")
        assert status == 404 and error["field"] == "job_id"
        status, error = await call("GET", f"{jobs}/alices", "bob")  # nor to read (issue 12)
        assert status == 404 and error["field"] == "job_id"
        status, _ = await call("GET", f"{jobs}/alices", "alice")
        assert status == 200


async def test_observe_routes_are_public_only_when_the_operator_says_so(make_gateway):
    """/metrics and the dashboard's data name every trainer and show failure reasons: a token
    with the observe scope by default (issue 12), anyone with --public-observe."""
    for public, anonymous in ((False, 401), (True, 200)):
        gw = await make_gateway(public_observe=public)
        async with aiohttp.ClientSession(gw.url) as http:
            for path in ("/metrics", "/api/dashboard"):
                async with http.get(path) as r:
                    assert r.status == anonymous, (public, path)
                async with http.get(path, headers=gw.headers("bob")) as r:  # rollouts scope only
                    assert r.status == (200 if public else 403), (public, path)
                async with http.get(path, headers=gw.headers()) as r:
                    assert r.status == 200


async def test_cancel_over_http(make_gateway, make_worker, make_client, policy):
    gw = await make_gateway()
    make_worker(delay_s=0.5, max_inflight=1)
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        async with http.post(f"/v1/policies/{policy}/jobs", json={"prompts": [[i + 1] for i in range(6)],
                                                                  "job_id": "slow"}) as r:
            assert r.status == 201
        async with http.delete(f"/v1/policies/{policy}/jobs/slow") as r:
            left = (await r.json())["cancelled"]
        assert left >= 4
        results = await make_client("alice").take(6, timeout_s=30)
        statuses = [x.status for x in results]
        # `left` counts the groups without a result; the one running (max_inflight=1) may still
        # finish ok before the worker sees the cancel.
        assert len(results) == 6 and left - 1 <= statuses.count("cancelled") <= left


async def test_publish_and_list_versions(make_gateway, policy, tmp_path):
    from safetensors.torch import save_file
    import torch

    gw = await make_gateway()
    inside = gw.weight_root / policy / "v3"  # weight roots are per policy
    inside.mkdir(parents=True)
    save_file({"w": torch.ones(4)}, inside / "model.safetensors")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    save_file({"w": torch.ones(4)}, outside / "model.safetensors")
    url = f"/v1/policies/{policy}/versions"
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        async with http.post(url, json={"version": 3, "path": str(inside)}) as r:
            assert r.status == 201, await r.text()
            entry = await r.json()
        assert entry["version"] == 3 and entry["files"][0]["name"] == "model.safetensors"
        file, = entry["files"]
        assert len(file["digest"]) == 64 and file["algorithm"] == "blake3" and entry["publisher"] == "alice"
        async with http.post(url, json={"version": 3, "path": str(inside)}) as r:
            assert r.status == 409 and (await r.json())["error"]["field"] == "version"
        async with http.post(url, json={"version": 4, "path": str(outside)}) as r:
            assert r.status == 403 and (await r.json())["error"]["field"] == "path"
        # Submitting is not publishing: bob's token has no publish scope.
        async with http.post(url, json={"version": 4, "path": str(inside)},
                             headers=gw.headers("bob")) as r:
            assert r.status == 403 and (await r.json())["error"]["field"] == "scopes"
        async with http.get(url) as r:
            listed = await r.json()
        assert listed["latest"] == 3 and [v["version"] for v in listed["versions"]] == [3]


async def test_workers_and_status(make_gateway, make_worker, policy):
    gw = await make_gateway()
    w, _ = make_worker()
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        async with http.get(f"/v1/policies/{policy}/workers") as r:
            workers = await r.json()
        assert [x["worker_id"] for x in workers] == [w.worker_id] and workers[0]["version"] == 0
        async with http.post(f"/v1/policies/{policy}/jobs", json={"prompts": [[1]]}) as r:
            assert r.status == 201
        async with http.get(f"/v1/policies/{policy}/status") as r:
            status = await r.json()
        assert status["policy"] == policy and [q["trainer"] for q in status["queues"]] == ["alice"]


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_of_gateway_and_worker_move(make_gateway, spawn_worker, make_client, policy):
    # Reserved, not merely free: a port picked free and bound seconds later by the worker
    # process may meanwhile be given to another bind; the worker then exits at start-up
    # (EADDRINUSE) and no result ever comes.
    port = reserved_port()
    gw = await make_gateway()
    # lease_s / 3 is the heartbeat period, and the gateway sees a worker's totals only in them.
    worker = spawn_worker(metrics_port=port, lease_s=6)
    client = make_client()
    await client.submit([[1, 2], [3]], n=2, sampling={"max_tokens": 5})
    observer = gw.headers()
    async with aiohttp.ClientSession() as http:
        async def scrape(url, headers=observer):
            async with http.get(url, headers=headers) as r:
                assert r.status == 200
                return _samples(await r.text())

        # Trainer names and failure reasons: only for tokens with the observe scope.
        for headers, status in (({}, 401), (gw.headers("bob"), 403)):
            async with http.get(f"{gw.url}/metrics", headers=headers) as r:
                assert r.status == status

        async def serving():
            assert worker.proc.poll() is None, worker.report()
            with contextlib.suppress(aiohttp.ClientConnectionError):
                return bool(await scrape(f"http://127.0.0.1:{port}/metrics", headers={}))

        await wait_until(serving, timeout_s=60, what="the worker process to serve /metrics")
        assert len(await client.take(2, timeout_s=30)) == 2
        key = ("rollq_groups_total", (("policy", policy), ("status", "ok")))
        pool = await wait_until(lambda: _until(scrape(f"{gw.url}/metrics"), key, 2), what="gateway counters")
        assert pool[("rollq_tokens_total", (("policy", policy),))] == 2 * 2 * 5
        assert pool[("rollq_version_lag_count", (("policy", policy),))] == 4
        at_worker = await scrape(f"http://127.0.0.1:{port}/metrics", headers={})
        assert at_worker[("rollq_worker_groups_total", (("policy", policy), ("status", "ok")))] == 2
        assert at_worker[("rollq_worker_tokens_total", (("policy", policy),))] == 20
        assert at_worker[("rollq_worker_generation_seconds_count", (("policy", policy),))] == 2
        again = await scrape(f"{gw.url}/metrics")  # the first scrape is counted by the second
        assert again[("rollq_gateway_requests_total", (("code", "200"), ("route", "/metrics")))] >= 1


async def _until(scraping, key, value):
    got = await scraping
    return got if got.get(key, 0) >= value else None


async def test_openapi_lists_every_route_and_validates(make_gateway):
    from openapi_spec_validator import validate

    from rollq.gateway.app import ROUTES

    gw = await make_gateway()
    async with aiohttp.ClientSession(gw.url) as http, http.get("/openapi.json") as r:
        doc = await r.json()
    validate(doc)
    documented = {(method.upper(), path) for path, ops in doc["paths"].items() for method in ops}
    assert documented == {(r.method, r.path) for r in ROUTES}
    # 26 of rollq's own + 14 of vLLM's for TRL (gateway/trl_compat.py) + /tokenize, /detokenize
    # + /inference/v1/generate
    assert len(documented) == 43


async def test_schemathesis_finds_no_server_error(make_gateway, make_worker, policy, tmp_path):
    gw = await make_gateway(no_auth=True, tokens=None)
    make_worker()
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "schemathesis"), "run", f"{gw.url}/openapi.json",
        "--checks", "not_a_server_error", "--max-examples", "25",
        "--exclude-path", "/v1/policies/{policy}/results/stream", "--request-timeout", "20",
        "--phases", "examples,coverage,fuzzing", "--no-color",
        "--seed", "1", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        cwd=tmp_path)
    out, _ = await asyncio.wait_for(proc.communicate(), 240)
    text = out.decode()
    assert proc.returncode == 0, text[-4000:]
    generated = re.search(r"(\d+) generated, (\d+) passed", text)
    assert generated and generated[1] == generated[2] and int(generated[1]) > 300, text[-2000:]


@pytest.mark.parametrize("path", ["/", "/health", "/static/uPlot.iife.min.js"])
async def test_public_pages_need_no_token(make_gateway, path):
    gw = await make_gateway()
    async with aiohttp.ClientSession(gw.url) as http, http.get(path) as r:
        assert r.status == 200


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


async def _chromium(*args: str, timeout_s: float = 90) -> str:
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
        "--virtual-time-budget=6000", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode()


@pytest.mark.skipif(CHROMIUM is None and not os.environ.get("CI"),
                    reason="no chromium (`make setup` installs Debian's as root)")
async def test_dashboard_renders_live_numbers_in_headless_chromium(make_gateway, make_worker, make_client,
                                                                     policy, tmp_path):
    gw = await make_gateway()
    w, _ = make_worker()
    client = make_client()
    await client.submit([[i + 1] for i in range(12)], n=2, sampling={"max_tokens": 3})
    await client.take(12, timeout_s=30)
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        async def counted():
            async with http.get("/api/dashboard") as r:
                p = (await r.json())["policies"].get(policy)
                return p and p["groups"].get("ok") == 12

        await wait_until(counted, what="the sampler to count 12 groups")
    page = f"{gw.url}/?policy={policy}#token={gw.tokens['alice']}"  # a fragment never leaves the browser
    dom = await _chromium("--dump-dom", page)
    assert f'<option>{policy}</option>' in dom  # among every other test's policies
    assert '<div class="tile" data-name="groups done"><b>12</b>' in dom
    assert w.worker_id in dom and '<span class="state serving">serving</span>' in dom
    assert dom.count('class="uplot') == 3  # throughput, queue depth, staleness charts
    shot = tmp_path / "dashboard.png"
    await _chromium(f"--screenshot={shot}", "--window-size=1400,1000", page)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000


async def test_publish_refuses_version_and_keep_out_of_range_before_any_file_work(make_gateway, policy):
    """Each a 400 naming its field, and nothing registered (keep=0 used to register the version,
    then fail in retention with a 500)."""
    from safetensors.torch import save_file
    import torch

    gw = await make_gateway()
    d = gw.weight_root / policy / "v1"
    d.mkdir(parents=True)
    save_file({"w": torch.ones(4)}, d / "model.safetensors")
    url = f"/v1/policies/{policy}/versions"
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        for body, field in (({"version": 2**62, "path": str(d)}, "version"),
                            ({"version": -1, "path": str(d)}, "version"),
                            ({"version": 1, "path": str(d), "keep": 0}, "keep")):
            async with http.post(url, json=body) as r:
                assert r.status == 400 and (await r.json())["error"]["field"] == field, await r.text()
        async with http.get(url) as r:
            assert (await r.json())["versions"] == []


async def test_an_http_publish_carries_its_canary(make_gateway, policy, redis):
    """The canary reaches the registry entry from HTTP as from the client (JSON: ids and floats),
    every bound checked in rollq's words, naming the field."""
    import torch
    from safetensors.torch import save_file

    from rollq.canary import canary_of
    from rollq.queue.keys import Keys
    from rollq.registry.versions import Registry

    gw = await make_gateway()
    inside = gw.weight_root / policy / "v1"
    inside.mkdir(parents=True)
    save_file({"w": torch.ones(4)}, inside / "model.safetensors")
    url = f"/v1/policies/{policy}/versions"
    canary = {"sequences": [[1, 5, 9]], "logprobs": [[-1.5, -0.25]], "dtype": "bfloat16",
              "tolerance": {"max_abs": 0.2, "mean_abs": 0.02, "kl": 1e-3}}
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        for bad, field in (({**canary, "logprobs": [[-1.5]]}, "canary.logprobs[0]"),
                           ({**canary, "logprobs": [[-1.5, 0.5]]}, "canary.logprobs[0]"),
                           ({**canary, "sequences": [[1, -5, 9]]}, "canary.sequences[0]"),
                           ({**canary, "dtype": "int8"}, "canary.dtype")):
            async with http.post(url, json={"version": 1, "path": str(inside), "canary": bad}) as r:
                assert r.status == 400 and (await r.json())["error"]["field"] == field, await r.text()
        async with http.post(url, json={"version": 1, "path": str(inside), "canary": canary}) as r:
            assert r.status == 201, await r.text()
    entry = await Registry(redis, Keys(policy)).get(1)
    got = canary_of(entry)
    assert got.token_ids() == [[1, 5, 9]] and got.dtype == "bfloat16" and got.tolerance.max_abs == 0.2
