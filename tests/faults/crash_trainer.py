"""The trainer process of test_trainer_crash.py, SIGKILLed at random moments and restarted.

Each step takes a batch of results (ack="manual"), "trains" on them, appends
`step N job:group ...` to its log and fsyncs it (the commit), then acknowledges the batch. On
restart it reads its committed log and skips (and acknowledges) results it has trained on
already. It also reports what must never happen as `dup` lines: a result handed twice to one
life of the process, or one handed again after its ack.

    python crash_trainer.py REDIS_URL POLICY TRAINER_ID LOG
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from pathlib import Path

from rollq.client import RolloutClient
from rollq.harness.chaos.trainer import repair


async def train(redis_url: str, policy: str, trainer_id: str, log: str) -> None:
    trained: set[str] = set()
    acked: set[str] = set()
    step = 0
    for line in repair(Path(log)):
        kind, number, *keys = line.split()
        if kind == "step":
            step = int(number)
            trained.update(keys)
        elif kind == "acked":
            acked.update(keys)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    handed: set[str] = set()
    async with RolloutClient(redis_url, policy=policy, trainer_id=trainer_id) as client:
        print("ready", flush=True)
        while True:
            batch = await client.take(random.randint(1, 8), timeout_s=0.5, ack="manual")
            if not batch:
                continue
            keys = [f"{r.job_id}:{r.group_index}" for r in batch]
            os.write(fd, f"handed 0 {' '.join(keys)}\n".encode())  # for the test's statistics
            wrong = [k for k in keys if k in handed or k in acked]
            handed.update(keys)
            new = [k for k in keys if k not in trained]
            record = f"dup 0 {' '.join(wrong)}\n" if wrong else ""
            if len(new) < len(keys):
                record += f"replayed 0 {' '.join(k for k in keys if k in trained)}\n"
            if new:
                await asyncio.sleep(random.uniform(0.005, 0.05))  # the optimizer step
                step += 1
                record += f"step {step} {' '.join(new)}\n"
            if record:
                os.write(fd, record.encode())
                os.fsync(fd)  # committed: only now may the results be acknowledged
                await asyncio.sleep(random.uniform(0.0, 0.02))  # e.g. a checkpoint before the ack
            trained.update(new)
            await client.ack(batch)
            acked.update(keys)
            os.write(fd, f"acked 0 {' '.join(keys)}\n".encode())


if __name__ == "__main__":
    asyncio.run(train(*sys.argv[1:5]))
