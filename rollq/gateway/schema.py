"""The gateway's HTTP bodies, as msgspec Structs with named fields.

These are the HTTP API's own types, not the Redis wire format (`rollq.protocol`): token ids are
plain integer lists here, so any language can use the API with JSON alone. Requests forbid
unknown fields, so a misspelt field is an error that names it, not a silently ignored setting.
The OpenAPI document is generated from these types.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rollq.canary import (MAX_CANARY_SEQUENCES, Canary, Dtype, Tolerance, encode_canary)
from rollq.protocol import (GroupResult, InvalidInput, Sample, VersionEntry, VersionWindow, pack_floats,
                            pack_tokens, unpack_floats, unpack_tokens)

_REQUEST = dict(forbid_unknown_fields=True, kw_only=True)


class Error(msgspec.Struct):
    message: str
    type: str
    """`invalid_request_error`, `authentication_error`, `permission_error`, `not_found_error`..."""
    field: str | None = None
    """The request field at fault, when there is one (also as `param`, as OpenAI clients expect)."""
    param: str | None = None
    code: int = 400


class ErrorBody(msgspec.Struct):
    error: Error


class SubmitRequest(VersionWindow, **_REQUEST):
    """Its version window: the fields of `VersionWindow`."""

    prompts: list[list[int] | str]
    """One prompt group per entry: token ids, or text for workers whose model has a tokenizer."""
    n: int = 1
    sampling: dict[str, Any] = {}
    """Sampling settings: temperature, top_p, top_k, min_p, max_tokens, logprobs, seed, ..."""
    job_id: str | None = None
    """Make the submit idempotent: the same id again adds nothing."""
    deadline_s: float | None = None
    meta: dict[str, Any] | None = None
    images: list[list[str]] | None = None
    """Per prompt group, its images as `data:image/...;base64,` URLs (PNG, JPEG or WebP), in the
    order of the image placeholders in its prompt; each distinct image is stored once."""
    reward: str | None = None
    """A scored job: a reward the policy's `rollq scorer`s offer (the operator's functions); each
    group reaches the trainer with its samples' `rewards`. As `RolloutClient.submit`'s."""
    reward_inputs: list[Any] | None = None
    """Group i's data for the reward (one entry per prompt group)."""
    reward_errors: Literal["skip", "fail"] = "skip"
    """A reward that raises or times out: that sample gets no reward (`skip`), or the group fails."""
    dynamic_sampling: int | None = None
    """Regenerate a group whose rewards are all equal, up to this many times (then `filtered`)."""
    deliver: int | None = None
    """Over-sampling: deliver the first `deliver` groups scored `ok`, cancel the others."""

    def scoring(self) -> dict[str, Any]:
        return dict(reward=self.reward, reward_inputs=self.reward_inputs, reward_errors=self.reward_errors,
                    dynamic_sampling=self.dynamic_sampling, deliver=self.deliver)


class Submitted(msgspec.Struct):
    job_id: str
    groups: int


class SampleView(msgspec.Struct):
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    stop_reason: int | str | None
    versions: list[tuple[int, int]]
    """(policy version, index of the first token it produced), in order."""
    top_logprobs: list[list[tuple[int, float | None]]] | None = None


class ResultView(msgspec.Struct):
    id: str
    """Result-stream entry id: acknowledge it with POST .../results/ack."""
    job_id: str
    group_index: int
    status: str
    reason: str
    prompt_token_ids: list[int]
    samples: list[SampleView]
    worker_id: str
    queued_s: float
    generation_s: float
    finished_at: float
    image_tokens: int = 0
    """Prompt tokens the images took."""
    rewards: list[float | None] = []
    """A scored job: each sample's reward (null where the reward raised or timed out)..."""
    reward_errors: list[str] = []
    """...why, per sample ('' where it was scored)..."""
    reward: str = ""
    reward_version: str = ""
    """...the reward's name and the version its scorer offers."""


class ResultBatch(msgspec.Struct):
    results: list[ResultView]


class AckRequest(msgspec.Struct, **_REQUEST):
    ids: list[str]


class Acked(msgspec.Struct):
    acked: int


class Cancelled(msgspec.Struct):
    job_id: str
    cancelled: int
    """Groups that had no result yet and end `cancelled`."""


class ToleranceRequest(msgspec.Struct, **_REQUEST):
    """`rollq.canary.Tolerance` as a JSON object."""

    max_abs: Annotated[float, Meta(ge=0.0)]
    mean_abs: Annotated[float, Meta(ge=0.0)]
    kl: Annotated[float, Meta(ge=0.0)]


class CanaryRequest(msgspec.Struct, **_REQUEST):
    """A version's canary as JSON (`rollq/canary.py`): token ids, the trainer's logprob of each
    token after the first under this version, the dtype it computed in, and an optional
    tolerance overriding the workers'. Bounds: `rollq.canary`'s, checked after decoding."""

    sequences: list[list[int]]
    logprobs: list[list[float]]
    dtype: Dtype
    tolerance: ToleranceRequest | None = None

    def to_canary(self) -> Canary:
        if len(self.sequences) > MAX_CANARY_SEQUENCES:
            raise InvalidInput("canary.sequences", f"holds {len(self.sequences)} sequences; the "
                               f"limit is {MAX_CANARY_SEQUENCES}")
        if any(not -2**31 <= t < 2**31 for ids in self.sequences for t in ids):
            raise InvalidInput("canary.sequences", "holds a token id outside int32")
        canary = Canary(sequences=[pack_tokens(ids) for ids in self.sequences],
                        logprobs=[pack_floats(lps) for lps in self.logprobs], dtype=self.dtype,
                        tolerance=None if self.tolerance is None else Tolerance(
                            **msgspec.structs.asdict(self.tolerance)))
        encode_canary(canary, "canary")  # every bound, in rollq's words
        return canary


class PublishRequest(msgspec.Struct, **_REQUEST):
    version: int
    path: str
    """A directory of safetensors files under one of the gateway's allowed weight roots."""
    copy: bool = False
    """Copy the files into the weight store (True) or register the directory in place."""
    keep: int | None = None
    canary: CanaryRequest | None = None
    """The version's canary: every worker checks its engine against it before serving it."""


class FileView(msgspec.Struct):
    name: str
    digest: str
    algorithm: str
    """`blake3` (what is published now) or `sha256` (versions published before it)."""
    bytes: int


class VersionView(msgspec.Struct):
    version: int
    path: str
    files: list[FileView]
    bytes: int
    created_at: float
    publisher: str


class VersionList(msgspec.Struct):
    latest: int | None
    versions: list[VersionView]


def sample_view(s: Sample) -> SampleView:
    return SampleView(unpack_tokens(s.tokens), unpack_floats(s.logprobs), s.finish_reason,
                      s.stop_reason, [tuple(v) for v in s.versions],
                      s.top() if s.top_counts else None)


def result_view(entry_id: str, r: GroupResult) -> ResultView:
    return ResultView(entry_id, r.job_id, r.group_index, r.status, r.reason, r.prompt_ids,
                      [sample_view(s) for s in r.samples], r.worker_id, r.queued_s, r.generation_s,
                      r.finished_at, r.image_tokens, r.rewards, r.reward_errors, r.reward, r.reward_version)


def version_view(e: VersionEntry) -> VersionView:
    return VersionView(e.version, e.path, [FileView(f.name, f.digest, f.algorithm, f.bytes) for f in e.files],
                       e.bytes, e.created_at, e.publisher)
