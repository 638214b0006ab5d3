"""What the gateway holds while it runs: its settings, one Redis connection pool, a client per
(policy, trainer), the completions routers, the pool sampler and its metrics registry."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from redis.asyncio import Redis

from rollq.client import RolloutClient
from rollq.config import default_weight_store
from rollq.gateway.auth import Tokens
from rollq.gateway.completions import CompletionRouter, TokenText
from rollq.gateway.files import FileWorkers
from rollq.gateway.pool_view import PoolSampler
from rollq.protocol import InvalidInput, check_id, derived_trainer_id
from rollq.queue.connection import DEFAULT_URL, check_durability
from rollq.queue.keys import Keys
from rollq.queue.results import ResultReader
from rollq.queue.scripts import Scripts

log = logging.getLogger("rollq.gateway")


class GatewaySettings(msgspec.Struct, kw_only=True):
    redis_url: str = DEFAULT_URL
    host: str = "127.0.0.1"
    port: int = 8000
    tokens: str | None = None
    """JSON file of bearer tokens → (trainer, policies); see gateway/auth.py."""
    no_auth: bool = False
    public_observe: bool = False
    """Serve /metrics and the dashboard's data without a token (they name every trainer)."""
    """Every request is the trainer `anonymous` with every policy. Loopback use only."""
    policies: list[str] = []
    """Show and serve only these policies (default: every policy found in Redis)."""
    gateway_id: str = "gateway"
    """Names this gateway's completions trainers; give each of several gateways its own."""
    weight_store: str = msgspec.field(default_factory=default_weight_store)
    weight_roots: list[Path] = []
    """Directories whose `<root>/<policy>/` subtree that policy may publish by path (default: the
    weight store, so `<store>/<policy>/`); another policy's store subtree is always refused."""
    tokenizer: str | None = None
    """A local tokenizer directory: text prompts are tokenized here and completions get text."""
    max_body_bytes: int = 64 * 1024 * 1024
    body_bytes_in_flight: int | None = None
    """Bytes of request bodies read and handled at once (default: 4 x max_body_bytes); others
    wait for room (a 503 after body_timeout_s). One 16 MiB submit costs ~140 MiB while decoded."""
    max_outstanding: int = 65_536
    """Quota of unfinished groups per trainer submitting through the gateway."""
    max_outstanding_bytes: int = 1024**3
    """Quota on the bytes of prompts (encoded work items) a trainer has waiting in Redis."""
    require_durable: bool = False
    """Refuse to start on a Redis that may lose acknowledged work (no AOF, evicting policy)."""
    header_timeout_s: float = 15.0
    """A connection that has not sent a whole request head (or the next one, kept alive) by then
    is closed: a slow or silent client holds a socket for this long at most."""
    body_timeout_s: float = 60.0
    """Reading a request body longer than this ends in a 408."""
    max_connections: int = 1024
    """Connections beyond this are answered 503 and closed at once."""
    trust_request_chat_template: bool = False
    """Let chat requests bring their own Jinja `chat_template` (vLLM's flag of the same name): a
    template runs on the workers, and a slow one takes their CPU until vLLM's render timeout."""
    max_reply_bytes: int = 16 * 1024 * 1024
    """A batch of results stops at this many bytes encoded (it has at least one result); the
    stream reads as few results at a time. One trainer's `count=1024` of big groups would
    otherwise be held in the gateway's memory at once."""

    def validate(self) -> GatewaySettings:
        if self.tokens is None and not self.no_auth:
            raise InvalidInput("tokens", "give a token file (--tokens FILE) or run with --no-auth")
        if self.tokens is not None and self.no_auth:
            raise InvalidInput("tokens", "--tokens and --no-auth exclude each other")
        for name in self.policies:
            check_id("policy", name)
        check_id("gateway_id", self.gateway_id)
        if not 0 <= self.port <= 65_535:
            raise InvalidInput("port", f"port={self.port} is out of range [0, 65535]")
        if not 1024 <= self.max_body_bytes <= 2**31:
            raise InvalidInput("max_body_bytes", f"{self.max_body_bytes} is out of range [1024, 2**31]")
        for name, lo, hi in (("header_timeout_s", 0.1, 3600), ("body_timeout_s", 0.1, 3600),
                             ("max_connections", 1, 1_000_000), ("max_reply_bytes", 1024, 2**31)):
            if not lo <= getattr(self, name) <= hi:
                raise InvalidInput(name, f"{name}={getattr(self, name)} is out of range [{lo}, {hi}]")
        if self.body_bytes_in_flight is not None and not \
                self.max_body_bytes <= self.body_bytes_in_flight <= 2**40:
            raise InvalidInput("body_bytes_in_flight", f"{self.body_bytes_in_flight} is out of range "
                                                       f"[max_body_bytes={self.max_body_bytes}, 2**40]")
        self.weight_roots = [Path(p).resolve() for p in (self.weight_roots or [self.weight_store])]
        return self


PUBLISH_PROCESSES = 2
"""Helper processes for publishes' file work, so at most this many publishes run at once."""


class Gateway:
    def __init__(self, settings: GatewaySettings, redis: Redis, tokenizer: Any | None = None):
        self.settings = settings
        self.redis = redis
        self.scripts = Scripts(redis)
        self.tokens = Tokens.load(settings.tokens) if settings.tokens else Tokens(None)
        self.words = TokenText(tokenizer)
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

    def client(self, policy: str, trainer: str) -> RolloutClient:
        key = (policy, trainer)
        if key not in self._clients:
            self._clients[key] = RolloutClient(policy=policy, trainer_id=trainer, redis=self.redis,
                                               max_outstanding=self.settings.max_outstanding,
                                               max_outstanding_bytes=self.settings.max_outstanding_bytes,
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

    def encode_text(self, prompt: list[int] | str, index: int = 0) -> list[int] | str:
        """Text prompts are tokenized here when the gateway has a tokenizer, else by the worker.
        With a tokenizer, token ids outside its vocabulary are refused here, as vLLM's server
        does (the worker checks against the model again: an out-of-vocabulary id must never
        reach an engine, issue 21)."""
        tokenizer = self.words.tokenizer
        if tokenizer is None:
            return prompt
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        size = len(tokenizer)
        bad = next((t for t in prompt if not 0 <= t < size), None)
        if bad is not None:
            raise InvalidInput("prompt", f"prompt {index}: token id {bad} is outside the tokenizer's "
                                         f"vocabulary of {size} tokens (ids 0..{size - 1})")
        return prompt

    async def start(self) -> None:
        await check_durability(self.redis, require=self.settings.require_durable, log=log)
        self._sampling = asyncio.create_task(self.sampler.run(), name="pool-sampler")

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
        await self.redis.aclose()


GATEWAY = web.AppKey("gateway", Gateway)
