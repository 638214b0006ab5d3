"""Agent conversations: the exact token trajectory of a chat that an unchanged OpenAI client carries
an identity for (`X-Rollq-Conversation: <id>`, set once with the SDK's `default_headers`).

Each served turn is appended to the conversation's record (`Keys.conversation`, one Lua script,
`conversation_append.lua`, idempotent on the turn's job id): its prompt as the engine saw it and
its sampled tokens, with a mask of the sampled ones, their behaviour logprobs and versions, and the
turn's parsed tool calls. A turn whose messages extend the last turn (the same earlier messages,
then the assistant message rollq answered with, then new ones) is rendered from those exact ids
(`Chat.prefix_tokens`) plus the template's continuation of the new messages, on the worker; any
other history (edited) is rendered whole and begins a new segment of the trajectory.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from rollq.protocol import (GroupResult, InvalidInput, Sample, check_id, pack_tokens, unpack_floats,
                            unpack_tokens)
from rollq.queue.names import ConversationField as F
from rollq.queue.scripts import call_durably

HEADER = "X-Rollq-Conversation"
"""The request header that names a chat's conversation (an id: letters, digits, '.', '_', '-')."""
TTL_S = 3600
"""A conversation's record lives this long after its last turn."""
MAX_TOKENS = 1_000_000
"""Tokens a conversation may hold; a turn of a longer one is refused (start another id)."""


class Turn(msgspec.Struct, array_like=True, omit_defaults=True):
    """One served turn as the record keeps it."""

    job_id: str
    prompt: int
    """Tokens of its prompt."""
    sampled: int
    tool_calls: list[dict[str, Any]] = []
    drift: bool = False
    """Its whole rendering would have given other ids than its exact prompt."""
    finish_reason: str = ""


class TrajectoryTurn(msgspec.Struct, kw_only=True):
    job_id: str
    segment: int
    """Index into `Trajectory.segments` of the segment the turn belongs to."""
    continued: bool
    """It continued its segment's exact ids (False: its prompt was rendered whole)."""
    prompt_start: int
    """Its prompt is `tokens[prompt_start:sample_start]` (the segment's start)..."""
    sample_start: int
    """...and it sampled `tokens[sample_start:end]`."""
    end: int
    tool_calls: list[dict[str, Any]]
    finish_reason: str
    drift: bool
    """Rendering the turn's conversation from its text would have given other prompt ids."""


class Trajectory(msgspec.Struct, kw_only=True):
    """A conversation's whole token sequence, for training on exactly what the policy saw and did."""

    conversation_id: str
    tokens: list[int]
    mask: list[int]
    """1 where the policy sampled the token."""
    logprobs: list[float | None]
    """Behaviour logprob of each sampled token (None elsewhere)."""
    token_versions: list[int]
    """The policy version that sampled each token (-1 elsewhere)."""
    segments: list[int]
    """Where each rendered segment starts in `tokens`: a new one begins when a request's history
    did not extend the conversation (edited), and is not a continuation of the one before."""
    turns: list[TrajectoryTurn]
    drift: int
    """Turns whose prompt would have had other ids had it been rendered from text (the exact path
    avoided it)."""


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


def check_header(value: str | None) -> str | None:
    return None if value is None else check_id(HEADER, value)


async def prior(client: Any, conversation_id: str, messages: list[dict[str, Any]]) -> Prior:
    """The exact prefix a turn with `messages` continues, or none (new, or history edited)."""
    tokens, start, stored = await client.redis.hmget(
        client.keys.conversation(client.trainer_id, conversation_id), F.TOKENS, F.SEGMENT_START, F.MESSAGES)
    if tokens is None:
        return Prior()
    if len(tokens) // 4 >= MAX_TOKENS:
        raise InvalidInput(HEADER, f"conversation {conversation_id!r} holds {len(tokens) // 4} tokens; the "
                                   f"limit is {MAX_TOKENS}: start a new conversation id")
    before = msgspec.msgpack.decode(stored)
    if not extends(before, messages):
        return Prior()
    return Prior(tokens[int(start or 0) * 4:], len(before))


async def append(client: Any, conversation_id: str, job_id: str, at: Prior, messages: list[dict[str, Any]],
                 reply: dict[str, Any], result: GroupResult) -> None:
    """Record one served turn (one sample: conversations take n=1); sent again, a no-op."""
    [sample] = result.samples
    turn = msgspec.msgpack.encode(Turn(job_id, len(result.prompt) // 4, len(sample.tokens) // 4,
                                       sample.tool_calls, result.prompt_drift, sample.finish_reason))
    await call_durably(
        client.scripts.conversation_append, client.redis,
        keys=[client.keys.conversation(client.trainer_id, conversation_id)],
        args=[job_id, len(at.prefix_tokens) // 4 if at.prefix_tokens else -1, result.prompt, sample.tokens,
              sample.logprobs, pack_tokens(_token_versions(sample)), int(result.prompt_drift),
              msgspec.msgpack.encode([*messages, reply]), len(turn).to_bytes(4, "little") + turn, TTL_S])


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
        continued = log[offset:offset + 1] == b"1"
        size = int.from_bytes(log[offset + 1:offset + 5], "little")
        turn = msgspec.msgpack.decode(log[offset + 5:offset + 5 + size], type=Turn)
        offset += 5 + size
        if continued:  # its prompt: the segment so far, then what it added
            sample_start = segments[-1] + turn.prompt
        else:
            segments.append(at)
            sample_start = at + turn.prompt
        at = sample_start + turn.sampled
        turns.append(TrajectoryTurn(job_id=turn.job_id, segment=len(segments) - 1, continued=continued,
                                    prompt_start=segments[-1], sample_start=sample_start, end=at,
                                    tool_calls=turn.tool_calls, finish_reason=turn.finish_reason,
                                    drift=turn.drift))
    return Trajectory(
        conversation_id=conversation_id, tokens=unpack_tokens(field[F.TOKENS]), mask=list(field[F.MASK]),
        logprobs=[None if math.isnan(v) else v for v in unpack_floats(field[F.LOGPROBS])],
        token_versions=unpack_tokens(field[F.TOKEN_VERSIONS]), segments=segments, turns=turns,
        drift=int(field.get(F.DRIFT, b"0")))
