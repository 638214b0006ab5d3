# ruff: noqa: F811 (fixtures imported from swap_fixtures are test arguments by design)
"""Pushes on real vLLM (CPU): a version's tensors into a live engine through vLLM's weight-transfer
API and rollq's shm engine (`engine/pushes.py`, `engine/transfer.py`), checked against
transformers under each version and against the same version loaded from its files.

One engine for the module, started with the `rollq_shm` backend; the tests swap it."""

import time
from pathlib import Path

import pytest
from conftest import engine_flags
from helpers import collect, wait_until
from models import token_logprobs

from rollq.engine import pushes
from rollq.registry.safetensors_check import dir_schema
from swap_fixtures import (GREEDY, PROMPTS, Reference, engine_v1, follower,  # noqa: F401
                           publisher, versions)

SCORED = GREEDY | {"max_tokens": 24, "logprobs": 0}


@pytest.fixture(scope="module")
async def swap_engine(tiny_model):
    """The module's float32 engine, receiving pushes (`rollq_shm`); it starts as version 1."""
    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    flags = engine_flags(tiny_model) | {"engine_args": {"weight_transfer_config": {"backend": "rollq_shm"}}}
    engine = await VLLMEngine.start(VLLMSettings(**flags).validate(), version=1)
    assert engine.push_transport == "shm"
    yield engine
    await engine.close()


async def _served(client, prompts) -> list:
    await client.submit(prompts, n=1, sampling=SCORED)
    return sorted(await collect(client, len(prompts), timeout_s=60), key=lambda r: r.group_index)


def _pushed(worker) -> bool:
    """The last swap came by a push (its phases: drain, pause, push, resume)."""
    return "push" in worker.stats.totals.last_swap


async def test_push_equals_transformers_and_the_files(publisher, follower, versions, engine_v1,
                                                      tiny_model, make_worker):
    """A push serves v2 exactly (transformers' greedy tokens, logprobs within 1e-4), and bit for
    bit what the same engine serves after loading v2 from its files, as a worker started after
    the push (its segment gone) does. The pushed worker then checks v2's files as its restore
    point."""
    weights, models = versions
    worker, task = make_worker(engine=engine_v1, base_schema=dir_schema(tiny_model), max_inflight=32,
                               max_inflight_seqs=32, swap_mode="drain")
    await publisher.publish_weights(2, weights[2], push="shm")
    entry = await publisher.registry.get(2)
    assert entry.push.transport == "shm" and len(entry.tensors) == len(weights[2])
    await wait_until(lambda: engine_v1.version == 2, what="the push served")
    assert _pushed(worker), worker.stats.totals.last_swap
    pushed = await _served(publisher, PROMPTS[:6])
    reference = Reference(models)
    for r in pushed:
        [sample] = r.samples
        assert sample.versions == [(2, 0)]
        reference.check(r.prompt_ids, sample)
        expected = token_logprobs(models[2], r.prompt_ids, sample.token_ids)
        assert max(abs(a - b) for a, b in zip(sample.token_logprobs, expected)) < 1e-4
    await wait_until(lambda: engine_v1._weights_version == 2, what="v2's files as restore point")

    # A worker that missed the push: the engine back on v1, the segment removed.
    worker.stop()
    await task
    await engine_v1.swap(1, str(tiny_model))
    publisher._publisher.drop_segments()
    late = follower(swap_mode="drain")
    await wait_until(lambda: engine_v1.version == 2, what="v2 from its files")
    assert not _pushed(late) and "No such file" in late.last_error, late.last_error
    from_files = await _served(publisher, PROMPTS[:6])
    for a, b in zip(pushed, from_files):
        assert (a.samples[0].token_ids, a.samples[0].token_logprobs) == \
               (b.samples[0].token_ids, b.samples[0].token_logprobs)


@pytest.mark.parametrize("mode", ["interrupt", "keep"])
async def test_push_under_running_groups(mode, publisher, follower, versions):
    """Groups running while a push lands: each token labelled with the version that sampled it,
    each segment what that version gives (interrupt: greedy from the text so far; keep: with the
    old KV, `Reference.check_kept`)."""
    weights, models = versions
    worker = follower(swap_mode=mode)
    accepts = {"swap_modes": ["keep"]} if mode == "keep" else {}
    await publisher.submit(PROMPTS[:16], n=1, sampling=GREEDY | {"max_tokens": 96} | accepts)
    await wait_until(lambda: len(worker.admission.generating) >= 8, what="groups running")
    await publisher.publish_weights(2, weights[2], push="shm")
    results = await collect(publisher, 16, timeout_s=120)
    assert _pushed(worker) and worker.engine.version == 2
    reference, crossed = Reference(models), 0
    for r in results:
        assert r.status == "ok", r.reason
        [sample] = r.samples
        (reference.check_kept if mode == "keep" else reference.check)(r.prompt_ids, sample)
        crossed += [v for v, _ in sample.versions] == [1, 2]
    print(mode, "samples across the push:", crossed, worker.stats.totals.last_swap)


