# ruff: noqa: F811 (fixtures imported from swap_fixtures are test arguments by design)
"""Pushes that go wrong, on real vLLM (CPU): a push that never finishes, the trainer killed
mid-push (its segment then cut or removed), a worker that joins while a push runs, a worker
killed mid-receive. In each: every group served exactly once, every token's version label
right and its tokens what that version gives (`Reference.check`: no group served on bytes that
were not checked), the pool serving on.

A push is held mid-read inside vLLM's engine process by the tests' hook (`pushes.HOLD_ENV`: the
engine's environment names a directory; a `hold` file there stops the next read after its first
tensor, as `held-<segment>`, until the test removes that file). One push-capable engine for the
module (started with the hook's variable) and one engine without pushes, for the joining worker.
"""

import os
import signal
import subprocess
import sys

import pytest
import torch
from conftest import LONG, engine_flags
from helpers import collect, wait_until

from rollq.engine import pushes
from swap_fixtures import (GREEDY, PROMPTS, Reference, engine_v1, follower,  # noqa: F401
                           publisher, start_with_hold, versions)

PUSHED = {"weight_transfer_config": {"backend": "rollq_shm"}}


@pytest.fixture(scope="module")
def hold_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("push-hold")


@pytest.fixture(scope="module")
async def swap_engine(tiny_model, hold_dir):
    """The module's push-capable float32 engine (`rollq_shm`, the hold hook on); starts as v1."""
    engine = await start_with_hold(tiny_model, hold_dir, engine_args=PUSHED)
    yield engine
    await engine.close()


@pytest.fixture(scope="module")
async def plain_engine(tiny_model, hold_dir):
    """An engine without a transfer backend: its worker takes every version from the files."""
    engine = await start_with_hold(tiny_model, hold_dir)
    yield engine
    await engine.close()


@pytest.fixture
def hold(hold_dir):
    """hold() -> the next push read stops mid-segment; returns `held()`: the held segment's
    marker once a reader holds it (remove it to let the read go on)."""
    def ask():
        (hold_dir / "hold").touch()
        return lambda: next(iter(hold_dir.glob("held-*")), None)

    yield ask
    for path in hold_dir.iterdir():  # (a test that failed mid-hold lets its read go)
        path.unlink()


def _pushed(worker) -> bool:
    """The last swap came by a push (its phases: drain, pause, push, resume)."""
    return "push" in worker.stats.totals.last_swap


async def _served_once(client, prompts, results, reference) -> None:
    """`results` are every group of `prompts` (one job), each exactly once, and no further result
    comes; each sample's tokens are what its labelled versions give."""
    assert sorted(r.group_index for r in results) == list(range(len(prompts)))
    assert await client.take(1, timeout_s=0.5) == []
    for r in results:
        assert r.status == "ok", r.reason
        [sample] = r.samples
        reference.check(r.prompt_ids, sample)


async def test_a_push_that_never_finishes_is_given_up(publisher, follower, versions, engine_v1, hold):
    """A push whose read never ends (held mid-segment): the worker gives it up after
    `push_timeout_s`, nothing loaded, reports it and loads the version's files; the abandoned
    read wedges nothing: the next push serves. (Seen failing with `_Reading.result` waiting
    without its deadline: the paused update_weights never returned, the groups never came.)"""
    weights, models = versions
    worker = follower(swap_mode="drain", push_timeout_s=1.0)
    await publisher.submit(PROMPTS[:8], n=1, sampling=GREEDY)
    await wait_until(lambda: len(worker.admission.generating) >= 4, what="groups running")
    held = hold()
    await publisher.publish_weights(2, weights[2], push="shm")
    await wait_until(held, what="the push's read held")
    await wait_until(lambda: engine_v1.version == 2 and not engine_v1.swapping, timeout_s=60,
                     what="v2 from its files")
    assert "not read and checked within 1 s" in worker.last_error, worker.last_error
    assert not _pushed(worker), worker.stats.totals.last_swap
    reference = Reference(models)
    await _served_once(publisher, PROMPTS[:8], await collect(publisher, 8), reference)

    await publisher.publish_weights(3, weights[3], push="shm")  # (the held read still held)
    await wait_until(lambda: engine_v1.version == 3 and not engine_v1.swapping, what="v3 pushed")
    assert _pushed(worker), worker.stats.totals.last_swap
    await publisher.submit(PROMPTS[8:12], n=1, sampling=GREEDY)
    results = await collect(publisher, 4)
    assert {v for r in results for v, _ in r.samples[0].versions} == {3}
    for r in results:
        reference.check(r.prompt_ids, r.samples[0])


