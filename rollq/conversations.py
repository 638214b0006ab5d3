"""Agent conversations: the exact token trajectory of a chat that an unchanged OpenAI client carries
an identity for (`X-Rollq-Conversation: <id>`, set once with the SDK's `default_headers`).

Each served turn is appended to the conversation's record (`Keys.conversation`, one Lua script,
`conversation_append.lua`, idempotent on the turn's job id): its prompt as the engine saw it and
its sampled tokens, with a mask of the sampled ones, their behaviour logprobs and versions, and the
turn's parsed tool calls. A turn whose messages extend the last turn (the same earlier messages,
then the assistant message rollq answered with, then new ones) is rendered from those exact ids
(`Chat.prefix_tokens`) plus the template's continuation of the new messages, on the worker; any
other history (edited) is rendered whole and begins a new segment of the trajectory.

A trainer's records are bounded by a byte budget (the gateway's `--max-conversation-bytes`,
default its `--max-outstanding-bytes`), checked before each turn is queued and enforced by the
append: a turn that would take the trainer's records past it is refused (400, naming the limit).
A record counts until it expires (`TTL_S` after its last turn).

An HTTP retry of a served turn is answered with that turn's reply, never served and recorded
again: the record keeps the last turn's reply under the request's key, its `Idempotency-Key`
header when it has one (sent again on every retry by the openai SDK's `extra_headers`), else the
digest of its body, which the openai SDK sends again byte for byte with `X-Stainless-Retry-Count`
>= 1. A request that is not such a retry is a new turn, whatever its body.
"""

from __future__ import annotations

import hashlib
import math
from typing import Annotated, Any

import msgspec

from rollq.protocol import (GroupResult, InvalidInput, Sample, check_id, pack_tokens, unpack_floats,
                            unpack_tokens)
from rollq.queue.names import ConversationField as F
from rollq.queue.names import Reply
from rollq.queue.scripts import call_durably

HEADER = "X-Rollq-Conversation"
"""The request header that names a chat's conversation (an id: letters, digits, '.', '_', '-')."""
TTL_S = 3600
"""A conversation's record lives this long after its last turn."""
MAX_TOKENS = 1_000_000
"""Tokens a conversation may hold; a turn of a longer one is refused (start another id)."""
IDEMPOTENCY_HEADER = "Idempotency-Key"
"""A request header: a retry that sends the same key as the last served turn gets its reply."""
RETRY_HEADER = "X-Stainless-Retry-Count"
"""The openai SDK's: how many times it has sent this request before (its retries)."""
MAX_KEY_CHARS = 256
UNBOUNDED = 2**62
"""The budget of a writer that has none (a script's numbers are doubles: exact to 2**53 and past)."""


class Turn(msgspec.Struct, array_like=True, omit_defaults=True):
    """One served turn as the record keeps it."""

    job_id: str
    prompt: int
    """Tokens of its prompt."""
    sampled: int
    tool_calls: list[dict[str, Any]] = []
    drift: bool = False
    """Its whole rendering would have given other ids than its exact prompt..."""
    finish_reason: str = ""
    drift_at: int = -1
    """...from this position of its prompt on."""


def _doc(kind: Any, description: str) -> Any:
    """A field's type with its description, which `/openapi.json` shows (msgspec's schema)."""
    return Annotated[kind, msgspec.Meta(description=description)]


class TrajectoryTurn(msgspec.Struct, kw_only=True):
    """One served chat request of the conversation (a retry answered from the record is not one)."""

    job_id: _doc(str, "The id of its reply (`chatcmpl-...`).")
    segment: _doc(int, "Index into `segments` of the segment the turn belongs to.")
    continued: _doc(bool, "It continued its segment's exact ids (false: it began a segment, see `began`).")
    began: _doc(str, 'Why it began a segment: "" (it did not: continued), "new" (the conversation\'s first '
                     'turn), "edited" (its messages did not extend the last turn\'s messages and reply: a '
                     'history edited, cut or sampled again), "overtaken" (it extended the record as it was '
                     "when it started, but another turn was appended before it finished: two requests at "
                     "once, or a client's retry of a turn still being served).")
    prompt_start: _doc(int, "Its prompt is `tokens[prompt_start:sample_start]`: its segment's start, so a "
                            "continued turn's prompt holds every turn of the segment before it.")
    sample_start: _doc(int, "It sampled `tokens[sample_start:end]`.")
    end: _doc(int, "The end of what it sampled (the next turn's new tokens begin here).")
    tool_calls: _doc(list[dict[str, Any]], "Its reply's parsed tool calls as the reply had them (`id`, "
                                           "`type`, `function` with `name` and `arguments`, a JSON string): "
                                           "the ids tool messages answer with `tool_call_id`.")
    finish_reason: _doc(str, 'The engine\'s: "stop" (an end token or a stop string) or "length"; the reply '
                             'said "tool_calls" where this says "stop" and the turn called tools.')
    drift: _doc(bool, "vLLM's rendering of the turn's messages (what its server would have prompted "
                      "with) has other ids than the exact prompt.")
    drift_at: _doc(int, "Where it drifted: the index in `tokens` of the first prompt token that vLLM's "
                        "rendering has another id for (or ends before); -1 without drift.")


