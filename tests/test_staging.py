"""Packing a trainer's tensors into a staging buffer (registry/staging.py) and writing the image
(store.write_image): the file must be exactly what safetensors reads back, hashed right, and a
reused buffer must never leak an earlier checkpoint's bytes."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

from rollq.registry.safetensors_check import WeightError, check_header
from rollq.registry.staging import Staging
from rollq.registry.store import WeightStore, digest_file
from rollq.registry.versions import VersionConflict


@pytest.fixture
def make_publisher(make_client, tmp_path):
    def create(trainer_id: str = "trainer", **kwargs):
        return make_client(trainer_id, weight_store=str(tmp_path / "store"), **kwargs)

    return create


def mixed() -> dict[str, torch.Tensor]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "odd.bf16": torch.arange(5, dtype=torch.bfloat16),  # 10 bytes: the next span is unaligned
        "f32": torch.randn(3, 7),
        "transposed": base.t(),  # not contiguous
        "tied.a": base, "tied.b": base,  # one storage, two names
        "i64": torch.tensor([-1, 2**40]),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
    }


def test_a_packed_image_is_the_file_safetensors_reads_and_hashes_as_written(tmp_path):
    tensors = mixed()
    staging = Staging()
    image = staging.pack(tensors)
    path, [digest] = WeightStore(tmp_path).write_image("p", 1, image)
    f = path / "model.safetensors"
    loaded = load_file(str(f))
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert torch.equal(loaded[name], t), name
    assert check_header(f)["odd.bf16"] == ("BF16", (5,))
    assert digest.bytes == f.stat().st_size == image.size
    assert digest.digest == digest_file(f)


def test_a_reused_buffer_holds_only_the_new_checkpoint_and_the_trainer_may_step_at_once(tmp_path):
    staging = Staging(keep=1)
    store = WeightStore(tmp_path)
    big = {"w": torch.full((256, 256), 7.0)}
    first = staging.pack(big)
    big["w"] += 1  # the optimizer step right after the publish call returned
    path1, _ = store.write_image("p", 1, first)
    staging.give(first.buffer)
    small = {"v": torch.ones(3)}
    second = staging.pack(small)
    assert second.buffer is first.buffer  # reused, not reallocated
    path2, _ = store.write_image("p", 2, second)
    assert load_file(str(path1 / "model.safetensors"))["w"].eq(7.0).all()
    assert load_file(str(path2 / "model.safetensors")).keys() == {"v"}


def test_a_dtype_safetensors_cannot_hold_is_refused_when_packing():
    with pytest.raises(WeightError, match="complex"):
        Staging().pack({"z": torch.zeros(2, dtype=torch.complex64)})


async def test_a_failed_background_publish_is_logged_even_if_nobody_awaits_it(make_publisher, caplog):
    client = make_publisher()
    await client.publish_weights(2, {"w": torch.ones(2)})
    with caplog.at_level(logging.ERROR, logger="rollq.client"):
        lost = await client.publish_weights(1, {"w": torch.ones(2)}, wait=False)
        later = await client.publish_weights(3, {"w": torch.full((2,), 3.0)}, wait=False)
        assert (await later).version == 3  # the failed one did not stop the next
        assert lost.done()
    assert any("VersionConflict" in r.getMessage() for r in caplog.records)
    with pytest.raises(VersionConflict):
        await lost


def test_a_copied_directory_is_hashed_from_the_bytes_written_each_file_whole(tmp_path):
    from safetensors.torch import save_file

    source = tmp_path / "ckpt"
    source.mkdir()
    shards = {"a.safetensors": {"x": torch.randn(300, 300)},  # larger, then smaller, then larger
              "b.safetensors": {"y": torch.randn(10)},
              "c.safetensors": {"z": torch.randn(400, 400)}}
    for name, tensors in shards.items():
        save_file(tensors, str(source / name))
    path, files = WeightStore(tmp_path / "store").copy_dir("p", 1, source)
    assert [d.name for d in files] == sorted(shards)
    for d in files:
        assert (path / d.name).read_bytes() == (source / d.name).read_bytes()
        assert d.digest == digest_file(source / d.name) and d.bytes == (source / d.name).stat().st_size


def test_a_buffer_not_kept_is_allocated_to_the_page_not_in_64_mib_steps():
    """An adapter's image (3.7 MB) used to populate a 64 MiB buffer: 21-25 ms of its store time."""
    import mmap

    tensors = {"lora": torch.ones(1000, 900)}  # 3.6 MB
    image = Staging(keep=0).pack(tensors)
    assert image.size < len(image.buffer) <= image.size + mmap.PAGESIZE
    kept = Staging(keep=1).pack(tensors)
    assert len(kept.buffer) == 4 << 20  # reused buffers still leave room to grow
    assert len(Staging(keep=1).pack({"w": torch.ones(20 << 20)}).buffer) == 128 << 20
