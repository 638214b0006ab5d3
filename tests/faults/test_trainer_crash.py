"""Results survive a trainer crash: a trainer process that acknowledges after each committed
step is SIGKILLed at 20 random moments and restarted with the same trainer_id; every group ends
in its committed log exactly once. In-process workers on the instant engine, a durable Redis."""

from __future__ import annotations

import asyncio
import random
import signal
import sys
from collections import Counter
from pathlib import Path

from helpers import wait_until

from rollq.queue.names import Group

TRAINER = Path(__file__).with_name("crash_trainer.py")
KILLS = 20
GROUPS_PER_LIFE = 60


async def start_trainer(redis_url: str, policy: str, log: Path) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(TRAINER), redis_url, policy, "trainer", str(log),
        stdout=asyncio.subprocess.PIPE)
    assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"ready\n"
    return proc


def read_log(log: Path) -> dict[str, Counter]:
    """Per kind of line (handed, step, replayed, dup): how often each job:group appears."""
    counts: dict[str, Counter] = {kind: Counter() for kind in ("handed", "step", "replayed", "dup")}
    for line in log.read_text().splitlines():
        kind, _, *keys = line.split()
        if kind in counts:
            counts[kind].update(keys)
    return counts


async def test_trainer_sigkilled_20_times_trains_on_every_group_once(make_client, spawn_worker,
                                                                     redis, redis_url, policy,
                                                                     tmp_path):
    client = make_client(max_outstanding=100_000)  # the same trainer, submitting only
    spawn_worker(max_inflight=16)
    log = tmp_path / "trained.log"
    expected = set()
    for life in range(KILLS):
        job = await client.submit([[life + 1, i + 1] for i in range(GROUPS_PER_LIFE)], n=1,
                                  sampling={"max_tokens": 2})
        expected.update(f"{job}:{i}" for i in range(GROUPS_PER_LIFE))
        trainer = await start_trainer(redis_url, policy, log)
        await asyncio.sleep(random.uniform(0.0, 0.6))  # a random moment of its training
        trainer.send_signal(signal.SIGKILL)
        assert await trainer.wait() == -signal.SIGKILL
    trained_before_last = len(read_log(log)["step"])
    last = await start_trainer(redis_url, policy, log)
    try:
        await wait_until(lambda: len(read_log(log)["step"]) == len(expected), timeout_s=60,
                         what="every group trained on")

        async def all_acked() -> bool:
            return await client.outstanding() == 0

        await wait_until(all_acked, what="every result acknowledged")
    finally:
        last.send_signal(signal.SIGKILL)
        await last.wait()
    counts = read_log(log)
    assert set(counts["step"]) == expected  # none lost, none foreign
    assert set(counts["step"].values()) == {1}  # trained on once each
    assert not counts["dup"], list(counts["dup"])[:5]  # never handed twice to one life, nor after its ack
    stream = client.keys.results("trainer")
    assert await redis.xlen(stream) == 0
    assert (await redis.xpending(stream, Group.TRAINER))["pending"] == 0
    # The kills did hit between a read and its committed step: those results came back.
    redelivered = sum(1 for key, n in counts["handed"].items() if n > 1)
    print(f"{len(expected)} groups; {trained_before_last} trained before the last life; "
          f"{redelivered} handed again after a kill; {len(counts['replayed'])} of them committed "
          "before the kill (skipped and acknowledged)")
    assert redelivered > 0
