"""The gap and the canary checks where an operator looks (issue 41): an HTTP trainer's report and
read (`/v1/policies/{p}/gap`, scopes as the other trainer routes), `/status` and `/workers` JSON,
`/metrics`, `rollq status` and the dashboard (headless chromium, as tests/test_dashboard_live.py).
Real redis-server and gateway; the canary checks are written by a real `Heartbeat` (as the worker's
gate reports them: `beat(canaries=...)`; these tests are about what is shown), the gap by trainers."""

from __future__ import annotations

import asyncio
import os
import sys
import time

import aiohttp
import pytest
from helpers import wait_until
from test_dashboard_live import CHROMIUM, _dom  # the headless page, as the dashboard tests read it
from prometheus_client.parser import text_string_to_metric_families

from rollq.canary import TOLERANCES, CanaryCheck, Verdict
from rollq.protocol import GroupResult, Sample, pack_floats, pack_tokens
from rollq.queue.keys import Keys
from rollq.worker.heartbeat import Heartbeat



def _sample(worker: str, versions: list[list[int]], rollout: list[float], trainer: list[float]) -> dict:
    return dict(worker_id=worker, policy_versions=versions, rollout_logprobs=rollout,
                trainer_logprobs=trainer)


def _metrics(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def test_an_http_trainer_reports_and_reads_the_gap(make_gateway, make_client, policy):
    gw = await make_gateway(policies=[policy])
    # alice (observe) reported through the SDK; bob reports over HTTP.
    alice = make_client("alice")
    sample = Sample(tokens=pack_tokens([1, 2]), logprobs=pack_floats([-1.0, -1.0]), finish_reason="length",
                    versions=[(1, 0)])
    await alice.report_logprobs([GroupResult("j", 0, "ok", samples=[sample], worker_id="w1")], [[-1.0, -1.0]])
    body = dict(samples=[_sample("w1", [[1, 0], [2, 1]], [-1.0, -1.0], [-1.5, -0.5]),
                         _sample("w2", [[2, 0]], [-2.0], [-2.0])])
    async with aiohttp.ClientSession(gw.url, headers=gw.headers("bob")) as http:
        async with http.post(f"/v1/policies/{policy}/gap", json=body) as r:
            assert r.status == 200, await r.text()
            assert await r.json() == {"samples": 2, "tokens": 3}
        async with http.get(f"/v1/policies/{policy}/gap") as r:
            mine = await r.json()
        # Lengths that disagree, a worker id rollq never makes, segments out of order: 400 naming them.
        for bad, field in ((_sample("w1", [[1, 0]], [-1.0, -1.0], [-1.0]), "samples[0].trainer_logprobs"),
                           (_sample("w:1", [[1, 0]], [-1.0], [-1.0]), "samples[0].worker_id"),
                           (_sample("w1", [[1, 1], [2, 0]], [-1.0, -1.0], [-1.0, -1.0]),
                            "samples[0].policy_versions[0]"),
                           (_sample("w1", [[1, 0]], [-1.0], [0.5]), "samples[0].trainer_logprobs[0]"),
                           # a sum Redis could not hold (an increment to infinity is an error)
                           (_sample("w1", [[1, 0]], [-1e308], [-1.0]), "samples[0].rollout_logprobs[0]")):
            async with http.post(f"/v1/policies/{policy}/gap", json=dict(samples=[bad])) as r:
                assert r.status == 400 and (await r.json())["error"]["field"] == field, await r.text()
        async with http.get(f"/v1/policies/{policy}/status") as r:
            status = await r.json()
    async with aiohttp.ClientSession(gw.url, headers=gw.headers("mallory")) as http, \
            http.post(f"/v1/policies/{policy}/gap", json=body) as r:
        assert r.status == 403
    async with aiohttp.ClientSession(gw.url, headers=gw.headers("alice")) as http, \
            http.get(f"/v1/policies/{policy}/gap") as r:
        every = await r.json()
    # bob sees his own reports only: v1 on w1 (Δ -0.5), v2 on w1 (+0.5) and w2 (0).
    rows = {(w["version"], w["worker"]): w for w in mine["workers"]}
    assert {k: (w["tokens"], w["mean_abs"]) for k, w in rows.items()} == \
        {(1, "w1"): (1, 0.5), (2, "w1"): (1, 0.5), (2, "w2"): (1, 0.0)}
    assert status["gap"] == mine
    # alice (observe) sees both trainers': v1 on w1 has alice's 2 tokens too.
    assert {(w["version"], w["worker"]): w["tokens"] for w in every["workers"]}[1, "w1"] == 3


async def _beat(redis, policy: str, worker: str, check: CanaryCheck | None, version: int = 2) -> None:
    heartbeat = Heartbeat(redis, Keys(policy), worker, ttl_s=30)
    await heartbeat.beat(version=version, inflight=0, state="serving", canaries=[check] if check else [])


def _check(version: int, accepted: bool, max_abs: float, mean_abs: float, kl: float) -> CanaryCheck:
    verdict = Verdict(accepted=accepted, max_abs=max_abs, mean_abs=mean_abs, kl=kl, tokens=1016,
                      worst=(3, 17),
                      tolerance=TOLERANCES["float32"], dtype="float32")
    return CanaryCheck(version=version, verdict=verdict, at=time.time())


async def test_a_refused_canary_and_a_worker_that_disagrees_show_everywhere(
        make_gateway, make_client, redis, redis_url, policy):
    """A worker whose latest check refused version 3 (the swapped-rows figures) beside one that
    accepted it: /metrics, /status and /workers, `rollq status` and the dashboard show the
    refusal from that one beat (no later beat is written: what shows came with it); the gap the
    trainer reported of the bad worker's samples stands out per worker."""
    gw = await make_gateway(policies=[policy])
    await _beat(redis, policy, "good", _check(3, True, 9.5e-7, 1.5e-7, 3.6e-14), version=3)
    await _beat(redis, policy, "bad", _check(3, False, 0.34, 1.2e-2, 3.9e-4))
    client = make_client("alice")
    results, given = [], []
    for worker, shift in (("good", 0.001), ("bad", 0.3), ("third", 0.0015)):
        sample = Sample(tokens=pack_tokens([5] * 4), logprobs=pack_floats([-1.0] * 4), finish_reason="length",
                        versions=[(2, 0)])
        results.append(GroupResult("j", 0, "ok", samples=[sample], worker_id=worker))
        given.append([-1.0 - shift] * 4)
    await client.report_logprobs(results, given)
    labels = lambda worker, version: (("policy", policy), ("version", str(version)), ("worker", worker))  # noqa: E731
    async with aiohttp.ClientSession(gw.url, headers=gw.headers("alice")) as http:
        async def shown():
            async with http.get("/metrics") as r:
                m = _metrics(await r.text())
            if ("rollq_worker_canary_refused", labels("bad", 3)) in m and \
                    ("rollq_gap_outlier", labels("bad", 2)) in m:
                return m

        m = await wait_until(shown, timeout_s=10, what="the canary and the gap on /metrics")
        assert m["rollq_worker_canary_refused", labels("bad", 3)] == 1
        assert m["rollq_worker_canary_refused", labels("good", 3)] == 0
        assert m["rollq_worker_canary_max_abs", labels("bad", 3)] == pytest.approx(0.34)
        assert m["rollq_worker_canary_kl_k3", labels("bad", 3)] == pytest.approx(3.9e-4)
        assert m["rollq_gap_outlier", labels("bad", 2)] == 1
        assert m["rollq_gap_outlier", labels("good", 2)] == 0
        assert m["rollq_gap_mean_abs_logprob", labels("bad", 2)] == pytest.approx(0.3)
        assert m["rollq_gap_tokens", labels("third", 2)] == 4
        for trainer in ("alice", "bob"):  # bob has no observe scope: the canaries are no secret
            async with http.get(f"/v1/policies/{policy}/workers", headers=gw.headers(trainer)) as r:
                workers = {w["worker_id"]: w for w in await r.json()}
            [check] = workers["bad"]["canaries"]
            verdict = check["verdict"]
            assert (check["version"], verdict["accepted"], verdict["max_abs"]) == (3, False, 0.34)
        async with http.get("/api/dashboard") as r:
            p = (await r.json())["policies"][policy]
        shown_workers = {w["id"]: w for w in p["workers"]}
        assert shown_workers["bad"]["canary"]["accepted"] is False
        assert shown_workers["good"]["canary"]["accepted"] is True
        assert [(w["worker"], w["outlier"]) for w in p["gap"]["workers"]] == \
            [("bad", True), ("good", False), ("third", False)]
    if CHROMIUM or os.environ.get("CI"):  # the page draws them (`make setup` installs chromium)
        dom = await _dom(f"{gw.url}/?policy={policy}#token={gw.tokens['alice']}")
        assert '<tr class="refused" data-worker="bad">' in dom
        assert '<tr class="" data-worker="good">' in dom and "v3 accepted" in dom
        assert "v3 REFUSED" in dom and "max |Δ| 0.3400" in dom
        assert '<tr class="outlier" data-version="2" data-worker="bad">' in dom and "stands out" in dom
        assert dom.count('class="uplot') == 4  # throughput, depth, lag + the gap's chart
    out = await _status_cli(redis_url, policy)
    rows = {cells[0]: cells for line in out.splitlines()
            if len(cells := [c.strip() for c in line.split("│")[1:-1]]) > 1}
    assert rows["bad"][1:6] == ["3", "REFUSED", "0.34 (0.0001)", "0.012 (1e-05)", "0.00039 (1e-09)"], out
    assert rows["good"][2] == "accepted", out
    assert "training-inference gap" in out and "bad (stands out)" in out, out


async def _status_cli(redis_url: str, policy: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq", "status", "--redis-url", redis_url, "--policy", policy,
        stdout=asyncio.subprocess.PIPE, env=os.environ | {"COLUMNS": "250"})
    out = (await proc.communicate())[0].decode()
    assert proc.returncode == 0, out
    return out

