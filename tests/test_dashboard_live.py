"""The dashboard's figures move as the pool does (issue 30), read through the gateway's own
`/api/dashboard` and `/metrics` over HTTP, with a real redis-server, `rollq worker` processes on
the instant engine (these tests are about what the gateway shows, not generation) and real
`rollq scorer` processes.

The workers here beat every 10 s (lease 30 s), as by default: before the figures were live the
worker table showed a swap up to 10 s late, and the rates moved in heartbeat steps (a steady
run drew zeros and spikes)."""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import sys
import time

import aiohttp
import scoring_fixtures
from helpers import collect, wait_until
from prometheus_client.parser import text_string_to_metric_families

from rollq.scoring.records import live_scorers

spawn_scorer = scoring_fixtures.spawn_scorer

BEAT_LEASE_S = 30  # heartbeats lease/3 = 10 s apart
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


async def _policy(http, policy: str) -> dict | None:
    async with http.get("/api/dashboard") as r:
        assert r.status == 200
        return (await r.json())["policies"].get(policy)


async def _shown_version(http, policy: str, worker_id: str) -> int | None:
    p = await _policy(http, policy)
    return p and {w["id"]: w["version"] for w in p["workers"]}.get(worker_id)


async def test_the_worker_table_shows_a_swap_as_it_happens(make_gateway, spawn_worker, make_client,
                                                           policy, tmp_path):
    """A worker beats when its version changes: the table showed v2 for 8 s after the worker
    logged serving v5 (it waited for the next heartbeat)."""
    import torch

    gw = await make_gateway(policies=[policy])  # (the sampler reads this one only)
    worker = spawn_worker(lease_s=BEAT_LEASE_S)
    publisher = make_client(weight_store=str(tmp_path / "store"))
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        await wait_until(lambda: _is(_shown_version(http, policy, worker.worker_id), 0), timeout_s=60,
                         what="the worker's first beat on the dashboard")
        for version in (1, 2):
            await publisher.publish_weights(version, {"w": torch.zeros(2)})
            await wait_until(lambda v=version: f"now serving version {v} " in worker.log, timeout_s=30,
                             what=f"the worker to log serving version {version}")
            logged = time.monotonic()
            await wait_until(lambda v=version: _is(_shown_version(http, policy, worker.worker_id), v),
                             timeout_s=5, what=f"the dashboard to show version {version} "
                                               "(the next heartbeat is 10 s away)")
            assert time.monotonic() - logged < 5


async def _is(value, expected) -> bool:
    return await value == expected


