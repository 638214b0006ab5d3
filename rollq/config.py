"""Settings, validated once at the edge (CLI flags, environment); narrow values go downward."""

from __future__ import annotations

import os
import socket
import uuid
from typing import Literal

import msgspec

from rollq.protocol import InvalidInput, check_id
from rollq.queue.connection import DEFAULT_URL


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class WorkerSettings(msgspec.Struct, kw_only=True):
    redis_url: str = DEFAULT_URL
    """Redis to serve from (`redis://`, `rediss://` for TLS, user:password@ for ACL)."""
    policy: str = "default"
    """The policy whose queue this worker serves."""
    worker_id: str = msgspec.field(default_factory=default_worker_id)
    """Consumer name in the work streams; unique per process so leases are fenced."""
    engine: Literal["instant", "vllm"] = "instant"
    """`vllm` generates; `instant` returns deterministic tokens at once (load tests only)."""
    max_inflight: int = 32
    """Groups running on the engine at once."""
    lease_s: float = 30.0
    """A held group not renewed for this long may be taken over by another worker."""
    max_deliveries: int = 3
    """Deliveries of a group before it is dead-lettered with a `failed` result."""
    grace_s: float = 30.0
    """On SIGTERM: time for in-flight groups to finish before they are handed back."""
    poll_s: float = 1.0
    """Longest a blocked read waits before looking for new trainers."""
    job_ttl_s: int = 86_400
    """How long a finished job's record stays for `status` (and idempotent submit)."""
    instant_delay_s: float = 0.0
    """InstantEngine only: seconds each group takes."""

    def validate(self) -> WorkerSettings:
        check_id("policy", self.policy)
        check_id("worker_id", self.worker_id)
        limits = {
            "max_inflight": (self.max_inflight, 1, 100_000),
            "lease_s": (self.lease_s, 0.5, 3600),
            "max_deliveries": (self.max_deliveries, 1, 1000),
            "grace_s": (self.grace_s, 0, 86_400),
            "poll_s": (self.poll_s, 0.01, 60),
            "job_ttl_s": (self.job_ttl_s, 1, 365 * 86_400),
            "instant_delay_s": (self.instant_delay_s, 0, 3600),
        }
        for name, (value, lo, hi) in limits.items():
            if not lo <= value <= hi:
                raise InvalidInput(name, f"{name}={value} is out of range [{lo}, {hi}]")
        return self
