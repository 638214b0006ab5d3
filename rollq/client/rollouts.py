"""Trainer SDK: submit prompt groups fire-and-forget, consume results, manage jobs.

    async with RolloutClient(policy="math", trainer_id="run-7") as client:
        job = await client.submit([[1, 2, 3], [4, 5]], n=8, sampling={"max_tokens": 64})
        async for result in client.results():
            train_on(result)          # acknowledged when you ask for the next ones (AckMode)

`SyncRolloutClient` offers the same for trainers that are not async.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Literal

import msgspec
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollq.protocol import (
    MAX_JOB_GROUPS,
    Chat,
    GroupResult,
    InvalidInput,
    QueueFull,
    Sampling,
    as_sampling,
    WorkItem,
    check_id,
    check_trainer_id,
    derived_trainer_id,
    decode_item,
    encode_item,
    encode_meta,
    pack_tokens,
    typed,
    validate_n,
    VersionWindow,
)
from rollq import conversations
from rollq.canary import Canary
from rollq import images as imaging
from rollq.client.episodes import Episodes
from rollq.client.gap import tally_results
from rollq.client.publishing import Publisher
from rollq.conversations import Trajectory
from rollq.queue import gap, jobs
from rollq.queue.gap import GapReported, Tally
from rollq.config import default_weight_store
from rollq.queue.connection import DEFAULT_URL, Backoff, connect
from rollq.queue.jobs import JobStatus
from rollq.queue.keys import Keys
from rollq.queue.results import ResultReader
from rollq.queue.scripts import Scripts
from rollq.registry.versions import Registry
from rollq.scoring import jobs as scoring


log = logging.getLogger("rollq.client")

Prompt = Sequence[int] | str
"""Token ids, or text for workers whose model directory has a tokenizer."""

AckMode = Literal["auto", "manual"]
"""How results read by `results()` / `take()` are acknowledged. The one statement of delivery to
trainers (docs/reliability.md, "Delivery to trainers", says the same for HTTP):

- A result stays pending on the trainer's result stream until it is acknowledged; only then does
  it leave the stream and the trainer's quota (`outstanding`). A client hands each result out
  once. A client started with the same `trainer_id` (a restarted trainer) is handed every
  unacknowledged result first, once each, then new ones.
- "manual": nothing is acknowledged until `await client.ack(results)`: call it after the training
  step (or the checkpoint) that consumed them. A trainer killed before that gets them again on
  restart; with a committed record of what it trained on, it trains on each group exactly once.
- "auto" (the default): the results a read handed out are acknowledged when you next ask this
  client for results (the next batch of `results()`, the next `take()`): your loop is done with
  them. The last ones stay pending until `ack()`; a crash before that hands them to the
  restarted trainer again (at least once, never lost).
- Breaking out of `results()` strands nothing: results read but not handed out come first from
  the next read of this client.
"""


def check_ack(ack: str) -> None:
    if ack not in ("auto", "manual"):
        raise InvalidInput("ack", f"ack={ack!r} must be 'auto' or 'manual'")


def group_prompts(prompts: Sequence[Prompt], n: int, repeated: bool) -> list[list[int] | str]:
    """Unique prompts as given; with `repeated`, TRL-style runs of n equal prompts become one each."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise InvalidInput("prompts", "must be a list of prompts (token-id lists or strings)")
    prompts = [p if isinstance(p, str) else list(p) for p in prompts]
    if not repeated:
        return prompts
    if len(prompts) % n:
        raise InvalidInput("prompts", f"{len(prompts)} prompts is not a multiple of n={n} "
                                      "(repeated=True expects each prompt n times in a row)")
    groups = []
    for start in range(0, len(prompts), n):
        run = prompts[start:start + n]
        for offset, p in enumerate(run[1:], 1):
            if p != run[0]:
                raise InvalidInput(f"prompts[{start + offset}]",
                                   f"differs from prompts[{start}]; with repeated=True each prompt "
                                   f"must appear n={n} times in a row")
        groups.append(run[0])
    return groups


