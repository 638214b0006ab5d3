"""A trainer that may be killed at any moment and trains on every group exactly once.

Written from README.md and docs/reliability.md ("Delivery to trainers") alone, as a new user
would: deterministic job ids (a resubmit after a crash is a no-op while the job's record lives,
`--job-ttl-s`, a day by default), `take(ack="manual")`, a log of the groups each step used,
appended and fsynced before `ack()`, and results the log already holds dropped and acknowledged.
The "training" sums token ids; a real trainer steps its optimizer there.

    python examples/crash_safe_trainer.py --redis-url redis://127.0.0.1:6379/0 --policy demo \\
        --trainer run-1 --log run-1.log --steps 20

Kill it (SIGKILL) and start it again with the same arguments: it goes on where its log ends.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

from rollq import RolloutClient


def read_log(path: Path) -> tuple[int, set[tuple[str, int]]]:
    """Steps committed, and the (job_id, group_index) of every group they trained on. A line
    cut short by a kill mid-write is not committed: it is ignored (and its groups come again)."""
    steps, used = 0, set()
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break
            steps = record["step"] + 1
            used.update((job, group) for job, group in record["groups"])
    return steps, used


def commit(path: Path, step: int, groups: list[tuple[str, int]], loss: float) -> None:
    with path.open("a") as log:
        log.write(json.dumps({"step": step, "groups": groups, "loss": loss}) + "\n")
        log.flush()
        os.fsync(log.fileno())


async def train(args: argparse.Namespace) -> None:
    log = Path(args.log)
    step, used = read_log(log)
    async with RolloutClient(args.redis_url, policy=args.policy, trainer_id=args.trainer) as client:
        # Every job, submitted ahead: one submitted before a crash is a no-op now (same job id).
        for k in range(args.steps):
            await client.submit([[k + 1, i + 1] for i in range(args.groups)], n=args.n,
                                sampling={"max_tokens": 4}, job_id=f"step-{k}")
        while len(used) < args.steps * args.groups:
            batch = await client.take(args.groups, timeout_s=30.0, ack="manual")
            if not batch:
                continue  # fewer than asked for, even none, when the timeout passes: take again
            fresh = [r for r in batch if (r.job_id, r.group_index) not in used]
            if not fresh:  # handed again after a kill between the log write and the ack
                await client.ack(batch)
                continue
            ok = [r for r in fresh if r.status == "ok"]
            loss = float(sum(sum(s.token_ids) for r in ok for s in r.samples))  # the "step"
            groups = [(r.job_id, r.group_index) for r in fresh]
            commit(log, step, groups, loss)
            used.update(groups)
            await client.ack(batch)  # after the commit: a kill before this hands them again
            print(f"step {step} committed {len(groups)} groups", flush=True)
            step += 1
        # Killed after its last commit but before that ack, a trainer restarts with nothing left
        # to train on and those results pending (they hold quota): acknowledge what the log has.
        while stale := await client.take(args.groups, timeout_s=1.0, ack="manual"):
            assert all((r.job_id, r.group_index) in used for r in stale), "a group never trained on"
            await client.ack(stale)
        print("done", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--policy", required=True)
    parser.add_argument("--trainer", required=True)
    parser.add_argument("--log", required=True, help="The committed log (JSON lines).")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--groups", type=int, default=8, help="Groups per step.")
    parser.add_argument("--n", type=int, default=2, help="Samples per group.")
    asyncio.run(train(parser.parse_args()))


if __name__ == "__main__":
    main()
