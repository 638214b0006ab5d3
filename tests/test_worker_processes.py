"""`rollq worker` processes on the instant engine: throughput, fairness, kills, stops, shutdown."""

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
from collections import Counter

import aiohttp
from helpers import collect, wait_until

from rollq.engine.instant import expected_tokens
from rollq.worker.pool import _metrics_port_of


async def test_1000_groups_from_3_trainers_through_2_workers(make_client, spawn_worker):
    trainers = {name: make_client(name) for name in ("alice", "bob", "carol")}
    for _ in range(2):
        spawn_worker(max_inflight=16)
    sizes = {"alice": [100, 100, 134], "bob": [111, 111, 111], "carol": [333]}  # 1,000 groups
    jobs = {}
    for name, client in trainers.items():
        jobs[name] = [
            await client.submit([[len(name), step, i] for i in range(size)], n=2,
                                sampling={"max_tokens": 3})
            for step, size in enumerate(sizes[name])
        ]
    total = 0
    for name, client in trainers.items():
        results = await collect(client, sum(sizes[name]), timeout_s=120)
        total += len(results)
        keys = Counter((r.job_id, r.group_index) for r in results)
        assert max(keys.values()) == 1, "a group arrived twice"
        assert {j for j, _ in keys} == set(jobs[name]), "a result arrived on another trainer's stream"
        for r in results:
            assert r.status == "ok"
            assert r.samples[1].token_ids == expected_tokens(r.prompt, 1, 3, 32_000)
        assert await client.take(1, timeout_s=0.3) == []
    assert total == 1000


async def test_small_trainer_is_not_starved_by_a_backlog(make_client, spawn_worker):
    big, small = make_client("big"), make_client("small")
    for _ in range(2):
        spawn_worker(max_inflight=4, instant_delay_s=0.02)
    backlog = await big.submit([[1, i] for i in range(5000)], n=1, sampling={"max_tokens": 1})
    await wait_until(lambda: _done(big, backlog, 1), what="workers busy with the backlog")
    quick = await small.submit([[2, i] for i in range(10)], n=1, sampling={"max_tokens": 1})
    await small.wait(quick, timeout_s=60)
    done_of_backlog = (await big.status(backlog)).done
    assert done_of_backlog < 2500, f"the small job waited for {done_of_backlog} of 5000"


async def _done(client, job, at_least):
    return (await client.status(job)).done >= at_least


async def test_sigkilled_worker_groups_are_finished_by_the_other(make_client, spawn_worker):
    client = make_client()
    doomed = spawn_worker("doomed", max_inflight=8, instant_delay_s=1.0, lease_s=2)
    job = await client.submit([[i + 1] for i in range(60)], n=2, sampling={"max_tokens": 2})
    stream = client.keys.work("trainer")
    await wait_until(lambda: _pending_of(client, stream, "doomed", 8), what="doomed holds 8")
    doomed.signal(signal.SIGKILL)
    doomed.wait()
    spawn_worker("survivor", max_inflight=16, instant_delay_s=0.05, lease_s=2)
    results = await collect(client, 60, timeout_s=60)
    assert Counter(r.group_index for r in results) == Counter(range(60))
    assert {r.status for r in results} == {"ok"}
    by = Counter(r.worker_id for r in results)
    assert by["survivor"] >= 8 and by["survivor"] + by["doomed"] == 60
    assert (await client.status(job)).ok == 60
    assert await client.redis.xlen(stream) == 0  # nothing left pending


async def _pending_of(client, stream, consumer, count):
    info = await client.redis.xpending(stream, "workers")
    owners = {c["name"].decode(): c["pending"] for c in info["consumers"]}
    return owners.get(consumer, 0) >= count