class RolloutClient:
    """One trainer's connection to a policy's queue."""

    def __init__(
        self,
        redis_url: str = DEFAULT_URL,
        *,
        policy: str,
        trainer_id: str,
        max_outstanding: int = 65_536,
        max_outstanding_bytes: int = 1024**3,
        max_image_bytes: int = 1024**3,
        weight_store: str | None = None,
        redis=None,
        reconnect_s: float = 60.0,
    ):
        self.keys = Keys(policy)
        self.trainer_id = check_trainer_id("trainer_id", trainer_id)
        if not 1 <= max_outstanding <= 10_000_000:
            raise InvalidInput("max_outstanding", f"{max_outstanding} is out of range [1, 10000000]")
        self.max_outstanding = max_outstanding
        if not 1024 <= max_outstanding_bytes <= 2**40:
            raise InvalidInput("max_outstanding_bytes",
                               f"{max_outstanding_bytes} is out of range [1024, 2**40]")
        self.max_outstanding_bytes = max_outstanding_bytes
        """Quota on the bytes of this trainer's encoded work items waiting in Redis: the group
        quota alone lets 65,536 groups of 512 KiB prompts (32 GiB) wait there."""
        if not 1024 <= max_image_bytes <= 2**40:
            raise InvalidInput("max_image_bytes", f"{max_image_bytes} is out of range [1024, 2**40]")
        self.max_image_bytes = max_image_bytes
        """Budget on the bytes of the distinct images this trainer stored or named and keeps
        alive in Redis (each for its TTL after the last submit naming it; `rollq/images.py`)."""
        self.reconnect_s = reconnect_s
        """How long calls keep retrying while Redis is unreachable."""
        self.redis = redis if redis is not None else connect(redis_url)
        self._owns_redis = redis is None
        self.scripts = Scripts(self.redis)
        self.registry = Registry(self.redis, self.keys, self.scripts)
        self.weight_store = weight_store or default_weight_store()
        self._reader = ResultReader(self.redis, self.scripts, self.keys, trainer_id, trainer_id)
        self._publisher = Publisher(self.redis, self.keys, self.registry, self.weight_store,
                                    self.trainer_id)
        self._auto_unacked: list[str] = []
        """Handed out by reads with ack="auto": acknowledged by this client's next read."""
        self._gap_versions: dict[int, set[str]] | None = None
        """The versions (and their workers) this trainer's gap record holds: read at its first
        report, kept up to date by each (`queue/gap.write` drops the oldest beyond its cap)."""

    async def __aenter__(self) -> RolloutClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._publisher.settle()  # a background publish finishes (or fails) first
        self._publisher.drop_segments()
        if self._owns_redis:
            await self.redis.aclose()

    # --- submitting --------------------------------------------------------------------------

    async def submit(
        self,
        prompts: Sequence[Prompt],
        n: int = 1,
        sampling: Sampling | dict[str, Any] | None = None,
        *,
        job_id: str | None = None,
        deadline_s: float | None = None,
        meta: dict[str, Any] | None = None,
        repeated: bool = False,
        max_staleness: int | None = None,
        min_version: int | None = None,
        max_version: int | None = None,
        exact_version: int | None = None,
        wait: bool = True,
        timeout_s: float | None = None,
        images: Sequence[Any] | None = None,
        reward: str | None = None,
        reward_inputs: Sequence[Any] | None = None,
        reward_errors: Literal["skip", "fail"] = "skip",
        dynamic_sampling: int | None = None,
        deliver: int | None = None,
    ) -> str:
        """Queue one group of `n` samples per prompt; returns the job id at once.

        One Redis round trip whatever the batch size. With `job_id`, submitting again is a
        no-op (idempotent). When the trainer's quota has no room: waits (`wait=True`, up to
        `timeout_s`) or raises QueueFull.

        Version window: every token is generated by a version in [min_version, max_version]
        (`exact_version=v`: both v) that is at least (newest - max_staleness) when the group
        starts. A `min_version` not yet published waits (until the deadline); a window no
        worker can ever serve ends the group `failed` with the reason.

        Images (vision-language models): `images[i]` are group i's images, in the order of
        the image placeholders in its prompt (the model's image token, which vLLM expands):
        bytes of PNG, JPEG or WebP files, or `ImageRef`s from `upload_image`. Each distinct
        image is stored once in Redis, whatever the number of groups and jobs naming it.

        Scored jobs (`rollq/scoring/`): `reward` names a reward a live `rollq scorer` offers
        (refused otherwise, with the names on offer), `reward_inputs[i]` is group i's data for
        it; each group reaches the trainer scored (`GroupResult.rewards`). `reward_errors`: a
        reward that raises or times out leaves that sample without a reward (`skip`) or fails
        the group (`fail`). `dynamic_sampling=k` (DAPO): a group whose rewards are all equal is
        generated again, up to k times, then ends `filtered` (no samples); the job's status
        counts `filtered` and `resampled`. `deliver=k` (over-sampling): the first k groups
        scored `ok` are delivered, the others end `cancelled` (running ones aborted).
        """
        validate_n(n)
        job_id = check_id("job_id", job_id) if job_id is not None else uuid.uuid4().hex
        window = VersionWindow(max_staleness=max_staleness, min_version=min_version,
                               max_version=max_version, exact_version=exact_version).resolve()
        groups = group_prompts(prompts, n, repeated)
        found: dict[str, bytes | None] = {}
        digests = self._group_images(images, len(groups), found)
        items = self._encode_items(job_id, groups, n, as_sampling(sampling), deadline_s, window, digests)
        items = await self._scored(items, reward, reward_inputs, reward_errors, dynamic_sampling, n, deliver)
        meta_bytes = encode_meta(meta)
        await self._store_images(found, deadline_s)
        return await self._enqueue(job_id, items, meta_bytes, window, wait, timeout_s)

    async def upload_image(self, data: bytes, *, ttl_s: int | None = None) -> imaging.ImageRef:
        """Store an image (bytes of a PNG, JPEG or WebP file) once; submits may then name it by
        the returned reference. Stored for `ttl_s` (default: a week), extended by each submit."""
        ttl_s = imaging.IMAGE_TTL_S if ttl_s is None else ttl_s
        if not isinstance(ttl_s, int) or not 1 <= ttl_s <= 30 * 86_400:
            raise InvalidInput("ttl_s", f"ttl_s={ttl_s!r} must be an integer in [1, 2592000]")
        digest = imaging.group_images([data], "data", found := {})[0]
        await self._retrying(imaging.store_images, self.scripts.store_images, self.keys,
                             self.trainer_id, found, ttl_s, self.max_image_bytes)
        return imaging.ImageRef(digest)

    @staticmethod
    def _group_images(images: Any, groups: int, found: dict[str, bytes | None]) -> list[list[str]] | None:
        if images is None:
            return None
        if not isinstance(images, Sequence) or len(images) != groups:
            raise InvalidInput("images", f"must be a list with one list of images per group ({groups})")
        return [imaging.group_images(group, f"images[{i}]", found) for i, group in enumerate(images)]

    async def _store_images(self, found: dict[str, bytes | None], deadline_s: float | None) -> None:
        """Before the items that name them are queued: a worker never reads a missing image."""
        if found:
            ttl = max(imaging.IMAGE_TTL_S, int(deadline_s or 0) + 3600)
            await self._retrying(imaging.store_images, self.scripts.store_images, self.keys,
                                 self.trainer_id, found, ttl, self.max_image_bytes)

    async def submit_chat(
        self,
        conversations: Sequence[Sequence[dict[str, Any]]],
        n: int = 1,
        sampling: Sampling | dict[str, Any] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool | None = True,
        reasoning_effort: str | None = None,
        prefix_tokens: Sequence[int] | None = None,
        prefix_messages: int = 0,
        job_id: str | None = None,
        deadline_s: float | None = None,
        meta: dict[str, Any] | None = None,
        max_staleness: int | None = None,
        min_version: int | None = None,
        max_version: int | None = None,
        exact_version: int | None = None,
        wait: bool = True,
        timeout_s: float | None = None,
        reward: str | None = None,
        reward_inputs: Sequence[Any] | None = None,
        reward_errors: Literal["skip", "fail"] = "skip",
        dynamic_sampling: int | None = None,
        deliver: int | None = None,
    ) -> str:
        """Queue one group of `n` samples per conversation (a list of OpenAI chat messages).

        The worker renders each conversation with its model's chat template exactly as vLLM's
        OpenAI server does (`tools`, `chat_template_kwargs`, `chat_template`,
        `add_generation_prompt`, `continue_final_message` as vLLM takes them); each result's
        `prompt` holds the rendered token ids, and its samples carry decoded `text`. On a worker
        started with vLLM's parser flags, samples also carry vLLM's parsed `content`,
        `tool_calls` and `reasoning` (`tool_choice`, `parallel_tool_calls` as vLLM's). Otherwise
        as `submit` (one round trip, idempotent `job_id`, quota, version window).
        `prefix_tokens` (one conversation only): the exact ids of its first `prefix_messages`
        messages, continued instead of rendered again (`Chat.prefix_tokens`; the gateway's
        conversations send them, `rollq/conversations.py`).
        """
        validate_n(n)
        job_id = check_id("job_id", job_id) if job_id is not None else uuid.uuid4().hex
        window = VersionWindow(max_staleness=max_staleness, min_version=min_version,
                               max_version=max_version, exact_version=exact_version).resolve()
        settings = msgspec.structs.replace(as_sampling(sampling), return_text=True)
        if isinstance(conversations, (str, bytes)) or not isinstance(conversations, Sequence):
            raise InvalidInput("conversations", "must be a list of conversations (lists of messages)")
        shared = dict(tools=typed("tools", tools, list[dict[str, Any]] | None),
                      chat_template=typed("chat_template", chat_template, str | None),
                      chat_template_kwargs=typed("chat_template_kwargs", chat_template_kwargs or {},
                                                 dict[str, Any]),
                      add_generation_prompt=bool(add_generation_prompt),
                      continue_final_message=bool(continue_final_message),
                      tool_choice=typed("tool_choice", tool_choice, str | dict[str, Any] | None),
                      parallel_tool_calls=typed("parallel_tool_calls", parallel_tool_calls, bool | None),
                      reasoning_effort=typed("reasoning_effort", reasoning_effort, str | None))
        if prefix_tokens is not None:
            if len(conversations) != 1:
                raise InvalidInput("prefix_tokens", "continues one conversation; send one")
            shared |= dict(prefix_tokens=pack_tokens(typed("prefix_tokens", list(prefix_tokens), list[int])),
                           prefix_messages=typed("prefix_messages", prefix_messages, int))
        found: dict[str, bytes | None] = {}
        chats, digests = [], []
        for i, messages in enumerate(conversations):
            # Convert data URLs --> images stored once in Redis, named by digest in the chat.
            messages, named = imaging.chat_images(
                typed(f"conversations[{i}]", messages, list[dict[str, Any]]), f"conversations[{i}]", found)
            chats.append(Chat(messages, **shared))
            digests.append(named)
        # The prompts are placeholders: the items are built as for token prompts, then carry the chat.
        placeholders = self._encode_items(job_id, [[0]] * len(chats), n, settings, deadline_s, window,
                                          digests)
        items = []
        for i, ((data, deadline), chat) in enumerate(zip(placeholders, chats)):
            try:
                item = msgspec.structs.replace(decode_item(data), prompt=b"", chat=chat)
                items.append((encode_item(item), deadline))  # the limits of the chat and the whole item
            except (OverflowError, TypeError, msgspec.EncodeError) as e:  # e.g. an integer beyond 64 bits
                raise InvalidInput(f"conversations[{i}]", f"cannot be encoded: {e}") from None
            except InvalidInput as e:
                field = f"conversations[{i}]{e.field[4:]}" if e.field.startswith("chat") else e.field
                raise InvalidInput(field, str(e).split(": ", 1)[1]) from None
        items = await self._scored(items, reward, reward_inputs, reward_errors, dynamic_sampling, n, deliver)
        await self._store_images(found, deadline_s)
        return await self._enqueue(job_id, items, encode_meta(meta), window, wait, timeout_s)

    async def _scored(self, items: list[tuple[bytes, float]], reward: str | None,
                      reward_inputs: Sequence[Any] | None, on_error: str, resample: int | None,
                      n: int, deliver: int | None) -> list[tuple[bytes, float]]:
        if reward is None:
            for name, value in (("reward_inputs", reward_inputs), ("dynamic_sampling", resample),
                                ("deliver", deliver)):
                if value is not None:
                    raise InvalidInput(name, "given without a reward; name one (reward=...)")
            return items
        specs = scoring.score_specs(reward, reward_inputs, on_error, len(items), resample, n, deliver)
        await self._retrying(scoring.check_offered, self.redis, self.keys, self.trainer_id, reward,
                             reading=False)
        return scoring.scored_items(items, specs)

    async def _enqueue(self, job_id: str, items: list[tuple[bytes, float]], meta: bytes,
                       window: tuple[int, int | None, int | None], wait: bool,
                       timeout_s: float | None) -> str:
        """Enqueue encoded items in one round trip; without room in the quota, wait (polling
        the cheap counters against the effective caps, not resending the batch) or raise."""
        size = sum(len(b) for b, _ in items)
        if size > self.max_outstanding_bytes:
            raise InvalidInput("prompts", f"the job's items are {size} bytes encoded; they can never "
                                          f"fit the quota max_outstanding_bytes={self.max_outstanding_bytes}")
        give_up = time.monotonic() + timeout_s if timeout_s is not None else None
        backoff = Backoff(0.01, 0.5)
        while True:
            try:
                # Retried through connection loss: the job id makes a repeated enqueue a no-op.
                await self._retrying(
                    jobs.enqueue, self.redis, self.scripts, self.keys, trainer=self.trainer_id,
                    job_id=job_id, items=[b for b, _ in items], quota=self.max_outstanding,
                    byte_quota=self.max_outstanding_bytes, deadline=items[0][1], meta=meta,
                    min_version=window[0], max_version=window[1])
                return job_id
            except QueueFull as full:
                if full.never_fits or not wait or (give_up is not None and time.monotonic() >= give_up):
                    raise
                limit = full.limit  # the effective cap: the operator's may be below ours
                byte_limit = full.byte_limit
            # Poll the cheap counters, not the whole batch, until there is room.
            while not await self._room(len(items), size, limit, byte_limit):
                if give_up is not None and time.monotonic() >= give_up:
                    break
                await backoff.sleep()

    async def submit_routed(self, job_id: str, prompt: list[int], n: int, sampling: Sampling,
                            window: tuple[int, int | None, int | None], deadline_s: float | None,
                            stream: str | None) -> None:
        """One group on `stream`, a stream routed to one worker (`Keys.routed_work`), or on this
        trainer's own stream (None), which every worker reads: how episodes queue their turns.
        The routed stream is listed (`Keys.routed`) before the group goes on it, so a worker
        scanning the listing never misses an entry. No waiting for quota: QueueFull is raised."""
        [(item, deadline)] = self._encode_items(job_id, [prompt], n, sampling, deadline_s, window)
        if stream is not None:
            await self._retrying(self.redis.hset, self.keys.routed, stream, time.time())
        await self._retrying(
            jobs.enqueue, self.redis, self.scripts, self.keys, trainer=self.trainer_id, job_id=job_id,
            items=[item], quota=self.max_outstanding, byte_quota=self.max_outstanding_bytes,
            deadline=deadline, meta=encode_meta(None), min_version=window[0], max_version=window[1],
            stream=stream, routed=True)

    async def _room(self, groups: int, size: int, limit: int, byte_limit: int) -> bool:
        """Room for the job under both caps? Read through connection loss (a failover)."""
        def read(func, *args):
            return self._retrying(func, self.redis, *args)

        if await read(jobs.outstanding, self.keys, self.trainer_id) + groups > limit:
            return False
        if not byte_limit:
            return True
        if await read(jobs.queued_bytes, self.keys, self.trainer_id) + size <= byte_limit:
            return True
        # The submit script resets the byte counter's drift when the work stream is empty.
        return await self._retrying(self.redis.xlen, self.keys.work(self.trainer_id)) == 0

    async def _retrying(self, func, *args, reading: bool = False, **kwargs):
        """`await func(*args, **kwargs)`, again with backoff while Redis is unreachable (a restart, a killed
        connection), for up to `reconnect_s`. A read starts over with the results delivered but
        not acknowledged, in case the lost reply carried some."""
        give_up, backoff = time.monotonic() + self.reconnect_s, Backoff(0.05, 2.0)
        while True:
            try:
                return await func(*args, **kwargs)
            except (RedisConnectionError, RedisTimeoutError):
                if time.monotonic() > give_up:
                    raise
                if reading:
                    self._reader.replay()
                await backoff.sleep()

    def _encode_items(self, job_id: str, prompts: list[list[int] | str], n: int, sampling: Sampling,
                      deadline_s: float | None, window: tuple[int, int | None, int | None],
                      images: list[list[str]] | None = None) -> list[tuple[bytes, float]]:
        if not prompts:
            raise InvalidInput("prompts", "is empty; submit at least one prompt")
        if len(prompts) > MAX_JOB_GROUPS:
            raise InvalidInput("prompts", f"{len(prompts)} groups in one job; the limit is {MAX_JOB_GROUPS}")
        if len(prompts) > self.max_outstanding:
            raise InvalidInput("prompts", f"{len(prompts)} groups can never fit the quota "
                                          f"max_outstanding={self.max_outstanding}")
        if deadline_s is not None and not 0 < deadline_s <= 30 * 86_400:
            raise InvalidInput("deadline_s", f"deadline_s={deadline_s} must be in (0, 2592000]")
        now = time.time()
        deadline = now + deadline_s if deadline_s is not None else 0.0
        items = []
        for index, prompt in enumerate(prompts):
            text = prompt if isinstance(prompt, str) else ""
            try:
                packed = b"" if text else pack_tokens(prompt)
            except (TypeError, OverflowError) as e:
                raise InvalidInput(f"prompts[{index}]", f"token ids must be int32 integers ({e})") from None
            item = WorkItem(job_id, index, packed, n, sampling, now, deadline, text, *window,
                            images=images[index] if images else [])
            try:
                data = encode_item(item)
            except InvalidInput as e:
                field = f"prompts[{index}]" if e.field in ("prompt", "text") else e.field
                raise InvalidInput(field, str(e).split(": ", 1)[1]) from None
            items.append((data, deadline))
        return items

    # --- results -----------------------------------------------------------------------------

    async def results(self, *, block_s: float = 1.0, batch: int = 64,
                      ack: AckMode = "auto") -> AsyncIterator[GroupResult]:
        """Results as they arrive, forever. Acknowledgement: see `AckMode`.

        Breaking out of the loop is safe: results read but not handed out yet come first from the
        next `results()` or `take()` of this client.
        """
        check_ack(ack)
        while True:
            for entry_id, result in await self._next_batch(batch, int(block_s * 1000)):
                # Handed (and, with "auto", due for acknowledgement) only when actually yielded.
                if self._hand(entry_id, ack):
                    yield result

    async def take(self, count: int, *, timeout_s: float = 30.0,
                   ack: AckMode = "auto") -> list[GroupResult]:
        """Up to `count` results, waiting at most `timeout_s`. Acknowledgement: see `AckMode`."""
        check_ack(ack)
        await self._ack_auto()
        got: list[GroupResult] = []
        give_up = time.monotonic() + timeout_s
        while len(got) < count:
            left = give_up - time.monotonic()
            if left <= 0:
                break
            entries = await self._retrying(self._reader.read, count - len(got),
                                           max(1, int(min(left, 1.0) * 1000)), hand=False,
                                           reading=True)
            got.extend(r for e, r in entries if self._hand(e, ack))
        return got

    async def arrived(self, *, max_count: int = 64, block_s: float = 0.5,
                      ack: AckMode = "auto") -> list[GroupResult]:
        """The results that have arrived, up to `max_count`, as soon as there is one (waiting at
        most `block_s`; `take` instead waits to fill its count). Acknowledgement: see `AckMode`."""
        check_ack(ack)
        return [r for e, r in await self._next_batch(max_count, int(block_s * 1000)) if self._hand(e, ack)]

    async def ack(self, results: Iterable[GroupResult | str] | None = None) -> int:
        """Acknowledge results (or their `entry_id`s): they leave the result stream and the quota.
        None: every result this client has handed out and not acknowledged. Returns how many
        were pending; a result acknowledged before is not counted again."""
        if results is None:
            ids = sorted(self._reader.handed)
        else:
            ids = [r if isinstance(r, str) else r.entry_id for r in results]
            if not all(ids):
                raise InvalidInput("results", "a result without entry_id was not read through a "
                                              "client; acknowledge results that results()/take() gave you")
        acked = await self._retrying(self._reader.ack, ids)
        done = set(ids)
        self._auto_unacked = [e for e in self._auto_unacked if e not in done]
        return acked

    def _hand(self, entry_id: str, ack: AckMode) -> bool:
        if not self._reader.hand(entry_id):
            return False
        if ack == "auto":
            self._auto_unacked.append(entry_id)
        return True

    async def _ack_auto(self) -> None:
        """Acknowledge what "auto" reads handed out: the caller has asked for more."""
        if self._auto_unacked:
            ids = list(self._auto_unacked)
            await self._retrying(self._reader.ack, ids)
            del self._auto_unacked[:len(ids)]  # ones handed out meanwhile were appended

    async def _next_batch(self, batch: int, block_ms: int) -> list[tuple[str, GroupResult]]:
        await self._ack_auto()
        return await self._retrying(self._reader.read, batch, block_ms, hand=False, reading=True)

    # --- jobs --------------------------------------------------------------------------------

    async def status(self, job_id: str) -> JobStatus:
        status = await jobs.job_status(self.redis, self.keys, self.trainer_id, job_id)
        if status is None:
            raise KeyError(f"no job {job_id!r} in policy {self.keys.policy!r} (unknown or expired)")
        return status

    async def wait(self, job_id: str, *, timeout_s: float | None = None) -> JobStatus:
        """Until every group of the job has its terminal result (results still arrive via `results`)."""
        give_up = time.monotonic() + timeout_s if timeout_s is not None else None
        delay = 0.01
        while True:
            status = await self.status(job_id)
            if status.finished:
                return status
            if give_up is not None and time.monotonic() >= give_up:
                raise TimeoutError(f"job {job_id!r}: {status.done} of {status.groups} groups done "
                                   f"after {timeout_s} s")
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    async def cancel(self, job_id: str) -> int:
        """Cancel a job: its groups without a result end `cancelled`. Returns how many were left."""
        left = await jobs.cancel(self.redis, self.scripts, self.keys, self.trainer_id, job_id)
        if left is None:
            raise KeyError(f"no job {job_id!r} in policy {self.keys.policy!r} (unknown or expired)")
        return left

    # --- weights -----------------------------------------------------------------------------

    async def publish_weights(self, version: int, source: Any, *, copy: bool = True,
                              keep: int | None = None, wait: bool = True,
                              adapter_on: int | None = None, push: str | None = None,
                              canary: Canary | bool | None = None):
        """Register policy `version` (strictly above the newest); workers swap to it.

        `source`: a directory of safetensors files (copied into the weight store, or registered
        in place with `copy=False`), a state_dict, or a Hugging Face / PEFT model. Files are
        hashed before the version is registered; the store's copy is fsynced right after, while
        workers already copy and verify it, and the call returns once it is durable (what a crash
        leaves: docs/architecture.md, "Versions before they are durable"). `keep`: then delete all
        but the newest `keep` versions that no worker holds and no unfinished job may need.

        Returns the `VersionEntry`; with `wait=False`, an `asyncio.Task` of it, as soon as the
        weights are safe from the trainer's next optimizer step: a state_dict or model is copied
        (one memcpy per tensor) into a host staging buffer laid out as the safetensors file; a
        directory is read later, so it must stay unchanged until the task is done. The store
        write (the buffer to disk while it is hashed in memory), registration and fsync then run
        in the background, so the training loop is not held up by them. The client keeps up to
        two staging buffers of the checkpoint's size for its next publishes (a fresh one costs
        its page faults, 5-10x the copy here). Publishes register in the order they were made, waited
        for or not; one that fails (its task raises, and the failure is logged even if nobody
        awaits the task) does not stop the next.

        Sharded models (FSDP2 / DTensor parameters): call it on every rank, like any collective;
        the full tensors are gathered to rank 0, which publishes, and the other ranks return None.

        `adapter_on=B`: publish an adapter version instead, served on top of the full version B
        (0: the model workers start with) by workers started with adapter support, beside other
        adapters and without a swap. `source` is then a PEFT model (its active LoRA adapter) or
        a directory PEFT's `save_pretrained` wrote; only `adapter_config.json` and
        `adapter_model.safetensors` are stored (always copied).

        `push="shm"` (a state_dict or model): the tensors are also offered to live workers whose
        engine receives pushes (on this machine, `engine/pushes.py`), which take them straight
        into vLLM and check each tensor's fingerprint in the entry; workers that miss the push
        load the files (docs/architecture.md, "GPU weight paths").

        `canary`: the version's reference, which every worker checks its engine against before
        the version serves there (`rollq/canary.py`; docs/architecture.md, "The version canary"):
        `True` computes it from `source` (a transformers model, or a PEFT model for an adapter
        version) on the default sequences, in the model's dtype, before this call returns; or a
        `Canary` made by `rollq.canary.reference(model, sequences | texts=...)`. A worker whose
        engine disagrees beyond its tolerance refuses the version and serves the previous one.
        """
        return await self._publisher.publish(version, source, copy=copy, keep=keep, wait=wait,
                                             adapter_on=adapter_on, push=push, canary=canary)

    async def latest_version(self) -> int | None:
        return await self.registry.latest()

    async def outstanding(self) -> int:
        """Groups submitted whose result this trainer has not acknowledged yet."""
        return await jobs.outstanding(self.redis, self.keys, self.trainer_id)

    async def conversation(self, conversation_id: str) -> Trajectory | None:
        """The exact trajectory of an agent conversation this trainer's chat requests named with
        the `X-Rollq-Conversation` header (tokens, mask, logprobs, versions, tool calls,
        segments, drift: `rollq.conversations.Trajectory`); None when there is none (or it
        expired, an hour after its last turn)."""
        return await self._retrying(conversations.trajectory, self, conversation_id)

    async def report_logprobs(self, results: Iterable[GroupResult],
                              trainer_logprobs: Sequence[Any]) -> GapReported:
        """Report the trainer's own logprobs of the samples it trains on: the training-inference
        gap, summed per policy version and worker (`rollq.queue.gap`; shown by `rollq status`,
        `/metrics`, the dashboard and `GET .../gap`).

        `results`: the GroupResults taken; `trainer_logprobs`: one entry per sample of them, in
        order (result by result, sample by sample), each the trainer's logprob of every sampled
        token (what TRL calls `old_per_token_logps`, verl `old_log_probs`; a list of floats or a
        1-D tensor), or None for a sample not trained on. Each token counts for the version that
        sampled it (`Sample.versions`) and the result's worker. One pipeline to Redis."""
        tally, samples, tokens = tally_results(results, trainer_logprobs)
        await self.record_gap(tally)
        return GapReported(samples, tokens)

    async def record_gap(self, tally: Tally) -> None:
        """Add a tally (`queue/gap.tally_sample`) to this trainer's gap record (the gateway's
        reports from HTTP trainers come here)."""
        if not tally:
            return
        if self._gap_versions is None:
            self._gap_versions = await gap.known_versions(self.redis, self.keys, self.trainer_id)
        await gap.write(self.redis, self.keys, self.trainer_id, tally, self._gap_versions)

    def replay(self) -> None:
        """After a lost reply: the next read hands again the results delivered to this client
        and not acknowledged (the reply may have carried some)."""
        self._reader.replay()

    def episodes(self, *, owner: str | None = None, affinity: bool = True) -> Episodes:
        """Multi-turn episodes of this trainer (`rollq.client.episodes.Episodes`; close it when done).
        `owner` names the result stream its turns come back on (default: a fresh one; name it
        so a restarted trainer can `recover()` the turns it left running);
        `affinity`: each turn goes to the worker that served the previous one while it can."""
        owner = check_id("owner", owner) if owner is not None else uuid.uuid4().hex[:10]
        # The turns go through a client of their own: its trainer id names the owner's stream.
        turns = RolloutClient(policy=self.keys.policy, redis=self.redis,
                              trainer_id=derived_trainer_id(self.trainer_id, "episodes", owner))
        return Episodes(turns, trainer=self.trainer_id, scripts=self.scripts, registry=self.registry,
                        owner=owner, affinity=affinity)
