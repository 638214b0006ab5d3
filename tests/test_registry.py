"""Weight store and registry: atomic publish, refusal of bad weights, compare-and-set, retention,
and version gating in the worker (instant engine: the queue logic, not generation)."""

import asyncio
import hashlib
import json
import struct
from pathlib import Path

import msgspec
import pytest
import torch
from helpers import collect, drop_a_reply
from safetensors.torch import save_file

from rollq.protocol import FileDigest, InvalidInput, Sampling, WorkItem, pack_tokens
from rollq.registry.retention import retain
from rollq.registry.safetensors_check import WeightError, check_compatible, check_header
from rollq.registry.sources import clean_peft_names
from rollq.registry.store import COMMIT_MARKER, WeightStore, digest_file, verify
from rollq.registry.versions import VersionConflict
from rollq.worker.heartbeat import Heartbeat
from rollq.worker.windows import Decision, decide

TENSORS = {"a.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
           "b.bias": torch.ones(5, dtype=torch.bfloat16)}


@pytest.fixture
def weights_dir(tmp_path):
    d = tmp_path / "weights"
    d.mkdir()
    save_file(TENSORS, str(d / "model.safetensors"))
    return d


@pytest.fixture
def make_publisher(make_client, tmp_path):
    def create(trainer_id: str = "trainer", **kwargs):
        return make_client(trainer_id, weight_store=str(tmp_path / "store"), **kwargs)

    return create


async def test_publish_copies_hashes_and_commits(make_publisher, weights_dir):
    client = make_publisher()
    entry = await client.publish_weights(1, weights_dir)
    assert entry.owned and entry.version == 1 and entry.publisher == "trainer"
    [f] = entry.files
    assert f.algorithm == "blake3" and f.digest == digest_file(weights_dir / "model.safetensors")
    manifest = json.loads((Path(entry.path) / COMMIT_MARKER).read_text())
    assert manifest["files"] == [[f.name, f.digest, f.bytes, "blake3"]]
    verify(entry.path, entry.files)
    assert await client.latest_version() == 1
    assert (await client.registry.get(1)) == entry


async def test_publish_by_reference_and_from_state_dict(make_publisher, weights_dir):
    client = make_publisher()
    by_ref = await client.publish_weights(1, weights_dir, copy=False)
    assert by_ref.path == str(weights_dir) and not by_ref.owned
    from_tensors = await client.publish_weights(2, {k: v * 2 for k, v in TENSORS.items()})
    assert check_header(Path(from_tensors.path) / "model.safetensors") == {
        "a.weight": ("F32", (3, 4)), "b.bias": ("BF16", (5,))}


def test_peft_names_are_cleaned_as_vllm_expects():
    names = {
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight": 1,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": 2,
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight": 3,
        "base_model.model.lm_head.modules_to_save.default.weight": 4,
        "base_model.model.lm_head.original_module.weight": 5,
        "base_model.model.model.norm.weight": 6,
    }
    assert clean_peft_names(names) == {"model.layers.0.self_attn.q_proj.weight": 1,
                                       "lm_head.weight": 4, "model.norm.weight": 6}


async def test_versions_strictly_increase(make_publisher, weights_dir):
    client = make_publisher()
    await client.publish_weights(3, weights_dir)
    for stale in (3, 2):
        with pytest.raises(VersionConflict, match=f"version {stale} refused, the newest is 3"):
            await client.publish_weights(stale, weights_dir)
    with pytest.raises(InvalidInput, match="version=-1"):
        await client.publish_weights(-1, weights_dir)
    assert [e.version for e in await client.registry.entries()] == [3]


async def test_a_publish_whose_reply_was_lost_is_retried_not_refused(make_publisher, weights_dir,
                                                                    monkeypatch):
    """The client retries a command whose connection dropped before its reply arrived, though
    Redis ran it. The publish script must know its own entry again: refusing it (the newest is
    this very version) made the publisher delete the files of the version it had registered, as
    a chaos run's killed connection once did."""
    client = make_publisher()
    dropped = drop_a_reply(monkeypatch, client.redis, "EVALSHA", lambda reply: isinstance(reply, list))
    entry = await client.publish_weights(3, weights_dir)
    assert dropped, "no reply was dropped: the test did not test the retry"
    assert await client.latest_version() == 3 and await client.registry.get(3) == entry
    verify(entry.path, entry.files)  # its copy in the store was kept
    with pytest.raises(VersionConflict, match="version 3 refused, the newest is 3"):
        await client.publish_weights(3, weights_dir)  # another publish of 3 is still refused


