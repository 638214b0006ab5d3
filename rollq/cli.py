"""`rollq` command line: every flag also reads an environment variable (ROLLQ_*, REDIS_URL)."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import click
from rich.logging import RichHandler

from rollq.config import WorkerSettings, default_worker_id
from rollq.protocol import InvalidInput
from rollq.queue.connection import DEFAULT_URL


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(show_path=False, rich_tracebacks=True)])


@click.group()
@click.option("--log-level", default="info", envvar="ROLLQ_LOG_LEVEL", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def main(log_level: str) -> None:
    """rollq: rollout service for asynchronous RL of language models."""
    _setup_logging(log_level)


@main.command()
@click.option("--redis-url", envvar="REDIS_URL", default=DEFAULT_URL, show_default=True)
@click.option("--policy", envvar="ROLLQ_POLICY", default="default", show_default=True)
@click.option("--worker-id", envvar="ROLLQ_WORKER_ID", default=None,
              help="Consumer name; default host-pid-random.")
@click.option("--engine", envvar="ROLLQ_ENGINE", default="instant", show_default=True,
              type=click.Choice(["instant", "vllm"]))
@click.option("--max-inflight", envvar="ROLLQ_MAX_INFLIGHT", default=32, show_default=True)
@click.option("--lease-s", envvar="ROLLQ_LEASE_S", default=30.0, show_default=True)
@click.option("--max-deliveries", envvar="ROLLQ_MAX_DELIVERIES", default=3, show_default=True)
@click.option("--grace-s", envvar="ROLLQ_GRACE_S", default=30.0, show_default=True)
@click.option("--poll-s", envvar="ROLLQ_POLL_S", default=1.0, show_default=True)
@click.option("--job-ttl-s", envvar="ROLLQ_JOB_TTL_S", default=86_400, show_default=True)
@click.option("--instant-delay-s", envvar="ROLLQ_INSTANT_DELAY_S", default=0.0, show_default=True,
              help="Instant engine only: seconds each group takes.")
def worker(**flags) -> None:
    """Serve one policy's queue with one engine."""
    flags["worker_id"] = flags["worker_id"] or default_worker_id()
    try:
        settings = WorkerSettings(**flags).validate()
    except InvalidInput as e:
        raise click.BadParameter(str(e)) from None
    sys.exit(asyncio.run(_serve(settings)))


async def _serve(s: WorkerSettings) -> int:
    from rollq.engine.instant import InstantEngine
    from rollq.queue.connection import connect
    from rollq.queue.keys import Keys
    from rollq.queue.work import WorkQueue
    from rollq.worker.loop import Worker

    if s.engine == "vllm":
        raise click.UsageError("the vLLM engine is not built yet; use --engine instant")
    engine = InstantEngine(delay_s=s.instant_delay_s)
    redis = connect(s.redis_url)
    queue = WorkQueue(redis, Keys(s.policy), s.worker_id, job_ttl_s=s.job_ttl_s)
    w = Worker(queue, engine, max_inflight=s.max_inflight, lease_s=s.lease_s,
               max_deliveries=s.max_deliveries, grace_s=s.grace_s, poll_s=s.poll_s)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, w.stop)
    try:
        return await w.run()
    finally:
        await engine.close()
        await redis.aclose()


if __name__ == "__main__":
    main()
