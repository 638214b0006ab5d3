"""Worker and pool processes on real vLLM engines: an engine that dies, a pool that restarts."""

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

from conftest import cli_flags, engine_flags
from helpers import collect, wait_until

from rollq.worker.pool import reap_group


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except FileNotFoundError:
            continue
        for child in map(int, children):
            found += [child, *descendants(child)]
    return found


def comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except FileNotFoundError:
        return ""


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


async def held_by(client, consumer: str) -> int:
    info = await client.redis.xpending(client.keys.work("trainer"), "workers")
    return {c["name"].decode(): c["pending"] for c in info["consumers"]}.get(consumer, 0)


async def test_engine_core_killed_under_a_running_worker(make_client, spawn_worker, make_worker,
                                                         tiny_model):
    """An engine core that dies under running groups: the worker exits with an error and hands
    back what it held, at once; another worker serves it, nothing lost or doubled. The rescuer
    runs the instant engine: what it proves is the hand-back (its engine is not under test), and
    it finishes in a second what a vLLM engine took 20 s of the test to generate."""
    groups = 40  # the worker holds 8 at a time (32 sequences): seconds of work after the kill
    client = make_client()
    doomed = spawn_worker("doomed", engine="vllm", lease_s=60, **engine_flags(tiny_model))
    # The engine core is found before the groups go in, so the kill follows the first claim
    # at once: a test process starved between the two (CI) once killed an idle worker.
    core = await wait_until(lambda: [p for p in descendants(doomed.proc.pid)
                                     if comm(p).startswith("VLLM::EngineCor")],
                            timeout_s=120, what="the worker's engine core")
    await client.submit([[1, i + 3] for i in range(groups)], n=4, sampling={"max_tokens": 200})
    await wait_until(lambda: held_by(client, "doomed"), timeout_s=120, what="doomed generating")
    for pid in core:
        subprocess.run(["kill", "-9", str(pid)], check=True)
    assert doomed.wait(timeout_s=60) == 1
    assert "engine failed" in doomed.log
    served_before = len(await client.take(groups, timeout_s=0.5))
    assert served_before < groups, "doomed served every group before its engine died"
    assert "handed back" in doomed.log
    make_worker("rescuer", lease_s=60)
    # Handed back, so taken at once: well inside the 60 s lease a reclaim would wait for.
    results = await collect(client, groups - served_before, timeout_s=30)
    assert {r.worker_id for r in results} == {"rescuer"}
    assert {r.status for r in results} == {"ok"}
    assert await client.take(1, timeout_s=0.5) == []
    assert await client.redis.xlen(client.keys.work("trainer")) == 0


def in_group(pgid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def is_engine_core(pid: int) -> bool:
    """vLLM's engine core, from its spawn on: the CPU build always spawns it (multiprocessing's
    spawn_main), and it takes its `VLLM::EngineCore` name only once its imports are done."""
    return comm(pid).startswith("VLLM::EngineCor") or "multiprocessing.spawn" in cmdline(pid)


def pool_workers(pool: subprocess.Popen) -> list[int]:
    return [p for p in descendants(pool.pid) if " worker " in cmdline(p) and "rollq" in cmdline(p)
            and not comm(p).startswith("VLLM")]


def start_pool(log_path: Path, redis_url: str, policy: str, workers: int, *flags: str) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "rollq", "pool", "--workers", str(workers), "--grace-s", "2",
             "--redis-url", redis_url, "--policy", policy, "--poll-s", "0.2", *flags],
            stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"COLUMNS": "200"})


def end_pool(pool: subprocess.Popen) -> None:
    if pool.poll() is None:
        for worker in pool_workers(pool):
            reap_group(worker)
        pool.kill()
        pool.wait()


