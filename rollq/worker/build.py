"""One worker from its settings: the same assembly for `rollq worker` and for the tests."""

from __future__ import annotations

from redis.asyncio import Redis

from rollq.config import WorkerSettings
from rollq.engine.base import Engine
from rollq.queue.keys import Keys
from rollq.queue.work import WorkQueue
from rollq.registry.safetensors_check import Schema
from rollq.worker.limits import Limits
from rollq.worker.loop import Worker
from rollq.worker.stats import WorkerStats
from rollq.worker.swap import VersionFollower

DEFAULT_MAX_INFLIGHT = 32
"""Groups in flight without `max_inflight` and without an engine's sequence budget."""


def build_worker(s: WorkerSettings, redis: Redis, engine: Engine, *, max_inflight_seqs: int | None = None,
                 base_schema: Schema | None = None, stats: WorkerStats | None = None,
                 follow: bool = True) -> tuple[Worker, VersionFollower | None]:
    """The worker, and the follower that swaps its engine to new versions (None when pinned,
    or `follow=False`). `max_inflight_seqs`: the engine's sequence budget (vLLM's max_num_seqs);
    `base_schema`: the tensors of the served model, which every new version must match."""
    queue = WorkQueue(redis, Keys(s.policy), s.worker_id, job_ttl_s=s.job_ttl_s)
    limits = Limits(max_inflight=s.max_inflight or max_inflight_seqs or DEFAULT_MAX_INFLIGHT,
                    lease_s=s.lease_s, max_deliveries=s.max_deliveries, grace_s=s.grace_s,
                    poll_s=s.poll_s, max_inflight_seqs=max_inflight_seqs, pinned=s.pin_version is not None)
    worker = Worker(queue, engine, limits, stats=stats)
    follower = None
    if follow and not limits.pinned:
        follower = VersionFollower(worker.engine, worker.registry, worker.versions,
                                   admission=worker.admission, heartbeat=worker.heartbeat,
                                   stats=worker.stats, worker_id=worker.worker_id,
                                   stopping=lambda: worker.stopping, mode=s.swap_mode,
                                   base_schema=base_schema, poll_s=s.poll_s, tolerance=s.tolerance(),
                                   push_timeout_s=s.push_timeout_s, refusal=s.canary_refusal)
    return worker, follower
