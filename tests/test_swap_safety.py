"""Swap safety with real Redis and the instant engine (the queue and registry logic, fast):
retention never deletes what a worker verifies, drains toward or loads; concurrent retention
never breaks a publish; a follower survives any error; exact versions a worker is about to load
wait instead of failing. Generation itself is tested on vLLM in test_swap_safety_vllm.py."""

import asyncio
import threading
from pathlib import Path

import msgspec
import pytest
import torch
from helpers import collect, drop_a_reply, wait_until
from safetensors.torch import save_file

import rollq.registry.snapshots as snapshots_module
import rollq.worker.swap as swap_module
from rollq.engine.instant import InstantEngine
from rollq.engine.vllm import VLLMEngine
from rollq.protocol import Sampling, WorkItem, pack_tokens
from rollq.registry.retention import retain
from rollq.registry.safetensors_check import WeightError
from rollq.registry.store import WeightStore, verify
from rollq.registry.versions import VersionConflict
from rollq.worker.windows import Decision, decide, interruptible

TENSORS = {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4)}


@pytest.fixture
def weights_dir(tmp_path):
    d = tmp_path / "weights"
    d.mkdir()
    save_file(TENSORS, str(d / "model.safetensors"))
    return d


@pytest.fixture
def publisher(make_client, tmp_path):
    return make_client(weight_store=str(tmp_path / "store"))


class FileCheckingEngine(InstantEngine):
    """Instant generation, but every load re-checks the files it is handed against the registry
    entry, as vLLM would read them: the test's witness of what a real load would have seen."""

    def __init__(self, entries: dict, **kwargs):
        super().__init__(**kwargs)
        self.entries = entries
        self.loads: list[tuple[int, str]] = []

    async def swap(self, version, path, *, interrupt=False, keep=False):
        try:
            verify(path, self.entries[version].files)
            seen = "intact"
        except (WeightError, OSError) as e:
            seen = f"broken: {e}"
        self.loads.append((version, seen))
        if seen != "intact":  # what vLLM does with missing files: the load fails
            raise RuntimeError(seen)
        return await super().swap(version, path, interrupt=interrupt, keep=keep)


def gated_check(monkeypatch, version: int) -> threading.Event:
    """Hold the follower inside the check of `version` until the returned event is set."""
    gate, real = threading.Event(), swap_module.check_version

    def check(entry, *args, **kwargs):
        if entry.version == version:
            assert gate.wait(30), "test never opened the gate"
        return real(entry, *args, **kwargs)

    monkeypatch.setattr(swap_module, "check_version", check)
    return gate


async def test_retention_keeps_a_version_while_a_worker_verifies_it(
        publisher, make_worker, weights_dir, monkeypatch):
    gate = gated_check(monkeypatch, 2)
    entries = {1: await publisher.publish_weights(1, weights_dir)}
    engine = FileCheckingEngine(entries, version=1)
    worker, _ = make_worker(engine=engine)
    entries[2] = await publisher.publish_weights(2, {k: v + 1 for k, v in TENSORS.items()})
    await wait_until(lambda: worker.newest == 2, what="worker checking v2")
    entries[3] = await publisher.publish_weights(3, {k: v + 2 for k, v in TENSORS.items()}, keep=1)
    assert await publisher.registry.get(2) == entries[2], "retention removed a version being verified"
    gate.set()
    await wait_until(lambda: engine.version == 3, what="worker on v3")
    assert engine.loads == [(2, "intact"), (3, "intact")]


async def test_quick_publishes_with_keep_1_never_delete_what_a_draining_worker_loads(
        publisher, make_worker, weights_dir):
    """Issue 21: drain mode, long groups, v2, v3, v4 published with keep=1 in quick succession."""
    entries = {1: await publisher.publish_weights(1, weights_dir)}
    engine = FileCheckingEngine(entries, version=1, delay_s=1.5)
    worker, _ = make_worker(engine=engine, swap_mode="drain")
    await publisher.submit([[1, i] for i in range(6)], n=2, sampling={"max_tokens": 4})
    await wait_until(lambda: len(worker.admission.generating) == 6, what="long groups running")
    entries[2] = await publisher.publish_weights(2, {k: v + 1 for k, v in TENSORS.items()}, keep=1)
    await wait_until(lambda: worker.state == "draining", what="draining toward v2")
    for v in (3, 4):
        entries[v] = await publisher.publish_weights(v, {k: t + v for k, t in TENSORS.items()}, keep=1)
    await publisher.submit([[2, i] for i in range(6)], n=2, sampling={"max_tokens": 4})
    results = await collect(publisher, 12, timeout_s=30)
    await wait_until(lambda: engine.version == 4, what="worker on v4")
    assert all(seen == "intact" for _, seen in engine.loads), engine.loads
    assert engine.loads[-1] == (4, "intact") and not worker.cannot_load
    assert {r.status for r in results} == {"ok"}
    assert [e.version for e in await publisher.registry.entries()][-1] == 4


