"""`rollq status`: versions, workers, scorers and queue depths of one policy or all, as rich
tables."""

from __future__ import annotations

import time

import msgspec
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from rich.console import Console
from rich.table import Table

from rollq.queue import members
from rollq.queue.keys import EVERY_POLICY, Keys, policy_of
from rollq.queue.names import Group
from rollq.registry.versions import Registry
from rollq.queue.workers import WorkerState, live_workers
from rollq.scoring.records import ScorerState, live_scorers


class TrainerQueue(msgspec.Struct):
    trainer: str
    waiting: int
    """Groups no worker has read yet."""
    running: int
    """Groups a worker holds (pending in the consumer group)."""
    results: int
    """Results not yet acknowledged by the trainer."""
    outstanding: int


class ScoringDepth(msgspec.Struct):
    """A trainer's scoring stream: generated groups of its scored jobs."""

    trainer: str
    waiting: int
    """Groups no scorer has read yet."""
    running: int
    """Groups a scorer holds."""


class PolicyStatus(msgspec.Struct):
    policy: str
    latest: int | None
    versions: list[int]
    workers: list[WorkerState]
    queues: list[TrainerQueue]
    scorers: list[ScorerState] = []
    scoring: list[ScoringDepth] = []


async def policies(redis: Redis) -> list[str]:
    """Policies with trainers, registered versions or workers."""
    found = set()
    for pattern in (EVERY_POLICY.trainers, EVERY_POLICY.latest, EVERY_POLICY.workers,
                    EVERY_POLICY.scorers):
        async for key in redis.scan_iter(match=pattern, count=1000):
            found.add(policy_of(key.decode()))
    return sorted(found)


async def policy_status(redis: Redis, policy: str) -> PolicyStatus:
    keys = Keys(policy)
    registry = Registry(redis, keys)
    trainers = members.trainer_ids(keys.trainers, await redis.smembers(keys.trainers))
    # A trainer's groups: on its own stream and on the streams routed to workers (episodes).
    streams = {trainer: [keys.work(trainer)] for trainer in trainers}
    routes, _ = members.routes(keys, await redis.hgetall(keys.routed))
    for routed, (trainer, *_) in sorted(routes.items()):
        if trainer in streams:
            streams[trainer].append(routed)
    queues = []
    for trainer in trainers:
        total = running = 0
        for stream in streams[trainer]:
            length = await redis.xlen(stream)
            total += length
            if length:
                running += (await redis.xpending(stream, Group.WORKERS))["pending"]
        queues.append(TrainerQueue(trainer, total - running, running,
                                   await redis.xlen(keys.results(trainer)),
                                   members.count(keys.outstanding(trainer),
                                                 await redis.get(keys.outstanding(trainer)))))
    return PolicyStatus(policy, await registry.latest(),
                        [e.version for e in await registry.entries()],
                        await live_workers(redis, keys), queues, await live_scorers(redis, keys),
                        await _scoring(redis, keys))


async def _scoring(redis: Redis, keys: Keys) -> list[ScoringDepth]:
    out = []
    for trainer in members.trainer_ids(keys.scoring_trainers, await redis.smembers(keys.scoring_trainers)):
        stream = keys.scoring(trainer)
        length, running = await redis.xlen(stream), 0
        if length:
            try:
                running = (await redis.xpending(stream, Group.WORKERS))["pending"]
            except ResponseError as e:  # no scorer has read the stream yet: none running
                if "NOGROUP" not in str(e):
                    raise
        out.append(ScoringDepth(trainer, length - running, running))
    return out


def render(status: PolicyStatus, console: Console) -> None:
    versions = ", ".join(map(str, status.versions[-8:])) or "none"
    console.print(f"[bold]policy {status.policy}[/bold]: newest version "
                  f"{status.latest if status.latest is not None else '-'} (registered: {versions})")
    workers = Table(title="workers", title_justify="left")
    for col in ("worker", "version", "state", "in flight", "last beat", "last error"):
        workers.add_column(col)
    for w in status.workers:
        version = str(w.version) + (f" + adapters {', '.join(map(str, w.adapters))}" if w.adapters else "")
        workers.add_row(w.worker_id + (" (pinned)" if w.pinned else ""), version, w.state,
                        str(w.inflight), f"{time.time() - w.at:.0f} s ago", w.last_error or "-")
    console.print(workers)
    queues = Table(title="trainers", title_justify="left")
    for col in ("trainer", "waiting", "running", "results unacked", "outstanding (quota)"):
        queues.add_column(col)
    for q in status.queues:
        queues.add_row(q.trainer, str(q.waiting), str(q.running), str(q.results), str(q.outstanding))
    console.print(queues)
    if status.scorers or status.scoring:
        _render_scoring(status, console)


def _render_scoring(status: PolicyStatus, console: Console) -> None:
    scorers = Table(title="scorers", title_justify="left")
    for col in ("scorer", "rewards (versions)", "held", "scored", "reward errors", "child restarts",
                "last beat"):
        scorers.add_column(col)
    for s in status.scorers:
        offered = ", ".join(f"{name} (v{version})" for name, version in sorted(s.rewards.items()))
        scorers.add_row(s.scorer_id, offered or "-", str(s.inflight), str(s.scored), str(s.reward_errors),
                        str(s.restarts), f"{time.time() - s.at:.0f} s ago")
    console.print(scorers)
    queues = Table(title="scoring queues", title_justify="left")
    for col in ("trainer", "waiting", "scoring"):
        queues.add_column(col)
    for q in status.scoring:
        queues.add_row(q.trainer, str(q.waiting), str(q.running))
    console.print(queues)
    waiting = sum(q.waiting for q in status.scoring)
    if waiting and not status.scorers:  # queued before any scorer started (or after all stopped)
        console.print(f"[yellow]no live scorer: {waiting} generated groups wait to be scored[/yellow]")