class Trajectory(msgspec.Struct, kw_only=True):
    """An agent conversation's whole token sequence (`GET .../conversations/{id}`), for training
    on exactly what the policy saw and did."""

    conversation_id: str
    tokens: _doc(list[int], "Every turn's prompt as the engine saw it (a continued turn adds only what "
                            "the conversation did not hold yet), then its sampled tokens.")
    mask: _doc(list[int], "1 where the policy sampled the token, 0 elsewhere.")
    logprobs: _doc(list[float | None], "Behaviour logprob of each sampled token; null where the policy "
                                       "did not sample it (mask 0).")
    token_versions: _doc(list[int], "The policy version that sampled each token; -1 where it did not.")
    segments: _doc(list[int], "Where each segment starts in `tokens`. A segment is one exact sequence; a "
                              "new one begins when a turn did not continue the last (its `began` says "
                              "why), and is no continuation of the one before: train on each as its "
                              "own sequence.")
    turns: list[TrajectoryTurn]
    drift: _doc(int, "A count: how many turns drifted (vLLM's rendering of their messages would have "
                     "prompted other ids; the exact path avoided it). Which ones, and where: "
                     "`turns[i].drift`, `turns[i].drift_at`.")


# --- which messages extend the conversation ---------------------------------------------------

def _text(content: Any) -> Any:
    """A content list of text parts means its joined text (SDKs send either)."""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(p.get("text", "") for p in content)
    return content


def _call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    function = call.get("function") or {}
    return (call.get("id"), function.get("name"), function.get("arguments"))


def normal(message: Any) -> Any:
    """A message as compared: keys whose value is null or empty text left out (rollq's reply has
    `refusal: null` and the like, SDKs send some back and drop others), text parts joined, tool
    calls by (id, name, arguments)."""
    if not isinstance(message, dict):
        return message
    out = {}
    for key, value in message.items():
        value = _text(value) if key == "content" else value
        if value is None or (key == "content" and value == "") or (key == "tool_calls" and value == []):
            continue
        out[key] = [_call(c) for c in value] if key == "tool_calls" and isinstance(value, list) else value
    return out


def extends(before: list[dict[str, Any]], messages: list[dict[str, Any]]) -> bool:
    """`messages` continue `before` (the last turn's messages and rollq's reply): the same ones
    first, then at least one new message."""
    return len(messages) > len(before) and all(normal(a) == normal(b) for a, b in zip(before, messages))


# --- the record -------------------------------------------------------------------------------

class Prior(msgspec.Struct):
    """What a turn needs from the record: the exact prefix it may continue."""

    prefix_tokens: bytes = b""
    """The last segment's ids ('' when the turn is rendered whole)..."""
    prefix_messages: int = 0
    """...the messages they stand for..."""
    replay: bytes = b""
    """The request retries the last turn: its reply (JSON), sent again instead of serving it."""


def check_header(value: str | None) -> str | None:
    return None if value is None else check_id(HEADER, value)


def request_key(headers: Any, body: bytes) -> tuple[str, bool]:
    """The key a served turn's reply is kept under, and whether the request may retry it: its
    `Idempotency-Key`, else its body's digest when the openai SDK says it is a retry."""
    given = headers.get(IDEMPOTENCY_HEADER)
    if given is not None:
        if not 0 < len(given) <= MAX_KEY_CHARS:
            raise InvalidInput(IDEMPOTENCY_HEADER, f"has {len(given)} characters; it must have 1 to "
                                                   f"{MAX_KEY_CHARS}")
        return f"key:{given}", True
    retried = headers.get(RETRY_HEADER, "0").strip() not in ("", "0")
    return f"body:{hashlib.blake2b(body, digest_size=16).hexdigest()}", retried


async def prior(client: Any, conversation_id: str, messages: list[dict[str, Any]], *, key: str = "",
                retried: bool = False, budget: int | None = None) -> Prior:
    """The exact prefix a turn with `messages` continues, or none (new, or history edited), or
    the reply of the turn it retries. InvalidInput when the trainer's records fill `budget`."""
    record = client.keys.conversation(client.trainer_id, conversation_id)
    tokens, start, stored, last_key, reply = await client.redis.hmget(
        record, F.TOKENS, F.SEGMENT_START, F.MESSAGES, F.REQUEST, F.REPLY)
    if retried and reply is not None and last_key is not None and last_key.decode() == key:
        return Prior(replay=reply)
    if budget is not None:
        held = int(await client.scripts.conversation_held(
            keys=[client.keys.conversation_holds(client.trainer_id),
                  client.keys.conversation_bytes(client.trainer_id)], client=client.redis))
        if held >= budget:
            raise _over_budget(client.trainer_id, held, 0, budget)
    if tokens is None:
        return Prior()
    if len(tokens) // 4 >= MAX_TOKENS:
        raise InvalidInput(HEADER, f"conversation {conversation_id!r} holds {len(tokens) // 4} tokens; the "
                                   f"limit is {MAX_TOKENS}: start a new conversation id")
    before = msgspec.msgpack.decode(stored)
    if not extends(before, messages):
        return Prior()
    return Prior(tokens[int(start or 0) * 4:], len(before))


