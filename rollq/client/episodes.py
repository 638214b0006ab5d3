"""Multi-turn episodes: each turn continues from the exact token ids of everything before it.

    async with RolloutClient(policy="math", trainer_id="run-7") as client:
        episodes = client.episodes()
        [first] = await episodes.start([1, 2, 3], sampling={"max_tokens": 32})
        turn = await episodes.turn(first.episode_id, tool_output_ids)
        episode = await episodes.end(first.episode_id)   # tokens, mask, logprobs, versions

An episode is a record in Redis (`Keys.episode`, fields `names.EpisodeField`): the token sequence
so far, a mask of what the policy sampled, each token's logprob and version, the version that
served the last turn, the worker that served it and a state (idle, running, ended). A turn is an
ordinary one-group job whose prompt is the sequence so far plus the turn's new tokens, with the
window `[v, v]` once the first turn was served by version v (unless the episode may `move`), so
the engine, swap gating and provenance are the queue's own. Its result is appended to the record
by one script (`episode_apply.lua`), idempotent on the turn's job id. `n` branches: the first
turn is one group of n samples, and branch i (`<episode_id>.<i>`) continues from sample i.

Turns are submitted as the derived trainer `<trainer>~episodes~<owner>`, whose results one router
task of this object reads, applies and acknowledges; the object holds its owner (a lease: a
second live object with that owner is refused). Name the owner to survive a restart: the new
object's first call (or `recover()`) applies the turns its predecessor left running and frees
the ones it never queued. docs/reliability.md, Episodes, lists each fault and its
test. A turn goes to the worker
that served the previous one (its prefix cache holds the episode) while that worker is alive and
serves the turn's version, through a work stream routed to it (`Keys.routed_work`); else to any
worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from rollq.protocol import (
    GroupResult,
    InvalidInput,
    Sample,
    Sampling,
    as_sampling,
    check_id,
    encode,
    pack_floats,
    pack_tokens,
    unpack_floats,
    unpack_tokens,
    VersionWindow,
    validate_n,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollq.closing import MARKED_BASE, after_marker, closing_end, skip_sampled, special_ids
from rollq.queue.connection import Backoff
from rollq.queue.names import EpisodeField, EpisodeState, Reply
from rollq.queue.scripts import Scripts
from rollq.queue.workers import WorkerState
from rollq.registry.versions import Registry

if TYPE_CHECKING:  # annotations only: the client imports this module
    from rollq.client.rollouts import RolloutClient

log = logging.getLogger("rollq.client.episodes")

DEFAULT_TTL_S = 600
"""An episode record lives this long after its last turn began or ended."""
MAX_EPISODE_ID_CHARS = 100
OWNER_LEASE_S = 5.0
"""The owner lease (one live object per owner), renewed by the result router about every second:
a killed holder's lapses after this long."""
_NOT_SAMPLED = -1
"""`token_versions` of a token the policy did not sample (prompt, tool output, user message)."""
_OUTAGE = (RedisConnectionError, RedisTimeoutError, NoScriptError)
"""What the router rides out and tries again: NOSCRIPT too, which redis-py raised when Redis
restarted between its SCRIPT LOAD and the script's second call (the script did not run; rollq's
clients now send such a call again as EVAL, queue/connection.py, so this is a second guard)."""


class EpisodeError(Exception):
    """A turn or an end that cannot be done; `reason` is one of `unknown` (no such episode, or it
    expired), `running` (a turn is running), `ended`, `retired` (its version is gone) or `failed`
    (the turn's group ended without samples: `GroupResult.reason` says why) or `owner` (another
    live object or gateway holds this object's owner)."""

    def __init__(self, episode_id: str, reason: str, message: str):
        super().__init__(f"episode {episode_id!r}: {message}" if episode_id else message)
        self.episode_id = episode_id
        self.reason = reason


@dataclass
class Turn:
    """What one turn added to one episode (branch)."""

    episode_id: str
    new_tokens: list[int]
    """Tokens the caller sent (not sampled), then..."""
    sample: Sample
    """...the tokens the policy sampled, with logprobs and version segments."""
    worker_id: str
    version: int
    """The version that served it (the last segment's, when the episode may move)."""

    @property
    def tokens(self) -> list[int]:
        return self.sample.token_ids


