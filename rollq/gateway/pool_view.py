"""The whole pool as the gateway sees it, sampled every second from Redis.

Rates come from counters Redis keeps as results are written (`results-written`: entries written
per result and scoring stream, counted by `finish.lua`), read at each sample: a run at 56
groups/s draws at 56 groups/s every second. (They came from the workers' heartbeat totals,
which move every lease/3, 10 s by default: the same run drew as spikes of 300 and 600.)
Workers also put running totals into their heartbeats (`rollq.worker.stats.Totals`); the sampler
adds up what each live worker did since the last look, for the `/metrics` counters (tokens,
swaps, staleness...), whose rates a scraper takes over minutes. Workers beat at once when their
version or state changes (`Heartbeat.soon`), so the worker table shows a swap as it happens.
Scoring: `gateway/scoring_view.py`. Nothing here scrapes a worker or scans a result stream.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from redis.asyncio import Redis
from redis.exceptions import RedisError

from rollq.protocol import DERIVED_SEPARATOR
from rollq.queue.keys import Keys
from rollq.queue.names import DeadField
from rollq.gateway import gap_view
from rollq.gateway.gap_view import GAP_EVERY_S
from rollq.gateway.scoring_view import ScoringView, metric_families
from rollq.queue import gap
from rollq.queue.gap import GapView
from rollq.status import PolicyStatus, policies, policy_status
from rollq.queue.workers import LAG_BUCKETS, Totals, WorkerState

SERIES_POINTS = 900
"""Dashboard history: 15 minutes at one point per second."""
log = logging.getLogger("rollq.gateway")

_COUNTERS = ("tokens", "samples", "swaps", "swap_failures", "reclaims", "dead_letters", "errors")


class Point(msgspec.Struct, array_like=True):
    t: float
    waiting: int
    running: int
    groups_per_s: float
    """Results written to trainers' result streams per second (every status)."""
    tokens_per_s: float
    """groups_per_s x the workers' completion tokens per ok group (their totals): an estimate,
    no counter of tokens is kept in Redis."""
    scoring_waiting: int = 0
    scoring_running: int = 0


@dataclass
class PolicyView:
    status: PolicyStatus | None = None
    series: collections.deque = field(default_factory=lambda: collections.deque(maxlen=SERIES_POINTS))
    groups: collections.Counter = field(default_factory=collections.Counter)
    counters: collections.Counter = field(default_factory=collections.Counter)
    lag: collections.Counter = field(default_factory=collections.Counter)
    swap_s: float = 0.0
    seen: dict[str, Totals] = field(default_factory=dict)
    dead: list[dict] = field(default_factory=list)
    at: float = 0.0
    written: dict[str, int] = field(default_factory=dict)
    """Stream -> entries written to it, as last read (`Keys.results_written`)."""
    results: dict[str, int] = field(default_factory=dict)
    """Trainer -> results written to its result stream (as kept: a stream dropped unread goes)."""
    scoring: ScoringView = field(default_factory=ScoringView)
    gap: GapView = field(default_factory=GapView)
    """The trainers' reported gap, as last read (every GAP_EVERY_S)."""
    gap_at: float = 0.0

    def update(self, status: PolicyStatus, dead: list[dict], written: dict[str, int], now: float,
               keys: Keys) -> None:
        """Add what each live worker did since the last sample (a worker seen for the first time
        adds its totals to the counters: it did that work before); the rates are the results
        written since the last sample."""
        groups_delta = self._written(written, keys)
        groups_delta = groups_delta if self.at else 0  # the first sample only sets where to count from
        for w in status.workers:
            cur, prev = w.totals, self.seen.get(w.worker_id)
            base = prev or Totals()
            for name, count in cur.groups.items():
                self.groups[name] += max(0, count - base.groups.get(name, 0))
            for name in _COUNTERS:
                self.counters[name] += max(0, getattr(cur, name) - getattr(base, name))
            for lag, count in cur.lag.items():
                self.lag[lag] += max(0, count - base.lag.get(lag, 0))
            self.swap_s += max(0.0, cur.swap_s - base.swap_s)
            self.seen[w.worker_id] = cur
        live = {w.worker_id for w in status.workers}
        self.seen = {k: v for k, v in self.seen.items() if k in live}
        dt = now - self.at if self.at else 0.0
        groups_per_s = groups_delta / dt if dt else 0.0
        per_group = self.counters["tokens"] / self.groups["ok"] if self.groups["ok"] else 0.0
        self.series.append(Point(now, sum(q.waiting for q in status.queues),
                                 sum(q.running for q in status.queues), groups_per_s,
                                 groups_per_s * per_group, sum(q.waiting for q in status.scoring),
                                 sum(q.running for q in status.scoring)))
        self.status, self.dead, self.at = status, dead, now

    def _written(self, written: dict[str, int], keys: Keys) -> int:
        """Results written to result streams since the last sample. A stream not seen before
        was written since (its count is new); one whose count went down was deleted and written
        again."""
        delta, results = 0, {}
        prefix = keys.results("")
        for stream, count in written.items():
            if stream.startswith(prefix):
                prev = self.written.get(stream, 0)
                delta += count - prev if count >= prev else count
                results[keys.trainer_of_results(stream)] = count
        self.written, self.results = written, results
        return delta

    def failures(self) -> list[dict]:
        """Newest first: dead letters and failed/expired groups reported by live workers."""
        out = list(self.dead)
        for w in self.status.workers if self.status else []:
            out += [dict(at=f.at, job_id=f.job_id, group_index=f.group_index, status=f.status,
                         reason=f.reason, worker=w.worker_id) for f in w.totals.failures]
        return sorted(out, key=lambda f: -f["at"])[:20]