def _over_budget(trainer: str, held: int, adds: int, budget: int) -> InvalidInput:
    more = f"; this turn's record would hold {adds}" if adds else ""
    return InvalidInput(HEADER, f"the conversation records of trainer {trainer!r} hold {held} bytes{more}, "
                                f"over its budget max_conversation_bytes={budget} (a record counts until "
                                f"it expires, {TTL_S} s after its last turn)")


async def append(client: Any, conversation_id: str, job_id: str, at: Prior, messages: list[dict[str, Any]],
                 reply: dict[str, Any], result: GroupResult, *, body: bytes = b"", key: str = "",
                 budget: int | None = None) -> None:
    """Record one served turn (one sample: conversations take n=1) and its reply's `body` (sent
    again to a retry with `key`); sent again, a no-op. InvalidInput (nothing recorded) when the
    trainer's records would hold more than `budget` bytes with it (None: no budget)."""
    [sample] = result.samples
    turn = msgspec.msgpack.encode(Turn(job_id, len(result.prompt) // 4, len(sample.tokens) // 4,
                                       sample.tool_calls, result.prompt_drift, sample.finish_reason,
                                       result.prompt_drift_at))
    keys, trainer = client.keys, client.trainer_id
    answer = await call_durably(
        client.scripts.conversation_append, client.redis,
        keys=[keys.conversation(trainer, conversation_id), keys.conversation_holds(trainer),
              keys.conversation_bytes(trainer)],
        args=[job_id, len(at.prefix_tokens) // 4 if at.prefix_tokens else -1, result.prompt, sample.tokens,
              sample.logprobs, pack_tokens(_token_versions(sample)), int(result.prompt_drift),
              msgspec.msgpack.encode([*messages, reply]), len(turn).to_bytes(4, "little") + turn, TTL_S,
              conversation_id, UNBOUNDED if budget is None else budget, key, body])
    if Reply(answer[0].decode()) is Reply.BYTES:
        raise _over_budget(trainer, int(answer[1]), int(answer[2]), budget)


def _token_versions(sample: Sample) -> list[int]:
    count, out = len(sample.tokens) // 4, []
    for i, (version, start) in enumerate(sample.versions):
        end = sample.versions[i + 1][1] if i + 1 < len(sample.versions) else count
        out += [version] * (end - start)
    return out


async def trajectory(client: Any, conversation_id: str) -> Trajectory | None:
    """The conversation's record as a Trajectory; None when there is none (or it expired)."""
    check_id("conversation_id", conversation_id)
    found = await client.redis.hgetall(client.keys.conversation(client.trainer_id, conversation_id))
    if not found or F.TOKENS.encode() not in found:
        return None
    field = {k.decode(): v for k, v in found.items()}
    turns, segments, at, log = [], [], 0, field[F.TURNS]
    offset = 0
    while offset < len(log):
        flag = log[offset:offset + 1]
        size = int.from_bytes(log[offset + 1:offset + 5], "little")
        turn = msgspec.msgpack.decode(log[offset + 5:offset + 5 + size], type=Turn)
        offset += 5 + size
        if flag == b"1":  # its prompt: the segment so far, then what it added
            sample_start = segments[-1] + turn.prompt
        else:
            segments.append(at)
            sample_start = at + turn.prompt
        at = sample_start + turn.sampled
        began = "" if flag == b"1" else "overtaken" if flag == b"2" else "edited" if turns else "new"
        turns.append(TrajectoryTurn(
            job_id=turn.job_id, segment=len(segments) - 1, continued=flag == b"1", began=began,
            prompt_start=segments[-1], sample_start=sample_start, end=at, tool_calls=turn.tool_calls,
            finish_reason=turn.finish_reason, drift=turn.drift,
            drift_at=segments[-1] + turn.drift_at if turn.drift and turn.drift_at >= 0 else -1))
    return Trajectory(
        conversation_id=conversation_id, tokens=unpack_tokens(field[F.TOKENS]), mask=list(field[F.MASK]),
        logprobs=[None if math.isnan(v) else v for v in unpack_floats(field[F.LOGPROBS])],
        token_versions=unpack_tokens(field[F.TOKEN_VERSIONS]), segments=segments, turns=turns,
        drift=int(field.get(F.DRIFT, b"0")))