@dataclass
class Episode:
    """An episode's record: one token sequence with what the policy sampled."""

    episode_id: str
    state: EpisodeState
    tokens: list[int]
    mask: list[int]
    """1 where the policy sampled the token (train on it), 0 for prompt and new tokens."""
    logprobs: list[float]
    """The sampling version's logprob where `mask` is 1, NaN elsewhere."""
    token_versions: list[int]
    """The version that sampled each token, -1 where `mask` is 0."""
    version: int | None
    turns: int
    worker: str
    reason: str = ""
    """Why the last turn failed ('' when it was served)."""
    extra: dict[str, Any] = field(default_factory=dict)


def _text(value: bytes | str | None) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


def _window(record_min: str, record_max: str, staleness: str, version: int | None, move: bool):
    """The version window of a turn: the episode's before its first turn and when it may move
    (never below the version that served the last turn), else exactly that version."""
    lo, hi = int(record_min), int(record_max) if record_max else None
    if version is None:
        return lo, hi, int(staleness) if staleness else None
    if not move:
        return version, version, None
    return max(lo, version), hi, int(staleness) if staleness else None


def _added(new_tokens: list[int], sample: Sample | None) -> tuple[bytes, bytes, bytes, bytes]:
    """The record's four arrays for a turn: the new tokens (not sampled), then the sample's."""
    sampled = sample.token_ids if sample is not None else []
    versions = [_NOT_SAMPLED] * len(new_tokens)
    if sample is not None:
        for k in range(len(sampled)):
            versions.append(_version_at(sample.versions, k))
    tokens = pack_tokens(new_tokens + sampled)
    mask = bytes(len(new_tokens)) + b"\x01" * len(sampled)
    logprobs = pack_floats([math.nan] * len(new_tokens)) + (sample.logprobs if sample else b"")
    return tokens, mask, logprobs, pack_tokens(versions)


def _token_ids(field: str, ids: Sequence[int]) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise InvalidInput(field, "must be a list of token ids")
    try:
        pack_tokens(ids)
    except (TypeError, OverflowError) as e:
        raise InvalidInput(field, f"token ids must be int32 integers ({e})") from None
    return list(ids)


def _start_job(episode_id: str) -> str:
    # Fresh per start: a job id lives `job_ttl_s` (a day), an episode id only `ttl_s`, so an id
    # reused after its record expired must not name the old start's job (its enqueue would be
    # taken as a repeat and queue nothing).
    return f"{episode_id}.t0{uuid.uuid4().hex[:12]}"