async def test_concurrent_publishers_of_one_version_exactly_one_wins(make_publisher, weights_dir,
                                                                     tmp_path):
    clients = [make_publisher(f"trainer-{i}") for i in range(4)]
    outcomes = await asyncio.gather(*(c.publish_weights(5, weights_dir) for c in clients),
                                    return_exceptions=True)
    winners = [o for o in outcomes if not isinstance(o, BaseException)]
    assert len(winners) == 1
    assert all(isinstance(o, VersionConflict) for o in outcomes if o not in winners)
    assert (await clients[0].registry.get(5)) == winners[0]
    # The losers' copies are gone; only the winner's directory is left.
    left = [p for p in (tmp_path / "store").rglob("v*") if p.is_dir()]
    assert [str(p) for p in left] == [winners[0].path]


def forge(path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("damage, message", [
    ("offsets past the data", "outside the data"),
    ("header length past the file", "does not fit"),
    ("overlapping tensors", "overlapping or gapped"),
    ("size mismatch", "needs 16"),
    ("truncated", "outside the data"),
])
async def test_bad_headers_are_refused_at_publish(make_publisher, tmp_path, damage, message):
    d = tmp_path / "bad"
    d.mkdir()
    f = d / "model.safetensors"
    if damage == "offsets past the data":
        forge(f, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 1 << 40]}}, b"\0" * 16)
    elif damage == "header length past the file":
        f.write_bytes(struct.pack("<Q", 1 << 30) + b"{}")
    elif damage == "overlapping tensors":
        forge(f, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                  "v": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, b"\0" * 16)
    elif damage == "size mismatch":
        forge(f, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, b"\0" * 12)
    else:
        save_file(TENSORS, str(f))
        f.write_bytes(f.read_bytes()[:-20])
    client = make_publisher()
    with pytest.raises(WeightError, match=message):
        await client.publish_weights(1, d)
    assert await client.latest_version() is None


async def test_pickle_files_are_refused(make_publisher, weights_dir):
    (weights_dir / "pytorch_model.bin").write_bytes(b"\x80\x04cos\nsystem\n.")
    client = make_publisher()
    for copy in (True, False):
        with pytest.raises(WeightError, match="pickle-based weight files are refused"):
            await client.publish_weights(1, weights_dir, copy=copy)
    assert await client.latest_version() is None


async def test_verify_catches_corruption_and_truncation_after_publish(make_publisher, weights_dir):
    client = make_publisher()
    entry = await client.publish_weights(1, weights_dir, copy=False)
    f = weights_dir / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(WeightError, match="blake3 .* does not match"):
        verify(entry.path, entry.files)
    f.write_bytes(bytes(data[:-4]))
    with pytest.raises(WeightError, match="truncated or replaced"):
        verify(entry.path, entry.files)


def test_new_versions_must_fit_the_served_model():
    base = {"a": ("F32", (3, 4)), "b": ("F32", (5,))}
    check_compatible({"a": ("BF16", (3, 4)), "b": ("F32", (5,))}, base, "v2")
    with pytest.raises(WeightError, match="missing 1 tensors"):
        check_compatible({"a": ("F32", (3, 4))}, base, "v2")
    with pytest.raises(WeightError, match=r"'a' has shape \[4, 3\]"):
        check_compatible({"a": ("F32", (4, 3)), "b": ("F32", (5,))}, base, "v2")


async def test_retention_keeps_what_workers_and_unfinished_jobs_need(make_publisher, weights_dir,
                                                                    redis, tmp_path):
    client = make_publisher()
    for v in range(1, 7):
        await client.publish_weights(v, weights_dir)
    await Heartbeat(redis, client.keys, "old-worker", ttl_s=30).beat(
        version=2, inflight=0, state="serving")
    job = await client.submit([[1]], exact_version=4)
    done_job = await client.submit([[1]], exact_version=1)
    await redis.hset(client.keys.job(client.trainer_id, done_job), "state", "done")
    removed = await retain(redis, client.keys, WeightStore(tmp_path / "store"), keep=2)
    assert removed == [1, 3]  # kept: 2 (a worker), 4 (an unfinished job), 5 and 6 (newest)
    assert [e.version for e in await client.registry.entries()] == [2, 4, 5, 6]
    assert len([p for p in (tmp_path / "store").rglob("v*") if p.is_dir()]) == 4
    await client.cancel(job)
    await redis.hset(client.keys.job(client.trainer_id, job), "state", "done")
    assert await retain(redis, client.keys, WeightStore(tmp_path / "store"), keep=2) == [4]


