"""A push's segment and fingerprints without vLLM (`engine/pushes.py`): what the trainer writes
is what the reader gets, and the reader refuses every difference from the registry's entry
before handing anything on."""

import os
import time

import pytest
import torch

from rollq.engine import pushes
from rollq.registry.staging import Staging


def _empty(t):
    tensor = torch.empty(t.shape, dtype=getattr(torch, t.dtype))
    return tensor, memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")


@pytest.fixture
def pushed():
    """A packed state_dict of three dtypes, its tensors fingerprinted, its segment."""
    state = {"a.weight": torch.randn(4, 8), "b.bias": torch.arange(5, dtype=torch.int64),
             "c.weight": torch.randn(3, 2).to(torch.bfloat16)}
    image = Staging(keep=0).pack(state)
    tensors, start = pushes.image_tensors(image.view)
    segment = pushes.write_segment(image.view[start:], "p/v1")
    yield state, tensors, segment
    segment.unlink(missing_ok=True)


def test_what_is_written_is_what_is_read(pushed):
    state, tensors, segment = pushed
    assert [t.name for t in tensors] == list(state)
    assert segment.parent == pushes.SHM_DIR and os.stat(segment).st_mode & 0o777 == 0o600
    got = dict(pushes.read_checked(str(segment), tensors, _empty))
    for name, t in state.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t)


def test_every_difference_is_refused(pushed, tmp_path):
    _, tensors, segment = pushed
    data = bytearray(segment.read_bytes())
    data[-1] ^= 1  # the last tensor's last byte
    segment.write_bytes(bytes(data))
    with pytest.raises(pushes.PushRefused, match="c.weight: its bytes do not match"):
        pushes.read_checked(str(segment), tensors, _empty)
    segment.write_bytes(bytes(data[:-2]))  # cut short
    with pytest.raises(pushes.PushRefused, match="bytes, the entry's tensors take"):
        pushes.read_checked(str(segment), tensors, _empty)
    segment.unlink()
    with pytest.raises(pushes.PushRefused, match="No such file"):
        pushes.read_checked(str(segment), tensors, _empty)
    outside = tmp_path / "rollq-push-x"
    outside.write_bytes(b"")
    with pytest.raises(pushes.PushRefused, match="is not a rollq segment"):
        pushes.read_checked(str(outside), tensors, _empty)
    link = pushes.SHM_DIR / f"rollq-push-link-{os.getpid()}"
    link.symlink_to(outside)
    try:
        with pytest.raises(pushes.PushRefused):
            pushes.read_checked(str(link), tensors, _empty)
    finally:
        link.unlink()
    bad = [tensors[0].__class__(tensors[0].name, "object", [1], "")]
    one = pushes.write_segment(memoryview(b"x"), "one-byte")
    try:
        with pytest.raises(pushes.PushRefused, match="dtype 'object'"):
            pushes.read_checked(str(one), bad, _empty)
    finally:
        one.unlink()


def test_expired_segments_are_swept(pushed):
    _, _, segment = pushed
    old = pushes.write_segment(memoryview(b"x"), "left-by-a-dead-trainer")
    os.utime(old, (time.time() - 120, time.time() - 120))
    pushes.sweep_segments(60)
    assert not old.exists() and segment.exists()


def test_an_offer_is_taken_on_its_host_by_its_transport(pushed):
    _, _, segment = pushed
    offer = pushes.shm_offer(segment)
    assert pushes.reachable(offer, "shm")
    assert not pushes.reachable(offer, None)
    assert not pushes.reachable(offer.__class__("shm", str(segment), "elsewhere/boot"), "shm")
    assert pushes.untouched(pushes.PushRefused("x"))


async def test_a_push_publish_offers_fingerprints_and_cleans_up(make_client, tmp_path, policy):
    """The entry carries every tensor's fingerprint (of its C-order bytes) and the offer; a push
    refused by the registry (not above the newest) leaves no segment; bad input names `push`."""
    from rollq.protocol import InvalidInput
    from rollq.registry.versions import VersionConflict

    client = make_client(weight_store=str(tmp_path / "store"))
    state = {"w": torch.randn(4, 4), "b": torch.arange(3, dtype=torch.int32)}
    await client.publish_weights(2, state, push="shm")
    entry = await client.registry.get(2)
    assert [(t.name, t.dtype, t.shape) for t in entry.tensors] == [("w", "float32", [4, 4]),
                                                                    ("b", "int32", [3])]
    assert entry.tensors[0].digest == pushes.fingerprint(state["w"].numpy().tobytes())
    assert pushes.reachable(entry.push, "shm") and os.path.exists(entry.push.address)
    label = f"{pushes.SEGMENT_PREFIX}{policy}-2-*"
    with pytest.raises(VersionConflict):
        await client.publish_weights(2, state, push="shm")
    assert [str(p) for p in pushes.SHM_DIR.glob(label)] == [entry.push.address]
    with pytest.raises(InvalidInput, match="push"):
        await client.publish_weights(3, state, push="nccl")
    with pytest.raises(InvalidInput, match="push"):
        await client.publish_weights(3, str(tmp_path), push="shm")
    await client.close()
    assert not os.path.exists(entry.push.address)
