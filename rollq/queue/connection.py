"""Redis connections: binary-safe, retried with jittered backoff on connection errors only."""

from __future__ import annotations

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError, ResponseError, TimeoutError

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


async def durability_problems(redis: Redis) -> list[str]:
    """Why this Redis could lose acknowledged work: no AOF, or an eviction policy that may drop
    keys. Empty when it looks durable. Read from INFO (CONFIG is often not permitted)."""
    try:
        persistence = await redis.info("persistence")
        memory = await redis.info("memory")
    except ResponseError as e:
        return [f"could not check durability ({e}); grant INFO or check AOF and eviction by hand"]
    problems = []
    if not int(persistence.get("aof_enabled", 0)):
        problems.append("AOF is off (appendonly no): a Redis crash or restart loses queued groups "
                        "and results; run it with --appendonly yes")
    policy = memory.get("maxmemory_policy", "noeviction")
    policy = policy.decode() if isinstance(policy, bytes) else policy
    if policy != "noeviction":
        problems.append(f"maxmemory-policy is {policy}: under memory pressure Redis may evict "
                        "queued work; set maxmemory-policy noeviction")
    return problems


async def check_durability(redis: Redis, *, require: bool, log) -> None:
    """Warn about a Redis that may lose work; with `require`, refuse it (RuntimeError)."""
    problems = await durability_problems(redis)
    for problem in problems:
        log.warning("redis: %s", problem)
    if problems and require:
        raise RuntimeError("--require-durable: " + "; ".join(problems))
