"""The pool's record of its workers in Redis: one short-lived heartbeat key per worker, listed
in a sorted set by last beat, and the marks of versions pinned workers serve. The record's types
and its readers live here, beside the other keys' owners, so that the registry, the gateway and
`rollq status` read it without importing the worker; `worker/heartbeat.py` writes it."""

from __future__ import annotations

import time

import msgspec
from redis.asyncio import Redis

from rollq.canary import CanaryCheck
from rollq.queue.keys import Keys

LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32, 64)
"""Policy-version lag buckets of the samples a worker reports (heartbeat totals and metrics)."""


class Failure(msgspec.Struct, array_like=True, frozen=True):
    at: float
    job_id: str
    group_index: int
    status: str
    reason: str


class Totals(msgspec.Struct):
    """Running totals since the worker started (they reset when it restarts)."""

    groups: dict[str, int] = {}
    """Terminal results written, by status."""
    samples: int = 0
    tokens: int = 0
    """Completion tokens of `ok` results."""
    lag: dict[int, int] = {}
    """Samples by policy-version lag: newest version when finished - oldest version of the sample."""
    swaps: int = 0
    swap_failures: int = 0
    swap_s: float = 0.0
    last_swap: dict[str, float] = {}
    """Seconds per phase of the latest swap: verify, drain, pause, load, resume."""
    last_adapter: dict[str, float] = {}
    """The latest adapter version loaded: `version`, `servable_at` (the worker's wall clock when
    groups could run on it) and `load_s` (from its pin: copy, checks, the engine's load)."""
    reclaims: int = 0
    dead_letters: int = 0
    errors: int = 0
    """Groups handed back after an unexpected error."""
    failures: list[Failure] = []


class WorkerState(msgspec.Struct, frozen=True):
    worker_id: str
    version: int
    inflight: int
    state: str
    """`serving`, `draining` / `swapping` (a weight swap), or `stopping`."""
    at: float
    last_error: str = ""
    pinned: bool = False
    totals: Totals = msgspec.field(default_factory=Totals)
    target: int | None = None
    """The version this worker is verifying, draining toward or loading (None: no swap)."""
    adapters: list[int] = []
    """Adapter versions loaded in its engine beside `version`, served without a swap."""
    capacity: int | None = None
    """Groups it holds at most (max_inflight); None from a worker that does not say."""
    max_model_len: int | None = None
    """Its engine's context length (vLLM's `max_model_len`); None from an engine without one
    (the instant engine) or a worker that does not say."""
    canaries: list[CanaryCheck] = []
    """Its latest version canary checks (`rollq/canary.py`), accepted and refused, newest last."""


async def live_workers(redis: Redis, keys: Keys) -> list[WorkerState]:
    ids = await redis.zrange(keys.workers, 0, -1)
    if not ids:
        return []
    beats = await redis.mget([keys.worker(i.decode()) for i in ids])
    return [msgspec.json.decode(b, type=WorkerState) for b in beats if b]


def max_model_len(workers: list[WorkerState]) -> int | None:
    """The context length every one of `workers` serves (the least they report; vLLM's
    `/v1/models` and `/tokenize` report their one engine's); None when none reports one."""
    lengths = [w.max_model_len for w in workers if w.max_model_len is not None]
    return min(lengths) if lengths else None


PINNED_GRACE_S = 300.0
"""How long a version stays servable after its last pinned worker's last beat: long enough for a
pinned vLLM worker to restart and load its version on a CPU (minutes), short enough that groups
for a version nobody will serve again fail within a few minutes."""


async def recently_pinned(redis: Redis, keys: Keys, within_s: float = PINNED_GRACE_S) -> set[int]:
    """Versions a pinned worker served within `within_s` (it may be restarting)."""
    since = time.time() - within_s
    await redis.zremrangebyscore(keys.pinned_versions, "-inf", f"({since}")
    return {int(v) for v in await redis.zrangebyscore(keys.pinned_versions, since, "+inf")}
