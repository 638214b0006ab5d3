"""Versioned weights on real vLLM (CPU): publish while groups run, swap in both modes, gate every
token by its job's window, refuse bad weights; checked against transformers under each version."""

import asyncio
import math
import shutil
from collections import Counter
from functools import cache
from pathlib import Path

import pytest
import torch
from conftest import engine_flags
from helpers import collect, wait_until
from models import greedy
from transformers import LlamaForCausalLM

from rollq.registry.safetensors_check import dir_schema
from rollq.worker.heartbeat import live_workers

GREEDY = {"temperature": 0.0, "max_tokens": 48}
PROMPTS = [[1, 7 + 13 * i, 3 + i] for i in range(25)]


def perturbed(base: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in base.items()}


@pytest.fixture(scope="module")
def versions(tiny_model, reference):
    """Weights of v1 (the tiny model), v2 and v3 (perturbed), and a transformers model of each."""
    base = {k: v.clone() for k, v in reference.state_dict().items()}
    weights = {1: base, 2: perturbed(base, 2), 3: perturbed(base, 3)}
    models = {}
    for v, state in weights.items():
        model = LlamaForCausalLM(reference.config).eval()
        model.load_state_dict(state)
        models[v] = model
    return weights, models


@pytest.fixture(scope="module")
async def swap_engine(tiny_model):
    """A float32 engine of its own (these tests swap it); it starts as version 1."""
    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    engine = await VLLMEngine.start(VLLMSettings(**engine_flags(tiny_model)).validate(), version=1)
    yield engine
    await engine.close()


@pytest.fixture
async def engine_v1(swap_engine, tiny_model):
    """The module's engine, on version 1 (set before any worker of the test starts)."""
    if swap_engine.version != 1:
        await swap_engine.swap(1, str(tiny_model))
    return swap_engine


@pytest.fixture
def follower(make_worker, engine_v1, tiny_model):
    def create(**settings):
        settings = {"max_inflight": 32, "max_inflight_seqs": 32, "lease_s": 5.0} | settings
        return make_worker(engine=engine_v1, base_schema=dir_schema(tiny_model), **settings)[0]

    return create


@pytest.fixture
def publisher(make_client, tmp_path):
    return make_client(weight_store=str(tmp_path / "store"))


class Reference:
    """Greedy continuations under each version, cached (prompts repeat)."""

    def __init__(self, models):
        self.models = models
        self.greedy = cache(self._greedy)

    def _greedy(self, version: int, prefix: tuple[int, ...], count: int) -> tuple[int, ...]:
        return tuple(greedy(self.models[version], list(prefix), count)) if count else ()

    def check(self, prompt: list[int], sample) -> None:
        """Each version segment continues greedily, under its version, what came before it."""
        tokens = sample.token_ids
        bounds = [start for _, start in sample.versions[1:]] + [len(tokens)]
        for (version, start), end in zip(sample.versions, bounds):
            expected = self.greedy(version, tuple(prompt + tokens[:start]), end - start)
            assert tuple(tokens[start:end]) == expected, f"segment of version {version} at {start}"


@pytest.mark.parametrize("mode", ["drain", "interrupt"])
async def test_publish_while_200_groups_run(mode, publisher, follower, versions):
    weights, models = versions
    worker = follower(swap_mode=mode)
    await publisher.submit([p for p in PROMPTS for _ in range(8)], n=1, sampling=GREEDY)
    results = await collect(publisher, 24, timeout_s=120)
    await publisher.publish_weights(2, weights[2])
    results += await collect(publisher, 200 - 24, timeout_s=240)
    assert Counter(r.group_index for r in results) == Counter(range(200))
    reference = Reference(models)
    segments = Counter()
    for r in results:
        assert r.status == "ok", r.reason
        [sample] = r.samples
        reference.check(r.prompt_ids, sample)
        segments[tuple(v for v, _ in sample.versions)] += 1
    print(mode, dict(segments), worker.stats.totals.last_swap)
    assert segments[(1,)] > 0 and segments[(2,)] > 0
    # Where the swap's time went (metrics, heartbeat, bench/swap.py): every phase, measured.
    assert set(worker.stats.totals.last_swap) == {"verify", "drain", "pause", "load", "resume"}
    assert all(seconds >= 0 for seconds in worker.stats.totals.last_swap.values())
    if mode == "drain":
        assert set(segments) == {(1,), (2,)}
    else:
        assert segments[(1, 2)] > 0, "no sample was cut by the swap"
        assert set(segments) <= {(1,), (2,), (1, 2)}


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
    assert ("sha256" if damage == "corrupted" else "truncated") in worker.last_error
    await wait_until(lambda: _beat_reports(redis, publisher.keys, "version 2 refused"),
                     what="heartbeat reports the error")
    await publisher.submit(PROMPTS[:4], n=1, sampling=GREEDY)
    reference = Reference(models)
    for r in await collect(publisher, 4, timeout_s=60):  # the v1 weights are intact
        assert r.samples[0].versions == [(1, 0)]
        reference.check(r.prompt_ids, r.samples[0])


async def _beat_reports(redis, keys, text) -> bool:
    return any(text in w.last_error for w in await live_workers(redis, keys))


async def test_load_error_keeps_the_old_version_serving(publisher, follower, versions, engine_v1):
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
        worker = follower()
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


# --- issue 21: swap safety on the real engine -----------------------------------------------------

