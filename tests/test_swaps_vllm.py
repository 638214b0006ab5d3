# ruff: noqa: F811 (fixtures imported from swap_fixtures are test arguments by design)
"""Versioned weights on real vLLM (CPU): publish while groups run, swap in both modes, gate every
token by its job's window, refuse bad weights; checked against transformers under each version."""

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import LONG, engine_flags
from helpers import collect, wait_until

from rollq.queue.workers import live_workers

# The fixtures come from swap_fixtures (imported: tests/conftest.py is not ours to grow).
from swap_fixtures import (GREEDY, PROMPTS, Reference, engine_v1, follower,  # noqa: F401
                           publisher, versions)


@pytest.fixture(scope="module")
async def swap_engine(tiny_model):
    """A float32 engine of its own that also takes pushes (`rollq_shm`); it starts as version 1."""
    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    flags = engine_flags(tiny_model) | {"engine_args": {"weight_transfer_config": {"backend": "rollq_shm"}}}
    engine = await VLLMEngine.start(VLLMSettings(**flags).validate(), version=1)
    yield engine
    await engine.close()


LONG_ONLY = pytest.mark.skipif(not LONG, reason="ROLLQ_LONG_TESTS=1: the CI's 20 minutes run one push mode")


@pytest.mark.parametrize("mode, push", [("drain", None), ("interrupt", None), ("keep", None),
                                        ("interrupt", "shm"),
                                        pytest.param("drain", "shm", marks=LONG_ONLY),
                                        pytest.param("keep", "shm", marks=LONG_ONLY)])
async def test_publish_while_200_groups_run(mode, push, publisher, follower, versions, caplog):
    """192 tokens a group: the 168 groups left when v2 is published run for many seconds, so the
    swap begins while they run (with 48 tokens they took ~1.5 s, and a clean CI run once finished
    them all on v1 before the interrupting swap began; with 128, another, in under 17 s, the
    follower having read version 2 and no swap begun: its cause is not found, so a failure now
    carries the worker's log and the follower's state). A third, on a cluster (2026-12-06 CI):
    64 groups wholly on v1, none cut, the swap itself 0.05 s; locally, beside two busy loops,
    the swap began 0.07-0.27 s after the publish, a wave of 32 groups lasting ~2 s. A failure now
    also says when each log line came and when the last v1-only group ended, both relative to
    the publish. In keep mode the job accepts keep, and
    each sample is checked against what keep promises (`Reference.check_kept`). `push`: v2 comes
    by a push (issue 40), the same labels and tokens asked of it."""
    caplog.set_level(logging.INFO, logger="rollq")
    weights, models = versions
    worker = follower(swap_mode=mode)
    accepts = {"swap_modes": ["keep"]} if mode == "keep" else {}
    await publisher.submit([p for p in PROMPTS for _ in range(8)], n=1,
                           sampling=GREEDY | {"max_tokens": 192} | accepts)
    # The first 32 (the worker's max_inflight) run side by side and end together; the next wave
    # starts on v1 as soon as they are done, and v2 is published while it runs (publishing after
    # 24 of the first wave left its last 8 to end during the copy's check now and then: nothing
    # ran when a keep swap began, so nothing was cut).
    results = await collect(publisher, 32, timeout_s=120)
    await wait_until(lambda: len(worker.admission.generating) >= 16, what="the second wave running")
    published, published_at = time.monotonic(), time.time()
    await publisher.publish_weights(2, weights[2], push=push)
    publish_s = time.monotonic() - published
    results += await collect(publisher, 200 - 32, timeout_s=300)
    ran_s = time.monotonic() - published
    assert Counter(r.group_index for r in results) == Counter(range(200))
    reference = Reference(models)
    segments, kept_differs = Counter(), 0
    for r in results:
        assert r.status == "ok", r.reason
        [sample] = r.samples
        if mode == "keep":
            reference.check_kept(r.prompt_ids, sample)
            kept_differs += len(sample.versions) > 1 and not _recomputed(reference, r.prompt_ids, sample)
        else:
            reference.check(r.prompt_ids, sample)
        segments[tuple(v for v, _ in sample.versions)] += 1
    print(mode, dict(segments), worker.stats.totals.last_swap, "kept KV changed", kept_differs,
          f"publish {publish_s:.2f} s")
    # On failure, what the follower saw, and how busy the loop's default executor (where the
    # snapshot check runs) was: a clean CI run once served all 200 on v1 with no swap begun.
    executor = getattr(asyncio.get_running_loop(), "_default_executor", None)
    log = [f"{r.created - published_at:+.2f} {r.name}: {r.getMessage()}" for r in caplog.records
           if r.name.startswith("rollq")][-30:]  # seconds since the publish began
    last_v1 = max((r.finished_at for r in results if r.samples[0].versions == [(1, 0)]), default=0)
    state = (dict(segments), worker.last_error, worker.cannot_load, worker.engine.version, worker.newest,
             f"swap state {worker.versions.swap}, heartbeat target {worker.heartbeat.target}",
             f"publish took {publish_s:.2f} s, the 168 groups after it {ran_s:.2f} s, the last "
             f"group of v1 alone ended {last_v1 - published_at:+.2f} s after the publish began",
             executor and (len(executor._threads), executor._work_queue.qsize()), log)
    assert segments[(1,)] > 0 and segments[(2,)] > 0, state
    # Where the swap's time went (metrics, heartbeat, bench/swap.py): every phase, measured.
    assert set(worker.stats.totals.last_swap) == ({"drain", "pause", "push", "resume"} if push else
                                                  {"verify", "drain", "pause", "load", "resume"})
    assert all(seconds >= 0 for seconds in worker.stats.totals.last_swap.values())
    if mode == "drain":
        assert set(segments) == {(1,), (2,)}
    else:
        assert segments[(1, 2)] > 0, ("no sample was cut by the swap", state)
        assert set(segments) <= {(1,), (2,), (1, 2)}
    if mode == "keep":  # the KV really was kept: some continuations differ from a recomputed one
        assert kept_differs > 0, "every kept sample equals v2's continuation with recomputed KV"


