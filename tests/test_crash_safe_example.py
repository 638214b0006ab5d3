"""examples/crash_safe_trainer.py, written from the delivery docs alone, SIGKILLed at several
moments and restarted: every group is in its committed log exactly once, nothing stays pending."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import sys
from pathlib import Path

from rollq.queue.keys import Keys
from rollq.queue.names import Group

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "crash_safe_trainer.py"


async def test_the_crash_safe_trainer_of_the_docs_trains_on_each_group_once(make_worker, redis_url,
                                                                            redis, policy, tmp_path):
    make_worker(delay_s=0.01, max_inflight=4)
    log = tmp_path / "trainer.log"
    steps, groups = 12, 6
    argv = [sys.executable, str(EXAMPLE), "--redis-url", redis_url, "--policy", policy,
            "--trainer", "crashy", "--log", str(log), "--steps", str(steps), "--groups", str(groups)]
    rng, kills = random.Random(27), 0
    for life in range(8):
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    env=os.environ | {"PYTHONUNBUFFERED": "1"})
        # Killed after a random number of its commits (0: before its first), except the last life.
        survive = rng.randint(0, 2) if life < 7 else None
        commits, finished = 0, False
        while line := await asyncio.wait_for(proc.stdout.readline(), 120):
            finished = line.startswith(b"done")
            commits += line.startswith(b"step")
            if survive is not None and commits >= survive:
                proc.send_signal(signal.SIGKILL)
                kills += 1
                break
        await asyncio.wait_for(proc.wait(), 60)
        if finished:
            break
    assert finished and kills >= 1, (finished, kills)
    used = [tuple(g) for line in log.read_text().splitlines() for g in json.loads(line)["groups"]]
    assert sorted(used) == sorted((f"step-{k}", i) for k in range(steps) for i in range(groups))
    keys = Keys(policy)
    assert await redis.xlen(keys.results("crashy")) == 0
    assert (await redis.xpending(keys.results("crashy"), Group.TRAINER))["pending"] == 0
    assert int(await redis.get(keys.outstanding("crashy")) or 0) == 0