async def test_stopped_worker_cannot_write_after_its_lease_was_taken(make_client, spawn_worker):
    client = make_client()
    sleeper = spawn_worker("sleeper", max_inflight=4, instant_delay_s=2.0, lease_s=1)
    await client.submit([[i + 1] for i in range(4)], n=1)
    stream = client.keys.work("trainer")
    await wait_until(lambda: _pending_of(client, stream, "sleeper", 4), what="sleeper holds 4")
    sleeper.signal(signal.SIGSTOP)
    await asyncio.sleep(1.5)  # past the lease
    spawn_worker("taker", max_inflight=4, instant_delay_s=0.5, lease_s=1)
    await wait_until(lambda: _pending_of(client, stream, "taker", 4), what="taker took over")
    sleeper.signal(signal.SIGCONT)  # wakes with its generation done and tries to finish
    results = await collect(client, 4, timeout_s=30)
    assert {r.worker_id for r in results} == {"taker"}
    assert Counter(r.group_index for r in results) == Counter(range(4))
    await asyncio.sleep(2.5)
    assert await client.take(1, timeout_s=0.5) == []
    assert "taken over" in sleeper.log or "result not written (lost)" in sleeper.log


async def test_sigterm_finishes_in_flight_then_hands_back_the_rest(make_client, spawn_worker):
    client = make_client()
    leaving = spawn_worker("leaving", max_inflight=4, instant_delay_s=3.0, lease_s=60, grace_s=0.5)
    await client.submit([[i + 1] for i in range(4)], n=1)
    stream = client.keys.work("trainer")
    await wait_until(lambda: _pending_of(client, stream, "leaving", 4), what="leaving holds 4")
    leaving.signal(signal.SIGTERM)
    assert leaving.wait(timeout_s=15) == 0
    assert "handed back 4 of 4 groups" in leaving.log
    spawn_worker("staying", max_inflight=4, lease_s=60)
    # Taken at once, not after the 60 s lease.
    results = await collect(client, 4, timeout_s=15)
    assert {r.worker_id for r in results} == {"staying"}


async def test_sigterm_with_time_to_finish_writes_results_itself(make_client, spawn_worker):
    client = make_client()
    leaving = spawn_worker("leaving", max_inflight=4, instant_delay_s=1.0, grace_s=10)
    await client.submit([[i + 1] for i in range(4)], n=1)
    stream = client.keys.work("trainer")
    await wait_until(lambda: _pending_of(client, stream, "leaving", 4), what="leaving holds 4")
    leaving.signal(signal.SIGTERM)
    assert leaving.wait(timeout_s=15) == 0
    results = await collect(client, 4, timeout_s=5)
    assert {r.worker_id for r in results} == {"leaving"}


# --- the worker's /metrics port: bound before the engine starts ---------------------------------


async def test_metrics_port_0_binds_a_free_port_and_logs_it(spawn_worker, policy):
    worker = spawn_worker(metrics_port=0)

    def logged_port():
        assert worker.proc.poll() is None, worker.report()
        found = re.search(r"metrics on http://127\.0\.0\.1:(\d+)/metrics", worker.log)
        return found and int(found[1])

    port = await wait_until(logged_port, timeout_s=60, what="the worker to log its metrics port")
    assert port != 0
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as r:
        assert r.status == 200
        assert f'rollq_worker_inflight_groups{{policy="{policy}"}} 0.0' in await r.text()


def test_a_taken_metrics_port_fails_before_the_engine_starts(redis_url, tmp_path):
    # A model directory vLLM cannot start: had the worker started its engine before binding,
    # it would fail there (after vLLM's start-up), not on the port.
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "rollq", "worker", "--redis-url", redis_url, "--engine", "vllm",
             "--model", str(tmp_path / "model"), "--metrics-port", str(port)],
            capture_output=True, text=True, timeout=300, env=os.environ | {"COLUMNS": "200"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert f"--metrics-port {port}: cannot serve /metrics on 127.0.0.1:{port}" in out
    assert "Traceback" not in out


def test_pool_gives_each_worker_its_own_metrics_port_but_keeps_0():
    assert _metrics_port_of(["--metrics-port", "9100"], 2) == ["--metrics-port", "9102"]
    assert _metrics_port_of(["--metrics-port=9100"], 1) == ["--metrics-port=9101"]
    assert _metrics_port_of(["--metrics-port", "0"], 3) == ["--metrics-port", "0"]
