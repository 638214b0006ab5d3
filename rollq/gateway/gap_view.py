"""The training-inference gap as the gateway takes it (an HTTP trainer's report: `GapReport`,
handled in `api.py`) and shows it (`queue/gap.py`), with the workers' version canary checks
(`WorkerState.canaries`): Prometheus families and the dashboard's parts. The sampler
(`pool_view.py`) reads the gap every GAP_EVERY_S; the canaries come with the heartbeats it reads
each second, so a refusal shows within one heartbeat."""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta
from prometheus_client.core import GaugeMetricFamily

from rollq.queue import gap
from rollq.queue.gap import MAX_REPORT_SAMPLES, GapView, Tally
from rollq.queue.workers import WorkerState

GAP_EVERY_S = 5.0
"""How often the sampler reads the reported gap (one HGETALL per reporting trainer)."""
GAP_METRIC_VERSIONS = 8
"""Versions of the gap `/metrics` exports (the newest): a gauge per version and worker."""
GAP_DASHBOARD_VERSIONS = 12


class GapSample(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One sample the trainer trained on, as its result gave it, with the trainer's logprobs."""

    worker_id: str = ""
    """The result's `worker_id`."""
    policy_versions: list[tuple[int, int]]
    """The sample's version segments `[[version, first token], ...]`, as results and completion
    choices give them."""
    rollout_logprobs: list[float]
    """The behaviour logprob of each sampled token, as the result gave it."""
    trainer_logprobs: list[float]
    """The trainer's logprob of each sampled token (TRL's `old_per_token_logps`)."""


class GapReport(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    samples: Annotated[list[GapSample], Meta(max_length=MAX_REPORT_SAMPLES)]


def tally_report(body: GapReport) -> tuple[Tally, int]:
    tally: Tally = {}
    tokens = 0
    for i, s in enumerate(body.samples):
        at = f"samples[{i}]"
        worker = gap.check_worker(s.worker_id, f"{at}.worker_id")
        gap.check_logprobs(s.rollout_logprobs, f"{at}.rollout_logprobs")
        spans = gap.check_spans(s.policy_versions, len(s.rollout_logprobs), f"{at}.policy_versions")
        tokens += gap.tally_sample(tally, worker, spans, s.rollout_logprobs, s.trainer_logprobs,
                                   f"{at}.trainer_logprobs")
    return tally, tokens


# --- what the gateway shows --------------------------------------------------------------------

def metric_families() -> dict[str, GaugeMetricFamily]:
    labels = ["policy", "version", "worker"]
    return {name: GaugeMetricFamily(f"rollq_{name}", doc, labels=labels) for name, doc in (
        ("gap_tokens", "Tokens trainers reported their own logprobs of (queue/gap.py), by the version "
                       "that sampled them and the worker."),
        ("gap_mean_abs_logprob", "Mean |trainer logprob - behaviour logprob| of those tokens."),
        ("gap_kl_k3", "Schulman's k3 estimate of KL(behaviour || trainer) per token."),
        ("gap_share_over_1", "Share of those tokens with |Δ logprob| > 1."),
        ("gap_ratio_mean", "Mean importance ratio exp(trainer - behaviour)."),
        ("gap_ratio_std", "Standard deviation of the importance ratio."),
        ("gap_outlier", "1 when the worker's mean |Δ| is > 3x the median of the version's other workers."),
    )} | {name: GaugeMetricFamily(f"rollq_{name}", doc, labels=labels) for name, doc in (
        ("worker_canary_max_abs", "The worker's latest canary check: max |Δ logprob| against the trainer's."),
        ("worker_canary_mean_abs", "...its mean |Δ logprob|."),
        ("worker_canary_kl_k3", "...its k3 estimate of KL(trainer || engine)."),
        ("worker_canary_refused", "...1 when the check refused the version, else 0."),
    )}


def add_metrics(families: dict[str, GaugeMetricFamily], policy: str, view: GapView,
                workers: list[WorkerState]) -> None:
    shown = {v.version for v in view.versions[-GAP_METRIC_VERSIONS:]}
    for row in view.workers:
        if row.version not in shown:
            continue
        labels = [policy, str(row.version), row.worker]
        for name, value in (("gap_tokens", row.tokens), ("gap_mean_abs_logprob", row.mean_abs),
                            ("gap_kl_k3", row.kl), ("gap_share_over_1", row.over_1),
                            ("gap_ratio_mean", row.ratio_mean), ("gap_ratio_std", row.ratio_std),
                            ("gap_outlier", int(row.outlier))):
            families[name].add_metric(labels, value)
    for w in workers:
        if not w.canaries:
            continue
        c = w.canaries[-1]
        labels = [policy, str(c.version), w.worker_id]
        for name, value in (("worker_canary_max_abs", c.verdict.max_abs),
                            ("worker_canary_mean_abs", c.verdict.mean_abs),
                            ("worker_canary_kl_k3", c.verdict.kl),
                            ("worker_canary_refused", int(not c.verdict.accepted))):
            families[name].add_metric(labels, value)


def canary_of(w: WorkerState) -> dict | None:
    """The dashboard's view of a worker's latest check."""
    if not w.canaries:
        return None
    c = w.canaries[-1]
    v, t = c.verdict, c.verdict.tolerance
    return dict(version=c.version, adapter=c.adapter, accepted=v.accepted, max_abs=v.max_abs,
                mean_abs=v.mean_abs, kl=v.kl, tokens=v.tokens, dtype=v.dtype, at=c.at,
                tolerance=dict(max_abs=t.max_abs, mean_abs=t.mean_abs, kl=t.kl))


def dashboard(view: GapView) -> dict:
    shown = {v.version for v in view.versions[-GAP_DASHBOARD_VERSIONS:]}
    return dict(versions=[msgspec.structs.asdict(v) for v in view.versions if v.version in shown],
                workers=[msgspec.structs.asdict(w) for w in view.workers if w.version in shown])
