"""`rollq status`: versions, workers, scorers and queue depths of one policy or all, as rich
tables."""

from __future__ import annotations

import time

import msgspec
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from rich.console import Console
from rich.table import Table

from rollq.queue import gap, members
from rollq.queue.gap import GapView
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
    gap: GapView = msgspec.field(default_factory=GapView)
    """The training-inference gap trainers reported (`queue/gap.py`): every trainer's together,
    or the asking token's own (the gateway without the `observe` scope)."""


async def policies(redis: Redis) -> list[str]:
    """Policies with trainers, registered versions or workers."""
    found = set()
    for pattern in (EVERY_POLICY.trainers, EVERY_POLICY.latest, EVERY_POLICY.workers,
                    EVERY_POLICY.scorers):
        async for key in redis.scan_iter(match=pattern, count=1000):
            found.add(policy_of(key.decode()))
    return sorted(found)


async def policy_status(redis: Redis, policy: str, *, gap_of: str | None = "") -> PolicyStatus:
    """`gap_of`: whose reported gap to read: "" every trainer's, a trainer's own, None none (the
    gateway's sampler reads it on its own cadence)."""
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
                        await _scoring(redis, keys),
                        GapView() if gap_of is None else await gap.read(redis, keys, gap_of or None))


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
    if any(w.canaries for w in status.workers):
        _render_canaries(status.workers, console)
    if status.gap.versions:
        _render_gap(status.gap, console)
    if status.scorers or status.scoring:
        _render_scoring(status, console)


def _render_canaries(workers: list[WorkerState], console: Console) -> None:
    """Each worker's latest version check: refused in red, with the figures against the tolerance."""
    table = Table(title="version canary (each worker's latest check)", title_justify="left")
    for col in ("worker", "version", "verdict", "max |Δ| (tol)", "mean |Δ| (tol)", "k3 (tol)", "tokens",
                "checked"):
        table.add_column(col)
    for w in workers:
        if not w.canaries:
            continue
        c = w.canaries[-1]
        v, t = c.verdict, c.verdict.tolerance
        word = "accepted" if v.accepted else "[bold red]REFUSED[/bold red]"
        table.add_row(w.worker_id, f"{c.version}{' (adapter)' if c.adapter else ''}", word,
                      f"{v.max_abs:.3g} ({t.max_abs:.3g})", f"{v.mean_abs:.3g} ({t.mean_abs:.3g})",
                      f"{v.kl:.3g} ({t.kl:.3g})", str(v.tokens), f"{time.time() - c.at:.0f} s ago")
    console.print(table)


GAP_SHOWN = 8
"""Versions `rollq status` shows of the reported gap (the newest)."""


def _render_gap(view: GapView, console: Console) -> None:
    """The gap trainers reported, per version and then per worker; a worker that stands out red."""
    table = Table(title="training-inference gap (trainer-reported; Δ = trainer - behaviour logprob)",
                  title_justify="left")
    for col in ("version", "worker", "tokens", "mean |Δ|", "KL (k3)", "|Δ| > 1", "ratio mean ± std"):
        table.add_column(col)
    shown = {v.version for v in view.versions[-GAP_SHOWN:]}
    for row in [r for v in view.versions if v.version in shown
                for r in (v, *(w for w in view.workers if w.version == v.version))]:
        worker = "all" if row.worker == "*" else (row.worker or "(unnamed)")
        if row.outlier:
            worker = f"[bold red]{worker} (stands out)[/bold red]"
        table.add_row(str(row.version), worker, str(row.tokens), f"{row.mean_abs:.3g}", f"{row.kl:.3g}",
                      f"{row.over_1:.2%}", f"{row.ratio_mean:.4f} ± {row.ratio_std:.3g}")
    console.print(table)


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
