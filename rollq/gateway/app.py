"""`rollq gateway`: one aiohttp app serving the HTTP API, the OpenAI-compatible completions,
`/metrics`, the dashboard and `/openapi.json`.

`ROUTES` is the one list of routes: the app is built from it and so is the OpenAPI document,
so the two cannot disagree.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from rollq.gateway import api, trl_compat
from rollq.gateway import episodes as ep
from rollq.gateway import generate as gen
from rollq.gateway import tokenize as tk
from rollq.conversations import Trajectory
from rollq.gateway.chat import ChatCompletionRequest, chat_completions, get_conversation
from rollq.gateway.completions import CompletionRequest
from rollq.gateway.http import BODY_BUDGET, BODY_TIMEOUT, ApiError, BodyBudget, bounded_bodies, errors
from rollq.gateway.gap_view import GapReport
from rollq.gateway.openapi import Param, openapi_document
from rollq.queue.gap import GapReported, GapView
from rollq.gateway.schema import (AckRequest, Acked, Cancelled, PublishRequest, ResultBatch, SubmitRequest,
                                  Submitted, VersionList, VersionView)
from rollq.config import GatewaySettings
from rollq.gateway.state import GATEWAY, PUBLISH_PROCESSES, Gateway
from rollq.queue.connection import connect
from rollq.queue.jobs import JobStatus
from rollq.status import PolicyStatus
from rollq.queue.workers import WorkerState

log = logging.getLogger("rollq.gateway")
STATIC = Path(__file__).parent / "static"
STATIC_FILES = {"uPlot.iife.min.js": "application/javascript", "uPlot.min.css": "text/css",
                "dashboard.js": "application/javascript", "uPlot.LICENSE": "text/plain"}


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Any
    summary: str
    tag: str
    body: Any = None
    reply: Any = None
    status: int = 200
    public: bool = False
    scope: str = "rollouts"
    """What the caller's token must allow (gateway/auth.py: SCOPES); not asked of public routes."""
    query: tuple[Param, ...] = ()
    media: str = "application/json"
    errors: tuple[int, ...] = field(default=(400, 401, 403))
    path_values: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Path parameters that take only these values."""


async def static_file(request: web.Request) -> web.FileResponse:
    name = request.match_info["name"]
    if name not in STATIC_FILES:
        raise ApiError(404, f"no static file {name!r}")
    return web.FileResponse(STATIC / name, headers={"Content-Type": STATIC_FILES[name]})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])


_P = "/v1/policies/{policy}"
ROUTES = [
    Route("POST", f"{_P}/jobs", api.submit, "Submit prompt groups (fire-and-forget)", "jobs",
          body=SubmitRequest, reply=Submitted, status=201, errors=(400, 401, 403, 413, 429)),
    Route("GET", f"{_P}/jobs/{{job_id}}", api.job_status, "A job's record and counts", "jobs",
          reply=JobStatus, errors=(400, 401, 403, 404)),
    Route("DELETE", f"{_P}/jobs/{{job_id}}", api.cancel_job, "Cancel a job's unfinished groups", "jobs",
          reply=Cancelled, errors=(400, 401, 403, 404)),
    Route("GET", f"{_P}/results", api.results, "Results not yet acknowledged (a batch)", "results",
          reply=ResultBatch, query=(Param("count", 64, 1, 1024), Param("wait_ms", 0, 0, 10_000))),
    Route("GET", f"{_P}/results/stream", api.stream_results, "Results as Server-Sent Events", "results",
          media="text/event-stream",
          query=(Param("batch", 64, 1, 1024), Param("ack", None, enum=("auto", "manual")))),
    Route("POST", f"{_P}/results/ack", api.ack_results, "Acknowledge consumed results", "results",
          body=AckRequest, reply=Acked),
    Route("POST", f"{_P}/episodes", ep.start_episode,
          "Start a multi-turn episode (n branches) and serve its first turn", "episodes",
          body=ep.EpisodeStartRequest, reply=ep.TurnsView, status=201,
          errors=(400, 401, 403, 409, 413, 422, 429)),
    Route("POST", f"{_P}/episodes/{{episode_id}}/turns", ep.episode_turn,
          "Append new tokens (or messages) and sample the next reply from the exact ids so far",
          "episodes", body=ep.EpisodeTurnRequest, reply=ep.TurnView,
          errors=(400, 401, 403, 404, 409, 410, 413, 422, 429)),
    Route("GET", f"{_P}/episodes/{{episode_id}}", ep.get_episode,
          "An episode: tokens, mask, logprobs, versions", "episodes", reply=ep.EpisodeView,
          errors=(400, 401, 403, 404)),
    Route("DELETE", f"{_P}/episodes/{{episode_id}}", ep.end_episode, "End an episode", "episodes",
          reply=ep.EpisodeView, errors=(400, 401, 403, 404)),
    Route("GET", f"{_P}/conversations/{{conversation_id}}", get_conversation,
          "An agent conversation's exact trajectory (chat requests with the X-Rollq-Conversation header)",
          "openai", reply=Trajectory, errors=(400, 401, 403, 404)),
    Route("GET", f"{_P}/versions", api.list_versions, "Registered policy versions", "versions",
          reply=VersionList),
    Route("POST", f"{_P}/versions", api.publish_version, "Publish a version from a weights directory",
          "versions", body=PublishRequest, reply=VersionView, status=201, errors=(400, 401, 403, 409),
          scope="publish"),
    Route("POST", f"{_P}/gap", api.report_gap,
          "Report the trainer's own logprobs of samples it trains on (the training-inference gap)",
          "gap", body=GapReport, reply=GapReported, errors=(400, 401, 403, 413)),
    Route("GET", f"{_P}/gap", api.get_gap,
          "The training-inference gap per version and worker (every trainer's with `observe`)", "gap",
          reply=GapView),
    Route("GET", f"{_P}/workers", api.workers, "Live workers and their versions", "pool",
          reply=list[WorkerState]),
    Route("GET", f"{_P}/status", api.status, "Versions, workers and queue depths", "pool",
          reply=PolicyStatus),
    Route("GET", "/v1/models", api.models, "Policies this token may use (OpenAI format)", "openai",
          errors=(401,)),
    Route("POST", "/v1/completions", api.completions, "OpenAI/vLLM-compatible completions via the queue",
          "openai", body=CompletionRequest, errors=(400, 401, 403, 409, 413, 429, 504)),
    Route("POST", "/v1/chat/completions", chat_completions,
          "OpenAI/vLLM-compatible chat completions via the queue (rendered on the workers)", "openai",
          body=ChatCompletionRequest, errors=(400, 401, 403, 409, 413, 429, 504)),
    Route("POST", "/inference/v1/generate", gen.generate,
          "vLLM's token-in token-out generate (its --enable-scale-out route) via the queue", "openai",
          body=gen.GenerateRequest, errors=(400, 401, 403, 409, 413, 429, 504)),
    Route("POST", "/tokenize", tk.tokenize,
          "vLLM's: a prompt or chat messages as token ids, with the gateway's --tokenizer", "openai",
          body=tk.TokenizeRequest, reply=tk.TokenizeResponse),
    Route("POST", "/detokenize", tk.detokenize, "vLLM's: token ids as text, with the gateway's --tokenizer",
          "openai", body=tk.DetokenizeRequest, reply=tk.DetokenizeResponse),
    # What TRL's VLLMClient calls beside the OpenAI routes (gateway/trl_compat.py).
    Route("GET", "/get_world_size", trl_compat.world_size, "vLLM's: the policy's live workers", "trl",
          errors=(400, 401, 403)),
    Route("POST", "/reset_prefix_cache", trl_compat.reset_prefix_cache,
          "vLLM's: a no-op (workers reset their prefix cache at every swap)", "trl", errors=(400, 401, 403)),
    Route("GET", "/server_info", trl_compat.server_info,
          "vLLM's: the parts of its config TRL reads, and the pool's versions and workers", "trl",
          query=(Param("config_format", "json", enum=("json",)),), errors=(400, 401, 403)),
    *(Route("POST", path, trl_compat.publish_instead,
            "vLLM's weight transfer / pause: refused, publish through the registry", "trl",
            public=True, errors=(400,)) for path in trl_compat.NCCL_PATHS),
    Route("GET", "/health", api.health, "200 when the gateway and its Redis are up", "operations",
          public=True, media="", errors=(503,)),
    # Behind a token by default: they name every trainer and show failure reasons.
    Route("GET", "/metrics", api.metrics, "Prometheus metrics of the pool and the gateway", "operations",
          media="text/plain", errors=(401, 403), scope="observe"),
    Route("GET", "/api/dashboard", api.dashboard_data, "The dashboard's data", "operations",
          errors=(401, 403), scope="observe"),
    Route("GET", "/", api.dashboard, "The live dashboard", "operations", public=True, media="text/html",
          errors=()),
    Route("GET", "/static/{name}", static_file, "The dashboard's scripts and styles", "operations",
          public=True, media="application/javascript", errors=(404,),
          path_values={"name": tuple(STATIC_FILES)}),
    Route("GET", "/openapi.json", openapi, "This document", "operations", public=True, errors=()),
]

OPENAPI = web.AppKey("openapi", dict)
MAX_PUBLISHING = PUBLISH_PROCESSES
"""Concurrent publishes, one per helper process; more wait their turn."""


@web.middleware
async def count_requests(request: web.Request, handler):
    gw = request.app[GATEWAY]
    resource = request.match_info.route.resource
    route = resource.canonical if resource is not None else "unmatched"
    began = time.perf_counter()
    response = await handler(request)
    gw.requests.labels(route, str(response.status)).inc()
    gw.latency.labels(route).observe(time.perf_counter() - began)
    return response


def _guarded(route: Route, settings: GatewaySettings):
    """The route's handler, behind its scope: the token is checked before the handler runs."""
    if route.public or (route.scope == "observe" and settings.public_observe):
        return route.handler

    async def handler(request: web.Request) -> web.StreamResponse:
        request.app[GATEWAY].tokens.principal(request).require(route.scope)
        return await route.handler(request)

    return handler