async def test_rates_are_steady_for_a_steady_run_of_two_trainers(make_gateway, spawn_worker,
                                                                  make_client, policy):
    """Groups/s from counters Redis keeps as results are written, read each second: a run at a
    steady rate draws at that rate each second, not as zeros and heartbeat-sized spikes."""
    gw = await make_gateway(policies=[policy])  # (the sampler reads this one only)
    worker = spawn_worker(lease_s=BEAT_LEASE_S)
    trainers = [make_client("alice"), make_client("bob")]
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        await wait_until(lambda: _is(_shown_version(http, policy, worker.worker_id), 0), timeout_s=60,
                         what="the worker's first beat on the dashboard")
        submitted, started = 0, time.time()
        while time.time() - started < 9:
            tick = time.monotonic()
            for client in trainers:
                await client.submit([[1, 2], [3, 4], [5, 6]], n=1, sampling={"max_tokens": 2})
                submitted += 3
            await asyncio.sleep(max(0.0, 0.1 - (time.monotonic() - tick)))
        ended = time.time()
        for client in trainers:
            await collect(client, submitted // 2, timeout_s=60)
        await asyncio.sleep(2.5)  # the sampler's samples of the run's last seconds
        p = await _policy(http, policy)
    rate = submitted / (ended - started)
    series = p["series"]
    inside = [g for t, g in zip(series["t"], series["groups_per_s"]) if started + 1.5 <= t <= ended - 0.5]
    assert len(inside) >= 5, series
    # Heartbeat deltas drew 0 for 10 s, then the whole 10 s at once (a spike of 10x).
    assert all(0.25 * rate <= g <= 3.0 * rate for g in inside), (rate, inside)
    points = list(zip(series["t"], series["groups_per_s"]))
    drawn = sum(g * (t - prev) for (prev, _), (t, g) in zip(points, points[1:]))
    assert abs(drawn - submitted) <= 0.1 * submitted, (drawn, submitted)
    assert p["results"] == {"alice": submitted // 2, "bob": submitted // 2}


def _metrics(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _mean_std(values: list[float]) -> tuple[float, float]:
    mean = sum(values) / len(values)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))


async def test_rewards_per_trainer_and_job_scoring_time_and_counts(make_gateway, spawn_worker, spawn_scorer,
                                                                   make_client, policy, redis_url):
    """Real scorers: the dashboard's and /metrics' reward figures per trainer and job equal the
    rewards delivered (and those of the groups dynamic sampling generated again), its filtered
    and resampled counts the job's own, and every scored group is drawn in exactly one second;
    `rollq status` lists the scorers and the scoring queues."""
    gw = await make_gateway(policies=[policy])  # (the sampler reads this one only)
    spawn_worker()
    scorer = spawn_scorer()
    alice, bob = make_client("alice"), make_client("bob")
    await wait_until(lambda: _has_scorer(alice, scorer.scorer_id), timeout_s=60, what="the scorer's beat")
    sampling = {"max_tokens": 3}
    inputs = ["same"] * 3 + ["varied"] * 5
    dynamic = await alice.submit([[i + 1] for i in range(8)], n=2, reward="same_if", reward_inputs=inputs,
                                 dynamic_sampling=2, sampling=sampling)
    counted = await bob.submit([[i + 1, i + 2] for i in range(6)], n=3, reward="count",
                               reward_inputs=list(range(6)), sampling=sampling)
    got = {"alice": await collect(alice, 8), "bob": await collect(bob, 6)}
    status = {"alice": await alice.status(dynamic), "bob": await bob.status(counted)}
    assert (status["alice"].ok, status["alice"].filtered, status["alice"].resampled) == (5, 3, 6)
    # Rewards of every group scored: delivered, filtered, and the 6 uniform ones generated again.
    rewards = {"alice": [x for r in got["alice"] for x in r.rewards] + [1.0, 1.0] * 6,
               "bob": [x for r in got["bob"] for x in r.rewards]}
    scored = {"alice": 8 + 6, "bob": 6}
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        async def settled():
            p = await _policy(http, policy)
            jobs = {j["job_id"]: j for j in p["scoring"]["jobs"]} if p else {}
            if (p and sum(p["scoring"]["series"]["scored_per_s"]) == 20
                    and [s["scored"] for s in p["scorers"]] == [14]
                    and all(j.get("record") and j["record"]["done"] == j["record"]["groups"]
                            for j in jobs.values()) and len(jobs) == 2):
                return p

        p = await wait_until(settled, timeout_s=30, what="the dashboard to show the 20 groups scored")
        async with http.get("/metrics") as r:
            metrics = _metrics(await r.text())
    jobs = {j["trainer"]: j for j in p["scoring"]["jobs"]}
    for trainer, job_id in (("alice", dynamic), ("bob", counted)):
        job, mean_std = jobs[trainer], _mean_std(rewards[trainer])
        assert job["job_id"] == job_id and job["rewards"] == len(rewards[trainer])
        assert (job["mean"], job["std"]) == (round(mean_std[0], 4), round(mean_std[1], 4))
        assert job["scored"] == scored[trainer] and job["reward_ms"] > 0 and job["missing"] == 0
        assert p["scoring"]["trainers"][trainer]["mean"] == job["mean"]
        labels = (("policy", policy), ("trainer", trainer))
        assert metrics[("rollq_rewards_total", labels)] == len(rewards[trainer])
        assert math.isclose(metrics[("rollq_reward_sum", labels)], sum(rewards[trainer]), rel_tol=1e-9)
        assert math.isclose(metrics[("rollq_reward_mean", labels)], mean_std[0], rel_tol=1e-9)
        assert math.isclose(metrics[("rollq_reward_stddev", labels)], mean_std[1], rel_tol=1e-6, abs_tol=1e-9)
    record = jobs["alice"]["record"]
    assert (record["ok"], record["filtered"], record["resampled"]) == (5, 3, 6)
    assert jobs["alice"]["written"] == {"ok": 5, "filtered": 3} and jobs["alice"]["resampled"] == 6
    alice_labels = (("policy", policy), ("trainer", "alice"))
    assert metrics[("rollq_scored_groups_total", (*alice_labels[:1], ("status", "filtered"),
                                                   alice_labels[1]))] == 3
    assert metrics[("rollq_resampled_groups_total", alice_labels)] == 6
    assert metrics[("rollq_scoring_seconds_count", (("policy", policy),))] == 20
    assert metrics[("rollq_scorers", (("policy", policy),))] == 1
    assert metrics[("rollq_scoring_waiting", alice_labels)] == 0
    means = p["scoring"]["series"]["rewards"]["alice"]["mean"]
    assert any(m is not None for m in means)
    [shown] = p["scorers"]
    assert (shown["id"], shown["rewards"]["count"], shown["scored"]) == (scorer.scorer_id, "7", 14)
    if CHROMIUM or os.environ.get("CI"):  # the page draws them (`make setup` installs chromium)
        dom = await _dom(f"{gw.url}/?policy={policy}#token={gw.tokens['alice']}")
        assert dom.count('class="uplot') == 5  # + rewards, scoring
        assert f"<td>{dynamic}</td>" in dom and f"<td>{jobs['alice']['mean']:.3f} ± " in dom
        assert f"<td>{scorer.scorer_id}</td>" in dom

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rollq", "status", "--redis-url", redis_url, "--policy", policy,
        stdout=asyncio.subprocess.PIPE, env=os.environ | {"COLUMNS": "250"})
    out = (await proc.communicate())[0].decode()
    assert proc.returncode == 0, out
    rows = {cells[0]: cells for line in out.splitlines()
            if len(cells := [c.strip() for c in line.split("│")[1:-1]]) > 1}
    row = rows[scorer.scorer_id]
    assert "count (v7)" in row[1] and "acount (v3)" in row[1]
    assert row[2:6] == ["0", "14", "0", "0"] and row[6].endswith("s ago"), out
    assert "scoring queues" in out and rows["bob"][:3] == ["bob", "0", "0"], out


async def _has_scorer(client, scorer_id: str) -> bool:
    return scorer_id in {s.scorer_id for s in await live_scorers(client.redis, client.keys)}


async def _dom(page: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=6000",
        "--dump-dom", page, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0, err.decode()[-2000:]
    return out.decode()
