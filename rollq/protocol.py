"""The wire format: every message that crosses Redis, as msgspec Structs, and its limits.

This is the one module that knows how bytes on the wire look. Structs are `array_like` (no
field names on the wire) and `omit_defaults`; new fields go at the end with a default, so older
messages still decode. Token ids travel packed as little-endian int32 bytes and logprobs as
float32 bytes, never as lists of Python ints.

Limits live in two places, each limit in one of them: a limit msgspec can state (a range, a
length, a pattern) is a constraint on the field's type (`Annotated[int, Meta(ge=1, le=MAX_N)]`),
checked by msgspec as it decodes, and said in rollq's words by `_invalid`; the others are
code, in "Validation" below (its first comment says which and why).

Untrusted bytes go through `decode_item`: size first, then a typed decode (the constraints), then
the checks in code. Nothing here can execute code found in a payload (msgpack into typed Structs
only).
"""

from __future__ import annotations

import array
import math
import re
import re._constants as _sre  # the stdlib parser `re` itself uses: to look at a regex's shape
import re._parser as _sre_parse
import sys
from functools import cache
from typing import Annotated, Any, Literal, NamedTuple

import msgspec
from msgspec import Meta

from rollq.grammar import Refused, StructuralTag, is_lark, nullable_repetition

# --- Limits: explicit, checked on the client before encoding and on the worker before use. ---
MAX_N = 1024
"""Samples per group."""
MAX_PROMPT_TOKENS = 131_072
MAX_PROMPT_CHARS = 1_000_000
"""A text prompt (workers with a tokenizer only)."""
MAX_NEW_TOKENS = 131_072
"""`sampling.max_tokens`."""
MAX_GROUP_TOKENS = 4_194_304
"""`n * max_tokens`: bounds the size of one group's result."""
MAX_TOP_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 1024
MAX_ITEM_BYTES = 2 * 1024 * 1024
"""One encoded work item (one prompt group)."""
MAX_META_BYTES = 64 * 1024
"""The user's `meta` of one job, encoded."""
MAX_JOB_GROUPS = 65_536
MAX_ID_CHARS = 128
"""`job_id`, `trainer_id`, policy names."""
MAX_RESULT_BYTES = 512 * 1024 * 1024
MAX_REWARD_INPUT_BYTES = 256 * 1024
"""Encoded `reward_inputs` of one group (the answer, a program's test cases)."""
MAX_CHAT_MESSAGES = 4096
"""Messages of one conversation."""
MAX_CHAT_BYTES = 1024 * 1024
"""One conversation encoded: messages, tools, template and template kwargs together."""
MAX_CHAT_TOOLS = 256
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
"""Per stop string."""
MAX_REGEX_CHARS = 4096
"""`sampling.regex`: the engine compiles it into a grammar per job."""
MAX_STRUCTURED_BYTES = 64 * 1024
"""`sampling.structured_outputs` encoded (a JSON schema, a grammar, choices): the engine compiles
it into a grammar per request, at a cost that grows faster than its size (xgrammar 0.2.8, a flat
schema: 22 KB 0.12 s, 90 KB 1.05 s, 226 KB 8.9 s of CPU, on a loaded box)."""
MAX_LOGIT_BIAS = 4096
"""Token ids in `sampling.logit_bias`: the engine applies them to every sampling step. A
constraint on the field's type (`LogitBias`), so a longer one is refused as it decodes, before
anything walks its entries (msgpack: from its length, before any entry is read)."""
LogitBias = Annotated[dict[str, float], Meta(max_length=MAX_LOGIT_BIAS)]
"""The OpenAI routes' `logit_bias` (token ids as strings, vLLM's)."""
MAX_JSON_NESTING = 64
"""Objects and arrays nested in a structured-output JSON schema: vLLM 0.32's own limit
(`MAX_STRUCTURED_OUTPUT_JSON_NESTING`), 16 more in a structural tag, which wraps its schemas."""
MAX_IMAGES = 16
"""Images of one prompt group."""
MAX_IMAGE_BYTES = 8 * 1024 * 1024
"""One encoded image (PNG, JPEG or WebP file)."""
MAX_IMAGE_PIXELS = 4096 * 4096
"""Width x height of one image: bounds what decoding it costs a worker (4 bytes per pixel)."""
MAX_GROUP_PIXELS = 2 * MAX_IMAGE_PIXELS
"""All images of one group together: a group's decoded pixels stay under ~128 MB."""

ID_PATTERN = re.compile(r"[A-Za-z0-9._\-]+")
"""Matched with fullmatch: `$` would also match before a trailing newline."""

# --- Limits as field types: msgspec checks these as it decodes (`Meta`'s bounds are inclusive
# `ge`/`le` or exclusive `gt`/`lt`, as written here: the error message shows them so). ---
MAX_VERSION = 2**62
"""Policy versions are below this (and staleness too): Redis and Lua hold them as exact numbers."""