def make_app(settings: GatewaySettings, redis=None, tokenizer: Any | None = None) -> web.Application:
    app = web.Application(middlewares=[count_requests, errors, bounded_bodies],
                          client_max_size=settings.max_body_bytes)
    app[GATEWAY] = Gateway(settings, redis if redis is not None else connect(settings.redis_url), tokenizer)
    app[OPENAPI] = openapi_document(ROUTES)
    app[api.PUBLISHING] = asyncio.Semaphore(MAX_PUBLISHING)
    app[api.HEAVY_TURN] = asyncio.Lock()
    app[BODY_TIMEOUT] = settings.body_timeout_s
    app[ep.EPISODES] = {}
    app[BODY_BUDGET] = BodyBudget(settings.body_bytes_in_flight or 4 * settings.max_body_bytes,
                                  settings.max_body_bytes)
    for route in ROUTES:
        app.router.add_route(route.method, route.path, _guarded(route, settings))

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        await app[GATEWAY].start()
        yield
        await app[GATEWAY].stop()

    app.cleanup_ctx.append(lifetime)
    app.cleanup_ctx.append(ep.lifetime)
    return app


def load_tokenizer(path: str | None) -> Any | None:
    if path is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


_BUSY_BODY = b'{"error":{"message":"the gateway is at its connection limit; retry later",' \
             b'"type":"server_error","field":null,"param":null,"code":503}}'
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
         b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