def turn_seed(seed: int, branch: str, prompt_tokens: int) -> int:
    """The seed of a seeded episode's later turn: the start's `seed`, the branch and where the
    turn begins (its prompt's length), hashed. Reproducible (the same episode samples the same
    tokens again) without one seed for every turn of every branch: the start's seed reused gave
    each turn the same random draws (vLLM gives `seed + i` only to the first turn's n samples)."""
    digest = hashlib.blake2b(f"{seed}:{branch}:{prompt_tokens}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # within Sampling.seed's 0..2**63 - 1


def _turn_job(branch: str, turn_id: str | None = None) -> str:
    if turn_id is None:
        return f"{branch}.tn{uuid.uuid4().hex[:12]}"
    check_id("turn_id", turn_id)  # any length: hashed into the job id
    return f"{branch}.tn{hashlib.sha256(turn_id.encode()).hexdigest()[:20]}"


_TurnRecord = tuple[list[int], Sample, str, int]
"""`EpisodeField.LAST_TURN`: (new tokens, sample, worker, version)."""


def _job_episode(job_id: str) -> tuple[str, bool]:
    """(the episode or branch a turn's job belongs to, whether it is the start's job)."""
    head, _, tail = job_id.rpartition(".t")
    return head, tail.startswith("0")


def _version_at(segments: list[tuple[int, int]], k: int) -> int:
    found = segments[0][0] if segments else _NOT_SAMPLED
    for version, start in segments:
        if start <= k:
            found = version
    return found


class Episodes:
    """One trainer's episodes on one policy (`RolloutClient.episodes()`)."""

    def __init__(self, turns: RolloutClient, *, trainer: str, scripts: Scripts, registry: Registry,
                 owner: str, affinity: bool = True):
        """`turns`: the client the turns are submitted and read through, on the owner's own
        result stream (`RolloutClient.episodes()` makes it); `trainer`: the trainer whose
        episodes these are, with its `scripts` and `registry`."""
        self.affinity = affinity
        """Send each turn to the worker that served the previous one while it can serve it."""
        self.redis, self.keys = turns.redis, turns.keys
        self.scripts, self.registry = scripts, registry
        self.trainer = trainer
        self.owner = owner
        self._submitter = turns
        self._waiting: dict[str, tuple[list[str], list[int], asyncio.Future]] = {}
        self._router: asyncio.Task | None = None
        self._stopping = False
        self.owner_lease_s = OWNER_LEASE_S
        self._token = uuid.uuid4().hex
        self._opened: asyncio.Task | None = None
        self._renewed = 0.0
        self._inflight: set[str] = set()
        """Turn jobs of this object between their episode_start/turn and their enqueue."""
        self._unqueued: dict[str, tuple[list[str], str]] = {}
        """Turn jobs whose record may be `running` but whose call failed before the job was
        queued, and not yet freed (the undo failed too, or was cut short): job -> (branches,
        reason). The router frees them once Redis answers, with no further call needed."""
        self._adopted = 0

    @property
    def closing(self) -> bool:
        """`close()` was called: nothing opens it again."""
        return self._stopping

    async def close(self) -> None:
        self._stopping = True
        if self._router is not None:
            await asyncio.wait([self._router], timeout=5)
            if not self._router.done():
                self._router.cancel()
        for *_, waiter in self._waiting.values():
            if not waiter.done():
                waiter.cancel()
        if self._opened is not None and self._opened.done() and not self._opened.exception():
            # The next object with this owner need not wait for the lease to lapse.
            with contextlib.suppress(RedisConnectionError, RedisTimeoutError):
                await self._hold(0)

    # --- one owner, one reader ---------------------------------------------------------------

    async def open(self) -> None:
        """Hold the owner and start applying its results (every call does this first; a gateway
        calls it at start-up for the owners it had)."""
        await self._ready()

    async def _ready(self) -> None:
        """Before any call: hold the owner lease, run the result router (which also applies the
        turns an earlier holder left running) and free the turns it left unsubmitted."""
        if self._opened is None or (self._opened.done() and self._opened.exception()):
            self._opened = asyncio.create_task(self._open(), name="episodes-open")
        await asyncio.shield(self._opened)
        if self._router is None or self._router.done():
            error = self._router.exception() if self._router else None
            if isinstance(error, EpisodeError):
                raise error
            await self._claim()  # the router stopped when idle and left the lease to lapse
            if self._router is None or self._router.done():  # (another call may have restarted it)
                self._router = asyncio.create_task(self._route(), name="episode-results")

    async def _open(self) -> int:
        await self._claim()
        self._router = asyncio.create_task(self._route(), name="episode-results")
        return await self._free_unsubmitted()

    async def _claim(self) -> None:
        # A holder killed a moment ago leaves its lease up to `owner_lease_s`: wait that out.
        give_up = time.monotonic() + self.owner_lease_s * 1.5
        while not await self._hold():
            if time.monotonic() >= give_up:
                raise EpisodeError("", "owner", f"owner {self.owner!r} of trainer {self.trainer!r} "
                                   "is held by another live Episodes object or gateway: one object "
                                   "reads an owner's results; close that one or use another owner")
            await asyncio.sleep(0.2)

    async def _hold(self, lease_ms: int | None = None) -> bool:
        """Take or renew the owner lease (0: give it up); False when another token holds it."""
        ms = int(self.owner_lease_s * 1000) if lease_ms is None else lease_ms
        held = await self.scripts.episode_owner(
            keys=[self.keys.episode_owner(self._submitter.trainer_id)], args=[self._token, ms],
            client=self.redis)
        self._renewed = time.monotonic()
        return int(held) == 1

    async def _free_unsubmitted(self) -> int:
        """Free this owner's running turns whose job was never queued (an earlier holder died
        between the record's change and the enqueue): each becomes idle, its reason recorded."""
        redis, mine, sub = self.redis, self.keys.episode(self.trainer, ""), self._submitter.trainer_id
        stale: dict[str, list[str]] = {}
        running = self.keys.episode_running(sub)
        for key in await redis.zrange(running, 0, -1):
            key = _text(key)
            if not key.startswith(mine):
                continue
            state, job, submitter = await redis.hmget(key, EpisodeField.STATE, EpisodeField.TURN_JOB,
                                                      EpisodeField.SUBMITTER)
            job = _text(job)
            if _text(state) == EpisodeState.RUNNING and _text(submitter) == sub and job \
                    and job not in self._inflight:
                stale.setdefault(job, []).append(key)
            elif _text(state) != EpisodeState.RUNNING:  # applied, ended or expired since
                await redis.zrem(running, key)
        freed = 0
        for job, records in stale.items():
            freed += await self.scripts.episode_unsubmitted(
                keys=[self.keys.episodes, self.keys.job(sub, job), *records],
                args=[job, "not submitted: its client stopped before queuing the turn"],
                client=redis)
        return freed

    def _key(self, episode_id: str) -> str:
        return self.keys.episode(self.trainer, check_id("episode_id", episode_id))

    # --- starting, turns, ending -------------------------------------------------------------

    async def start(self, prompt: Sequence[int], n: int = 1,
                    sampling: Sampling | dict[str, Any] | None = None, *,
                    episode_id: str | None = None, min_version: int | None = None,
                    max_version: int | None = None, exact_version: int | None = None,
                    max_staleness: int | None = None, move: bool = False,
                    ttl_s: int = DEFAULT_TTL_S, deadline_s: float | None = None) -> list[Turn]:
        """Start an episode and serve its first turn; returns one Turn per branch.

        `n` branches (a GRPO group of episodes): the first turn is one group of n samples, and
        branch i, `<episode_id>.<i>`, goes on from sample i on its own. Every turn of a branch is
        served by the version that served its first turn, unless `move` (then by any version of
        the window, never an older one than the last turn's; `Episode.token_versions` says which).
        """
        validate_n(n)
        episode_id = check_id("episode_id", episode_id) if episode_id else uuid.uuid4().hex
        if len(episode_id) > MAX_EPISODE_ID_CHARS:  # room for a branch and a turn in the job ids
            raise InvalidInput("episode_id", f"is {len(episode_id)} characters; the limit is "
                                             f"{MAX_EPISODE_ID_CHARS}")
        lo, hi, staleness = VersionWindow(min_version=min_version, max_version=max_version,
                                          exact_version=exact_version, max_staleness=max_staleness).resolve()
        settings = as_sampling(sampling)
        if not move:  # a sample crossing a swap would have two versions: drain instead
            settings = msgspec.structs.replace(settings, swap_modes=("drain",))
        if not 1 <= ttl_s <= 30 * 86_400:
            raise InvalidInput("ttl_s", f"ttl_s={ttl_s} must be in [1, 2592000]")
        prompt = _token_ids("prompt", prompt)
        branches = [f"{episode_id}.{i}" for i in range(n)]
        job_id = _start_job(episode_id)
        arrays = _added(prompt, None)
        await self._ready()
        self._inflight.add(job_id)
        try:
            reply = await self.scripts.episode_start(
                keys=[self.keys.episodes, *map(self._key, branches),
                      self.keys.episode_running(self._submitter.trainer_id)],
                args=[self.trainer, encode(settings), lo, "" if hi is None else hi,
                      "" if staleness is None else staleness, int(move), ttl_s, job_id,
                      time.time(), *arrays, self._submitter.trainer_id], client=self.redis)
        except BaseException as e:  # its reply lost, the script may have run: free what it did
            self._inflight.discard(job_id)
            self._unqueued[job_id] = (branches, f"not submitted: {e}")
            raise
        if _text(reply) == Reply.DUP:
            self._inflight.discard(job_id)
            raise InvalidInput("episode_id", f"{episode_id!r} is taken (an episode of this trainer)")
        return await self._run(episode_id, job_id, branches, [], prompt, n, settings,
                               (lo, hi, staleness), deadline_s)

    async def turn(self, episode_id: str, new_tokens: Sequence[int], *,
                   max_tokens: int | None = None, deadline_s: float | None = None,
                   turn_id: str | None = None, end_token_at: int | None = None) -> Turn:
        """Append `new_tokens` (a tool's output, a user message: not sampled, masked out) and
        sample the policy's reply from the exact token ids of everything before.

        `turn_id` (your name for this turn, e.g. an HTTP request's retry key): the turn sent again
        with it is not appended twice: while it runs, the call waits for it; once served (and
        until the next turn is), it gets the same Turn back. Without it every call is a new turn.

        `end_token_at`: `new_tokens` is a template's whole closing and continuation
        (`chat_closing`) with its end-of-turn token there: when the episode's last token is that
        token (the last reply ended with it), the ids up to and through it are not appended
        (`Turn.new_tokens` says what was). The gateway's `messages` turns use it: the choice is
        made against the record itself, as `chat_continuation(..., sampled)` makes it."""
        new_tokens = _token_ids("new_tokens", new_tokens)
        if end_token_at is not None and not -1 <= end_token_at < len(new_tokens):
            raise InvalidInput("end_token_at", f"is {end_token_at}; it must be an index of new_tokens "
                                               f"(0..{len(new_tokens) - 1}) or -1")
        key = self._key(episode_id)
        await self._ready()
        job_id = _turn_job(episode_id, turn_id)
        if job_id in self._waiting:  # sent again while it runs in this object: wait for it
            return await self._rejoin(episode_id, job_id)
        self._inflight.add(job_id)
        try:
            reply = await self.scripts.episode_turn(
                keys=[key, self.keys.episodes, self.keys.episode_running(self._submitter.trainer_id)],
                args=[self.trainer, job_id, self._submitter.trainer_id],
                client=self.redis)
        except BaseException as e:  # its reply lost, the script may have run: free what it did
            self._inflight.discard(job_id)
            self._unqueued[job_id] = ([episode_id], f"not submitted: {e}")
            raise
        word = Reply(_text(reply[0]))
        if word is not Reply.OK:
            self._inflight.discard(job_id)
        if word is Reply.DUP:
            added, sample, worker_id, version = msgspec.msgpack.decode(reply[1], type=_TurnRecord)
            return Turn(episode_id, added, sample, worker_id, version)
        if word is Reply.GONE:
            raise EpisodeError(episode_id, "unknown", "no such episode of this trainer (unknown, "
                                                      "or expired: start a new one)")
        if word is Reply.ENDED:
            raise EpisodeError(episode_id, "ended", "it was ended; start a new episode")
        if word is Reply.BUSY:
            raise EpisodeError(episode_id, "running", f"its turn {_text(reply[1])} is still running; "
                                                      "wait for it before sending the next")
        # Everything the turn needs comes from episode_turn's one read: a start or turn applied
        # between a separate read and the script would give this turn a window it must not have.
        tokens, version, _, sampling, lo, hi, staleness, move, worker = reply[1:10]
        version = int(version) if version else None
        move = move == b"1"
        settings = msgspec.msgpack.decode(sampling, type=Sampling)
        if max_tokens is not None:
            settings = msgspec.structs.replace(settings, max_tokens=max_tokens)
        before = unpack_tokens(tokens)
        if end_token_at is not None and before:
            new_tokens = skip_sampled(before[-1], new_tokens, end_token_at)
        prompt = before + new_tokens
        if settings.seed is not None:
            settings = msgspec.structs.replace(settings, seed=turn_seed(settings.seed, episode_id,
                                                                        len(prompt)))
        window = _window(_text(lo), _text(hi), _text(staleness), version, move)
        try:
            [done] = await self._run(episode_id, job_id, [episode_id], new_tokens, prompt, 1, settings,
                                     window, deadline_s, _text(worker) if self.affinity else None)
        except EpisodeError as e:
            # Version 0 (the start-up model) is never registered: a version above it, older than
            # the newest and no longer registered, was retired.
            if version is not None and not move and await self._retired(version):
                raise EpisodeError(episode_id, "retired", f"its version {version} is no longer "
                                   f"registered (retired); no worker will serve it again ({e})") from None
            raise
        return done

    async def _retired(self, version: int) -> bool:
        latest = await self.registry.latest()
        return (latest is not None and 0 < version < latest
                and await self.registry.get(version) is None)

    async def end(self, episode_id: str) -> Episode:
        """End the episode (no more turns; its version is no longer kept for it) and return it.
        A turn running now is discarded when it finishes (its `turn()` raises `ended`): the
        record returned is the episode's last."""
        reply = await self.scripts.episode_end(keys=[self._key(episode_id), self.keys.episodes],
                                                      args=[self.trainer], client=self.redis)
        if Reply(_text(reply)) is Reply.GONE:
            raise EpisodeError(episode_id, "unknown", "no such episode of this trainer (unknown, "
                                                      "or expired)")
        return await self.get(episode_id)

    async def get(self, episode_id: str) -> Episode:
        record = await self.redis.hgetall(self._key(episode_id))
        if not record or _text(record.get(EpisodeField.TRAINER.encode())) != self.trainer:
            raise EpisodeError(episode_id, "unknown", "no such episode of this trainer (unknown, "
                                                      "or expired)")

        def raw(f: EpisodeField) -> bytes:
            return record.get(f.encode(), b"")

        version = _text(raw(EpisodeField.VERSION))
        return Episode(episode_id, EpisodeState(_text(raw(EpisodeField.STATE))),
                       unpack_tokens(raw(EpisodeField.TOKENS)), list(raw(EpisodeField.MASK)),
                       unpack_floats(raw(EpisodeField.LOGPROBS)),
                       unpack_tokens(raw(EpisodeField.TOKEN_VERSIONS)),
                       int(version) if version else None, int(raw(EpisodeField.TURNS) or 0),
                       _text(raw(EpisodeField.WORKER)), _text(raw(EpisodeField.REASON)))

    # --- a turn's job and its result ---------------------------------------------------------

    async def _rejoin(self, episode_id: str, job_id: str) -> Turn:
        _, new_tokens, waiter = self._waiting[job_id]
        result, applied = await asyncio.shield(waiter)
        if result.status != "ok" or not applied:
            raise EpisodeError(episode_id, "failed" if result.status != "ok" else "ended",
                               f"its turn ended {result.status}: {result.reason}")
        s = result.samples[0]
        return Turn(episode_id, new_tokens, s, result.worker_id, s.versions[-1][0] if s.versions else 0)

    async def _run(self, episode_id: str, job_id: str, branches: list[str], new_tokens: list[int],
                   prompt: list[int], n: int, settings: Sampling, window,
                   deadline_s: float | None, route: str | None = None) -> list[Turn]:
        waiter = asyncio.get_running_loop().create_future()
        self._waiting[job_id] = (branches, new_tokens, waiter)
        try:
            await self._submit(job_id, prompt, n, settings, window, deadline_s, route)
        except BaseException as e:
            self._waiting.pop(job_id, None)
            self._inflight.discard(job_id)
            # Remembered before the undo is tried: the submit failed because Redis is unreachable,
            # so the undo may fail too (or this task be cancelled again); the router then frees it
            # once Redis answers. The caller gets the submit's own error either way.
            self._unqueued[job_id] = (branches, f"not submitted: {e}")
            with contextlib.suppress(*_OUTAGE):
                await self._free_unqueued(job_id)
            raise
        self._inflight.discard(job_id)
        last = EpisodeField.LAST_TURN_JOB
        if n == 1 and not waiter.done() \
                and await self.redis.hget(self._key(branches[0]), last) == job_id.encode():
            # A turn sent again (its turn_id) whose first send's result was applied between
            # its episode_turn and now: no result will come for this call; the record has it.
            self._waiting.pop(job_id, None)
            raw = await self.redis.hget(self._key(branches[0]), EpisodeField.LAST_TURN)
            added, sample, worker_id, version = msgspec.msgpack.decode(raw, type=_TurnRecord)
            return [Turn(episode_id, added, sample, worker_id, version)]
        result, applied = await waiter
        if result.status != "ok" or len(result.samples) != n:
            raise EpisodeError(episode_id, "failed", f"its turn ended {result.status}: {result.reason} "
                                                     "(nothing was added; send the turn again or end it)")
        if not applied:
            raise EpisodeError(episode_id, "ended", "it was ended while this turn ran: the turn was "
                                                    "discarded (the record is as end() returned it)")
        return [Turn(b, new_tokens, s, result.worker_id, s.versions[-1][0] if s.versions else 0)
                for b, s in zip(branches, result.samples)]

    async def _free_unqueued(self, job_id: str) -> None:
        """Free a turn this object failed to queue (`_unqueued`). Only if no job record of it
        exists: a lost reply may hide an enqueue that landed, and then its result, adopted by the
        router, ends the turn."""
        found = self._unqueued.get(job_id)
        if found is None:  # freed meanwhile (the failed call's own try, or the router's)
            return
        branches, reason = found
        if job_id not in self._waiting and job_id not in self._inflight:  # else sent again (its
            # turn_id) and that call owns it now
            await self.scripts.episode_unsubmitted(
                keys=[self.keys.episodes, self.keys.job(self._submitter.trainer_id, job_id),
                      *map(self._key, branches)], args=[job_id, reason], client=self.redis)
        self._unqueued.pop(job_id, None)

    async def _submit(self, job_id: str, prompt: list[int], n: int, settings: Sampling, window,
                      deadline_s: float | None, route: str | None) -> None:
        """Queue the turn's group: on the stream routed to `route` (a worker) when it still serves
        the window's version, else on the trainer's own stream, which every worker reads."""
        stream = await self._routed_stream(route, window)
        await self._submitter.submit_routed(job_id, prompt, n, settings, window, deadline_s, stream)

    async def _routed_stream(self, worker: str | None, window) -> str | None:
        """Prefix-cache affinity: the worker that served the last turn, if it is alive, serving
        (not swapping), on the turn's exact version and has room: the turns waiting or running on
        its routed stream leave one of its slots (max_inflight) free. A full worker's turn goes to
        any worker: its cache is lost, never its time. (Its other groups are not counted: the
        heartbeat's count is up to a third of a lease old, too stale to route by.)"""
        lo, hi, _ = window
        if not worker or lo != hi:
            return None
        stream = self.keys.routed_work(self._submitter.trainer_id, worker, lo)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(self.keys.worker(worker))
            pipe.xlen(stream)
            beat, routed = await pipe.execute()
        if beat is None:
            return None
        state = msgspec.json.decode(beat, type=WorkerState)
        if state.state != "serving" or state.version != lo or state.target is not None:
            return None
        if state.capacity is not None and routed >= state.capacity:
            return None
        return stream

    async def _apply(self, job_id: str, branches: list[str], new_tokens: list[int],
                     result: GroupResult | None, reason: str = "") -> int:
        served = result is not None and result.status == "ok" and len(result.samples) == len(branches)
        args: list[Any] = [job_id]
        for i, _ in enumerate(branches):
            sample = result.samples[i] if served else None
            version = sample.versions[-1][0] if sample and sample.versions else 0
            why = reason or (f"{result.status}: {result.reason}" if result else "")
            args += [int(served), version, result.worker_id if result else "", why,
                     *_added(new_tokens, sample if served else None),
                     msgspec.msgpack.encode((new_tokens, sample, result.worker_id, version))
                     if served else b""]
        return int(await self.scripts.episode_apply(
            keys=[self.keys.episodes, *map(self._key, branches)], args=args, client=self.redis))

    async def _route(self) -> None:
        try:
            await self._route_results()
        except BaseException as e:  # no caller may wait forever for a router that is gone
            for *_, waiter in self._waiting.values():
                if not waiter.done():
                    waiter.set_exception(e if isinstance(e, Exception) else asyncio.CancelledError())
            raise

    async def _route_results(self) -> None:
        from rollq.queue import jobs

        """Read the turns' results, apply each to its episodes, then acknowledge it and wake its
        caller; renew the owner lease on the way. A result nobody waits for (a turn of an earlier
        holder of this owner) is applied all the same (`_adopt`). Redis unreachable for longer
        than the client's retries: the results read are kept and applied when it is back, never
        acknowledged before (a result acknowledged unapplied would be lost for good)."""
        unapplied: list[GroupResult] = []
        backoff, busy = Backoff(0.1, 2.0), time.monotonic()
        while not self._stopping:
            try:
                if time.monotonic() - self._renewed >= self.owner_lease_s / 5 and not await self._hold():
                    raise EpisodeError("", "owner", f"owner {self.owner!r} was taken over while "
                                       "Redis was unreachable longer than its lease; this object stops")
                for job_id in list(self._unqueued):  # Redis answers again: free what it stranded
                    await self._free_unqueued(job_id)
                if not unapplied:
                    unapplied = await self._submitter.arrived(max_count=64, block_s=0.5, ack="manual")
                if unapplied or self._waiting or self._inflight or self._unqueued:
                    busy = time.monotonic()
                elif time.monotonic() - busy >= self.owner_lease_s and not await jobs.outstanding(
                        self.redis, self.keys, self._submitter.trainer_id) \
                        and not self._waiting and not self._inflight and not self._unqueued:
                    # Idle (nothing waits, nothing of this owner's is out): stop, and let the lease
                    # lapse (no await after this check: a call now restarts the router, re-taking
                    # the lease). An idle object costs Redis nothing.
                    return
                while unapplied and not self._stopping:  # left pending at close: the next holder's
                    await self._deliver(unapplied[0])
                    done = unapplied.pop(0)
                    await self._submitter.ack([done])
                backoff.reset()
            except _OUTAGE as e:
                log.warning("episode results of %s: Redis unreachable (%s); retrying", self.owner, e)
                self._submitter.replay()  # a lost reply may have carried results
                await backoff.sleep()

    async def _deliver(self, result: GroupResult) -> None:
        """Apply one result and wake its caller (a result applied before is a no-op)."""
        found = self._waiting.get(result.job_id)
        if found is None:
            self._adopted += await self._adopt(result)
            return
        branches, new_tokens, waiter = found
        try:
            applied = await self._apply(result.job_id, branches, new_tokens, result)
        except _OUTAGE:
            raise
        except Exception as e:  # noqa: BLE001 (the caller sees it)
            self._waiting.pop(result.job_id, None)
            if not waiter.done():
                waiter.set_exception(e)
            return
        self._waiting.pop(result.job_id, None)
        if not waiter.done():
            waiter.set_result((result, applied))

    async def _adopt(self, result: GroupResult) -> bool:
        """Apply a turn's result that no caller waits for; False if its episode no longer runs
        that turn (applied before, ended, expired). Its new tokens are what the job's prompt
        holds beyond the record's sequence."""
        episode, first = _job_episode(result.job_id)
        branches = [episode]
        if first:  # the start's one group of n samples: branches <episode>.0 .. <episode>.(n-1)
            branches = []
            while await self.redis.exists(self._key(f"{episode}.{len(branches)}")):
                branches.append(f"{episode}.{len(branches)}")
        if not branches:
            return False
        record = await self.redis.hmget(self._key(branches[0]), EpisodeField.TURN_JOB,
                                               EpisodeField.STATE, EpisodeField.TOKENS)
        if _text(record[0]) != result.job_id or _text(record[1]) != EpisodeState.RUNNING:
            return False
        before, prompt, new_tokens = unpack_tokens(record[2] or b""), result.prompt_ids, []
        if result.status == "ok":  # (a failed turn adds nothing: its new tokens do not matter)
            if prompt[:len(before)] != before:
                log.warning("turn %s: its prompt does not continue episode %s; not applied",
                            result.job_id, episode)
                return False
            new_tokens = prompt[len(before):]
        await self._apply(result.job_id, branches, new_tokens, result)
        log.info("applied turn %s of episode %s, which no caller waited for", result.job_id, episode)
        return True

    async def recover(self, *, timeout_s: float = 60.0) -> int:
        """After a restart: apply the turns this owner's earlier client left running (open this
        object with the same `owner`: the turns' results come back on its stream), and free the
        ones it never queued. Waits up to `timeout_s` for the owner lease (a killed holder's
        lapses within `OWNER_LEASE_S`) and for turns still running; returns how many it applied
        or freed. Each such episode is then idle (a failed turn's reason recorded) and takes
        turns again. Any call of this object does the same; recover() also waits for them."""
        from rollq.queue import jobs

        if self._waiting:
            raise RuntimeError("recover() is for a fresh Episodes object: this one has turns running")
        give_up, adopted = time.monotonic() + timeout_s, self._adopted
        freed = 0
        if self._opened is None or not self._opened.done() or self._opened.exception():
            await self._ready()
            freed = int(self._opened.result() or 0)
        while time.monotonic() < give_up:  # the router applies them; polled, not awaited: the
            # turns are another process's, known only by the derived trainer's counter
            if not await jobs.outstanding(self.redis, self.keys, self._submitter.trainer_id):
                break
            await asyncio.sleep(0.1)
        return self._adopted - adopted + freed




def chat_continuation(tokenizer: Any, messages: Sequence[dict[str, Any]],
                      sampled: Sequence[int] | None = None, **template_kwargs: Any) -> list[int]:
    """The token ids a chat template writes after an assistant message's content when `messages`
    (a tool's output, a user message) follow it, with the next generation prompt: what a turn
    sends as new tokens. `sampled`: the reply they follow (the last turn's `Turn.tokens`).

    Read off the template itself (`rollq/closing.py`): `messages` rendered after a stand-in
    assistant message whose content is a marker, and the text after the marker tokenized. It
    starts with the template's closing of the reply (ChatML's `<|im_end|>\n`, Llama 3's
    `<|eot_id|>`, Gemma's `<end_of_turn>\n`); a reply that ended with that end token (a stop token)
    wrote it already, so with `sampled` the ids go on after it (ChatML: `\n<|im_start|>...`), and
    a reply cut by max_tokens gets the whole closing. Without `sampled`, the whole closing (a
    caller that passed none before got the continuation after the closing, a fixed stand-in's:
    ChatML's lacked the `\n` after a sampled `<|im_end|>`). `Episodes.turn(..., end_token_at=)`
    makes the same choice against the record itself (`chat_closing`).

    Earlier turns are never rendered again: a template may render them differently from how they
    were sampled (one that drops the thinking of earlier assistant turns would change tokens the
    policy already produced).
    """
    after, end = chat_closing(tokenizer, messages, **template_kwargs)
    return skip_sampled(sampled[-1], after, end) if sampled else after


def chat_closing(tokenizer: Any, messages: Sequence[dict[str, Any]],
                 **template_kwargs: Any) -> tuple[list[int], int]:
    """What the template writes after an assistant message's content when `messages` follow it
    (closing, messages, generation prompt), as token ids, and where in them the closing's
    end-of-turn token is (`closing.closing_end`: -1 when it has none to skip)."""
    rendered = tokenizer.apply_chat_template([*MARKED_BASE, *messages], tokenize=False,
                                             add_generation_prompt=True, **template_kwargs)
    text = after_marker(rendered)
    if text is None:
        raise InvalidInput("messages", "the chat template does not write an assistant message's content "
                                       "as it is given; the text it puts after a reply is not well defined")
    after = list(tokenizer.encode(text, add_special_tokens=False))
    return after, closing_end(after, tokenizer, special_ids(tokenizer))
