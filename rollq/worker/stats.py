"""What a worker has done, counted twice over: Prometheus metrics for its own `/metrics`, and
running totals in its heartbeat so the gateway can show the whole pool without scraping anyone.
"""

from __future__ import annotations

import collections
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rollq.protocol import GroupResult
from rollq.queue.workers import LAG_BUCKETS, Failure, Totals

RECENT_FAILURES = 10
"""Failed or expired groups a heartbeat carries (newest last) for the dashboard."""
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)


class WorkerStats:
    def __init__(self, policy: str):
        self.totals = Totals()
        self._failures: collections.deque[Failure] = collections.deque(maxlen=RECENT_FAILURES)
        self.registry = CollectorRegistry()
        labels = dict(labelnames=["policy"], registry=self.registry)
        self._groups = Counter("rollq_worker_groups", "Terminal group results written.",
                               labelnames=["policy", "status"], registry=self.registry)
        self._tokens = Counter("rollq_worker_tokens", "Completion tokens generated (ok groups).", **labels)
        self._queued = Histogram("rollq_worker_queue_seconds", "Submit to generation start.",
                                 buckets=SECONDS_BUCKETS, **labels)
        self._generation = Histogram("rollq_worker_generation_seconds", "Generation time of a group.",
                                     buckets=SECONDS_BUCKETS, **labels)
        self._lag = Histogram("rollq_worker_version_lag", "Policy-version lag of delivered samples.",
                              buckets=LAG_BUCKETS, **labels)
        self._swaps = Counter("rollq_worker_swaps", "Weight swaps, by result.",
                              labelnames=["policy", "result"], registry=self.registry)
        self._swap_s = Histogram("rollq_worker_swap_seconds", "Duration of a weight swap (drain included).",
                                 buckets=SECONDS_BUCKETS, **labels)
        self._swap_phase_s = Histogram(
            "rollq_worker_swap_phase_seconds", "Seconds in each phase of a weight swap: verify, drain, "
            "pause, load, resume.", labelnames=["policy", "phase"], buckets=SECONDS_BUCKETS,
            registry=self.registry)
        self._reclaims = Counter("rollq_worker_reclaims", "Groups taken over after a lapsed lease.", **labels)
        self._dead = Counter("rollq_worker_dead_letters", "Groups dead-lettered.", **labels)
        self._errors = Counter("rollq_worker_errors", "Groups handed back after an unexpected error.",
                               **labels)
        self.inflight = Gauge("rollq_worker_inflight_groups", "Groups held.", **labels).labels(policy)
        self.version = Gauge("rollq_worker_version", "Policy version loaded.", **labels).labels(policy)
        self.policy = policy
        # The labelled children, looked up once: `labels()` per observation cost 12 % of a
        # worker's CPU time moving no-op groups (docs/benchmarks.md).
        self._groups_by_status: dict[str, Counter] = {}
        self._tokens_c, self._queued_h, self._generation_h, self._lag_h, self._dead_c = (
            m.labels(policy) for m in (self._tokens, self._queued, self._generation, self._lag, self._dead))

    def result(self, result: GroupResult, newest: int, dead: bool) -> None:
        t = self.totals
        t.groups[result.status] = t.groups.get(result.status, 0) + 1
        if result.status not in self._groups_by_status:
            self._groups_by_status[result.status] = self._groups.labels(self.policy, result.status)
        self._groups_by_status[result.status].inc()
        if dead:
            t.dead_letters += 1
            self._dead_c.inc()
        if result.status != "ok":
            if result.status in ("failed", "expired"):
                self._failures.append(Failure(time.time(), result.job_id, result.group_index,
                                              result.status, result.reason[:300]))
                t.failures = list(self._failures)
            return
        self._queued_h.observe(result.queued_s)
        self._generation_h.observe(result.generation_s)
        tokens = sum(len(s.tokens) // 4 for s in result.samples)
        t.tokens += tokens
        t.samples += len(result.samples)
        self._tokens_c.inc(tokens)
        for sample in result.samples:
            if sample.versions:
                lag = max(0, newest - min(v for v, _ in sample.versions))
                t.lag[lag] = t.lag.get(lag, 0) + 1
                self._lag_h.observe(lag)

    def swap(self, ok: bool, seconds: float, phases: dict[str, float] | None = None) -> None:
        if ok:
            self.totals.swaps += 1
            self.totals.swap_s += seconds
            self.totals.last_swap = dict(phases or {})
        else:
            self.totals.swap_failures += 1
        for phase, phase_s in (phases or {}).items():
            self._swap_phase_s.labels(self.policy, phase).observe(phase_s)
        self._swaps.labels(self.policy, "ok" if ok else "failed").inc()
        self._swap_s.labels(self.policy).observe(seconds)

    def reclaimed(self, count: int) -> None:
        if count:
            self.totals.reclaims += count
            self._reclaims.labels(self.policy).inc(count)

    def error(self) -> None:
        self.totals.errors += 1
        self._errors.labels(self.policy).inc()


async def serve_metrics(registry: CollectorRegistry, host: str, port: int):
    """A worker's `/metrics` (Prometheus text) on its own small HTTP server; returns the runner."""
    from aiohttp import web
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