class _TurnAway(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(_BUSY)  # type: ignore[attr-defined]
        transport.close()


class CappedSite(web.TCPSite):
    """A TCPSite that answers connections beyond `max_connections` with a 503 and closes them:
    each open connection costs a handler, buffers and a timer, and aiohttp has no cap of its own.
    Connections accepted in one burst are counted once they start, so a burst may overshoot."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, max_connections: int):
        super().__init__(runner, host, port)
        self.max_connections = max_connections

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site; TCPSite.start would bind uncapped
        server = self._runner.server
        assert server is not None

        def protocol() -> asyncio.Protocol:
            return _TurnAway() if len(server.connections) >= self.max_connections else server()

        self._server = await asyncio.get_running_loop().create_server(
            protocol, self._host, self._port, backlog=self._backlog)


LINGER_S = 2.0
"""After an error reply to a request whose body was not read, how long unread bytes are drained
(so the client sees the reply) before the connection closes."""


async def start_gateway(settings: GatewaySettings, redis=None, tokenizer: Any | None = None
                        ) -> tuple[web.AppRunner, int]:
    """Serve until the runner is cleaned up; returns it and the bound port (for `port=0`)."""
    # keepalive_timeout also bounds the wait for a new connection's first request head.
    runner = web.AppRunner(make_app(settings, redis, tokenizer), handler_cancellation=True,
                           access_log=None, keepalive_timeout=settings.header_timeout_s,
                           lingering_time=LINGER_S)
    await runner.setup()
    site = CappedSite(runner, settings.host, settings.port, settings.max_connections)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    log.info("gateway on http://%s:%d (dashboard at /, API docs at /openapi.json)", settings.host, port)
    return runner, port