class PoolSampler:
    def __init__(self, redis: Redis, only: list[str] | None, interval_s: float = 1.0):
        self.redis, self.only, self.interval_s = redis, only, interval_s
        self.views: dict[str, PolicyView] = {}
        self.healthy = False
        self.stopped = asyncio.Event()
        """Set to end `run` at its next turn: a cancellation alone can be lost inside redis-py
        on Python 3.11 (seen here: a gateway's shutdown hung on it)."""

    async def run(self) -> None:
        while not self.stopped.is_set():
            try:
                await self.sample()
                self.healthy = True
            except RedisError as e:
                self.healthy = False
                log.warning("pool sampler: %s", e)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopped.wait(), self.interval_s)

    async def sample(self) -> None:
        names = self.only or await policies(self.redis)
        now = time.time()
        for name in names:
            status = await policy_status(self.redis, name, gap_of=None)
            keys = Keys(name)
            view = self.views.setdefault(name, PolicyView())
            if now - view.gap_at >= GAP_EVERY_S:
                view.gap, view.gap_at = await gap.read(self.redis, keys), now
            counts = await self.redis.hgetall(keys.results_written)
            written = {k.decode(): int(v) for k, v in counts.items()}
            view.update(status, await self._dead_letters(name), written, now, keys)
            await view.scoring.sample(self.redis, keys, now)

    async def _dead_letters(self, policy: str) -> list[dict]:
        out = []
        for entry_id, fields in await self.redis.xrevrange(Keys(policy).dead, count=10):
            at = int(entry_id.decode().split("-")[0]) / 1000
            out.append(dict(at=at, job_id="", group_index=-1, status="dead-lettered",
                            reason=fields.get(DeadField.REASON.encode(), b"").decode(errors="replace")[:300],
                            worker=""))
        return out

    # --- Prometheus (a custom collector: collect() reads the last sample, never Redis) --------

    def describe(self):
        return []

    def collect(self):
        g = {name: GaugeMetricFamily(f"rollq_{name}", doc, labels=labels) for name, doc, labels in (
            ("queue_waiting", "Groups no worker has read yet.", ["policy", "trainer"]),
            ("queue_running", "Groups a worker holds.", ["policy", "trainer"]),
            ("results_unacked", "Results the trainer has not acknowledged.", ["policy", "trainer"]),
            ("workers", "Live workers by state.", ["policy", "state"]),
            ("worker_version", "Policy version each live worker serves.", ["policy", "worker"]),
            ("latest_version", "Newest registered policy version.", ["policy"]),
            ("scoring_waiting", "Generated groups of scored jobs no scorer has read yet.",
             ["policy", "trainer"]),
            ("scoring_running", "Groups a scorer holds.", ["policy", "trainer"]),
            ("scorers", "Live scorers.", ["policy"]),
            ("results_written", "Results written to the trainer's result stream (as long as it is kept).",
             ["policy", "trainer"]),
        )}
        scoring = metric_families()
        gaps = gap_view.metric_families()
        groups = CounterMetricFamily("rollq_groups", "Terminal group results, by status.",
                                     labels=["policy", "status"])
        counters = {name: CounterMetricFamily(f"rollq_{name}", f"Pool total of {name.replace('_', ' ')}.",
                                              labels=["policy"]) for name in _COUNTERS}
        swap_s = CounterMetricFamily("rollq_swap_seconds", "Time spent swapping weights.", labels=["policy"])
        lag = HistogramMetricFamily("rollq_version_lag", "Policy-version lag of delivered samples.",
                                    labels=["policy"])
        for policy, view in self.views.items():
            s = view.status
            if s is None:
                continue
            for q in s.queues:
                g["queue_waiting"].add_metric([policy, q.trainer], q.waiting)
                g["queue_running"].add_metric([policy, q.trainer], q.running)
                g["results_unacked"].add_metric([policy, q.trainer], q.results)
            for state, count in collections.Counter(w.state for w in s.workers).items():
                g["workers"].add_metric([policy, state], count)
            for w in s.workers:
                g["worker_version"].add_metric([policy, w.worker_id], w.version)
            if s.latest is not None:
                g["latest_version"].add_metric([policy], s.latest)
            for q in s.scoring:
                g["scoring_waiting"].add_metric([policy, q.trainer], q.waiting)
                g["scoring_running"].add_metric([policy, q.trainer], q.running)
            g["scorers"].add_metric([policy], len(s.scorers))
            for trainer, count in view.results.items():
                g["results_written"].add_metric([policy, trainer], count)
            view.scoring.families(policy, scoring)
            gap_view.add_metrics(gaps, policy, view.gap, s.workers)
            for status, count in view.groups.items():
                groups.add_metric([policy, status], count)
            for name in _COUNTERS:
                counters[name].add_metric([policy], view.counters[name])
            swap_s.add_metric([policy], view.swap_s)
            lag.add_metric([policy], _buckets(view.lag), sum(k * c for k, c in view.lag.items()))
        yield from g.values()
        yield groups
        yield from counters.values()
        yield swap_s
        yield lag
        yield from scoring.values()
        yield from gaps.values()

    # --- Dashboard -----------------------------------------------------------------------------

    def dashboard(self) -> dict:
        out = {}
        for policy, view in sorted(self.views.items()):
            s = view.status
            if s is None:
                continue
            points = list(view.series)
            out[policy] = dict(
                latest=s.latest, versions=s.versions[-20:],
                series=dict(t=[p.t for p in points], waiting=[p.waiting for p in points],
                            running=[p.running for p in points],
                            groups_per_s=[round(p.groups_per_s, 3) for p in points],
                            tokens_per_s=[round(p.tokens_per_s, 1) for p in points],
                            scoring_waiting=[p.scoring_waiting for p in points],
                            scoring_running=[p.scoring_running for p in points]),
                workers=[dict(id=w.worker_id, version=w.version, state=w.state, inflight=w.inflight,
                              pinned=w.pinned, last_error=w.last_error, age_s=round(time.time() - w.at, 1),
                              canary=gap_view.canary_of(w))
                         for w in s.workers],
                gap=gap_view.dashboard(view.gap),
                queues=[msgspec.structs.asdict(q) for q in s.queues],
                groups=dict(view.groups), tokens=view.counters["tokens"], results=view.results,
                scorers=[dict(id=c.scorer_id, rewards=c.rewards, inflight=c.inflight, scored=c.scored,
                              reward_errors=c.reward_errors, restarts=c.restarts,
                              age_s=round(time.time() - c.at, 1)) for c in s.scorers],
                scoring=view.scoring.dashboard(),
                lag={str(k): v for k, v in sorted(view.lag.items())},
                failures=view.failures())
        return out


