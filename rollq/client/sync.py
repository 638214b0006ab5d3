"""The synchronous trainer SDK: `RolloutClient`'s calls for code without an event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from rollq.client.rollouts import AckMode, RolloutClient, check_ack
from rollq.conversations import Trajectory
from rollq.protocol import GroupResult
from rollq.queue.connection import DEFAULT_URL
from rollq.queue.jobs import JobStatus


async def _result_of(task: asyncio.Task):
    return await task


async def _now(func, *args):
    """Run a plain function on the client's event loop (the sync wrapper's thread)."""
    return func(*args)


class SyncRolloutClient:
    """RolloutClient for synchronous code: the same calls, run on a private event loop thread."""

    def __init__(self, redis_url: str = DEFAULT_URL, **kwargs: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollq-client",
                                        daemon=True)
        self._thread.start()
        self._client = self._call(self._make(redis_url, kwargs))

    @staticmethod
    async def _make(redis_url: str, kwargs: dict[str, Any]) -> RolloutClient:
        return RolloutClient(redis_url, **kwargs)

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def submit(self, prompts, n: int = 1, sampling=None, **kwargs: Any) -> str:
        return self._call(self._client.submit(prompts, n, sampling, **kwargs))

    def upload_image(self, data: bytes, **kwargs: Any):
        return self._call(self._client.upload_image(data, **kwargs))

    def take(self, count: int, *, timeout_s: float = 30.0, ack: AckMode = "auto") -> list[GroupResult]:
        return self._call(self._client.take(count, timeout_s=timeout_s, ack=ack))

    def results(self, *, batch: int = 64, ack: AckMode = "auto") -> Iterator[GroupResult]:
        """Results as they arrive, forever; acknowledged as `RolloutClient.results` says."""
        check_ack(ack)
        while True:
            for entry_id, result in self._call(self._client._next_batch(batch, 1000)):
                if self._call(_now(self._client._hand, entry_id, ack)):
                    yield result

    def ack(self, results: Iterable[GroupResult | str] | None = None) -> int:
        return self._call(self._client.ack(results))

    def status(self, job_id: str) -> JobStatus:
        return self._call(self._client.status(job_id))

    def wait(self, job_id: str, *, timeout_s: float | None = None) -> JobStatus:
        return self._call(self._client.wait(job_id, timeout_s=timeout_s))

    def cancel(self, job_id: str) -> int:
        return self._call(self._client.cancel(job_id))

    def report_logprobs(self, results: Iterable[GroupResult], trainer_logprobs: Any):
        """`RolloutClient.report_logprobs`: the trainer's logprobs of the samples it trains on."""
        return self._call(self._client.report_logprobs(results, trainer_logprobs))

    def conversation(self, conversation_id: str) -> Trajectory | None:
        return self._call(self._client.conversation(conversation_id))

    def publish_weights(self, version: int, source: Any, *, wait: bool = True, **kwargs: Any):
        """`wait=False`: a `concurrent.futures.Future` of the `VersionEntry` (see the async client)."""
        published = self._call(self._client.publish_weights(version, source, wait=wait, **kwargs))
        return published if wait else asyncio.run_coroutine_threadsafe(_result_of(published), self._loop)

    def close(self) -> None:
        self._call(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncRolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