async def test_a_job_that_declines_keep_is_never_served_across_a_keep_swap(
        publisher, follower, versions):
    """A keep-mode worker drains the groups whose job does not list `keep` (the default) while the
    groups that accept it go on across the swap; and no request of the new version reuses KV that
    the old weights computed (vLLM's prefix cache cannot be reset under frozen requests)."""
    weights, models = versions
    worker = follower(swap_mode="keep")
    # A prompt longer than a KV block (128 tokens on CPU): its first block stays in the prefix cache.
    long = [1] + [3 + (37 * i) % 500 for i in range(150)]
    await publisher.submit([long], n=1, sampling=GREEDY | {"max_tokens": 4})
    results = await collect(publisher, 1, timeout_s=60)
    # The exact groups are shorter than the kept ones, so the kept ones still run after the drain.
    kept = await publisher.submit(PROMPTS[:16], n=1,
                                  sampling=GREEDY | {"max_tokens": 240, "swap_modes": ["keep"]})
    exact = await publisher.submit(PROMPTS[16:24], n=1, sampling=GREEDY | {"max_tokens": 100})
    await wait_until(lambda: len(worker.admission.generating) == 24, what="all 24 groups running")
    await publisher.publish_weights(2, weights[2])
    await wait_until(lambda: worker.state != "serving" or worker.engine.version == 2, timeout_s=30,
                     what="the swap to begin")
    running = {item.job_id for item in worker.admission.generating.values()}
    assert running == {kept, exact}, f"the swap should begin while both jobs run ({worker.state})"
    await wait_until(lambda: worker.engine.version == 2, timeout_s=60, what="swap to v2")
    after = await publisher.submit([long], n=1, sampling=GREEDY | {"max_tokens": 16})
    results += await collect(publisher, 25, timeout_s=120)
    reference = Reference(models)
    segments = {kept: Counter(), exact: Counter()}
    for r in results:
        assert r.status == "ok", r.reason
        [sample] = r.samples
        if r.job_id == after:  # v2 from scratch: no block of the v1 request was reused
            assert sample.versions == [(2, 0)]
            reference.check(r.prompt_ids, sample)
        elif r.job_id in segments:
            segments[r.job_id][tuple(v for v, _ in sample.versions)] += 1
            (reference.check if r.job_id == exact else reference.check_kept)(r.prompt_ids, sample)
    print(segments, worker.stats.totals.last_swap)
    assert segments[exact] == Counter({(1,): 8}), "a job that declines keep was served across a swap"
    assert segments[kept][(1, 2)] > 0, "no group was kept across the swap"


def _recomputed(reference, prompt, sample) -> bool:
    """Does the sample also equal each version's continuation from scratch (what interrupt does)?"""
    try:
        reference.check(prompt, sample)
    except AssertionError:
        return False
    return True


async def test_min_version_waits_and_never_gets_an_older_token(publisher, follower, versions):
    weights, models = versions
    follower(lease_s=1.0)
    await publisher.submit(PROMPTS[:6], n=1, sampling=GREEDY, min_version=2)
    assert await publisher.take(1, timeout_s=3) == []  # waits while v2 is unpublished
    await publisher.publish_weights(2, models[2])  # a transformers model, published as is
    results = await collect(publisher, 6, timeout_s=60)
    reference = Reference(models)
    for r in results:
        assert r.status == "ok" and r.samples[0].versions == [(2, 0)]
        reference.check(r.prompt_ids, r.samples[0])


async def test_zero_staleness_is_not_served_by_a_worker_still_on_the_old_version(
        publisher, follower, versions):
    weights, models = versions
    worker = follower(swap_mode="drain")
    await publisher.publish_weights(2, weights[2])
    await wait_until(lambda: worker.engine.version == 2, what="swap to v2")
    # Long groups keep the worker on v2 for a while after v3 is published (drain mode).
    await publisher.submit(PROMPTS[:8], n=1, sampling={"temperature": 0.0, "max_tokens": 200})
    await wait_until(lambda: len(worker.admission.generating) >= 8, what="long groups running")
    await publisher.publish_weights(3, weights[3])
    fresh = await publisher.submit(PROMPTS[8:14], n=1, sampling=GREEDY, max_staleness=0)
    results = await collect(publisher, 14, timeout_s=120)
    reference = Reference(models)
    for r in results:
        expected = [(3, 0)] if r.job_id == fresh else [(2, 0)]
        assert r.samples[0].versions == expected
        reference.check(r.prompt_ids, r.samples[0])


