"""Redis connections: binary-safe, retried with jittered backoff on connection errors only."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError, TimeoutError

DEFAULT_URL = "redis://127.0.0.1:6379/0"


def connect(url: str = DEFAULT_URL, *, retries: int = 8) -> Redis:
    """A client for `url` (`redis://`, `rediss://` for TLS, `unix://`; user:password for ACL)."""
    return Redis.from_url(
        url,
        decode_responses=False,
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), retries),
        retry_on_error=[ConnectionError, TimeoutError],
        health_check_interval=30,
    )
