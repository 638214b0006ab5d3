"""The trainer process of `rollq chaos`: reads results, "trains" on them, commits, acknowledges.

The chaos runner SIGKILLs and restarts it (fault `trainer_sigkill`), and half of its steps break
out of `results()` at a random position (fault `results_break`). Its log is the record of what
it trained on: one line per step, fsynced before the step's results are acknowledged (the
commit), so a restarted trainer skips (and acknowledges) results it trained on already.

Log lines are `<kind> <item> ...`: `step-take` / `step-break` (committed, items
`job/group/status`), `replayed` (handed again after a restart, committed before: skipped),
`acked`, and `dup`: what must never happen, a result handed twice to one life of the process or
handed again after it was acknowledged. Scored jobs (ids `s...`, `d...` with dynamic sampling,
`o...` over-sampled) add `rewards` (committed with the step, items `job/group/verdict`): `right`
when an `ok` group's rewards are each exactly the chaos reward recomputed from its samples
(`rollq/harness/chaos/rewards.py`), and when a `filtered` group is an even group of a `d` job
with its uniform rewards and no samples; `wrong` when not (a missing, stale or other reward, a
reward error, an odd group filtered or an even one delivered, a `cancelled` result with
samples); `unscored` for a group that ended otherwise (its status is in the step line).

    python -m rollq.harness.chaos.trainer REDIS_URL LOG SEED
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
from pathlib import Path

from rollq.client import RolloutClient
from rollq.harness.chaos.rewards import ASYNC, SYNC, UNIFORM_ASYNC, UNIFORM_SYNC, expected, expected_dynamic
from rollq.protocol import GroupResult

POLICY = "chaos"
TRAINER = "trainer"
MAX_STEP = 64


def repair(path: Path) -> list[str]:
    """The log's complete lines; a torn last line (killed mid-write) is cut off for good."""
    if not path.exists():
        return []
    with open(path, "rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            f.truncate(keep)
            os.fsync(f.fileno())
    return data[:keep].decode().splitlines()


def is_scored(job_id: str) -> bool:
    return job_id[:1] in ("s", "d", "o")


def verdict(result: GroupResult) -> str:
    """A scored group's rewards against the chaos reward recomputed from its own samples."""
    dynamic = result.job_id.startswith("d")
    rewards, fn = ((UNIFORM_SYNC, UNIFORM_ASYNC), expected_dynamic) if dynamic else ((SYNC, ASYNC), expected)
    if result.status == "cancelled":
        return "wrong" if result.samples else "unscored"  # a cancelled result carries no samples
    if result.status == "filtered":
        right = (dynamic and result.group_index % 2 == 0 and not result.samples
                 and result.rewards == [float(result.group_index)] * 2 and result.reward in rewards)
        return "right" if right else "wrong"
    if result.status != "ok":
        return "unscored"
    want = [fn(s.token_ids, i, result.group_index) for i, s in enumerate(result.samples)]
    right = (result.rewards == want and result.reward in rewards and result.reward_version == "1"
             and not any(result.reward_errors) and result.scorer_id != "" and len(want) > 0
             and not (dynamic and result.group_index % 2 == 0))  # an even group's are all equal
    return "right" if right else "wrong"


def group_key(item: str) -> str:
    """`job/group` of a log item (`job/group` or `job/group/status`)."""
    return "/".join(item.split("/")[:2])


async def next_step(client: RolloutClient, rng: random.Random) -> tuple[str, list[GroupResult]]:
    """One step's results: from `take`, or from `results()` broken out of at a random position."""
    # Results the trainer can still be handed: it acknowledged all it was handed at each step.
    available = await client._retrying(client.redis.xlen, client.keys.results(TRAINER))
    if available == 0 or rng.random() < 0.5:
        return "step-take", await client.take(rng.randint(1, MAX_STEP), timeout_s=0.5, ack="manual")
    limit, batch = rng.randint(1, min(MAX_STEP, available)), []
    async for result in client.results(batch=MAX_STEP, block_s=0.5, ack="manual"):
        batch.append(result)
        if len(batch) == limit:
            break  # mid-batch, usually: the rest must come from the next read, once
    return "step-break", batch


async def train(url: str, log: Path, seed: int) -> None:
    rng = random.Random(seed)
    trained: set[str] = set()
    acked: set[str] = set()
    for line in repair(log):
        kind, *items = line.split()
        if kind.startswith("step"):
            trained.update(map(group_key, items))
        elif kind == "acked":
            acked.update(items)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    handed: set[str] = set()
    async with RolloutClient(url, policy=POLICY, trainer_id=TRAINER, reconnect_s=120) as client:
        while True:
            kind, batch = await next_step(client, rng)
            keys = [f"{r.job_id}/{r.group_index}" for r in batch]
            new = [f"{k}/{r.status}" for k, r in zip(keys, batch) if k not in trained]
            scored = [f"{k}/{verdict(r)}" for k, r in zip(keys, batch)
                      if k not in trained and is_scored(r.job_id)]
            # The verdicts before the step: a torn record loses the step too, so its groups come
            # back and are judged again (a verdict is kept per group, the last one counts).
            lines = [("dup", [k for k in keys if k in handed or k in acked]), ("rewards", scored),
                     (kind, new), ("replayed", [k for k in keys if k in trained])]
            record = "".join(f"{name} {' '.join(items)}\n" for name, items in lines if items)
            if record:
                os.write(fd, record.encode())
                os.fsync(fd)  # committed: only now may the results be acknowledged
            handed.update(keys)
            trained.update(keys)
            if batch:
                await client.ack(batch)
                acked.update(keys)
                os.write(fd, f"acked {' '.join(keys)}\n".encode())


if __name__ == "__main__":
    asyncio.run(train(sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])))