async def test_concurrent_retention_removes_each_version_once(publisher, weights_dir, redis, tmp_path):
    for v in range(1, 9):
        await publisher.publish_weights(v, weights_dir)
    store = WeightStore(tmp_path / "store")
    outcomes = await asyncio.gather(*(retain(redis, publisher.keys, store, keep=1) for _ in range(4)),
                                    return_exceptions=True)
    errors = [o for o in outcomes if isinstance(o, BaseException)]
    assert not errors, errors
    removed = sorted(v for o in outcomes for v in o)
    assert removed == list(range(1, 8))  # each removed by exactly one of them
    assert [e.version for e in await publisher.registry.entries()] == [8]
    left = [p.name for p in (tmp_path / "store").rglob("v*") if p.is_dir()]
    assert len(left) == 1 and left[0].startswith("v0000000008-"), left


async def test_a_retention_whose_reply_was_lost_still_deletes_the_files(publisher, weights_dir,
                                                                        redis, tmp_path, monkeypatch):
    """retire.lua ran, its reply was lost to a dropped connection and redis-py sent it again: the
    second answer is GONE, and the version's directory must not stay on the store for ever."""
    old = await publisher.publish_weights(1, weights_dir)
    await publisher.publish_weights(2, weights_dir)
    dropped = drop_a_reply(monkeypatch, redis, "EVALSHA", lambda reply: reply == b"ok")
    assert await retain(redis, publisher.keys, WeightStore(tmp_path / "store"), keep=1) == []
    assert dropped == [b"ok"]
    assert await publisher.registry.get(1) is None and not Path(old.path).exists()


async def test_concurrent_publishers_with_keep_never_fail_after_registering(
        make_client, weights_dir, tmp_path):
    """Issue 12, bug 8: a publish that registered must not fail because of another's retention."""
    clients = [make_client(f"trainer-{i}", weight_store=str(tmp_path / "store")) for i in range(3)]
    outcomes = await asyncio.gather(*(
        clients[v % 3].publish_weights(v, weights_dir, keep=1) for v in range(1, 16)),
        return_exceptions=True)
    registered_then_failed = [
        (v, o) for v, o in zip(range(1, 16), outcomes)
        if isinstance(o, BaseException) and not isinstance(o, VersionConflict)]
    assert not registered_then_failed
    won = [o for o in outcomes if not isinstance(o, BaseException)]
    newest = await clients[0].registry.latest()
    assert newest == max(e.version for e in won)
    # The newest is registered and intact; a retry of it is a clean VersionConflict, nothing else.
    entry = await clients[0].registry.get(newest)
    verify(entry.path, entry.files)


async def test_follower_survives_an_unexpected_error_and_keeps_following(
        publisher, make_worker, weights_dir, monkeypatch, redis):
    real = swap_module.check_version

    def hostile(entry, *args, **kwargs):
        if entry.version == 2:  # e.g. a header nested deeply enough to blow the JSON parser
            raise RecursionError("maximum recursion depth exceeded while decoding a JSON array")
        return real(entry, *args, **kwargs)

    monkeypatch.setattr(swap_module, "check_version", hostile)
    await publisher.publish_weights(1, weights_dir)
    worker, _ = make_worker(engine=InstantEngine(version=1))
    await publisher.publish_weights(2, weights_dir)
    await wait_until(lambda: 2 in worker.cannot_load, what="v2 refused")
    assert "RecursionError" in worker.last_error and worker.engine.version == 1
    await publisher.submit([[5]], sampling={"max_tokens": 2})
    [served] = await collect(publisher, 1, timeout_s=10)
    assert served.status == "ok" and served.samples[0].versions == [(1, 0)]
    await publisher.publish_weights(3, weights_dir)
    await wait_until(lambda: worker.engine.version == 3, what="follower still following: v3")
    assert 2 in worker.cannot_load  # never retried