async def test_corrupted_push_is_refused(publisher, follower, versions, engine_v1, monkeypatch):
    """A segment whose bytes changed after the trainer fingerprinted them: the engine refuses it
    before loading any tensor and serves on what it had; the worker then loads the files."""
    weights, models = versions
    write = pushes.write_segment

    def flipped(data, label, over=None):  # the test hook: one byte of the first tensor changed
        path = write(data, label, over)
        with open(path, "r+b") as f:
            f.seek(100)
            byte = f.read(1)
            f.seek(100)
            f.write(bytes([byte[0] ^ 0xFF]))
        return path

    monkeypatch.setattr(pushes, "write_segment", flipped)
    worker = follower(swap_mode="interrupt")
    await publisher.publish_weights(2, weights[2], push="shm")
    await wait_until(lambda: engine_v1.version == 2 and not engine_v1.swapping, what="v2 from its files")
    assert "do not match the registry's fingerprint" in worker.last_error, worker.last_error
    assert not _pushed(worker)  # served from the files
    reference = Reference(models)
    for r in await _served(publisher, PROMPTS[:4]):
        reference.check(r.prompt_ids, r.samples[0])
        assert r.samples[0].versions == [(2, 0)]

    # The engine alone: a refused push leaves the version it serves serving, untouched.
    entry = await publisher.registry.get(2)
    segment = Path(entry.push.address)
    assert segment.exists()
    began = time.monotonic()
    with pytest.raises(Exception, match="rollq refused the push"):
        await engine_v1.push(3, pushes.update_info(entry.push, entry.tensors))
    print(f"refused in {time.monotonic() - began:.3f} s")
    assert engine_v1.version == 2
    for r in await _served(publisher, PROMPTS[4:8]):
        reference.check(r.prompt_ids, r.samples[0])
        assert r.samples[0].versions == [(2, 0)]


async def test_a_failed_load_after_a_push_goes_back_to_the_pushed_version(publisher, follower,
                                                                         versions, engine_v1):
    """After a push the worker checks the version's files and makes them the engine's restore
    point: a later load that fails half way goes back to the pushed version, not further."""
    weights, models = versions
    worker = follower(swap_mode="drain")
    await publisher.publish_weights(2, weights[2], push="shm")
    await wait_until(lambda: engine_v1._weights_version == 2, what="v2's files as restore point")
    rpc, reloads = engine_v1.llm.collective_rpc, []

    async def fail_first_reload(method, *args, **kwargs):
        if method == "reload_weights":
            reloads.append(kwargs["kwargs"]["weights_path"])
            if len(reloads) == 1:
                raise RuntimeError("simulated load failure half way")
        return await rpc(method, *args, **kwargs)

    engine_v1.llm.collective_rpc = fail_first_reload
    try:
        await publisher.publish_weights(3, weights[3])  # files
        await wait_until(lambda: 3 in worker.cannot_load, what="v3 given up")
    finally:
        engine_v1.llm.collective_rpc = rpc
    assert engine_v1.version == 2 and reloads[1] == engine_v1._weights_path
    reference = Reference(models)
    for r in await _served(publisher, PROMPTS[:4]):
        assert r.samples[0].versions == [(2, 0)]
        reference.check(r.prompt_ids, r.samples[0])


async def test_a_push_its_canary_refuses_is_not_served_and_not_held(publisher, follower, versions,
                                                                     engine_v1):
    """The canary gates pushes as it gates files (issue 41): v2 pushed with the canary of other
    weights is refused with its figures after the push's load, v1 serves on, v2 is not tried
    again from its files (the fingerprints proved them the same bytes), and the worker holds no
    pin on it (a refused push left its pin behind for ever before: retention could never take
    the version; seen failing with the release removed)."""
    from rollq.canary import reference

    weights, models = versions
    worker = follower(swap_mode="drain")
    await publisher.publish_weights(2, weights[2], push="shm", canary=reference(models[3]))
    await wait_until(lambda: 2 in worker.cannot_load, timeout_s=60, what="v2 refused")
    assert "canary refused" in worker.last_error and engine_v1.version == 1
    assert worker.stats.totals.swap_failures == 1  # one try: the push, not its files after
    await wait_until(lambda: _no_pins(publisher, 2), what="the refused version's pin released")
    served = await _served(publisher, PROMPTS[:4])
    reference_of = Reference(models)
    for r in served:
        assert r.samples[0].versions == [(1, 0)]
        reference_of.check(r.prompt_ids, r.samples[0])


async def _no_pins(client, version: int) -> bool:
    return not await client.redis.zcard(client.keys.pins(version))
