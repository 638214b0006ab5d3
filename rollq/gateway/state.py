"""What the gateway holds while it runs: its settings, one Redis connection pool, a client per
(policy, trainer), the completions routers, the pool sampler and its metrics registry."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from redis.asyncio import Redis

from rollq.client import RolloutClient
from rollq.config import GatewaySettings
from rollq.gateway.auth import Tokens
from rollq.gateway.completions import CompletionRouter, TokenText
from rollq.gateway.files import FileWorkers
from rollq.gateway.pool_view import PoolSampler
from rollq.gateway.render import RenderWorkers
from rollq.protocol import InvalidInput, derived_trainer_id
from rollq.queue.connection import check_durability
from rollq.queue.keys import Keys
from rollq.queue.results import ResultReader
from rollq.queue.scripts import Scripts

log = logging.getLogger("rollq.gateway")


PUBLISH_PROCESSES = 2
"""Helper processes for publishes' file work, so at most this many publishes run at once."""


class Gateway:
    def __init__(self, settings: GatewaySettings, redis: Redis, tokenizer: Any | None = None):
        self.settings = settings
        self.redis = redis
        self.scripts = Scripts(redis)
        self.tokens = Tokens.load(settings.tokens) if settings.tokens else Tokens(None)
        self.words = TokenText(tokenizer, settings.return_tokens_as_token_ids)
        self._clients: dict[tuple[str, str], RolloutClient] = {}
        self._routers: dict[tuple[str, str], CompletionRouter] = {}
        self.sampler = PoolSampler(redis, settings.policies or None)
        self.metrics = CollectorRegistry()
        self.metrics.register(self.sampler)
        self.requests = Counter("rollq_gateway_requests", "HTTP requests by route and status code.",
                                ["route", "code"], registry=self.metrics)
        self.latency = Histogram("rollq_gateway_request_seconds", "HTTP request duration by route.",
                                 ["route"], registry=self.metrics)
        self._sampling: asyncio.Task | None = None
        self.files = FileWorkers(PUBLISH_PROCESSES)
        self.render = RenderWorkers(tokenizer)

    def client(self, policy: str, trainer: str) -> RolloutClient:
        key = (policy, trainer)
        if key not in self._clients:
            self._clients[key] = RolloutClient(policy=policy, trainer_id=trainer, redis=self.redis,
                                               max_outstanding=self.settings.max_outstanding,
                                               max_outstanding_bytes=self.settings.max_outstanding_bytes,
                                               max_image_bytes=self.settings.max_image_bytes,
                                               weight_store=self.settings.weight_store)
        return self._clients[key]

    def reader(self, policy: str, trainer: str) -> ResultReader:
        """A fresh reader: it starts with the trainer's results delivered but not acknowledged."""
        return ResultReader(self.redis, self.scripts, Keys(policy), trainer, trainer)

    def completions_trainer(self, trainer: str) -> str:
        return derived_trainer_id(trainer, "completions", self.settings.gateway_id)

    def router(self, policy: str, trainer: str) -> CompletionRouter:
        key = (policy, trainer)
        if key not in self._routers:
            self._routers[key] = CompletionRouter(self.redis, Keys(policy), trainer)
        return self._routers[key]

    async def encode_text(self, prompt: list[int] | str, index: int = 0) -> list[int] | str:
        """Text prompts are tokenized here when the gateway has a tokenizer (in a render helper:
        gateway/render.py), else by the worker.
        With a tokenizer, token ids outside its vocabulary are refused here, as vLLM's server
        does (the worker checks against the model again: an out-of-vocabulary id must never
        reach an engine, issue 21)."""
        tokenizer = self.words.tokenizer
        if tokenizer is None:
            return prompt
        if isinstance(prompt, str):
            return await self.render.encode(prompt, "prompt")
        size = len(tokenizer)
        bad = next((t for t in prompt if not 0 <= t < size), None)
        if bad is not None:
            raise InvalidInput("prompt", f"prompt {index}: token id {bad} is outside the tokenizer's "
                                         f"vocabulary of {size} tokens (ids 0..{size - 1})")
        return prompt

    async def start(self) -> None:
        await check_durability(self.redis, require=self.settings.require_durable, log=log)
        self._sampling = asyncio.create_task(self.sampler.run(), name="pool-sampler")
        self.render.start()

    async def stop(self) -> None:
        """Bounded: background tasks are told to stop and cancelled, then waited for 5 s at most."""
        self.sampler.stopped.set()
        tasks = [self._sampling] if self._sampling else []
        for router in self._routers.values():
            router.close()
            tasks += [router.task] if router.task else []
        for task in tasks:
            task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=5.0)
            for task in stuck:
                log.warning("gateway task %s did not stop", task.get_name())
        self.files.close()
        self.render.close()
        await self.redis.aclose()


GATEWAY = web.AppKey("gateway", Gateway)
