"""What a worker has done: running totals, put into its heartbeat so the gateway can show the
whole pool without scraping anyone, and read as Prometheus metrics by its own `/metrics`.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from rollq.protocol import GroupResult
from rollq.queue.workers import LAG_BUCKETS, Failure, Totals

RECENT_FAILURES = 10
"""Failed or expired groups a heartbeat carries (newest last) for the dashboard."""
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)


class _Histogram:
    """Bucket counts kept by the hot path (a bisect and two additions per observation); exposed
    as a Prometheus histogram only when scraped."""

    def __init__(self, buckets: tuple[float, ...]):
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, name: str, documentation: str, policy: str) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, documentation, labels=["policy"])
        cumulative = list(itertools.accumulate(self.counts))
        les = [*(str(float(b)) for b in self.bounds), "+Inf"]
        family.add_metric([policy], list(zip(les, cumulative)), self.sum)
        return family


class WorkerStats:
    """Results are counted in plain Python numbers (`totals`, bucket counts) as they are written:
    the per-group path pays no Prometheus locks or label lookups, which cost a sixth of a
    worker's CPU time moving no-op groups (docs/benchmarks.md). `/metrics` reads them when
    scraped (`_ResultMetrics`)."""

    def __init__(self, policy: str):
        self.totals = Totals()
        self._failures: collections.deque[Failure] = collections.deque(maxlen=RECENT_FAILURES)
        self.registry = CollectorRegistry()
        self.policy = policy
        self.queued = _Histogram(SECONDS_BUCKETS)
        self.generation = _Histogram(SECONDS_BUCKETS)
        self.registry.register(_ResultMetrics(self))
        labels = dict(labelnames=["policy"], registry=self.registry)
        self._swaps = Counter("rollq_worker_swaps", "Weight swaps, by result.",
                              labelnames=["policy", "result"], registry=self.registry)
        self._swap_s = Histogram("rollq_worker_swap_seconds", "Duration of a weight swap (drain included).",
                                 buckets=SECONDS_BUCKETS, **labels)
        self._swap_phase_s = Histogram(
            "rollq_worker_swap_phase_seconds", "Seconds in each phase of a weight swap: verify, drain, "
            "pause, load, resume.", labelnames=["policy", "phase"], buckets=SECONDS_BUCKETS,
            registry=self.registry)
        self._adapter_s = Histogram(
            "rollq_worker_adapter_load_seconds", "Loading an adapter version, from its pin to "
            "servable: copy, checks, the engine's load.", buckets=SECONDS_BUCKETS, **labels)
        self.inflight = Gauge("rollq_worker_inflight_groups", "Groups held.", **labels).labels(policy)
        self.version = Gauge("rollq_worker_version", "Policy version loaded.", **labels).labels(policy)

    def result(self, result: GroupResult, newest: int, dead: bool) -> None:
        t = self.totals
        t.groups[result.status] = t.groups.get(result.status, 0) + 1
        if dead:
            t.dead_letters += 1
        if result.status != "ok":
            if result.status in ("failed", "expired"):
                self._failures.append(Failure(time.time(), result.job_id, result.group_index,
                                              result.status, result.reason[:300]))
                t.failures = list(self._failures)
            return
        self.queued.observe(result.queued_s)
        self.generation.observe(result.generation_s)
        samples, lags, size = result.samples, t.lag, 0
        for sample in samples:
            size += len(sample.tokens)
            if sample.versions:
                # (the oldest version: tuples order by their first item)
                lag = max(0, newest - min(sample.versions)[0])
                lags[lag] = lags.get(lag, 0) + 1
        t.tokens += size // 4
        t.samples += len(samples)

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

    def adapter_loaded(self, version: int, seconds: float) -> None:
        """Groups can run on adapter `version` from now, `seconds` after its load began."""
        self.totals.last_adapter = {"version": version, "servable_at": time.time(), "load_s": seconds}
        self._adapter_s.labels(self.policy).observe(seconds)

    def reclaimed(self, count: int) -> None:
        self.totals.reclaims += count

    def error(self) -> None:
        self.totals.errors += 1


class _ResultMetrics:
    """The per-result metrics, made from a WorkerStats' counts when `/metrics` is scraped."""

    def __init__(self, stats: WorkerStats):
        self.stats = stats

    def collect(self):
        s, t, policy = self.stats, self.stats.totals, self.stats.policy
        groups = CounterMetricFamily("rollq_worker_groups", "Terminal group results written.",
                                     labels=["policy", "status"])
        for status, count in sorted(t.groups.items()):
            groups.add_metric([policy, status], count)
        yield groups
        for name, documentation, value in (
                ("rollq_worker_tokens", "Completion tokens generated (ok groups).", t.tokens),
                ("rollq_worker_reclaims", "Groups taken over after a lapsed lease.", t.reclaims),
                ("rollq_worker_dead_letters", "Groups dead-lettered.", t.dead_letters),
                ("rollq_worker_errors", "Groups handed back after an unexpected error.", t.errors)):
            family = CounterMetricFamily(name, documentation, labels=["policy"])
            family.add_metric([policy], value)
            yield family
        yield s.queued.family("rollq_worker_queue_seconds", "Submit to generation start.", policy)
        yield s.generation.family("rollq_worker_generation_seconds", "Generation time of a group.", policy)
        lag = _Histogram(LAG_BUCKETS)
        for value, count in t.lag.items():
            lag.counts[bisect.bisect_left(lag.bounds, value)] += count
            lag.sum += value * count
        yield lag.family("rollq_worker_version_lag", "Policy-version lag of delivered samples.", policy)


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