async def test_failed_load_restores_the_old_version_even_when_its_files_are_gone(
        publisher, follower, versions, engine_v1):
    """A load that fails half way (vLLM has already moved the layers to the meta device) must
    put the old weights back, even when retention deleted the old version's published files."""
    weights, models = versions
    worker = follower()
    v2 = await publisher.publish_weights(2, weights[2])
    await wait_until(lambda: worker.engine.version == 2, timeout_s=120, what="swap to v2")
    shutil.rmtree(v2.path)  # what retention did in issue 21 while the heartbeat still said v1
    rpc, loads = engine_v1.llm.collective_rpc, []

    async def break_mid_load(method, *args, **kwargs):
        path = kwargs.get("kwargs", {}).get("weights_path")
        loads.append(path)
        if len(loads) == 1:  # the bytes vLLM reads go bad after they were verified (disk error)
            f = Path(path) / "model.safetensors"
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        return await rpc(method, *args, **kwargs)

    engine_v1.llm.collective_rpc = break_mid_load
    try:
        await publisher.publish_weights(3, weights[3])
        await wait_until(lambda: 3 in worker.cannot_load, timeout_s=120, what="v3 given up")
    finally:
        engine_v1.llm.collective_rpc = rpc
    assert worker.engine.version == 2 and worker.engine.alive and len(loads) >= 2
    await publisher.submit(PROMPTS[:4], n=1, sampling=GREEDY | {"logprobs": 0})
    reference = Reference(models)
    for r in await collect(publisher, 4, timeout_s=60):
        assert r.status == "ok", r.reason
        assert r.samples[0].versions == [(2, 0)]
        assert all(math.isfinite(lp) for lp in r.samples[0].token_logprobs)
        reference.check(r.prompt_ids, r.samples[0])


async def test_by_reference_version_rewritten_during_the_drain_serves_the_verified_bytes(
        publisher, follower, versions, tmp_path):
    """Issue 21, item 3: the bytes vLLM loads are the bytes that were verified."""
    from safetensors.torch import save_file

    weights, models = versions
    worker = follower(swap_mode="drain")
    directory, other = tmp_path / "v2", tmp_path / "v3"
    for d, v in ((directory, 2), (other, 3)):
        d.mkdir()
        save_file({k: t.contiguous() for k, t in weights[v].items()}, str(d / "model.safetensors"))
    await publisher.submit(PROMPTS[:8], n=1, sampling={"temperature": 0.0, "max_tokens": 200})
    await wait_until(lambda: len(worker.admission.generating) >= 8, what="long groups running")
    await publisher.publish_weights(2, directory, copy=False)
    await wait_until(lambda: worker.state == "draining", what="v2 verified, draining")
    with open(directory / "model.safetensors", "r+b") as f:  # in place: same inode, same size
        f.write((other / "model.safetensors").read_bytes())
    long = await collect(publisher, 8, timeout_s=180)
    await wait_until(lambda: worker.engine.version == 2, timeout_s=60, what="swap to v2")
    await publisher.submit(PROMPTS[8:14], n=1, sampling=GREEDY)
    reference = Reference(models)
    for r in long + await collect(publisher, 6, timeout_s=60):
        assert r.status == "ok", r.reason
        reference.check(r.prompt_ids, r.samples[0])  # v2-labelled tokens are v2's weights'
    assert {r.samples[0].versions[0][0] for r in long} == {1}


async def test_seeded_samples_are_the_same_with_or_without_an_interrupting_swap(
        publisher, follower, versions):
    """Issue 21, item 5: a seeded group is drained, never cut, so its samples do not depend
    on when a swap happened."""
    weights, _ = versions
    worker = follower(swap_mode="interrupt")
    seeded = {"temperature": 1.0, "max_tokens": 150, "seed": 1234}
    prompts = PROMPTS[:8]

    async def run() -> dict:
        await publisher.submit(prompts, n=2, sampling=seeded)
        return {tuple(r.prompt_ids): r for r in await collect(publisher, len(prompts), timeout_s=180)}

    before = await run()  # all on v1
    await publisher.submit(prompts, n=2, sampling=seeded)
    await wait_until(lambda: len(worker.admission.generating) >= 8, what="seeded groups running")
    await publisher.publish_weights(2, weights[2])
    during = {tuple(r.prompt_ids): r for r in await collect(publisher, len(prompts), timeout_s=180)}
    await wait_until(lambda: worker.engine.version == 2, timeout_s=60, what="swap to v2")
    after = await run()  # all on v2
    for prompt, r in during.items():
        for i, sample in enumerate(r.samples):
            assert len(sample.versions) == 1, f"seeded sample cut by the swap: {sample.versions}"
            same = (before if sample.versions[0][0] == 1 else after)[prompt].samples[i]
            assert sample.token_ids == same.token_ids


async def test_out_of_vocabulary_prompt_fails_its_group_and_the_engine_lives(
        publisher, follower, versions):
    """Issue 21, item 4: one bad token id must fail its group, never kill the engine core."""
    from models import VOCAB

    worker = follower()
    bad = await publisher.submit([[1, VOCAB + 5, 3], [1, 2, VOCAB]], n=1, sampling=GREEDY)
    results = await collect(publisher, 2, timeout_s=60)
    for r in results:
        assert r.job_id == bad and r.status == "failed"
        assert "prompt" in r.reason and str(VOCAB) in r.reason, r.reason
    assert worker.engine.alive
    await publisher.submit(PROMPTS[:3], n=1, sampling=GREEDY)
    reference = Reference(versions[1])
    for r in await collect(publisher, 3, timeout_s=60):
        assert r.status == "ok", r.reason
        reference.check(r.prompt_ids, r.samples[0])