TRAINER = """
import asyncio, sys, torch
from rollq.client import RolloutClient

async def main():
    client = RolloutClient(sys.argv[1], trainer_id="doomed-trainer", policy=sys.argv[2],
                           weight_store=sys.argv[3])
    await client.publish_weights(2, torch.load(sys.argv[4]), push="shm")
    print("published", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.parametrize("fate", ["cut", "removed"])
async def test_trainer_killed_mid_push(fate, publisher, follower, versions, engine_v1, hold,
                                       redis_url, policy, tmp_path):
    """A trainer process publishes v2 with a push and is SIGKILLed while the worker reads its
    segment, which is then cut short (`cut`) or removed (`removed`, as a later trainer's sweep
    does). Cut: the read comes up short, the push is refused, v2 comes from the files. Removed:
    the reader's descriptor still reads every byte, checked, and the push serves. Either way
    every group once, every token right. (Seen failing on a reader that trusted short reads,
    skipped fingerprints and re-opened the segment by path per tensor: `cut` served v2 as
    pushed, `removed` failed with "No such file" and was not pushed.)"""
    weights, models = versions
    state = tmp_path / "v2.pt"
    torch.save(weights[2], state)
    worker = follower(swap_mode="interrupt", push_timeout_s=60)
    await publisher.submit(PROMPTS[:8], n=1, sampling=GREEDY)
    held = hold()
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, redis_url, policy,
                                str(tmp_path / "store"), str(state)],
                               stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        marker = await wait_until(held, timeout_s=60, what="the worker reading the trainer's push")
        trainer.send_signal(signal.SIGKILL)
        assert trainer.wait(10) == -signal.SIGKILL
        segment = pushes.SHM_DIR / marker.name.removeprefix("held-")
        if fate == "cut":
            os.truncate(segment, segment.stat().st_size // 2)
        else:
            segment.unlink()
        marker.unlink()
        await wait_until(lambda: engine_v1.version == 2 and not engine_v1.swapping, timeout_s=60,
                         what="v2 served")
    finally:
        trainer.kill()
        trainer.wait()
        segment.unlink(missing_ok=True)
    if fate == "cut":
        assert "ended early" in worker.last_error and not _pushed(worker), worker.last_error
    else:
        assert _pushed(worker), (worker.last_error, worker.stats.totals.last_swap)
    reference = Reference(models)
    await _served_once(publisher, PROMPTS[:8], await collect(publisher, 8), reference)


async def test_a_worker_that_joins_while_a_push_runs(publisher, follower, versions, engine_v1,
                                                     plain_engine, make_worker, tiny_model, hold):
    """A worker started while another's push is held mid-read loads v2 from the files and
    serves it; the pushing worker then finishes its push; both serve v2 only, every group once."""
    from rollq.registry.safetensors_check import dir_schema

    weights, models = versions
    if plain_engine.version != 1:
        await plain_engine.swap(1, str(tiny_model))
    pusher = follower(swap_mode="drain", push_timeout_s=60, max_inflight=2)
    held = hold()
    await publisher.publish_weights(2, weights[2], push="shm")
    marker = await wait_until(held, what="the push's read held")
    joiner, _ = make_worker(engine=plain_engine, base_schema=dir_schema(tiny_model), max_inflight=32,
                            max_inflight_seqs=32)
    await wait_until(lambda: plain_engine.version == 2, timeout_s=60, what="the joiner on v2")
    assert engine_v1.version == 1 and engine_v1.swapping  # still in its push
    await publisher.submit(PROMPTS[:12], n=1, sampling=GREEDY)
    # The pusher holds at most 2 groups at its closed gate: the joiner serves the others now.
    results = await collect(publisher, 10)
    assert {r.worker_id for r in results} == {joiner.worker_id}
    marker.unlink()
    await wait_until(lambda: engine_v1.version == 2 and not engine_v1.swapping, what="v2 pushed")
    assert _pushed(pusher) and not _pushed(joiner)
    results += await collect(publisher, 2)
    assert {v for r in results for v, _ in r.samples[0].versions} == {2}
    await _served_once(publisher, PROMPTS[:12], results, Reference(models))


def _hold_store_write(monkeypatch, outcome=None):
    """The trainer's store writes wait until the returned event is set, then write, or raise
    `outcome`."""
    import threading

    from rollq.registry.store import WeightStore

    release, write = threading.Event(), WeightStore.write_image

    def held(*args, **kwargs):
        release.wait(120)
        if outcome is not None:
            raise outcome
        return write(*args, **kwargs)

    monkeypatch.setattr(WeightStore, "write_image", held)
    return release


async def test_a_push_serves_before_its_files_are_written(publisher, follower, versions, engine_v1,
                                                          plain_engine, make_worker, tiny_model,
                                                          monkeypatch):
    """A push publish registers the version as soon as its segment is written: the pushing worker
    serves v2 while the trainer's store write has not even begun; a worker that cannot take the
    push waits for the files and loads them once written; the pusher then makes them its
    restore point. (Seen failing before: the version was registered only after its files, so
    nothing served v2 while the write was held.)"""
    from rollq.registry.safetensors_check import dir_schema

    weights, models = versions
    if plain_engine.version != 1:
        await plain_engine.swap(1, str(tiny_model))
    release = _hold_store_write(monkeypatch)
    pusher = follower(swap_mode="drain")
    joiner, _ = make_worker(engine=plain_engine, base_schema=dir_schema(tiny_model))
    publishing = await publisher.publish_weights(2, weights[2], push="shm", wait=False)
    try:
        await wait_until(lambda: engine_v1.version == 2 and not engine_v1.swapping, timeout_s=60,
                         what="v2 pushed before its files")
        entry = await publisher.registry.get(2)
        assert _pushed(pusher) and not os.path.exists(entry.path)
        await wait_until(lambda: joiner.heartbeat.target == 2, what="the joiner waiting for v2's files")
        assert plain_engine.version == 1
        await publisher.submit(PROMPTS[:4], n=1, sampling=GREEDY, min_version=2)
        results = await collect(publisher, 4)
        assert {r.worker_id for r in results} == {pusher.worker_id}
    finally:
        release.set()
    await publishing
    await wait_until(lambda: plain_engine.version == 2, timeout_s=60, what="the joiner on v2's files")
    await wait_until(lambda: pusher.follower.loaded and pusher.follower.loaded[0] == 2,
                     what="the pusher's restore point on v2's files")
    await publisher.submit(PROMPTS[4:12], n=1, sampling=GREEDY, min_version=2)
    results += await collect(publisher, 8)
    assert {v for r in results for v, _ in r.samples[0].versions} == {2}
    reference = Reference(models)
    for r in results:
        reference.check(r.prompt_ids, r.samples[0])


async def test_a_push_whose_files_are_never_written(publisher, follower, versions, engine_v1,
                                                    plain_engine, make_worker, tiny_model, monkeypatch):
    """The trainer's store write fails after its push registered v2 (a full disk; a trainer
    killed there is the same to the workers): the publish raises, the pusher serves v2 from its
    checked push, the worker that missed it serves v1 and waits, and once v3 is registered
    it stops waiting and both serve v3."""
    from rollq.registry.safetensors_check import dir_schema

    weights, models = versions
    if plain_engine.version != 1:
        await plain_engine.swap(1, str(tiny_model))
    release = _hold_store_write(monkeypatch, OSError(28, "No space left on device"))
    pusher = follower(swap_mode="drain")
    joiner, _ = make_worker(engine=plain_engine, base_schema=dir_schema(tiny_model))
    publishing = await publisher.publish_weights(2, weights[2], push="shm", wait=False)
    await wait_until(lambda: engine_v1.version == 2 and not engine_v1.swapping, timeout_s=60,
                     what="v2 pushed")
    release.set()
    with pytest.raises(OSError, match="No space left"):
        await publishing
    await wait_until(lambda: joiner.heartbeat.target == 2, what="the joiner waiting for v2's files")
    assert _pushed(pusher) and plain_engine.version == 1
    monkeypatch.undo()
    await publisher.publish_weights(3, weights[3])  # by files
    await wait_until(lambda: plain_engine.version == 3 and engine_v1.version == 3, timeout_s=60,
                     what="both on v3")
    await publisher.submit(PROMPTS[:8], n=1, sampling=GREEDY)
    results = await collect(publisher, 8)
    assert {v for r in results for v, _ in r.samples[0].versions} == {3}
    reference = Reference(models)
    for r in results:
        reference.check(r.prompt_ids, r.samples[0])


async def _held_by(client, consumer: str) -> int:
    info = await client.redis.xpending(client.keys.work("trainer"), "workers")
    return {c["name"].decode(): c["pending"] for c in info["consumers"]}.get(consumer, 0)


@pytest.mark.skipif(not LONG, reason="ROLLQ_LONG_TESTS=1: `rollq worker` spawns its own engine (~60 s here)")
async def test_a_worker_killed_mid_receive(publisher, follower, versions, engine_v1, hold, hold_dir,
                                           spawn_worker, tiny_model, monkeypatch):
    """`rollq worker` (its own process, interrupt swaps) SIGKILLed, with its engine core, while
    its engine reads a push: the groups it held (cut by the swap, waiting to continue) come back
    after their lease and another worker, joining then, takes v2 by the same push and serves
    them; every group once, every token right."""
    weights, models = versions
    monkeypatch.setenv(pushes.HOLD_ENV, str(hold_dir))  # (its engine core inherits it)
    doomed = spawn_worker("doomed", engine="vllm", lease_s=2, swap_mode="interrupt", push_timeout_s=600,
                          engine_arg=f"weight_transfer_config={{\"backend\": \"{pushes.BACKENDS['shm']}\"}}",
                          **engine_flags(tiny_model))
    monkeypatch.delenv(pushes.HOLD_ENV)
    prompts = PROMPTS[:12]
    await publisher.submit(prompts, n=1, sampling=GREEDY | {"max_tokens": 160})
    await wait_until(lambda: _held_by(publisher, "doomed"), timeout_s=120, what="doomed generating")
    held = hold()
    await publisher.publish_weights(2, weights[2], push="shm")
    marker = await wait_until(held, timeout_s=60, what="doomed's engine reading the push")
    os.killpg(doomed.proc.pid, signal.SIGKILL)
    assert doomed.wait(10) == -signal.SIGKILL
    marker.unlink()
    lost = await _held_by(publisher, "doomed")
    assert lost > 0, "doomed held nothing when killed"
    rescuer = follower(swap_mode="drain")
    results = await collect(publisher, len(prompts), timeout_s=90)
    assert _pushed(rescuer) and engine_v1.version == 2
    assert sum(r.worker_id == rescuer.worker_id for r in results) >= lost
    await _served_once(publisher, prompts, results, Reference(models))