async def test_follower_outlives_an_error_outside_any_version(publisher, make_worker, weights_dir,
                                                             monkeypatch, caplog):
    """An error while reading announcements (not any version's fault) used to end the follower's
    task silently: the worker served its old version for ever with a fresh heartbeat."""
    worker, _ = make_worker(engine=InstantEngine(version=0))
    redis, raised = worker.registry.redis, []
    xread = redis.xread

    async def failing_once(*args, **kwargs):
        if not raised:
            raised.append(True)
            raise ValueError("a reply the follower did not expect")
        return await xread(*args, **kwargs)

    monkeypatch.setattr(redis, "xread", failing_once)
    await wait_until(lambda: raised, what="the follower's read")
    await publisher.publish_weights(1, weights_dir)
    await wait_until(lambda: worker.engine.version == 1, what="follower still following: v1")
    assert "following versions failed" in caplog.text and "ValueError: a reply" in caplog.text


async def test_exact_version_a_worker_is_verifying_waits_for_it(
        publisher, make_worker, weights_dir, monkeypatch):
    """Issue 21, item 6: submitted while the worker verifies v2 and v3 is already published."""
    gate = gated_check(monkeypatch, 2)
    await publisher.publish_weights(1, weights_dir)
    worker, _ = make_worker(engine=InstantEngine(version=1), lease_s=2.0)
    await publisher.publish_weights(2, weights_dir)
    await wait_until(lambda: worker.newest == 2, what="worker checking v2")
    await publisher.publish_weights(3, weights_dir)
    # A staleness-bounded group makes the worker read the newest version (3) while it verifies 2.
    fresh = await publisher.submit([[7]], sampling={"max_tokens": 2}, max_staleness=0)
    await wait_until(lambda: worker.newest == 3, what="worker saw v3")
    exact = await publisher.submit([[8]], sampling={"max_tokens": 2}, exact_version=2)
    await asyncio.sleep(0.5)  # the exact group is decided while v2 is still being verified
    gate.set()
    results = {r.job_id: r for r in await collect(publisher, 2, timeout_s=30)}
    assert results[exact].status == "ok", results[exact].reason
    assert results[exact].samples[0].versions == [(2, 0)]
    assert results[fresh].status == "ok" and results[fresh].samples[0].versions == [(3, 0)]


def test_seeded_groups_are_drained_not_cut():
    seeded = WorkItem("j", 0, pack_tokens([1]), 1, Sampling(seed=5), 0.0)
    unseeded = WorkItem("j", 0, pack_tokens([1]), 1, Sampling(), 0.0)
    assert interruptible(unseeded, 2, VLLMEngine) and not interruptible(seeded, 2, VLLMEngine)


@pytest.mark.parametrize("damage", ["tensor in two shards", "shard missing"])
async def test_incomplete_or_ambiguous_sharded_version_is_refused(
        publisher, make_worker, weights_dir, tmp_path, damage):
    """Issue 21, item 2: every tensor of the served model, each exactly once, before any load
    (vLLM only warns about a missing one, and which copy of a duplicate it keeps is unsaid)."""
    base = {"a.weight": ("F32", (3, 4)), "b.bias": ("F32", (5,))}
    shards = tmp_path / "sharded"
    shards.mkdir()
    save_file({"a.weight": TENSORS["a.weight"] + 1}, str(shards / "model-00001-of-00002.safetensors"))
    if damage == "tensor in two shards":
        save_file({"a.weight": TENSORS["a.weight"] + 2, "b.bias": torch.ones(5)},
                  str(shards / "model-00002-of-00002.safetensors"))
    await publisher.publish_weights(1, weights_dir)
    worker, _ = make_worker(engine=InstantEngine(version=1), base_schema=base)
    await publisher.publish_weights(2, shards, copy=False)
    await wait_until(lambda: 2 in worker.cannot_load, what="v2 refused")
    assert worker.engine.version == 1
    expected = "'a.weight' is in both" if damage == "tensor in two shards" else "missing 1 tensors"
    assert expected in worker.last_error