async def test_pool_of_two_replaces_the_killed_worker_and_stops_in_stages(make_client, make_worker,
                                                                          redis_url, policy, tmp_path):
    """The pool's own bookkeeping, on instant-engine workers (up in a second): a SIGKILLed worker
    is replaced while its sibling serves on; SIGTERM stops both in stages, and what they held is
    handed back and finished elsewhere, in seconds. The vLLM test below checks the same on real
    engines, and what needs one: the killed worker's engine core goes with it."""
    client = make_client()
    log_path = tmp_path / "pool.log"
    pool = start_pool(log_path, redis_url, policy, 2, "--engine", "instant", "--instant-delay-s", "0.2",
                      "--max-inflight", "4")  # so that both claim a share of a batch
    try:
        await wait_until(lambda: log_path.read_text().count("serving policy") == 2, timeout_s=60,
                         what="two workers up")
        first = pool_workers(pool)
        assert len(first) == 2
        victim, sibling = first
        subprocess.run(["kill", "-9", str(victim)], check=True)
        await wait_until(lambda: "was killed by SIGKILL" in log_path.read_text(), what="log line")
        await client.submit([[1, i + 3] for i in range(8)], n=2, sampling={"max_tokens": 8})
        await collect(client, 8, timeout_s=60)  # the sibling serves meanwhile
        await wait_until(lambda: len(pool_workers(pool)) == 2 and victim not in pool_workers(pool),
                         timeout_s=30, what="a replacement worker")
        assert sibling in pool_workers(pool), "the sibling was restarted too"
        replacement = (set(pool_workers(pool)) - set(first)).pop()
        await wait_until(lambda: log_path.read_text().count("serving policy") == 3, timeout_s=60,
                         what="the replacement up")
        job = await client.submit([[2, i + 3] for i in range(24)], n=2, sampling={"max_tokens": 8})
        served = await collect(client, 24, timeout_s=60)
        assert any(f"-{replacement}-" in r.worker_id for r in served), "replacement never served"
        assert (await client.status(job)).ok == 24

        await client.submit([[3, i + 3] for i in range(24)], n=2, sampling={"max_tokens": 8})
        await wait_until(lambda: _pending(client), what="groups in flight")
        pool.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(pool.wait, 60) == 0
        assert pool_workers(pool) == []
    finally:
        end_pool(pool)
    before = await client.take(24, timeout_s=1)
    make_worker("after-pool")
    after = await collect(client, 24 - len(before), timeout_s=60) if len(before) < 24 else []
    assert Counter(r.group_index for r in before + after) == Counter(range(24))
    log = log_path.read_text()
    assert "restarting in" in log and "all workers stopped" in log


async def test_pool_restarts_a_killed_worker_and_stops_in_stages(make_client, make_worker,
                                                                 redis_url, policy, tiny_model,
                                                                 tmp_path):
    """On a real engine what the instant-engine test above cannot see: the SIGKILLed worker's
    engine core goes with it, a replacement starts an engine and serves, and SIGTERM hands back
    groups the engine is running. One worker: the pool's bookkeeping of siblings is the test
    above's (two engines starting side by side cost this test a minute on two cores)."""
    client = make_client()
    log_path = tmp_path / "pool.log"
    pool = start_pool(log_path, redis_url, policy, 1, "--engine", "vllm",
                      *cli_flags(engine_flags(tiny_model)))
    try:
        # Killed once its engine core's process is spawned, while that process still imports
        # vLLM: the pool must reap it all the same, and the replacement below shows the pool
        # serving on a real engine (waiting for the core to run cost this test ~10 s of imports,
        # and a full engine start 15 s more).
        [victim] = await wait_until(lambda: pool_workers(pool), timeout_s=60, what="the pool's worker")
        await wait_until(lambda: [p for p in descendants(victim) if is_engine_core(p)],
                         timeout_s=180, what="the worker's engine core")

        subprocess.run(["kill", "-9", str(victim)], check=True)
        await wait_until(lambda: "was killed by SIGKILL" in log_path.read_text(), what="log line")
        up = log_path.read_text().count("serving policy")  # 1 if the victim's engine came up in time
        # Its engine core went with it (an orphaned one would hold the device).
        await wait_until(lambda: not in_group(victim), timeout_s=10, what="the group reaped")
        await wait_until(lambda: len(pool_workers(pool)) == 1 and victim not in pool_workers(pool),
                         timeout_s=30, what="a replacement worker")
        [replacement] = pool_workers(pool)
        await wait_until(lambda: log_path.read_text().count("serving policy") == up + 1, timeout_s=180,
                         what="the replacement's engine up")
        job = await client.submit([[1, i + 3] for i in range(24)], n=8, sampling={"max_tokens": 16})
        served = await collect(client, 24, timeout_s=180)
        assert all(f"-{replacement}-" in r.worker_id for r in served), "the replacement did not serve"
        assert (await client.status(job)).ok == 24

        await client.submit([[2, i + 3] for i in range(24)], n=8, sampling={"max_tokens": 150})
        await wait_until(lambda: _pending(client), what="groups in flight")
        pool.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(pool.wait, 60) == 0
        assert pool_workers(pool) == []
    finally:
        end_pool(pool)
    before = await client.take(24, timeout_s=1)
    # Whatever the pool handed back is finished here (an instant engine: the hand-back is under
    # test, not this worker's engine, and a vLLM one spent 20 s of the test generating it).
    make_worker("after-pool")
    after = await collect(client, 24 - len(before), timeout_s=60)
    assert Counter(r.group_index for r in before + after) == Counter(range(24))
    log = log_path.read_text()
    assert "restarting in" in log and "all workers stopped" in log


async def _pending(client) -> bool:
    info = await client.redis.xpending(client.keys.work("trainer"), "workers")
    return info["pending"] > 0
