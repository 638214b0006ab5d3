"""HTTP handlers: rollq's own API under `/v1/policies/{policy}/...`, the OpenAI-compatible
surface, health, metrics and the dashboard's data. Each handler checks the caller's token
against the policy, then calls the same code the Python client uses."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from rollq.canary import encode_canary
from rollq.client import RolloutClient
from rollq.gateway import completions as oai
from rollq.gateway.auth import Principal, allowed
from rollq.gateway.http import JSON, ApiError, body_bytes, decode_body, read_body, reply, wants_msgpack
from rollq.gateway.gap_view import GapReport, tally_report
from rollq.gateway.pool_view import unobserved
from rollq.gateway.schema import (AckRequest, Acked, Cancelled, PublishRequest, ResultBatch,
                                  SubmitRequest, Submitted, VersionList, result_view, sample_view,
                                  version_view)
from rollq.gateway.state import GATEWAY, Gateway
from rollq.gateway.streaming import completion_chunks, respond
from rollq.images import from_data_url
from rollq.protocol import GroupResult, Version, typed
from rollq.queue import gap, jobs
from rollq.queue.gap import GapReported
from rollq.queue.jobs import JobStatus
from rollq.queue.keys import Keys
from rollq.queue.results import ResultReader
from rollq.queue.workers import live_workers, max_model_len
from rollq.registry.commit import commit_files
from rollq.registry.safetensors_check import WeightError
from rollq.registry.store import WeightStore
from rollq.registry.versions import Registry, VersionConflict
from rollq.status import PolicyStatus, policies, policy_status

log = logging.getLogger("rollq.gateway")


def _context(request: web.Request) -> tuple[Gateway, str, Principal]:
    gw = request.app[GATEWAY]
    who = gw.tokens.principal(request)
    return gw, allowed(who, request.match_info["policy"]), who


def _int_query(request: web.Request, name: str, default: int, lo: int, hi: int) -> int:
    raw = request.query.get(name)
    try:
        value = default if raw is None else int(raw)
    except ValueError:
        raise ApiError(400, f"{name}={raw!r} is not an integer", name) from None
    if not lo <= value <= hi:
        raise ApiError(400, f"{name}={value} is out of range [{lo}, {hi}]", name)
    return value


# --- jobs ------------------------------------------------------------------------------------

HEAVY_TURN = web.AppKey("heavy_turn", asyncio.Lock)
"""Taken by a submit of over HEAVY_BYTES from its decode until Redis has its work items. That
is CPU on the event loop (~0.45 s for 16 MiB of token ids) that no await interrupts; one at a
time, at most one such stretch runs before any other request's turn, instead of one per body
in flight (issue 20's soak: another trainer's jobs waited seconds behind them)."""
HEAVY_BYTES = 1024 * 1024


def heavy_turn(request: web.Request, data: bytes) -> contextlib.AbstractAsyncContextManager:
    """The turn a body of `data` takes for its decode and what follows on the loop (every route
    whose body may be large: submits, completions, chat completions)."""
    return request.app[HEAVY_TURN] if len(data) > HEAVY_BYTES else contextlib.nullcontext()


async def submit(request: web.Request) -> web.Response:
    gw, policy, who = _context(request)
    data = await body_bytes(request)  # arrives outside the turn: a slow sender holds only itself
    async with heavy_turn(request, data):
        body = decode_body(request, data, SubmitRequest)
        images = None if body.images is None else [
            [from_data_url(url, f"images[{i}][{j}]") for j, url in enumerate(group)]
            for i, group in enumerate(body.images)]
        job_id = await gw.client(policy, who.trainer).submit(
            body.prompts, body.n, body.sampling, job_id=body.job_id, deadline_s=body.deadline_s,
            meta=body.meta, wait=False, images=images, **body.asked(), **body.scoring())
    return reply(request, Submitted(job_id, len(body.prompts)), status=201)


async def _own_job(gw: Gateway, policy: str, who: Principal, job_id: str) -> JobStatus:
    for trainer in (who.trainer, gw.completions_trainer(who.trainer)):
        if status := await jobs.job_status(gw.redis, Keys(policy), trainer, job_id):
            return status
    raise ApiError(404, f"no job {job_id!r} of trainer {who.trainer!r} in policy {policy!r} "
                        "(unknown or expired)", "job_id")


async def job_status(request: web.Request) -> web.Response:
    gw, policy, who = _context(request)
    return reply(request, await _own_job(gw, policy, who, request.match_info["job_id"]))


async def cancel_job(request: web.Request) -> web.Response:
    gw, policy, who = _context(request)
    status = await _own_job(gw, policy, who, request.match_info["job_id"])
    left = await gw.client(policy, status.trainer_id).cancel(status.job_id)
    return reply(request, Cancelled(status.job_id, left))


# --- results ---------------------------------------------------------------------------------

MAX_CHUNK = 64
"""Results read from Redis at once, at most (fewer when they are big)."""


def _encoder(request: web.Request):
    return msgspec.msgpack.encode if wants_msgpack(request) else msgspec.json.encode


SAMPLES_PER_TURN = 64
"""Samples encoded before a result's encoding lets other requests run: a maximal group
(n=1,024 x 4,096 tokens) takes ~0.4 s of the event loop to encode."""


async def _encoded(encode, entry_id: str, result: GroupResult) -> bytes:
    """One result in the reply's format. Sample by sample: a view unpacks token ids and
    logprobs into Python lists (~40 bytes a token), so only one sample's lists live at a time."""
    samples = []
    for i, sample in enumerate(result.samples):
        if i and not i % SAMPLES_PER_TURN:
            await asyncio.sleep(0)
        samples.append(msgspec.Raw(encode(sample_view(sample))))
    view = result_view(entry_id, msgspec.structs.replace(result, samples=[]))
    view.samples = samples  # encoded as they are: msgspec writes Raw bytes verbatim
    return encode(view)


