"""HTTP episodes: `/v1/policies/{policy}/episodes/...`, the same `rollq.client.episodes.Episodes` the
Python client uses, one per (policy, trainer) in this gateway.

A turn sends `tokens` (ids to append) or `messages` (a tool's output, a user message), which
need the gateway's `--tokenizer`: they become exactly what the template writes after the last
reply's content (`rollq.client.episodes.chat_closing`), past the end-of-turn token when the reply
ended with it (`Episodes.turn(end_token_at=)`), never a re-rendering of earlier turns. The first
turn's `messages` are rendered whole (with the generation prompt).

Each Episodes here has the owner `--gateway-id`, and holds it (one live reader per owner): a
second gateway with the same id is refused (409, reason `owner`). A gateway restarted with the
same id takes its episodes over at start-up (`lifetime`; the trainers it serves episodes for are
remembered in Redis, `Keys.gateway_episode_trainers`): the turns its predecessor left running are
applied when their results arrive, the ones it never queued are freed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import msgspec
from aiohttp import web
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollq.client.episodes import Episode, EpisodeError, Episodes, Turn
from rollq.gateway.api import _context
from rollq.gateway.http import ApiError, read_body, reply
from rollq.gateway.state import GATEWAY, Gateway
from rollq.protocol import InvalidInput, VersionWindow
from rollq.queue.connection import Backoff
from rollq.queue.keys import Keys
from rollq.queue.workers import live_workers
from rollq.status import policies

log = logging.getLogger("rollq.gateway.episodes")


class EpisodeStartRequest(VersionWindow, kw_only=True, forbid_unknown_fields=True):
    """Its version window: the fields of `VersionWindow`."""

    prompt: list[int] | None = None
    """Token ids; or `messages` (needs the gateway's tokenizer)."""
    messages: list[dict[str, Any]] | None = None
    n: int = 1
    """Branches: one group of n samples, each branch going on on its own."""
    sampling: dict[str, Any] | None = None
    episode_id: str | None = None
    move: bool = False
    """Later turns may be served by a newer version of the window (recorded per token)."""
    ttl_s: int = 600
    deadline_s: float | None = None
    chat_template_kwargs: dict[str, Any] = {}


class EpisodeTurnRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    turn_id: str | None = None
    """Your key for this turn: sent again (a retry), it is not appended twice (`Episodes.turn`)."""
    tokens: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    deadline_s: float | None = None
    chat_template_kwargs: dict[str, Any] = {}


class TurnView(msgspec.Struct):
    episode_id: str
    new_tokens: list[int]
    tokens: list[int]
    logprobs: list[float]
    versions: list[tuple[int, int]]
    """Version segments of the sampled tokens: (version, first index)."""
    finish_reason: str
    version: int
    worker_id: str
    text: str = ""


class TurnsView(msgspec.Struct):
    episodes: list[TurnView]


class EpisodeView(msgspec.Struct):
    episode_id: str
    state: str
    tokens: list[int]
    mask: list[int]
    logprobs: list[float | None]
    """null where the policy did not sample the token."""
    token_versions: list[int]
    version: int | None
    turns: int
    worker: str
    reason: str


def turn_view(turn: Turn) -> TurnView:
    s = turn.sample
    return TurnView(turn.episode_id, turn.new_tokens, s.token_ids, s.token_logprobs,
                    [tuple(v) for v in s.versions], s.finish_reason, turn.version, turn.worker_id, s.text)


def episode_view(e: Episode) -> EpisodeView:
    return EpisodeView(e.episode_id, str(e.state), e.tokens, e.mask,
                       [None if math.isnan(x) else x for x in e.logprobs], e.token_versions, e.version,
                       e.turns, e.worker, e.reason)


STATUS = {"unknown": 404, "running": 409, "ended": 409, "retired": 410, "failed": 422, "owner": 409}
"""HTTP status of each EpisodeError reason."""

EPISODES = web.AppKey("episodes", dict)
"""(policy, trainer) -> Episodes of this gateway."""


async def _served(gw: Gateway, policy: str) -> None:
    """A turn is awaited: with no worker to serve it, say so now rather than hold the request."""
    if not await live_workers(gw.redis, Keys(policy)):
        raise ApiError(409, f"no live worker serves policy {policy!r}; an episode's turns are "
                            "served while the caller waits: start a worker first", "policy")


def _episodes(request: web.Request) -> tuple[Gateway, Episodes]:
    gw, policy, who = _context(request)
    return gw, _made(request.app, gw, policy, who.trainer)


def _made(app: web.Application, gw: Gateway, policy: str, trainer: str) -> Episodes:
    """The (policy, trainer) Episodes of this gateway; a new one starts applying its owner's
    results at once (a GET must not wait for it: a predecessor's lease may take seconds)."""
    made = app[EPISODES]
    key = (policy, trainer)
    if key not in made:
        made[key] = gw.client(policy, trainer).episodes(owner=gw.settings.gateway_id)
        asyncio.get_running_loop().create_task(_opened(made[key]), name="episodes-open")
    return made[key]


REOPEN_MAX_S = 5.0
"""Longest wait between two tries to open an Episodes (or to take over) while Redis is unreachable."""


async def _until_done(call, what: str, stopped=lambda: False) -> None:
    """`call()` until it returns, tried again while Redis is unreachable (backoff to
    `REOPEN_MAX_S`) and until `stopped()`; any other error is logged and ends it."""
    backoff = Backoff(0.25, REOPEN_MAX_S)
    while not stopped():
        try:
            await call()
            return
        except (RedisConnectionError, RedisTimeoutError) as e:
            log.warning("%s: Redis unreachable (%s); trying again", what, e)
        except Exception as e:  # noqa: BLE001 (requests see it again: each call opens first)
            log.warning("%s: %s", what, e)
            return
        await backoff.sleep()


async def _opened(episodes: Episodes) -> None:
    """Open it (hold the owner, start the result router, free the turns never queued), trying
    again while Redis is unreachable: a take-over must not depend on a later request (a GET does
    not open an Episodes, and a trainer whose turn went unanswered may only GET)."""
    await _until_done(episodes.open, f"episodes of {episodes.trainer} on {episodes.keys.policy}",
                      lambda: episodes.closing)


TAKE_OVER_WINDOW_S = 86_400
"""A trainer this long without a start or turn through this gateway is not taken over at start-up
(a turn's unread result is kept a job's lifetime, a day by default; an episode record lives its
`ttl_s`, 600 s by default, after its last turn)."""


async def _remember(gw: Gateway, policy: str, trainer: str) -> None:
    """Record, before its record changes, that `trainer` has episodes through this gateway id."""
    await gw.redis.zadd(Keys(policy).gateway_episode_trainers(gw.settings.gateway_id),
                        {trainer: time.time()})


async def _take_over(app: web.Application) -> None:
    """Open the Episodes of every trainer that started or took turns through this gateway id
    lately (a restarted gateway's predecessor's): their results are applied, and the turns it
    never queued freed, without waiting for a request."""
    gw = app[GATEWAY]
    for policy in gw.settings.policies or await policies(gw.redis):
        mine = Keys(policy).gateway_episode_trainers(gw.settings.gateway_id)
        await gw.redis.zremrangebyscore(mine, "-inf", time.time() - TAKE_OVER_WINDOW_S)
        for member in await gw.redis.zrange(mine, 0, -1):
            _made(app, gw, policy, member.decode())


async def _tokens(gw: Gateway, tokens: list[int] | None, messages: list[dict[str, Any]] | None,
                  kwargs: dict[str, Any], first: bool) -> tuple[list[int], int | None]:
    """Token ids, or `messages` rendered by the gateway's render helpers (gateway/render.py:
    capped, off the loop, the caller's template refused unless trusted); with where a later
    turn's rendering has its end-of-turn token (None for ids and first turns)."""
    if (tokens is None) == (messages is None):
        raise InvalidInput("messages", "give token ids or messages, one of the two")
    if messages is None:
        return tokens, None
    return await gw.render.chat(messages, kwargs, first, gw.settings.trust_request_chat_template)


async def _guarded(episode_id: str, call):
    try:
        return await call
    except EpisodeError as e:
        raise ApiError(STATUS[e.reason], str(e), "episode_id") from None


async def start_episode(request: web.Request) -> web.Response:
    gw, episodes = _episodes(request)
    body = await read_body(request, EpisodeStartRequest)
    prompt, _ = await _tokens(gw, body.prompt, body.messages, body.chat_template_kwargs, first=True)
    await _served(gw, episodes.keys.policy)
    await _remember(gw, episodes.keys.policy, episodes.trainer)
    turns = await _guarded(body.episode_id or "", episodes.start(
        prompt, body.n, body.sampling, episode_id=body.episode_id, **body.asked(), move=body.move,
        ttl_s=body.ttl_s, deadline_s=body.deadline_s))
    return reply(request, TurnsView([turn_view(t) for t in turns]), status=201)


async def episode_turn(request: web.Request) -> web.Response:
    gw, episodes = _episodes(request)
    episode_id = request.match_info["episode_id"]
    body = await read_body(request, EpisodeTurnRequest)
    new, end = await _tokens(gw, body.tokens, body.messages, body.chat_template_kwargs, first=False)
    await _served(gw, episodes.keys.policy)
    await _remember(gw, episodes.keys.policy, episodes.trainer)
    turn = await _guarded(episode_id, episodes.turn(episode_id, new, max_tokens=body.max_tokens,
                                                    deadline_s=body.deadline_s, turn_id=body.turn_id,
                                                    end_token_at=end))
    return reply(request, turn_view(turn))


async def get_episode(request: web.Request) -> web.Response:
    _, episodes = _episodes(request)
    episode_id = request.match_info["episode_id"]
    return reply(request, episode_view(await _guarded(episode_id, episodes.get(episode_id))))


async def end_episode(request: web.Request) -> web.Response:
    _, episodes = _episodes(request)
    episode_id = request.match_info["episode_id"]
    return reply(request, episode_view(await _guarded(episode_id, episodes.end(episode_id))))


async def lifetime(app: web.Application):
    """cleanup_ctx: take this gateway id's episodes over at start-up (in the background, until it
    succeeds); close every Episodes (their result routers and owner leases) when the app stops."""
    taking_over = asyncio.get_running_loop().create_task(
        _until_done(lambda: _take_over(app), "episodes: taking this gateway's episodes over"),
        name="episodes-take-over")
    yield
    taking_over.cancel()
    for episodes in app[EPISODES].values():
        await episodes.close()