# --- version gating (pure) ---------------------------------------------------------------------

def item(**window) -> WorkItem:
    return WorkItem("j", 0, pack_tokens([1]), 1, Sampling(), 0.0, **window)


@pytest.mark.parametrize("window, loaded, pinned, newest, peers, expected", [
    (dict(), 0, False, None, set(), Decision.SERVE),
    (dict(min_version=2), 1, False, 1, set(), Decision.PASS),        # v2 not published: wait
    (dict(min_version=2), 1, False, 2, set(), Decision.WAIT_SWAP),   # about to swap to 2
    (dict(min_version=2), 2, False, 2, set(), Decision.SERVE),
    (dict(max_staleness=0), 2, False, 3, set(), Decision.WAIT_SWAP),
    (dict(max_staleness=1), 2, False, 3, set(), Decision.SERVE),
    (dict(max_staleness=0), 2, True, 3, set(), Decision.PASS),       # pinned: others serve it
    (dict(min_version=1, max_version=1), 3, False, 3, {1}, Decision.PASS),
    (dict(min_version=1, max_version=1), 1, True, 3, set(), Decision.SERVE),
    (dict(min_version=1, max_version=1), 3, False, 3, set(), Decision.FAIL),
    (dict(min_version=1, max_version=1), 3, False, 3, {2}, Decision.FAIL),
])
def test_decide(window, loaded, pinned, newest, peers, expected):
    verdict = decide(item(**window), loaded=loaded, pinned=pinned, newest=newest,
                     pinned_elsewhere=peers, cannot_load=set())
    assert verdict.decision is expected
    if expected is Decision.FAIL:
        assert "can never be served" in verdict.reason


async def test_window_no_worker_can_serve_fails_fast(make_publisher, make_worker, weights_dir):
    client = make_publisher()
    for v in (1, 2, 3):
        await client.publish_weights(v, weights_dir)
    make_worker()  # follows the registry (instant engine: a swap only changes its version)
    await client.submit([[1]], exact_version=1)
    [result] = await collect(client, 1, timeout_s=10)
    assert result.status == "failed"
    assert "version window [1, 1] can never be served: the newest version is 3" in result.reason


async def test_min_version_waits_for_publish(make_publisher, make_worker, weights_dir):
    client = make_publisher()
    make_worker(lease_s=1.0)
    await client.submit([[1, 2]], n=2, min_version=2, sampling={"max_tokens": 3})
    assert await client.take(1, timeout_s=2.0) == []  # waits, not fails
    await client.publish_weights(1, weights_dir)
    assert await client.take(1, timeout_s=1.0) == []
    await client.publish_weights(2, weights_dir)
    [result] = await collect(client, 1, timeout_s=15)
    assert result.status == "ok"
    assert {s.versions[0][0] for s in result.samples} == {2}


async def test_peft_model_is_merged_without_changing_the_trainer(make_publisher, tiny_model):
    """A LoRA model publishes merged weights under the base model's names; the trainer's
    model keeps its adapter unmerged."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from rollq.registry.safetensors_check import dir_schema

    base = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    entry = await make_publisher().publish_weights(1, model)
    published = dir_schema(Path(entry.path))
    assert set(published) == set(dir_schema(tiny_model))  # exactly the served model's names
    from safetensors.torch import load_file

    tensors = load_file(str(Path(entry.path) / "model.safetensors"))
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * layer.scaling["default"]
    expected = layer.base_layer.weight + delta
    assert torch.allclose(tensors["model.layers.0.self_attn.q_proj.weight"], expected, atol=1e-6)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # unmerged again


def test_adapter_of_is_peft_state_dict_reading_the_base_config_once(tiny_model, monkeypatch):
    """A PEFT model's adapter is exactly PEFT's adapter state dict; PEFT's "auto" check of the
    base model's config (a read of its directory, or a Hub request) runs for the first publish
    of a model, not for every one."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollq.registry.sources import adapter_of

    model = get_peft_model(LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32),
                           LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False))
    expected = get_peft_model_state_dict(model)
    reads, read = [], LlamaConfig.from_pretrained.__func__
    monkeypatch.setattr(LlamaConfig, "from_pretrained",
                        classmethod(lambda cls, *a, **kw: reads.append(a) or read(cls, *a, **kw)))
    for _ in range(3):
        tensors, _ = adapter_of(model)
        assert tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[k], expected[k]) for k in expected)
    assert len(reads) == 1


