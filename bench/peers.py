"""No-op jobs for the Python job queues rollq's dispatch is compared with (bench/dispatch.py).

saq:  `saq peers.settings` with ROLLQ_BENCH_REDIS_URL set.
arq:  `arq peers.ArqSettings`; each job also INCRs a counter so the benchmark knows when all
      are done (one extra Redis command per arq job, noted in the table).
"""

from __future__ import annotations

import os
from urllib.parse import urlparse

URL = os.environ.get("ROLLQ_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
CONCURRENCY = 256
DONE_KEY = "bench:arq:done"


async def noop(ctx, **kwargs):
    return None


async def noop_counted(ctx):
    await ctx["redis"].incr(DONE_KEY)


def _saq_settings():
    from saq import Queue

    return {"queue": Queue.from_url(URL), "functions": [noop], "concurrency": CONCURRENCY}


def _arq_settings():
    from arq.connections import RedisSettings

    parsed = urlparse(URL)

    class ArqSettings:
        functions = [noop_counted]
        redis_settings = RedisSettings(host=parsed.hostname, port=parsed.port)
        max_jobs = CONCURRENCY
        keep_result = 0
        poll_delay = 0.01

    return ArqSettings


settings = _saq_settings() if os.environ.get("ROLLQ_BENCH_PEER") == "saq" else None
ArqSettings = _arq_settings() if os.environ.get("ROLLQ_BENCH_PEER") == "arq" else None