GroupSize = Annotated[int, Meta(ge=1, le=MAX_N)]
"""`n`: samples per group."""
Version = Annotated[int, Meta(ge=0, lt=MAX_VERSION)]
"""A policy version (and a staleness, in versions)."""
TokenId = Annotated[int, Meta(ge=0, lt=2**31)]
TopLogprobs = Annotated[int, Meta(ge=0, le=MAX_TOP_LOGPROBS)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Regex = Annotated[str, Meta(max_length=MAX_REGEX_CHARS)]
"""A structured-output regex: its length here, its shape in `validate_regex`."""
Digest = Annotated[str, Meta(pattern=r"^[0-9a-f]{64}\Z",
                             description="a BLAKE3 digest: 64 lowercase hex digits")]
r"""`\Z`, not `$` (which also matches before a trailing newline); an error says the description."""

Status = Literal["ok", "failed", "expired", "cancelled", "filtered"]


class InvalidInput(ValueError):
    """Bad input from a user or a payload: names the field and the limit it broke."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class QueueFull(Exception):
    """The trainer's quota of outstanding groups has no room and the caller asked not to wait
    (or the job is larger than the quota and can never fit)."""

    def __init__(self, message: str, *, outstanding: int = 0, limit: int = 0, groups: int = 0,
                 queued_bytes: int = 0, byte_limit: int = 0, job_bytes: int = 0):
        super().__init__(message)
        self.outstanding = outstanding
        self.limit = limit
        """The effective quota: the smaller of the client's and the operator's cap."""
        self.groups = groups
        self.queued_bytes = queued_bytes
        """Set when the byte quota is what is full: bytes of the trainer's queued items..."""
        self.byte_limit = byte_limit
        """...its quota of them (0: the group quota is what is full)..."""
        self.job_bytes = job_bytes
        """...and the refused job's items."""

    @property
    def never_fits(self) -> bool:
        return self.groups > self.limit or self.job_bytes > self.byte_limit > 0


# --- Packed arrays ---------------------------------------------------------------------------

_LITTLE = sys.byteorder == "little"


def pack_tokens(ids: Any) -> bytes:
    """Token ids (any iterable of ints) -> little-endian int32 bytes."""
    if isinstance(ids, (bytes, bytearray, memoryview)):
        raise TypeError("token ids must be integers, not bytes (already packed?)")
    a = array.array("i", ids)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_tokens(data: bytes) -> list[int]:
    a = array.array("i")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


def pack_floats(values: Any) -> bytes:
    a = array.array("f", values)
    if not _LITTLE:
        a.byteswap()
    return a.tobytes()


def unpack_floats(data: bytes) -> list[float]:
    a = array.array("f")
    a.frombytes(data)
    if not _LITTLE:
        a.byteswap()
    return a.tolist()


# --- Wire types ------------------------------------------------------------------------------

_WIRE = dict(array_like=True, omit_defaults=True, gc=False)


SwapMode = Literal["drain", "interrupt", "keep"]
"""How a worker swaps weights under running groups (docs/architecture.md, "Swaps")."""


class Sampling(msgspec.Struct, **_WIRE):
    """Sampling settings of one job; vLLM's defaults and meanings (`top_k=0` disables it)."""

    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Meta(ge=-1)] = 0
    """0 or -1: off."""
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0, le=100)] = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_NEW_TOKENS)] = 256
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None
    logprobs: TopLogprobs = 0
    """Top-N logprobs per position besides the sampled token's own (always returned)."""
    regex: Regex | None = None
    """Structured output: completions must match this regular expression."""
    extra: dict[str, Any] = {}
    """Passed through to the engine's sampling parameters (validated by the engine)."""
    stop: Annotated[list[str], Meta(max_length=MAX_STOP_STRINGS)] = []
    """Stop strings: a sample ends before the first one its text contains (needs a tokenizer)."""
    return_text: bool = False
    """Return decoded text (`Sample.text`, and token strings with logprobs): the engine
    detokenizes only when this or `stop` asks for it."""
    prompt_logprobs: TopLogprobs | None = None
    """Score the prompt: each prompt token's logprob and the top N at each position
    (`GroupResult.prompt_scores`); None: not computed."""
    text_if_tokenizer: bool = False
    """As `return_text` where the worker's model has a tokenizer; a worker without one returns no
    text instead of failing the group (the gateway's completions: text is optional there)."""
    swap_modes: tuple[SwapMode, ...] = ("drain", "interrupt")
    """How a running group of this job may cross a weight swap (the worker's `--swap-mode`
    decides which kind of swap it makes): `interrupt` cut and continued under the new version
    (KV recomputed: exact per-token segments), `keep` paused and resumed with its KV cache (the
    tokens after the swap attend to KV the older version computed: not any one version's exact
    distribution). A swap of a mode not listed drains the group first (it finishes on its
    version), which every job accepts. The default keeps every token exact; list `keep` to let
    keep-mode workers swap under this job's groups."""
    structured_outputs: StructuredOutputs | None = None
    """Constrain every sample to a JSON schema, a regex, a choice or a grammar (vLLM's
    `SamplingParams.structured_outputs`); None: unconstrained."""
    logit_bias: Annotated[dict[int, float], Meta(max_length=MAX_LOGIT_BIAS)] | None = None
    """Added to the logits of these token ids before sampling (vLLM's `SamplingParams.logit_bias`;
    the engine clamps each to [-100, 100])."""
    token_ranks: bool = False
    """Return each sampled token's rank among all (`Sample.token_ranks`), as vLLM's generate
    route shows it: 4 bytes a token more in the result."""