async def test_pinned_worker_serves_its_version_while_the_pool_moves_on(
        publisher, follower, spawn_worker, tiny_model, versions, redis):
    weights, models = versions
    await publisher.publish_weights(1, tiny_model)
    worker = follower()
    await publisher.publish_weights(2, weights[2])
    await publisher.publish_weights(3, weights[3])
    await wait_until(lambda: worker.engine.version == 3, what="pool on v3")
    pinned = spawn_worker("pinned", engine="vllm", pin_version=1, base_version=0,
                          lease_s=3, **engine_flags(tiny_model))
    await wait_until(lambda: _pinned_at(redis, publisher.keys, 1), timeout_s=120,
                     what="pinned worker up")
    old = await publisher.submit(PROMPTS[:6], n=1, sampling=GREEDY, exact_version=1)
    # A job without a window would accept the pinned worker's v1 too: bound its staleness.
    new = await publisher.submit(PROMPTS[6:12], n=1, sampling=GREEDY, max_staleness=0)
    results = await collect(publisher, 12, timeout_s=120)
    reference = Reference(models)
    for r in results:
        assert r.status == "ok", r.reason
        if r.job_id == old:
            assert r.worker_id == "pinned" and r.samples[0].versions == [(1, 0)]
        else:
            assert r.job_id == new and r.samples[0].versions == [(3, 0)]
        reference.check(r.prompt_ids, r.samples[0])
    pinned.signal(15)
    assert await asyncio.to_thread(pinned.wait, 60) == 0
    await publisher.submit(PROMPTS[:2], n=1, sampling=GREEDY, exact_version=1)
    failed = await collect(publisher, 2, timeout_s=30)
    assert {r.status for r in failed} == {"failed"}
    assert "no live worker is pinned" in failed[0].reason


async def _pinned_at(redis, keys, version) -> bool:
    return any(w.pinned and w.version == version for w in await live_workers(redis, keys))


@pytest.mark.parametrize("damage", ["corrupted", "truncated"])
async def test_damaged_weights_are_refused_and_the_old_version_serves(
        damage, publisher, follower, versions, tmp_path, redis):
    from safetensors.torch import save_file

    weights, models = versions
    directory = tmp_path / "v2"
    directory.mkdir()
    save_file({k: v.contiguous() for k, v in weights[2].items()}, str(directory / "model.safetensors"))
    entry = await publisher.publish_weights(2, directory, copy=False)  # no worker is running yet
    f = Path(entry.path) / "model.safetensors"
    data = bytearray(f.read_bytes())
    if damage == "corrupted":
        data[len(data) // 2] ^= 0x40
    else:
        del data[-1000:]
    f.write_bytes(bytes(data))
    worker = follower()
    await wait_until(lambda: 2 in worker.cannot_load, what="v2 refused")
    assert worker.engine.version == 1
    assert ("does not match" if damage == "corrupted" else "truncated") in worker.last_error
    await wait_until(lambda: _beat_reports(redis, publisher.keys, "version 2 refused"),
                     what="heartbeat reports the error")
    await publisher.submit(PROMPTS[:4], n=1, sampling=GREEDY)
    reference = Reference(models)
    for r in await collect(publisher, 4, timeout_s=60):  # the v1 weights are intact
        assert r.samples[0].versions == [(1, 0)]
        reference.check(r.prompt_ids, r.samples[0])


async def _beat_reports(redis, keys, text) -> bool:
    return any(text in w.last_error for w in await live_workers(redis, keys))


@pytest.mark.parametrize("mode", ["drain", "keep"])
async def test_load_error_keeps_the_old_version_serving(mode, publisher, follower, versions, engine_v1):
    weights, models = versions
    rpc = engine_v1.llm.collective_rpc
    calls = []

    async def fail_first_load(method, *args, **kwargs):
        calls.append(kwargs.get("kwargs", {}).get("weights_path"))
        if len(calls) == 1:
            raise RuntimeError("simulated load failure half way")
        return await rpc(method, *args, **kwargs)

    engine_v1.llm.collective_rpc = fail_first_load
    try:
        worker = follower(swap_mode=mode)
        await publisher.publish_weights(2, weights[2])
        await wait_until(lambda: 2 in worker.cannot_load, what="v2 given up")
        assert worker.engine.version == 1 and "simulated load failure" in worker.last_error
        assert len(calls) == 2 and calls[1] == engine_v1._weights_path  # v1 loaded back
        await publisher.submit(PROMPTS[:4], n=1, sampling=GREEDY)
        reference = Reference(models)
        for r in await collect(publisher, 4, timeout_s=60):
            assert r.samples[0].versions == [(1, 0)]
            reference.check(r.prompt_ids, r.samples[0])
    finally:
        engine_v1.llm.collective_rpc = rpc