async def test_pin_and_retire_are_atomic_and_exclusive(publisher, weights_dir):
    registry = publisher.registry
    for v in (1, 2, 3):
        await publisher.publish_weights(v, weights_dir)
    assert await registry.retire(3) == "newest"
    assert (await registry.pin(2, "w1", 30)).version == 2
    assert await registry.retire(2) == "pinned"
    await registry.unpin(2, "w1")
    assert await registry.retire(2) == "ok"
    assert await registry.retire(2) == "gone"  # a second retention does not own it again
    assert await registry.pin(2, "w1", 30) is None  # too late: a worker skips it
    await registry.pin(1, "crashed-worker", 0.001)  # a lease nobody renews lapses by itself
    await wait_until(lambda: _retired(registry, 1), what="lapsed pin no longer protects v1")
    assert await registry.entries() == [await registry.get(3)]


async def _retired(registry, version) -> bool:
    return await registry.retire(version) == "ok"


async def test_heartbeat_renews_the_pins_of_the_versions_a_worker_holds(
        publisher, make_worker, weights_dir, redis, monkeypatch):
    gate = gated_check(monkeypatch, 3)
    await publisher.publish_weights(1, weights_dir)
    worker, _ = make_worker(engine=InstantEngine(version=1), lease_s=0.6)  # pins last 1.8 s
    await publisher.publish_weights(2, weights_dir)
    await wait_until(lambda: worker.engine.version == 2, what="worker on v2")
    key = publisher.keys.pins(2)
    first = await redis.zscore(key, worker.worker_id)
    await publisher.publish_weights(3, weights_dir)  # v2 is no longer the newest
    await wait_until(lambda: _renewed(redis, key, worker.worker_id, first + 2000),
                     what="pin renewed past its first lease")
    assert await publisher.registry.retire(2) == "pinned"  # served, so kept
    gate.set()
    await wait_until(lambda: worker.engine.version == 3, what="worker on v3")
    await wait_until(lambda: _retired(publisher.registry, 2), what="v2 released after the swap")


async def _renewed(redis, key, member, past) -> bool:
    return (await redis.zscore(key, member) or 0) > past


@pytest.mark.parametrize("target, cannot_load, peers, expected", [
    (2, set(), set(), Decision.WAIT_SWAP),  # this worker is verifying v2: wait for it
    (2, {2}, set(), Decision.FAIL),         # ... and gave it up
    (None, set(), {2}, Decision.PASS),      # another worker is swapping to v2 (or pinned to it)
    (None, set(), set(), Decision.FAIL),    # nobody holds or loads v2; followers go to v3
])
def test_decide_counts_versions_being_loaded(target, cannot_load, peers, expected):
    exact_2 = WorkItem("j", 0, pack_tokens([1]), 1, Sampling(), 0.0, min_version=2, max_version=2)
    verdict = decide(exact_2, loaded=1, pinned=False, newest=3, pinned_elsewhere=peers,
                     cannot_load=cannot_load, target=target)
    assert verdict.decision is expected


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_snapshot_copy_refuses_a_link_or_fifo_put_in_place_after_the_checks(tmp_path, kind):
    """The private copy reads through one descriptor opened without following links or
    blocking: a file swapped for a link or a FIFO after the directory was checked is refused
    with a WeightError naming it (not followed, not waited on)."""
    import os

    from rollq.protocol import FileDigest

    real = tmp_path / "real.safetensors"
    save_file({"w": torch.ones(4)}, real)
    source = tmp_path / "model.safetensors"
    if kind == "symlink":
        source.symlink_to(real)
    else:
        os.mkfifo(source)
    expected = FileDigest("model.safetensors", "0" * 64, real.stat().st_size)
    with pytest.raises(WeightError, match="model.safetensors: is (a symbolic link|not a regular file)"):
        snapshots_module._copy_checked(source, tmp_path / "copy.safetensors", expected)


def test_groups_with_images_are_drained_not_cut():
    """A continuation from prompt + tokens so far carries no images: such groups drain."""
    plain = WorkItem("j", 0, pack_tokens([1]), 1, Sampling(), 0.0)
    with_image = msgspec.structs.replace(plain, images=["ab" * 32])
    assert interruptible(plain, 2, VLLMEngine) and not interruptible(with_image, 2, VLLMEngine)