def _chunk(left_count: int, left_bytes: int, biggest: int) -> int:
    """How many to read next: as many as fit the bytes left if each were the biggest seen
    (one while none has been seen)."""
    if not biggest:
        return 1
    return max(1, min(left_count, MAX_CHUNK, left_bytes // max(biggest, 1)))


async def _first_entries(reader: ResultReader, wait_ms: int) -> list:
    give_up = time.monotonic() + wait_ms / 1000
    while True:  # blocks of 1 s at most: redis-py's socket timeout (5 s) would cut a longer one
        left = give_up - time.monotonic()
        entries = await reader.read(1, max(1, int(min(left, 1.0) * 1000)) if left > 0 else None)
        if entries or left <= 0:
            return entries


async def results(request: web.Request) -> web.Response:
    """A batch of results not yet acknowledged (the same ones again until they are), up to
    `count` and `max_reply_bytes` encoded (at least one). Read a few at a time, since a result's
    size is known only once read: what was read and not sent stays pending and comes first in
    the next batch (each request's reader starts with the pending ones)."""
    gw, policy, who = _context(request)
    count = _int_query(request, "count", 64, 1, 1024)
    wait_ms = _int_query(request, "wait_ms", 0, 0, 10_000)
    reader, encode, budget = gw.reader(policy, who.trainer), _encoder(request), gw.settings.max_reply_bytes
    parts: list[msgspec.Raw] = []
    size = biggest = 0
    entries = await _first_entries(reader, wait_ms)
    while entries:
        for entry_id, result in entries:
            data = await _encoded(encode, entry_id, result)
            if parts and (size + len(data) > budget or len(parts) == count):
                return reply(request, ResultBatch(parts))  # type: ignore[arg-type]  # Raw views
            parts.append(msgspec.Raw(data))
            size, biggest = size + len(data), max(biggest, len(data))
        if len(parts) == count or size >= budget:
            break
        entries = await reader.read(_chunk(count - len(parts), budget - size, biggest), None)
    return reply(request, ResultBatch(parts))  # type: ignore[arg-type]


async def stream_results(request: web.Request) -> web.StreamResponse:
    """Server-Sent Events, one `result` event per group; unacknowledged results of earlier
    connections come first. `ack=manual` (default, at least once): acknowledge with POST
    .../results/ack. `ack=auto` (at most once): each batch is acknowledged once it is written to
    the socket, so a client that disconnects loses what it had not received (reliability.md)."""
    gw, policy, who = _context(request)
    batch = _int_query(request, "batch", 64, 1, 1024)
    budget, biggest = gw.settings.max_reply_bytes, 0
    mode = request.query.get("ack", "manual")
    if mode not in ("auto", "manual"):
        raise ApiError(400, f"ack={mode[:20]!r} must be 'auto' or 'manual'", "ack")
    auto_ack = mode == "auto"
    reader = gw.reader(policy, who.trainer)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    while True:
        # As many at a time as fit max_reply_bytes if each were the biggest seen so far.
        entries = await reader.read(_chunk(batch, budget, biggest), 1000)
        if not entries:
            await response.write(b": idle\n\n")  # also finds a client that has gone
            continue
        written: list[str] = []
        try:
            for entry_id, result in entries:
                data = await _encoded(msgspec.json.encode, entry_id, result)
                biggest = max(biggest, len(data))
                await response.write(b"id: %s\nevent: result\ndata: %s\n\n" % (entry_id.encode(), data))
                written.append(entry_id)
                del data
        finally:
            if auto_ack and written:
                # At most once: what was written is acknowledged even when the client's
                # disconnect cancels this handler meanwhile (it did, mid-ack, on a loaded machine,
                # and the written result came again).
                await asyncio.shield(reader.ack(written))


_RESULT_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
"""A stream entry id as Redis writes it; ASCII digits only (str.isdigit also takes '١' and '²')."""
MAX_ACK_IDS = 10_000


async def ack_results(request: web.Request) -> web.Response:
    """Acknowledge results by id: each one read and not acknowledged yet leaves the stream and the
    quota; any other id (never read, acknowledged already) is left alone and not counted."""
    gw, policy, who = _context(request)
    body = await read_body(request, AckRequest)
    if len(body.ids) > MAX_ACK_IDS:
        raise ApiError(400, f"{len(body.ids)} ids; the limit is {MAX_ACK_IDS} per request", "ids")
    for i, entry_id in enumerate(body.ids):
        if not _RESULT_ID.fullmatch(entry_id):
            raise ApiError(400, f"ids[{i}]={entry_id[:40]!r} is not a result id like "
                                "'1700000000000-0' (the `id` of a result)", f"ids[{i}]")
    return reply(request, Acked(await gw.reader(policy, who.trainer).ack(body.ids)))


# --- versions, workers, status -----------------------------------------------------------------

async def list_versions(request: web.Request) -> web.Response:
    gw, policy, _ = _context(request)
    registry = Registry(gw.redis, Keys(policy))
    entries = await registry.entries()
    return reply(request, VersionList(await registry.latest(), [version_view(e) for e in entries]))


PUBLISHING = web.AppKey("publishing", asyncio.Semaphore)
"""Publishes at once: each holds a helper process (gateway/files.py) while it checks, copies and
hashes; more wait their turn without queueing work."""


def publishable(gw: Gateway, policy: str, raw: str) -> Path:
    """The directory to publish, if it lies under this policy's subtree of a weight root.

    Roots are per policy (`<root>/<policy>/`; the default root is the weight store, so
    `<store>/<policy>/`): a token for one policy cannot register another policy's files."""
    if not Path(raw).is_absolute():
        raise ApiError(400, f"path {raw[:200]!r} must be absolute", "path")
    try:
        path = Path(raw).resolve()
    except (OSError, ValueError, RuntimeError) as e:  # NUL byte, link loop, ...
        raise ApiError(400, f"path {raw[:200]!r} cannot be resolved: {e}", "path") from None
    store = Path(gw.settings.weight_store).resolve()
    if path.is_relative_to(store) and path != store:
        owner = path.relative_to(store).parts[0]
        if owner != policy:
            raise ApiError(403, f"{path} is in the weight store of policy {owner!r}; a token of "
                                f"policy {policy!r} may publish only from {store / policy}", "path")
    roots = [root / policy for root in gw.settings.weight_roots]
    if not any(path.is_relative_to(root) for root in roots):
        raise ApiError(403, f"{path} is outside the weight roots of policy {policy!r} "
                            f"({', '.join(map(str, roots))})", "path")
    return path


async def publish_version(request: web.Request) -> web.Response:
    """The client's publish by path, with the file work in a helper process (gateway/files.py):
    a hostile header costs that process CPU, never the event loop."""
    gw, policy, who = _context(request)
    body = await read_body(request, PublishRequest)
    typed("version", body.version, Version)
    if body.keep is not None and body.keep < 1:
        raise ApiError(400, f"keep={body.keep} must be >= 1 (versions kept)", "keep")
    path = publishable(gw, policy, body.path)
    canary = b"" if body.canary is None else encode_canary(body.canary.to_canary())
    store = WeightStore(gw.settings.weight_store)
    try:
        async with request.app[PUBLISHING]:
            where, files = await gw.files.prepare(store.root, policy, body.version, path, body.copy)
    except WeightError as e:  # the files, named by the message
        raise ApiError(400, f"{path}: {e}", "path") from None
    except BrokenProcessPool:
        raise ApiError(503, "the publish's helper process died (out of memory?); retry") from None
    try:
        entry = await commit_files(gw.redis, Keys(policy), store, body.version, where, files, body.copy,
                                   publisher=who.trainer, keep=body.keep, canary=canary)
    except VersionConflict as e:
        raise ApiError(409, str(e), "version") from None
    return reply(request, version_view(entry), status=201)


async def workers(request: web.Request) -> web.Response:
    return reply(request, (await _status(request)).workers)


async def status(request: web.Request) -> web.Response:
    return reply(request, await _status(request))


async def _status(request: web.Request) -> PolicyStatus:
    """The policy's status; without the `observe` scope, only what is the token's own business
    (`pool_view.unobserved`): `observe` guards every trainer's names, counts and failures."""
    gw, policy, who = _context(request)
    observer = _observes(gw, who)
    # The gap: every trainer's for an observer, else the token's own trainer's reports only.
    found = await policy_status(gw.redis, policy, gap_of="" if observer else who.trainer)
    return found if observer else unobserved(found, who.trainer)


# --- the training-inference gap (queue/gap.py) ------------------------------------------------

async def report_gap(request: web.Request) -> web.Response:
    """The trainer's own logprobs of samples it trains on, added to its gap record."""
    gw, policy, who = _context(request)
    body = await read_body(request, GapReport)
    tally, tokens = tally_report(body)
    await gw.client(policy, who.trainer).record_gap(tally)
    return reply(request, GapReported(len(body.samples), tokens))


async def get_gap(request: web.Request) -> web.Response:
    """The gap per version and worker: every trainer's with the `observe` scope, else the token's
    own trainer's reports."""
    gw, policy, who = _context(request)
    only = None if _observes(gw, who) else who.trainer
    return reply(request, await gap.read(gw.redis, Keys(policy), only))


def _observes(gw, who: Principal) -> bool:
    """May `who` see every trainer's figures (the `observe` scope, or the gateway made it public)?"""
    return gw.settings.public_observe or who.may("observe")


# --- OpenAI-compatible -----------------------------------------------------------------------

async def health(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    try:
        await gw.redis.ping()
    except Exception as e:
        raise ApiError(503, f"redis unreachable: {e}") from None
    return web.Response(status=200)


async def models(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    who = gw.tokens.principal(request)
    names = [p for p in (gw.settings.policies or await policies(gw.redis)) if who.may_use(p)]
    now = int(time.time())
    # max_model_len: as vLLM's model card, the context length; here the least the policy's live
    # workers report (None while none is live: vLLM's field is optional too).
    data = [dict(id=name, object="model", created=now, owned_by="rollq", root=name,
                 max_model_len=max_model_len(await live_workers(gw.redis, Keys(name))),
                 latest_version=await Registry(gw.redis, Keys(name)).latest()) for name in names]
    return web.json_response(dict(object="list", data=data))


async def completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY]
    who = gw.tokens.principal(request)
    data = await body_bytes(request)
    async with heavy_turn(request, data):  # as a submit's: a 16 MiB prompt decodes on the loop
        req = decode_body(request, data, oai.CompletionRequest)
        policy = allowed(who, req.model)
        prompts = oai.prompts_of(req.prompt)
    sampling = oai.sampling_of(req)
    sent = [await gw.encode_text(p, i) for i, p in enumerate(prompts)]  # text: in a render helper

    async def submit(client: RolloutClient, job_id: str, window: dict) -> str:
        async with heavy_turn(request, data):  # the work items' encoding
            return await client.submit(sent, req.n, sampling, job_id=job_id, deadline_s=req.timeout_s,
                                       wait=False, **window, **req.scoring())

    job_id = oai.new_job_id()
    results = await run_job(gw, policy, who, job_id, len(sent), req, submit)
    if req.stream:
        tokens = [(len(r.prompt_ids), len(s.token_ids)) for r in sorted(results, key=lambda r: r.group_index)
                  for s in r.samples]
        echoed = [r.prompt_ids for r in sorted(results, key=lambda r: r.group_index)
                  for _ in r.samples] if req.echo else None
        return await respond(request, lambda: oai.response(req, job_id, results, prompts, gw.words),
                             lambda body: completion_chunks(body, req.stream_options, tokens, echoed))
    body = oai.response(req, job_id, results, prompts, gw.words)
    return web.Response(body=msgspec.json.encode(body), content_type=JSON)


async def run_job(gw: Gateway, policy: str, who: Principal, job_id: str, groups: int, req: oai.OpenAIRequest,
                  submit: Callable[[RolloutClient, str, dict], Awaitable[str]]) -> list[GroupResult]:
    """Submit one job as the caller's completions trainer and wait for all its groups' results
    (the OpenAI-compatible routes). `req` gives `timeout_s` and the version window; a caller
    that leaves or times out cancels the job, which frees the workers."""
    if not 0 < req.timeout_s <= 86_400:
        raise ApiError(400, f"timeout_s={req.timeout_s} must be in (0, 86400]", "timeout_s")
    trainer = gw.completions_trainer(who.trainer)
    router = gw.router(policy, trainer)
    waiter = router.expect(job_id, groups)
    window = req.asked()
    finished = False
    try:
        await submit(gw.client(policy, trainer), job_id, window)
        async with asyncio.timeout(req.timeout_s + 30):  # the deadline ends the groups before this
            await waiter.done
        finished = True
    except TimeoutError:
        raise ApiError(504, f"no result within timeout_s={req.timeout_s}", "timeout_s") from None
    finally:
        router.forget(job_id)
        if not finished:  # the caller left or timed out: free the workers
            await asyncio.shield(_cancel_quietly(gw, policy, trainer, job_id))
    return list(waiter.results.values())


async def _cancel_quietly(gw: Gateway, policy: str, trainer: str, job_id: str) -> None:
    try:
        await gw.client(policy, trainer).cancel(job_id)
    except Exception as e:  # never submitted, or Redis gone: its deadline ends it anyway
        log.info("could not cancel abandoned completion %s: %s", job_id, e)


# --- metrics and dashboard -------------------------------------------------------------------

async def metrics(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    return web.Response(body=generate_latest(gw.metrics), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def dashboard_data(request: web.Request) -> web.Response:
    gw = request.app[GATEWAY]
    # msgspec writes a float that is no number as null, where json.dumps writes NaN or Infinity,
    # which a browser's JSON.parse refuses: one such figure would blank every observer's page.
    body = msgspec.json.encode(dict(now=time.time(), healthy=gw.sampler.healthy,
                                    policies=gw.sampler.dashboard()))
    return web.Response(body=body, content_type="application/json")


async def dashboard(request: web.Request) -> web.FileResponse:
    return web.FileResponse(Path(__file__).parent / "static" / "index.html")