def test_adapter_of_reads_the_adapters_tensors_as_they_are_now(tiny_model, monkeypatch):
    """After a model's first publish, its adapter's tensors are read from the modules that hold
    them, not through PEFT's whole-model state dict: still exactly what PEFT would give after
    an optimizer step (in place), a parameter replaced, a LoRA module replaced, and a config
    changed (other target modules: PEFT is asked again)."""
    import peft
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaForCausalLM

    from rollq.registry import sources

    model = get_peft_model(LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32),
                           LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    asked = []
    monkeypatch.setattr(peft, "get_peft_model_state_dict",
                        lambda *a, **kw: asked.append(1) or get_peft_model_state_dict(*a, **kw))

    def same_as_peft() -> None:
        tensors, _ = sources.adapter_of(model)
        expected = get_peft_model_state_dict(model)
        assert tensors.keys() == expected.keys()
        assert all(torch.equal(tensors[k], expected[k]) for k in expected)

    same_as_peft()  # the first publish: PEFT's, both ways
    first = len(asked)
    assert first == 2
    lora_a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"]
    with torch.no_grad():
        lora_a.weight.add_(1.0)  # an optimizer step
    same_as_peft()
    lora_a.weight = torch.nn.Parameter(torch.randn_like(lora_a.weight))  # a parameter replaced
    same_as_peft()
    layer = model.base_model.model.model.layers[1].self_attn.v_proj
    layer.lora_B["default"] = torch.nn.Linear(4, layer.lora_B["default"].out_features, bias=False)
    same_as_peft()  # a module replaced
    assert len(asked) == first  # none of those asked PEFT
    model.peft_config["default"].target_modules = {"q_proj"}  # a config changed: PEFT again
    same_as_peft()
    assert len(asked) == first + 2


async def test_versions_registered_with_sha256_still_verify(make_publisher, weights_dir):
    """Entries written before BLAKE3 have three fields and no algorithm: they mean sha256, and
    the worker's and store's checks still catch a change in their files."""
    entry = await make_publisher().publish_weights(1, weights_dir, copy=False)
    f = weights_dir / "model.safetensors"
    old_wire = msgspec.msgpack.encode([f.name, hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_size])
    old = msgspec.msgpack.decode(old_wire, type=FileDigest)
    assert old.algorithm == "sha256"
    verify(entry.path, [old])
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(WeightError, match="sha256 .* does not match"):
        verify(entry.path, [old])
    with pytest.raises(WeightError, match="unknown digest algorithm 'md5'"):
        verify(entry.path, [FileDigest(f.name, old.digest, old.bytes, "md5")])


async def test_a_publish_not_waited_for_keeps_the_weights_it_was_given_and_the_order(make_publisher,
                                                                                     monkeypatch):
    """`wait=False` returns before the store write: the weights must already be the client's own
    copy (the trainer's next step changes its tensors in place), and versions must still
    register in the order they were published, a failed one not stopping the next."""
    import threading

    from safetensors.torch import load_file

    client = make_publisher()
    held, write_image = threading.Event(), WeightStore.write_image

    def held_write(self, policy, version, image):  # the first write waits until released
        if version == 1 and not held.is_set():
            assert held.wait(30)
        return write_image(self, policy, version, image)

    monkeypatch.setattr(WeightStore, "write_image", held_write)
    big = {"w": torch.zeros(1024, 1024)}
    first = await client.publish_weights(1, big, wait=False)
    big["w"] += 1  # the optimizer step that follows the publish call
    clash = await client.publish_weights(1, {"w": torch.ones(2)}, wait=False)
    second = await client.publish_weights(2, {"w": torch.full((2,), 2.0)}, wait=False)
    assert not first.done()  # its store write is held: the calls returned before it
    held.set()
    entry = await first
    assert load_file(str(Path(entry.path) / "model.safetensors"))["w"].eq(0).all()
    with pytest.raises(VersionConflict):
        await clash
    assert (await second).version == 2 and await client.latest_version() == 2
    third = await client.publish_weights(3, {"w": torch.ones(2)}, wait=False)
    await client.close()  # a close waits for the publish it would otherwise cut off
    assert third.done() and third.result().version == 3