def _buckets(lag: collections.Counter) -> list[tuple[str, int]]:
    out = []
    for bound in LAG_BUCKETS:
        running = sum(c for k, c in lag.items() if k <= bound)
        out.append((str(float(bound)), running))
    out.append(("+Inf", sum(lag.values())))
    return out


def unobserved(status: PolicyStatus, trainer: str) -> PolicyStatus:
    """`status` as a token without the `observe` scope sees it: versions, the workers' versions,
    states and canary checks, and only its own trainer's queues (its derived ids' too: its
    episodes and completions); no other trainer's name or counts, no worker's last error or
    totals (their failures name other trainers' jobs and reasons). Its `gap` as read: the caller
    reads the token's own trainer's (`policy_status(gap_of=trainer)`)."""
    mine = [q for q in status.queues
            if q.trainer == trainer or q.trainer.startswith(trainer + DERIVED_SEPARATOR)]
    return PolicyStatus(status.policy, status.latest, status.versions,
                        [unobserved_worker(w) for w in status.workers], mine, status.scorers,
                        [q for q in status.scoring
                         if q.trainer == trainer or q.trainer.startswith(trainer + DERIVED_SEPARATOR)],
                        status.gap)


def unobserved_worker(w: WorkerState) -> WorkerState:
    return msgspec.structs.replace(w, last_error="", totals=Totals())