class StructuredOutputs(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """vLLM 0.32's `StructuredOutputsParams`, field for field and with its meanings: exactly one
    constraint (`json`, `regex`, `choice`, `grammar`, `json_object`, `structural_tag`) and
    the options beside it. Named fields on the wire, unknown ones refused: a worker that cannot
    read a constraint fails the item instead of generating unconstrained."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (an object, or its JSON text)."""
    regex: Regex | None = None
    choice: Annotated[list[str], Meta(min_length=1)] | None = None
    grammar: str | None = None
    """An EBNF (GBNF) or Lark grammar."""
    json_object: bool | None = None
    """True: any JSON object."""
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: Regex | None = None
    structural_tag: str | None = None
    """vLLM's structural tag, as JSON text."""


CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""The fields of `StructuredOutputs` of which exactly one is set."""


class Chat(msgspec.Struct, **_WIRE):
    """A conversation to render into prompt token ids with the worker model's chat template,
    as vLLM's OpenAI server renders a `/v1/chat/completions` request."""

    messages: Annotated[list[dict[str, Any]], Meta(min_length=1, max_length=MAX_CHAT_MESSAGES)]
    """OpenAI chat messages (`role`, `content`, optional `tool_calls`, `name`, ...)."""
    tools: Annotated[list[dict[str, Any]], Meta(max_length=MAX_CHAT_TOOLS)] | None = None
    """OpenAI tool definitions, handed to the template (and to the worker's tool parser)."""
    chat_template: str | None = None
    """A Jinja template instead of the model's own."""
    chat_template_kwargs: dict[str, Any] = {}
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tool_choice: str | dict[str, Any] | None = None
    """vLLM's: "none", "auto", "required" or {"type": "function", "function": {"name": ...}}.
    None (absent): "auto" on a worker started with --enable-auto-tool-choice, else "none"."""
    parallel_tool_calls: bool | None = True
    """False: at most one tool call per sample (constrained and cut as vLLM does)."""
    reasoning_effort: str | None = None
    """vLLM's: handed to the template (and `enable_thinking` = effort != "none")."""
    prefix_tokens: bytes = b""
    """int32 token ids of the conversation so far exactly as the policy saw and sampled them
    (a conversation's record, `rollq/conversations.py`): the prompt is these ids, then the
    template's continuation of `messages[prefix_messages:]`, never a new rendering of the first
    `prefix_messages` messages..."""
    prefix_messages: int = 0
    """...which those ids stand for (0 with no prefix)."""


class WorkItem(msgspec.Struct, **_WIRE):
    """One prompt group: the unit of work in a trainer's work stream.

    It carries no trainer id: the stream it was read from decides whose result stream the
    result goes to, so a forged item cannot write into another trainer's results.
    """

    job_id: str
    group_index: Annotated[int, Meta(ge=0, lt=MAX_JOB_GROUPS)]
    prompt: bytes
    """int32 token ids."""
    n: GroupSize
    sampling: Sampling
    submitted_at: float
    deadline: float = 0.0
    """Unix time after which the group ends `expired`; 0 means none."""
    text: Annotated[str, Meta(max_length=MAX_PROMPT_CHARS)] = ""
    """A text prompt instead of token ids (`prompt` empty); the worker's tokenizer encodes it."""
    min_version: Version = 0
    """Policy versions allowed to generate: at least this..."""
    max_version: Version | None = None
    """...at most this (None: no upper bound)..."""
    max_staleness: Version | None = None
    """...and at least (newest published version - max_staleness) when generation starts."""
    chat: Chat | None = None
    """A conversation instead of token ids or text (`prompt` and `text` empty)."""
    images: Annotated[list[Digest], Meta(max_length=MAX_IMAGES)] = []
    """BLAKE3 hex digests of the group's images, stored once each in Redis (`rollq/images.py`),
    in prompt order; a chat names them in its `rollq-image:<digest>` image_url parts."""
    score: ScoreSpec | None = None
    """A scored job's reward: its finished group goes to the scorers, not to the trainer
    (`rollq/scoring/`)."""


class ScoreSpec(msgspec.Struct, **_WIRE):
    """Which reward scores a group, with what: a name the operator's reward module registered
    (never code), and plain data for it."""

    reward: str
    inputs: Any = None
    """The group's `reward_inputs[i]` (msgpack data: the answer, test cases, ...)."""
    on_error: Literal["skip", "fail"] = "skip"
    """A reward that raises or times out: `skip` leaves that sample without a reward (and says
    why in `reward_errors`), `fail` fails the group."""
    resample: int | None = None
    """Dynamic sampling (DAPO): a group whose rewards are all equal is generated again up to
    this many times, then ends `filtered` (None: off)..."""
    attempt: int = 0
    """...and how many times this group was generated again so far."""
    deliver: int | None = None
    """Over-sampling: the job delivers its first `deliver` groups scored `ok`; the others end
    `cancelled` (the job is cancelled once they are picked: running groups are aborted)."""


class ItemHeader(msgspec.Struct, array_like=True):
    """The first fields of a WorkItem: to size a group before decoding it, and to name the group
    of an item that fails to decode."""

    job_id: str
    group_index: int
    prompt: msgspec.Raw
    n: int


class Sample(msgspec.Struct, **_WIRE):
    """One completion of a group."""

    tokens: bytes
    """int32 completion token ids."""
    logprobs: bytes
    """float32 logprob of each sampled token under the version that produced it."""
    finish_reason: str
    """`stop`, `length` or `abort`."""
    stop_reason: int | str | None = None
    versions: list[tuple[int, int]] = []
    """Version segments: (policy version, index of the first token it produced)."""
    top_counts: bytes = b""
    """Top-N logprobs (when asked for): uint8 entries per position, N, or N+1 when the sampled
    token is not among the top N (it is then last)..."""
    top_ids: bytes = b""
    """...int32 token ids of all positions' entries, best rank first..."""
    top_logprobs: bytes = b""
    """...and their float32 logprobs."""
    text: str = ""
    """Decoded completion text (when `Sampling.return_text` or stop strings asked for it)."""
    token_texts: list[str] = []
    """With text and logprobs: the engine's string of each sampled token..."""
    top_texts: list[str] = []
    """...and of each top-N entry, parallel to `top_ids`."""
    token_ranks: bytes = b""
    """int32 rank of each token among all (1 is the best; 0 unknown): filled for prompt scores,
    and for samples when `Sampling.token_ranks` asks (vLLM's engine ranks every sampled token)."""
    parsed: bool = False
    """A chat sample the worker's vLLM parsers read (--tool-call-parser / --reasoning-parser):
    then `content`, `reasoning` and `tool_calls` are vLLM's message fields, `text` stays raw."""
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = []
    """OpenAI tool calls: {"id", "type": "function", "function": {"name", "arguments"}}."""
    reasoning_tokens: int | None = None
    """A parsed sample's tokens inside thinking markers, counted by the worker's reasoning parser
    (vLLM's `usage.completion_tokens_details.reasoning_tokens`); None without one."""

    @property
    def token_ids(self) -> list[int]:
        return unpack_tokens(self.tokens)

    @property
    def token_logprobs(self) -> list[float]:
        return unpack_floats(self.logprobs)

    def top(self) -> list[list[tuple[int, float | None]]]:
        """Per position: (token id, logprob) by rank; NaN becomes None."""
        ids, values = unpack_tokens(self.top_ids), unpack_floats(self.top_logprobs)
        out, at = [], 0
        for count in self.top_counts:
            out.append([(ids[i], None if math.isnan(values[i]) else values[i])
                        for i in range(at, at + count)])
            at += count
        return out


class GroupResult(msgspec.Struct, **_WIRE):
    """The one terminal result of a group, appended to its trainer's result stream."""

    job_id: str
    group_index: int
    status: Status
    reason: str = ""
    samples: list[Sample] = []
    prompt: bytes = b""
    worker_id: str = ""
    queued_s: float = 0.0
    """Submit to generation start."""
    generation_s: float = 0.0
    finished_at: float = 0.0
    entry_id: str = ""
    """Its result-stream entry id, set by the reader (workers leave it empty): what
    `RolloutClient.ack` acknowledges."""
    prompt_scores: Sample | None = None
    """With `Sampling.prompt_logprobs`: the prompt as a scored sequence (its `tokens` are the
    prompt, `logprobs[0]` is NaN: the first token has no context; `top()` as for samples)."""
    image_tokens: int = 0
    """Tokens of `prompt` that the images took (their placeholders, as the model expands them)."""
    prompt_drift: bool = False
    """A chat with `prefix_tokens`: rendering the whole conversation from its text would have
    given other token ids than `prompt` (re-tokenization drift the exact prefix avoided)."""
    rewards: list[float | None] = []
    """A scored job: each sample's reward (None where the reward raised or timed out)..."""
    reward_errors: list[str] = []
    """...why, per sample ('' where it was scored)..."""
    reward: str = ""
    reward_version: str = ""
    """...the reward's name and the version its scorer offers..."""
    reward_s: float = 0.0
    """...and the wall time of scoring the group."""
    scorer_id: str = ""
    prompt_drift_at: int = -1
    """With `prompt_drift`: the first position where the whole rendering differs from `prompt`."""

    @property
    def prompt_ids(self) -> list[int]:
        return unpack_tokens(self.prompt)


class FileDigest(msgspec.Struct, **_WIRE):
    name: str
    digest: str
    """Hex digest of the file's bytes under `algorithm`."""
    bytes: int
    algorithm: str = "sha256"
    """How `digest` was made: `blake3` for what is published now; `sha256`, the default, is what
    entries written before BLAKE3 carry (they have no fourth field) and still verifies."""


class TensorDigest(msgspec.Struct, **_WIRE):
    """One tensor of a pushed version: torch dtype name (`float32`), shape, and the BLAKE3 of its
    bytes (C order), which the trainer computes on what it sends and the worker on what it got."""

    name: str
    dtype: str
    shape: list[int]
    digest: str


class PushOffer(msgspec.Struct, **_WIRE):
    """A version's tensors offered to live workers, announced with the version (its entry).

    `transport` `shm`: `address` is a file under /dev/shm holding the tensors' bytes back to back
    in the entry's `tensors` order, readable on the machine `host` names (`engine/pushes.py`)."""

    transport: str
    address: str
    host: str


_Bytes = bytes


class VersionEntry(msgspec.Struct, **_WIRE):
    """A registered policy version: where its safetensors files are and what they must hash to."""

    version: int
    path: str
    """Directory on a filesystem every worker sees."""
    files: list[FileDigest]
    bytes: int
    created_at: float
    publisher: str
    owned: bool = True
    """The weight store wrote this directory (retention may delete it); False: by reference."""
    kind: Literal["full", "adapter"] = "full"
    """`full`: complete weights, loaded by a swap. `adapter`: a LoRA adapter (PEFT's
    `adapter_config.json` + `adapter_model.safetensors`) served on top of the full version
    `base`, side by side with other adapters, without a swap."""
    base: int = 0
    """Adapters only: the full version the adapter applies on (0: the model workers start with)."""
    tensors: list[TensorDigest] = []
    """Full versions published with a push: every tensor, in the order the push sends them, with
    the fingerprint a worker checks what it received against before it serves it."""
    push: PushOffer | None = None
    """Where live workers can receive the tensors from, beside the files (`engine/pushes.py`)."""
    canary: _Bytes = b""  # (`bytes` in this class is the field above)
    """The version's canary, encoded (`rollq/canary.py`: sequences and the trainer's logprobs of
    them under this version): a worker checks its engine against it before the version serves.
    Empty: no check. Bounded by `MAX_CANARY_BYTES`, decoded and checked by the worker."""


# One encoder and one decoder per type per process, reused (msgspec's advice).
encoder = msgspec.msgpack.Encoder()
_item_decoder = msgspec.msgpack.Decoder(WorkItem)
_sampling_decoder = msgspec.msgpack.Decoder(Sampling)
_chat_decoder = msgspec.msgpack.Decoder(Chat)
_header_decoder = msgspec.msgpack.Decoder(ItemHeader)
_result_decoder = msgspec.msgpack.Decoder(GroupResult)
_meta_decoder = msgspec.msgpack.Decoder(dict[str, Any])
_version_decoder = msgspec.msgpack.Decoder(VersionEntry)


class ScoreItem(msgspec.Struct, **_WIRE):
    """An entry of a trainer's scoring stream: a generated group of a scored job, waiting for
    its reward. Like a WorkItem it names no trainer: the stream does."""

    spec: ScoreSpec
    result: msgspec.Raw
    """The encoded GroupResult, as the worker finished it."""
    item: bytes = b""
    """The encoded WorkItem, with dynamic sampling: what is queued again."""


_score_item_decoder = msgspec.msgpack.Decoder(ScoreItem)


def decode_score_item(data: bytes) -> tuple[ScoreSpec, GroupResult, bytes]:
    """A scoring entry's spec, group and work item (b"" unless dynamic sampling), size first
    (InvalidInput for anything malformed)."""
    if len(data) > MAX_RESULT_BYTES:
        raise InvalidInput("score item", f"is {len(data)} bytes; the limit is {MAX_RESULT_BYTES}")
    try:
        item = _score_item_decoder.decode(data)
        return item.spec, _result_decoder.decode(item.result), item.item
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise InvalidInput("score item", f"does not decode: {e}") from None


MAX_RESAMPLE = 16


def validate_score(spec: ScoreSpec, field: str = "reward_inputs") -> None:
    check_id("reward", spec.reward)
    if spec.resample is not None and not 0 <= spec.resample <= MAX_RESAMPLE:
        raise InvalidInput("dynamic_sampling", f"{spec.resample} must be in [0, {MAX_RESAMPLE}]")
    try:
        size = len(encode(spec.inputs))
    except (TypeError, OverflowError, msgspec.EncodeError) as e:
        raise InvalidInput(field, f"cannot be encoded as msgpack data: {e}") from None
    if size > MAX_REWARD_INPUT_BYTES:
        raise InvalidInput(field, f"is {size} bytes encoded; the limit is {MAX_REWARD_INPUT_BYTES}")


def encode(obj: Any) -> bytes:
    return encoder.encode(obj)


# --- Validation ------------------------------------------------------------------------------
# What stays code, and why (the rest is in the field types above: decoding checks it):
# - Limits set by configuration: a trainer's quota (`max_outstanding`, the gateway's
#   `max_outstanding_bytes`), the gateway's body and image caps, a worker's `max_model_len` and
#   sequence budget. They are checked where that configuration lives (`client/`, `gateway/`,
#   `worker/`, `engine/`), not here: a type cannot know them.
# - Limits across fields: `n * max_tokens`, `min_tokens <= max_tokens`, a version window's order,
#   one of prompt, text and chat, `prefix_messages` against `messages`, one structured constraint.
# - Limits on what a field encodes to or holds: sizes of `chat`, `meta`, `sampling.extra`,
#   `structured_outputs` and reward inputs encoded; a prompt's packed ids (a multiple of 4 bytes,
#   a count of tokens, none negative); a regex's or grammar's shape; a JSON schema's nesting;
#   `sampling.extra`'s allowed keys; chat roles and `tool_choice`; `logit_bias` (finite biases).
# - Ids (`check_id`): one rule for a dozen ids that are not wire fields (policy, worker, trainer
#   from a header), so it stays one function; and a stop string's length (1 to MAX_STOP_CHARS),
#   whose error names `sampling.stop` as a whole, as does the count's.
# Structs built in Python (the client's, the gateway's) are checked as a worker decodes them:
# `encode_item`, `validate_sampling` and `validate_chat` decode their encoding (msgspec checks
# constraints only when it decodes or converts).


def check_id(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidInput(field, f"must be a non-empty string, got {value!r}")
    if len(value) > MAX_ID_CHARS:
        raise InvalidInput(field, f"is {len(value)} characters; the limit is {MAX_ID_CHARS}")
    if not ID_PATTERN.fullmatch(value):
        raise InvalidInput(field, f"{value!r} may contain only letters, digits, '.', '_' and '-'")
    if not value.strip("."):  # ids name directories and keys: `.` and `..` are paths, not names
        raise InvalidInput(field, f"{value!r} is only dots; use a letter, digit, '_' or '-' too")
    return value


DERIVED_SEPARATOR = "~"
"""Joins the parts of a trainer id rollq derives; never allowed in an id a user chooses."""


def derived_trainer_id(trainer: str, purpose: str, owner: str) -> str:
    """The trainer id under which rollq submits on `trainer`'s behalf (e.g. a gateway's
    completions): `trainer~purpose~owner`. No chosen id contains the separator, so a derived
    id can equal neither a user's trainer id nor another derived id, whatever the lengths."""
    return DERIVED_SEPARATOR.join(check_id(field, part) for field, part in
                                  (("trainer", trainer), ("purpose", purpose), ("owner", owner)))


def check_trainer_id(field: str, value: Any) -> str:
    """A trainer id as chosen by a user, or one of rollq's derived ids."""
    if isinstance(value, str) and value.count(DERIVED_SEPARATOR) == 2:
        for part in value.split(DERIVED_SEPARATOR):
            check_id(field, part)
        return value
    return check_id(field, value)


SAMPLING_EXTRA: dict[str, type] = {
    "ignore_eos": bool, "min_tokens": int, "skip_special_tokens": bool,
    "spaces_between_special_tokens": bool, "include_stop_str_in_output": bool,
}
"""What `sampling.extra` may pass on to vLLM's SamplingParams: cheap, bounded switches. Others are
refused, e.g. `prompt_logprobs` (a vocabulary of floats per prompt token), `logit_bias`,
`allowed_token_ids`, `extra_args` (read by custom logits processors)."""


def validate_extra(extra: dict[str, Any], max_tokens: int, field: str = "sampling.extra") -> None:
    for key, value in extra.items():
        kind = SAMPLING_EXTRA.get(key)
        if kind is None:
            raise InvalidInput(f"{field}.{key}"[:200], f"is not allowed; {field} takes only "
                                                       f"{sorted(SAMPLING_EXTRA)}")
        if type(value) is not kind:  # `type`: a bool is an int, and 1 is not a bool
            raise InvalidInput(f"{field}.{key}", f"must be a {kind.__name__}, got {value!r}"[:200])
    if not 0 <= extra.get("min_tokens", 0) <= max_tokens:
        raise InvalidInput(f"{field}.min_tokens", f"min_tokens={extra['min_tokens']} must be between 0 "
                                                  f"and max_tokens={max_tokens}")


def validate_sampling(s: Sampling, n: int, field: str = "sampling") -> None:
    """The field constraints (as a worker decodes `s`), then the checks in code."""
    _checked(s, _sampling_decoder, field)
    if n * s.max_tokens > MAX_GROUP_TOKENS:
        raise InvalidInput(f"{field}.max_tokens",
                           f"n * max_tokens = {n * s.max_tokens} exceeds {MAX_GROUP_TOKENS} per group")
    validate_extra(s.extra, s.max_tokens, f"{field}.extra")
    if any(not 0 < len(stop) <= MAX_STOP_CHARS for stop in s.stop):
        raise InvalidInput(f"{field}.stop", f"stop strings must have 1 to {MAX_STOP_CHARS} characters")
    if s.regex is not None:
        validate_regex(s.regex, f"{field}.regex")
    if s.structured_outputs is not None:
        if s.regex is not None:
            raise InvalidInput(f"{field}.regex", "excludes structured_outputs: give the regex there")
        validate_structured_outputs(s.structured_outputs, f"{field}.structured_outputs")
    if s.logit_bias is not None:
        validate_logit_bias(s.logit_bias, f"{field}.logit_bias")


def validate_structured_outputs(so: StructuredOutputs, field: str = "sampling.structured_outputs") -> None:
    """Refuse up front what vLLM 0.32 refuses up front (one constraint, none empty, nesting), and
    bound what compiling the rest costs the engine: size, and a regex's shape (`validate_regex`)."""
    given = [name for name in CONSTRAINTS if getattr(so, name) is not None]
    if len(given) != 1:
        raise InvalidInput(field, f"must set exactly one of {', '.join(CONSTRAINTS)}; got "
                                  f"{', '.join(given) or 'none'}")
    [name] = given
    value = getattr(so, name)
    size = len(encode(so))
    if size > MAX_STRUCTURED_BYTES:
        raise InvalidInput(f"{field}.{name}", f"is {size} bytes encoded; the limit is {MAX_STRUCTURED_BYTES}")
    if isinstance(value, str) and name != "regex" and not value.strip():
        raise InvalidInput(f"{field}.{name}", "is empty")
    if name == "json_object" and value is not True:
        raise InvalidInput(f"{field}.json_object", "must be true if set; omit structured_outputs instead")
    if name == "regex":
        if "\x00" in value:
            raise InvalidInput(f"{field}.regex", "must not contain a NUL character")
        validate_regex(value, f"{field}.regex")
    if name == "grammar":
        _check_grammar(value, f"{field}.grammar")
    if name in ("json", "structural_tag"):
        _check_nesting(value, f"{field}.{name}", MAX_JSON_NESTING + (16 if name == "structural_tag" else 0))
        spec = msgspec.json.decode(value) if isinstance(value, str) else value  # (valid: checked above)
        if name == "json":
            _check_schema(spec, f"{field}.json")
        else:
            try:
                tags = StructuralTag(_tag_regex, _check_grammar, _check_schema)
                tags.check(spec, f"{field}.structural_tag")
            except Refused as e:
                raise InvalidInput(e.field, e.why) from None
    if so.whitespace_pattern is not None:
        validate_regex(so.whitespace_pattern, f"{field}.whitespace_pattern")


def _check_grammar(grammar: str, field: str) -> None:
    """An EBNF (GBNF) grammar that repeats nothing that can match nothing; Lark refused."""
    if is_lark(grammar):  # (vLLM's own test: no line with `::=`)
        raise InvalidInput(field, "is a Lark grammar (no `::=` rule), which rollq does not check for "
                                  "what would cost the engine without bound; write it in GBNF "
                                  "(`root ::= ...`)")
    try:
        hazard = nullable_repetition(grammar)
    except RecursionError:
        raise InvalidInput(field, "nests parentheses too deeply") from None
    if hazard:
        raise InvalidInput(field, f"repeats something that can match nothing ({hazard}), which costs "
                                  "the engine time that grows with every token; make each repeated "
                                  "part match at least one character")


def _tag_regex(regex: str, field: str) -> bool:
    """A structural tag's regex, checked as `structured_outputs.regex` is; whether it matches
    the empty string (a part that can match nothing, see `grammar.StructuralTag`)."""
    if len(regex) > MAX_REGEX_CHARS:
        raise InvalidInput(field, f"has {len(regex)} characters; the limit is {MAX_REGEX_CHARS}")
    if "\x00" in regex:
        raise InvalidInput(field, "must not contain a NUL character")
    validate_regex(regex, field)
    try:
        return re.fullmatch(regex, "") is not None
    except re.error:  # (parsed above; compiled differently: count it as empty, the stricter)
        return True


_SCHEMA_VALUES = frozenset({"const", "enum", "default", "examples"})
"""JSON schema keywords whose values are data, not schemas: no `pattern` in them is a regex."""


def _check_schema(schema: Any, field: str) -> None:
    """Every regex a JSON schema holds (`pattern`, `patternProperties`' names), checked as
    `structured_outputs.regex` is: xgrammar turns each into grammar rules. Level by level
    (nesting is bounded before: `_check_nesting`); a node's path is spelled only for a refusal
    (a chat's tools are walked on every request)."""
    if not isinstance(schema, (dict, list)) or b"pattern" not in encode(schema):  # (most: ~0.3 ms)
        return
    level: list[tuple[Any, Any]] = [(schema, (None, field))]  # (node, (parent's link, key))
    while level:
        below = []
        for node, link in level:
            children = enumerate(node) if isinstance(node, list) else node.items()
            for key, value in children:
                if key == "pattern" and isinstance(value, str):
                    _tag_regex(value, _path(link, key))
                elif key == "patternProperties" and isinstance(value, dict):
                    for regex in value:
                        _tag_regex(regex, f"{_path(link, key)}[{regex[:40]!r}]")
                if isinstance(value, (dict, list)) and key not in _SCHEMA_VALUES:
                    below.append((value, (link, key)))
        level = below


def _path(link: tuple[Any, Any], key: Any) -> str:
    """`field.a.b[2].c` from a chain of (parent's link, key) links."""
    parts = [f"[{key}]" if isinstance(key, int) else f".{key}"]
    while link[0] is not None:
        link, key = link
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return (link[1] + "".join(reversed(parts)))[:300]


def validate_logit_bias(bias: dict[int, float], field: str = "sampling.logit_bias") -> None:
    """Size and token-id range; ids beyond the model's vocabulary are the engine's to refuse."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidInput(field, f"has {len(bias)} token ids; the limit is {MAX_LOGIT_BIAS}")
    if any(not 0 <= t < 2**31 for t in bias):
        raise InvalidInput(field, "token ids must be in [0, 2**31)")
    if not all(math.isfinite(v) for v in bias.values()):
        raise InvalidInput(field, "biases must be finite numbers")


def _check_nesting(spec: str | dict[str, Any], field: str, limit: int) -> None:
    """Level by level, without recursion: a schema nested 10,000 deep costs no stack."""
    too_deep = InvalidInput(field, f"is nested too deeply: objects and arrays may nest at most "
                                   f"{limit} levels")
    if isinstance(spec, str):
        try:
            spec = msgspec.json.decode(spec)
        except RecursionError:  # deeper than the decoder's stack: too deep by far
            raise too_deep from None
        except msgspec.DecodeError as e:
            raise InvalidInput(field, f"is not valid JSON: {e}"[:300]) from None
    level: list[Any] = [spec]
    for _ in range(limit):
        level = [child for node in level if isinstance(node, (dict, list))
                 for child in (node.values() if isinstance(node, dict) else node)
                 if isinstance(child, (dict, list))]
        if not level:
            return
    raise too_deep


def validate_chat(chat: Chat, field: str = "chat") -> None:
    """Shape and size only; roles and content are the chat template's business (on the worker).
    The field constraints (as a worker decodes `chat`), then the checks in code."""
    _check_chat(chat, field, len(_checked(chat, _chat_decoder, field)))


def _check_chat(chat: Chat, field: str, size: int) -> None:
    """`validate_chat`'s checks in code, on a decoded Chat that encodes to `size` bytes."""
    for i, message in enumerate(chat.messages):
        if not isinstance(message.get("role"), str):
            raise InvalidInput(f"{field}.messages[{i}].role", "every message needs a string `role`")
    if chat.tool_choice is not None and not isinstance(chat.tool_choice, dict) and \
            chat.tool_choice not in ("none", "auto", "required"):
        raise InvalidInput(f"{field}.tool_choice", f'is {chat.tool_choice!r}: "none", "auto", "required" '
                                                   'or {"type": "function", "function": {"name": ...}}')
    for i, tool in enumerate(chat.tools or ()):
        function = tool.get("function")
        if isinstance(function, dict):  # vLLM turns these into grammars (a named tool_choice, ...)
            _check_schema(function.get("parameters"), f"{field}.tools[{i}].function.parameters")
    if chat.add_generation_prompt and chat.continue_final_message:
        raise InvalidInput(f"{field}.continue_final_message",
                           "excludes add_generation_prompt (set add_generation_prompt to false)")
    _validate_prefix(chat, field)
    if size > MAX_CHAT_BYTES:
        raise InvalidInput(field, f"is {size} bytes encoded; the limit is {MAX_CHAT_BYTES}")


def _validate_prefix(chat: Chat, field: str) -> None:
    at = f"{field}.prefix_messages"
    if len(chat.prefix_tokens) % 4:
        raise InvalidInput(f"{field}.prefix_tokens",
                           f"is {len(chat.prefix_tokens)} bytes; int32 ids take 4 each")
    if not 0 <= chat.prefix_messages < len(chat.messages):
        raise InvalidInput(at, f"is {chat.prefix_messages}; it must leave at least one of the "
                               f"{len(chat.messages)} messages to continue with")
    if bool(chat.prefix_tokens) != bool(chat.prefix_messages):
        raise InvalidInput(at, "and prefix_tokens go together: both or neither")
    if chat.prefix_tokens and not (chat.add_generation_prompt and not chat.continue_final_message):
        raise InvalidInput(f"{field}.continue_final_message",
                           "cannot continue an exact prefix: its continuation ends with the "
                           "generation prompt")
    if chat.prefix_tokens and min(unpack_tokens(chat.prefix_tokens)) < 0:
        raise InvalidInput(f"{field}.prefix_tokens", "holds a negative token id")


_REPEATS = {_sre.MAX_REPEAT, _sre.MIN_REPEAT, getattr(_sre, "POSSESSIVE_REPEAT", _sre.MAX_REPEAT)}


def _children(av: Any) -> list[Any]:
    """The sub-patterns inside one parsed node's arguments (groups, branches, lookarounds)."""
    found = []
    for arg in av if isinstance(av, (tuple, list)) else ():
        if isinstance(arg, _sre_parse.SubPattern):
            found.append(arg)
        elif isinstance(arg, (tuple, list)):
            found += _children(arg)
    return found


def _nested_repeat(pattern: Any, inside_repeat: bool) -> bool:
    """A variable repetition (`*`, `+`, `?`, `{m,n}`) inside a repetition that may run more
    than once: `(a*)*`, `(a+a+)+`, `(a?){300}`."""
    for op, av in pattern:
        if op in _REPEATS:
            low, high, body = av
            if inside_repeat and low != high:
                return True
            if _nested_repeat(body, inside_repeat or high > 1):
                return True
        elif any(_nested_repeat(child, inside_repeat) for child in _children(av)):
            return True
    return False


def validate_regex(regex: str, field: str = "sampling.regex") -> None:
    """Bound what a structured-output regex costs the engine.

    vLLM 0.32 (`auto`) hands it to xgrammar, an Earley parser: no backtracking, but nested
    repetition makes its state sets grow with each generated token (`(a*)*b`: 3.2 s of engine
    time for 200 tokens), in the loop every request of the engine shares. So nested repetition
    is refused; its length (`MAX_REGEX_CHARS`) is its field's type's (`Regex`). Checked with
    Python's parser, whose syntax is close to xgrammar's; what Python cannot parse is refused too.
    """
    try:
        parsed = _sre_parse.parse(regex)
    except (re.error, RecursionError, OverflowError) as e:
        raise InvalidInput(field, f"is not a regular expression: {e}"[:300]) from None
    try:
        nested = _nested_repeat(parsed, False)
    except RecursionError:
        nested = True
    if nested:
        raise InvalidInput(field, "has nested repetition (a `*`, `+`, `?` or `{m,n}` inside a "
                                  "repeated group, as in `(a*)*`), which costs the engine time that "
                                  "grows with every token; write it without the nesting")


def validate_prompt(prompt: bytes, field: str = "prompt") -> None:
    if len(prompt) % 4:
        raise InvalidInput(field, f"packed token ids must be a multiple of 4 bytes, got {len(prompt)}")
    count = len(prompt) // 4
    if count == 0:
        raise InvalidInput(field, "is empty; a prompt needs at least one token")
    if count > MAX_PROMPT_TOKENS:
        raise InvalidInput(field, f"has {count} tokens; the limit is {MAX_PROMPT_TOKENS}")
    smallest = min(memoryview(prompt).cast("i")) if _LITTLE else min(unpack_tokens(prompt))
    if smallest < 0:
        raise InvalidInput(field, "token ids must be non-negative")


def validate_n(n: Any) -> None:
    typed("n", n, GroupSize)


class Window(NamedTuple):
    """A job's version window, resolved and validated (`VersionWindow.resolve`): what its work
    items carry."""

    min_version: int
    max_version: int | None
    max_staleness: int | None


class VersionWindow(msgspec.Struct, kw_only=True):
    """A job's version window as a caller asks for it: the SDK's keyword arguments and the
    gateway's request fields (its request types inherit these four). Every token of the job is
    generated by a version in [min_version, max_version] (`exact_version=v`: both v) that is at
    least (newest - max_staleness) when its group starts."""

    max_staleness: int | None = None
    min_version: int | None = None
    max_version: int | None = None
    exact_version: int | None = None

    def resolve(self) -> Window:
        """The window the work items carry; InvalidInput naming the field that is wrong."""
        lo, hi = self.min_version, self.max_version
        if self.exact_version is not None:
            if lo is not None or hi is not None:
                raise InvalidInput("exact_version", "excludes min_version and max_version")
            lo = hi = self.exact_version
        window = Window(lo or 0, hi, self.max_staleness)
        validate_window(*window)
        return window

    def asked(self) -> dict[str, int | None]:
        """The four fields as keyword arguments (`RolloutClient.submit(**window.asked())`)."""
        return dict(max_staleness=self.max_staleness, min_version=self.min_version,
                    max_version=self.max_version, exact_version=self.exact_version)


def validate_window(min_version: int, max_version: int | None, max_staleness: int | None) -> None:
    """A window given in Python (`VersionWindow.resolve`): each bound as its `Version` type says,
    then their order."""
    for field, value in (("min_version", min_version), ("max_version", max_version),
                         ("max_staleness", max_staleness)):
        if value is not None:
            typed(field, value, Version)
    _check_order(min_version, max_version)


def _check_order(min_version: int, max_version: int | None) -> None:
    if max_version is not None and max_version < min_version:
        raise InvalidInput("max_version", f"max_version={max_version} is below min_version={min_version}")


_passed_shared: bytes | None = None
"""The fields that the groups of one job share (`_shared`), as they were in the last item that
passed `validate_item`."""


def _shared(item: WorkItem) -> bytes | None:
    """What `validate_item` checks that the groups of one job share, as exact bytes (msgpack
    tells 1 from True and from 1.0, which the checks do too); None if it cannot be encoded."""
    try:
        return encoder.encode((item.job_id, item.n, item.min_version, item.max_version,
                               item.max_staleness, item.sampling))
    except (TypeError, OverflowError, msgspec.EncodeError):
        return None


def encode_item(item: WorkItem) -> bytes:
    """A WorkItem built in Python (the client's) -> its bytes, checked as a worker will check them
    (`decode_item`: msgspec checks the fields' constraints only when it decodes)."""
    data = _checked(item, _item_decoder, "")
    _check_item(item)
    return data


def validate_item(item: WorkItem) -> None:
    """`encode_item`, for its checks only."""
    encode_item(item)


def _check_item(item: WorkItem) -> None:
    """The checks in code of a decoded item, in this order; the first one that fails is raised.
    The checks of the fields a job's groups share ran for the previous item of its job already:
    they are skipped when those fields are byte for byte what passed last (a job's groups are
    checked one after the other, on the client and on the worker: this halved the cost of a
    no-op group's)."""
    global _passed_shared
    shared = _shared(item)
    if shared is None or shared != _passed_shared:
        _validate_item(item)
        _passed_shared = shared
        return
    _validate_group(item)


def _validate_item(item: WorkItem) -> None:
    check_id("job_id", item.job_id)
    _check_order(item.min_version, item.max_version)
    _validate_prompt_and_images(item)
    validate_sampling(item.sampling, item.n)
    extra_size = len(encode(item.sampling.extra))
    if extra_size > MAX_META_BYTES:
        raise InvalidInput("sampling.extra", f"is {extra_size} bytes encoded; the limit is {MAX_META_BYTES}")
    if item.score is not None:
        validate_score(item.score, f"reward_inputs[{item.group_index}]")


def _validate_group(item: WorkItem) -> None:
    """The checks of `_validate_item` on fields each group has its own of, in the same order."""
    _validate_prompt_and_images(item)
    if item.score is not None:
        validate_score(item.score, f"reward_inputs[{item.group_index}]")


def _validate_prompt_and_images(item: WorkItem) -> None:
    if item.chat is not None:
        if item.prompt or item.text:
            raise InvalidInput("chat", "give a conversation, token ids or text: one of them")
        _check_chat(item.chat, "chat", len(encode(item.chat)))
    elif item.text:
        if item.prompt:
            raise InvalidInput("prompt", "give token ids or text, not both")
    else:
        validate_prompt(item.prompt)


# --- Decoding untrusted bytes ----------------------------------------------------------------


def decode_item(data: bytes) -> WorkItem:
    """Untrusted work-item bytes -> a validated WorkItem, or InvalidInput naming the problem."""
    if len(data) > MAX_ITEM_BYTES:
        raise InvalidInput("item", f"is {len(data)} bytes; the limit is {MAX_ITEM_BYTES}")
    try:
        item = _item_decoder.decode(data)
    except msgspec.DecodeError as e:
        raise _invalid(e, data, WorkItem, "", "malformed work item: ") from None
    _check_item(item)
    return item


def peek_header(data: bytes) -> ItemHeader | None:
    """Best effort: the job and group of an item that failed to decode, if they can be read."""
    try:
        return _header_decoder.decode(data[:MAX_ITEM_BYTES])
    except msgspec.DecodeError:
        return None


def decode_result(data: bytes) -> GroupResult:
    if len(data) > MAX_RESULT_BYTES:
        raise InvalidInput("result", f"is {len(data)} bytes; the limit is {MAX_RESULT_BYTES}")
    return _result_decoder.decode(data)


def _object_twin(cls: type) -> type:
    """The same Struct with named fields, to validate user dicts with field names in errors."""
    fields = []
    for f in msgspec.structs.fields(cls):
        default = f.default if f.default is not msgspec.NODEFAULT else msgspec.field(
            default_factory=f.default_factory)
        fields.append((f.name, f.type, default))
    return msgspec.defstruct(cls.__name__, fields, forbid_unknown_fields=True)


_SamplingObject = _object_twin(Sampling)


def sampling_from_dict(values: dict[str, Any]) -> Sampling:
    """User settings (`{"max_tokens": 64}`) -> Sampling; unknown, mistyped or out-of-range fields
    are named."""
    obj = typed("sampling", values, _SamplingObject, strict=False)
    return Sampling(**msgspec.structs.asdict(obj))


def as_sampling(sampling: Sampling | dict[str, Any] | None) -> Sampling:
    """What a caller may pass as `sampling` (a Sampling, a dict of settings or None: the
    defaults) -> Sampling."""
    if sampling is None:
        return Sampling()
    if isinstance(sampling, Sampling):
        return sampling
    if not isinstance(sampling, dict):
        raise InvalidInput("sampling", f"must be a Sampling or a dict, got {type(sampling).__name__}")
    return sampling_from_dict(sampling)


def encode_meta(meta: dict[str, Any] | None) -> bytes:
    data = encode(meta or {})
    if len(data) > MAX_META_BYTES:
        raise InvalidInput("meta", f"is {len(data)} bytes encoded; the limit is {MAX_META_BYTES}")
    return data


def decode_meta(data: bytes) -> dict[str, Any]:
    return _meta_decoder.decode(data) if data else {}


def decode_version(data: bytes) -> VersionEntry:
    return _version_decoder.decode(data)


# --- msgspec's errors in rollq's words -------------------------------------------------------
# msgspec says `Expected `int` <= 1024 - at `$[3]``: a position (array_like Structs carry no
# names) and a bound without the value. rollq says `n: n=0 must be an integer between 1 and
# 1024`, as its checks in code do. Only a broken constraint is reworded; any other error (a
# wrong type, a missing field) keeps msgspec's words, with field names for positions.

_AT = re.compile(r" - at (`key` in )?`\$((?:\[\d+\]|\.\w+)*)`$")
_PATH = re.compile(r"`\$((?:\[\d+\]|\.\w+)*)`")
_STEP = re.compile(r"\[(\d+)\]|\.(\w+)")
_ABSENT = object()
_UNITS = {msgspec.inspect.StrType: "characters", msgspec.inspect.BytesType: "bytes",
          msgspec.inspect.ListType: "items", msgspec.inspect.DictType: "entries"}


def typed(field: str, value: Any, typ: Any, *, strict: bool = True) -> Any:
    """A value given in Python (settings, a count) -> `typ` (`msgspec.convert`), its constraints
    checked: InvalidInput naming `field` (and the part of it that is wrong) otherwise."""
    try:
        return msgspec.convert(value, typ, strict=strict)
    except msgspec.ValidationError as e:
        raise _invalid(e, value, typ, field, "", raw=True) from None


def _checked(obj: msgspec.Struct, decoder: msgspec.msgpack.Decoder, field: str) -> bytes:
    """A Struct built in Python -> its bytes, decoded as a worker would decode them: msgspec
    checks the fields' constraints only when it decodes (or converts)."""
    try:
        data = encode(obj)
    except (TypeError, OverflowError, msgspec.EncodeError) as e:  # e.g. an integer beyond 64 bits
        raise InvalidInput(field or "item", f"cannot be encoded: {e}") from None
    try:
        decoder.decode(data)
    except msgspec.ValidationError as e:
        raise _invalid(e, data, type(obj), field, "") from None
    return data


def _invalid(error: msgspec.DecodeError, data: Any, cls: Any, field: str, what: str, *,
             raw: bool = False) -> InvalidInput:
    """msgspec's error on `data` (`cls` encoded; with `raw`, the value itself) -> InvalidInput:
    a broken constraint in rollq's words, named by its field under `field`; anything else as
    msgspec says it, after `what`, positions named (`$.sampling.max_tokens`)."""
    message = str(error)
    if isinstance(error, msgspec.ValidationError):
        at = _AT.search(message)
        if at is None and " - at `" not in message:  # the value itself, not a part of it
            at = _AT.search(" - at `$`")
        if at is not None and not at.group(1):  # a dict's key: msgspec's words say enough
            value = data if raw else _untyped(data)
            # A value given whole (`n`) is reworded whatever it is; a part of one only when it is
            # a number: a wrong type keeps msgspec's words, which name it.
            ours = _reworded(*_locate(cls, at.group(2), value), field, raw and not at.group(2))
            if ours is not None:
                return ours
    return InvalidInput(field or "item", what + _PATH.sub(
        lambda m: f"`{_joined(field or '$', _locate(cls, m.group(1), _ABSENT)[0])}`", message))


def _untyped(data: bytes) -> Any:
    try:
        return msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return _ABSENT


@cache
def _type_info(cls: Any) -> msgspec.inspect.Type:
    return msgspec.inspect.type_info(cls)


def _unwrapped(t: Any) -> tuple[Any, str | None]:
    """A type without `| None` and without Meta's description (returned: an error may say it)."""
    words = None
    while True:
        if isinstance(t, msgspec.inspect.Metadata):
            words = (t.extra_json_schema or {}).get("description", words)
            t = t.type
        elif isinstance(t, msgspec.inspect.UnionType):
            members = [u for u in t.types if not isinstance(u, msgspec.inspect.NoneType)]
            if len(members) != 1:  # which member was meant is not said
                return None, words
            t = members[0]
        else:
            return t, words


def _locate(cls: Any, path: str, value: Any) -> tuple[str, Any, Any, str | None]:
    """An error's path in `cls` (`[4][7]`) -> the field's name (`sampling.max_tokens`), its type
    (`msgspec.inspect`; None where not known), its part of `value` and its description."""
    name, t, words = "", _type_info(cls), None
    for index, key in _STEP.findall(path):
        t, words = _unwrapped(t)
        fields = t.fields if isinstance(t, msgspec.inspect.StructType) else ()
        found = [f for i, f in enumerate(fields) if (i == int(index) if index else f.encode_name == key)]
        if found:
            name, t = _joined(name, found[0].name), found[0].type
        else:
            name, t = _joined(name, f"[{index}]" if index else key), getattr(t, "item_type", None)
        if index and isinstance(value, list) and int(index) < len(value):
            value = value[int(index)]
        elif key and isinstance(value, dict) and key in value:
            value = value[key]
        else:
            value = _ABSENT
    t, described = _unwrapped(t)
    return name, t, value, described or words


def _joined(name: str, part: str) -> str:
    """`sampling` + `max_tokens` -> `sampling.max_tokens`; `images` + `[0]` -> `images[0]`."""
    if not name or not part:
        return name or part
    return f"{name}{part}" if part.startswith("[") else f"{name}.{part}"


def _reworded(name: str, t: Any, value: Any, words: str | None, field: str,
              whole: bool) -> InvalidInput | None:
    name = _joined(field, name)
    if isinstance(t, (msgspec.inspect.IntType, msgspec.inspect.FloatType)) and \
            (whole or isinstance(value, (int, float))):
        leaf = name.rsplit(".", 1)[-1]
        return InvalidInput(name, f"{leaf}={value!r} must be {_bounds(t)}")
    if type(t) in _UNITS and isinstance(value, (str, bytes, list, dict)):
        count, unit = len(value), _UNITS[type(t)]
        if t.max_length is not None and count > t.max_length:
            return InvalidInput(name, f"has {count} {unit}; the limit is {t.max_length}")
        if t.min_length is not None and count < t.min_length:
            return InvalidInput(name, f"{'is empty' if not count else f'has {count} {unit}'}; it needs at "
                                      f"least {t.min_length}")
        if getattr(t, "pattern", None) is not None:
            return InvalidInput(name, f"must be {words}" if words else f"must match {t.pattern!r}")
    return None


def _bounds(t: msgspec.inspect.IntType | msgspec.inspect.FloatType) -> str:
    """`an integer between 1 and 1024`, `a number in (0, 1]`: the bounds as the type states them."""
    if isinstance(t, msgspec.inspect.IntType):
        lo = t.ge if t.ge is not None else None if t.gt is None else t.gt + 1
        hi = t.le if t.le is not None else None if t.lt is None else t.lt - 1
        if lo is not None and hi is not None:
            return f"an integer between {lo} and {hi}"
        return f"an integer >= {lo}" if lo is not None else f"an integer <= {hi}"
    lo = f"[{t.ge}" if t.ge is not None else f"({t.gt}" if t.gt is not None else "(-inf"
    hi = f"{t.le}]" if t.le is not None else f"{t.lt})" if t.lt is not None else "inf)"
    return f"a number in {lo}, {hi}"
