"""A worker's knobs, once: how many groups it holds, how long their leases last, how often a
group may be delivered, how long it waits. Validated as `WorkerSettings` at the edge
(`rollq/config.py`); read by the loop that claims and holds groups and by the server that
serves them, from this one object."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_inflight: int
    """Groups held at once (claimed, not finished)."""
    lease_s: float
    max_deliveries: int
    """A group delivered more often than this fails (`dead`): it killed or stalled its workers."""
    grace_s: float
    """How long a stopping worker lets its running groups finish."""
    poll_s: float
    max_inflight_seqs: int | None = None
    """The engine's sequence budget (vLLM's max_num_seqs): samples held at once, if bounded."""
    pinned: bool = False
    """Serves its one version for ever (`--pin-version`): never follows the registry."""
