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


async def test_the_next_push_is_written_over_the_segment_no_longer_offered(make_client, tmp_path, policy):
    """Pushes keep two segments: the newest, offered, and the one before, kept as the spare the
    next push is written over (its pages allocated already). A reader still holding the spare
    (a worker far behind) then reads the newer bytes, which fail the older version's fingerprints:
    it loads the files instead."""
    client = make_client(weight_store=str(tmp_path / "store"))
    states = {v: {"w": torch.full((64, 64), float(v))} for v in (1, 2, 3)}
    await client.publish_weights(1, states[1], push="shm")
    first = await client.registry.get(1)
    fd = os.open(first.push.address, os.O_RDONLY)
    try:
        await client.publish_weights(2, states[2], push="shm")
        await client.publish_weights(3, states[3], push="shm")
        third = await client.registry.get(3)
        assert os.fstat(fd).st_ino == os.stat(third.push.address).st_ino  # written over
        assert len(list(pushes.SHM_DIR.glob(f"{pushes.SEGMENT_PREFIX}{policy}-*"))) == 2
        data = os.pread(fd, 64 * 64 * 4, 0)
        assert pushes.fingerprint(data) == third.tensors[0].digest != first.tensors[0].digest
    finally:
        os.close(fd)
    await client.close()
    assert not list(pushes.SHM_DIR.glob(f"{pushes.SEGMENT_PREFIX}{policy}-*"))


def _in_thread(call, wait_s: float = 5.0):
    """`call()`'s outcome, or TimeoutError if it is still running after `wait_s` (a daemon
    thread: one that blocks for ever must fail the test, not hang it)."""
    import threading

    out = {}

    def run():
        try:
            out["value"] = call()
        except BaseException as e:  # noqa: BLE001 (handed to the test)
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(wait_s)
    if thread.is_alive():
        raise TimeoutError(f"still running after {wait_s} s")
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_a_fifo_at_the_address_is_refused_not_waited_on(pushed):
    """A FIFO of the right name: opened for reading, it blocks until a writer comes (for ever);
    the reader opens it non-blocking and refuses it as not a segment. (Seen failing, hanging
    until the thread's wait ran out, with O_NONBLOCK removed from `read_checked`'s open.)"""
    _, tensors, _ = pushed
    fifo = pushes.SHM_DIR / f"rollq-push-fifo-{os.getpid()}"
    os.mkfifo(fifo, 0o600)
    try:
        with pytest.raises(pushes.PushRefused, match="0 bytes, the entry's tensors take"):
            _in_thread(lambda: pushes.read_checked(str(fifo), tensors, _empty))
    finally:
        fifo.unlink()


def test_a_read_that_never_finishes_is_given_up_and_wedges_nothing(pushed, tmp_path, monkeypatch):
    """A read held mid-segment (the tests' hook, `HOLD_ENV`): its waiter refuses the push at the
    deadline, the abandoned thread stops at its next tensor, and a new read of the same segment
    is not queued behind it. (Seen failing, the waiter never returning, with `_Reading.result`
    waiting without its deadline.)"""
    from rollq.engine.transfer import ShmUpdateInfo, _Reading

    state, tensors, segment = pushed
    monkeypatch.setenv(pushes.HOLD_ENV, str(tmp_path))
    (tmp_path / "hold").touch()
    info = ShmUpdateInfo(**pushes.update_info(pushes.shm_offer(segment), tensors, timeout_s=0.5))
    stuck = _Reading(info)
    with pytest.raises(pushes.PushRefused, match=r"not read and checked within 0.5 s"):
        _in_thread(stuck.result)
    assert (tmp_path / f"held-{segment.name}").exists()  # still held: the thread gave up itself
    with pytest.raises(pushes.PushRefused, match="read given up"):
        stuck.future.result(timeout=5)
    got = dict(_in_thread(_Reading(info).result))
    assert all(torch.equal(got[name], t) for name, t in state.items())
    with pytest.raises(ValueError, match="timeout_s=0 must be a finite number > 0"):
        ShmUpdateInfo(**pushes.update_info(pushes.shm_offer(segment), tensors, timeout_s=0))
