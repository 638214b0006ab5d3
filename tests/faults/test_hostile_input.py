"""Hostile bytes written straight into a work stream: Hypothesis-generated malformed, oversized
and mistyped payloads and a pickle exploit. The worker must survive all of them, run none,
and dead-letter each on its first delivery with a `failed` result."""

from __future__ import annotations

from pathlib import Path

import msgspec
from conftest import LONG
from helpers import wait_until
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from rollq.protocol import MAX_ITEM_BYTES, InvalidInput, Sampling, WorkItem, decode_item, encode, pack_tokens
from rollq.queue.keys import Keys

PAYLOADS = 10_000 if LONG else 3_000
"""Short in CI: Hypothesis' generation is half the time. 3,000 still carries every kind (the
exploit, oversized and short-prompt items, 2,980 generated) and 2,000 items after the first
1,000 for the memory bound; ROLLQ_LONG_TESTS=1 runs 10,000."""


def _exploit(marker) -> bytes:
    """A pickle (protocol 0, written by hand: nothing here imports pickle) that runs
    `touch <marker>` when unpickled."""
    return b"cposix\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR."


_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12)
_VALID = msgspec.to_builtins(WorkItem("job", 0, pack_tokens([1, 2, 3]), 2, Sampling(max_tokens=4), 0.0),
                             enc_hook=bytes)


@st.composite
def _mutated(draw) -> bytes:
    """A valid item with one field replaced by anything, or unknown fields appended."""
    fields = list(_VALID)
    if draw(st.booleans()):
        fields[draw(st.integers(0, len(fields) - 1))] = draw(_values)
    else:
        fields += draw(st.lists(_values, min_size=1, max_size=3))
    return msgspec.msgpack.encode(fields)


hostile = st.one_of(st.binary(max_size=300), _values.map(msgspec.msgpack.encode), _mutated())


def _bad(payload: bytes) -> bool:
    try:
        decode_item(payload)
    except InvalidInput:
        return True
    return False


def generate(count: int) -> list[bytes]:
    found: list[bytes] = []

    @settings(max_examples=count * 2, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(hostile)
    def collect(payload: bytes) -> None:
        if len(found) < count and _bad(payload):
            found.append(payload)

    collect()
    return found


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def test_hostile_payloads_are_dead_lettered_and_none_runs(spawn_worker, redis, policy, tmp_path):
    marker = tmp_path / "pwned"
    payloads = generate(PAYLOADS - 20)
    payloads += [_exploit(marker)] * 10 + [b"\x91" + b"\x00" * (MAX_ITEM_BYTES + 1)] * 5
    payloads += [encode(["job", 0, b"\x01\x00\x00", 1, [], 0.0])] * 5  # prompt not whole int32s
    assert len(payloads) == PAYLOADS and all(_bad(p) for p in payloads)
    keys = Keys(policy)
    stream = keys.work("mallory")
    worker = spawn_worker(max_inflight=64)
    await wait_until(lambda: redis.exists(keys.worker(worker.worker_id)), what="worker up")

    async def write(batch: list[bytes]) -> None:
        # As enqueue.lua does: the entries, then the trainer in the set workers claim from (a
        # trainer listed with nothing queued is pruned by the workers, and its stream with it).
        async with redis.pipeline(transaction=False) as pipe:
            for payload in batch:
                pipe.xadd(stream, {"d": payload})
            pipe.sadd(keys.trainers, "mallory")
            await pipe.execute()

    await write(payloads[:1000])
    await wait_until(lambda: _dead_at_least(redis, keys, 1000), timeout_s=120, what="first 1000 dead")
    warm = rss_mb(worker.proc.pid)
    for start in range(1000, PAYLOADS, 1000):
        await write(payloads[start:start + 1000])
    await wait_until(lambda: _dead_at_least(redis, keys, PAYLOADS), timeout_s=300, what="all dead-lettered")
    grown = rss_mb(worker.proc.pid) - warm

    assert worker.proc.poll() is None, "the worker died"
    assert not marker.exists(), "the pickle exploit ran"
    results = await redis.xrange(keys.results("mallory"))
    decoded = [msgspec.msgpack.decode(fields[b"d"]) for _, fields in results]
    assert len(decoded) == PAYLOADS and {r[2] for r in decoded} == {"failed"}
    dead = await redis.xrange(keys.dead)
    assert len(dead) == PAYLOADS
    assert all(b"deliveries" not in fields[b"reason"] for _, fields in dead), "not on first delivery"
    # Nothing pending: the stream's group has none, or the workers pruned the emptied stream.
    assert not await redis.exists(stream) or (await redis.xpending(stream, "workers"))["pending"] == 0
    print(f"worker RSS grew {grown:.1f} MB over {PAYLOADS - 1000} hostile items")
    assert grown < 50


async def _dead_at_least(redis, keys: Keys, count: int) -> bool:
    return await redis.xlen(keys.dead) >= count
