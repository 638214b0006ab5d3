"""A version's canary (issue 41): token sequences with the trainer's own logprobs of them under
one version, and the check of an engine's logprobs of the same sequences against them.

Three parts, one owner: the wire type (`Canary`, size-limited like every Struct of
`protocol.py`), the trainer's side (`reference`: computed by its transformers model in its own
dtype, from token ids, from texts and a tokenizer, or from `default_sequences`), and the verdict
(`compare`). The engine's side, scoring the sequences with vLLM's prompt logprobs, is
`rollq/engine/canary_check.py`. It lives at the root because the publisher (client/), the
registry, the engine and the worker all read it; torch is imported only by `reference`.

The figures, over every scored token (each sequence's tokens after its first):
- `max_abs`, `mean_abs`: max and mean |Δ|, Δ = engine logprob - trainer logprob.
- `kl`: Schulman's k3 estimator of KL(trainer || engine), mean of r - 1 - log r with
  r = p_engine / p_trainer = exp(Δ). On tokens sampled from the trainer's model it is an unbiased
  estimate of the per-token KL, and on any tokens it is never negative and ~Δ²/2 for small Δ (the
  figure verl and slime report for the training-inference gap, so the two read alike). The
  default sequences are vocabulary walks, not samples: there it is a per-token divergence in KL's
  units, not an unbiased KL. Exact KL would need each position's whole distribution (or both
  sides' top-k over the same tokens); vLLM's prompt logprobs return the engine's own top-k, so
  that is left out.

Default tolerances (`TOLERANCES`), measured on the tests' tiny Llama (2 layers, vocabulary 512;
vLLM 0.32's CPU build against transformers, the default canary of 1,016 scored tokens):

| engine vs reference | max abs | mean abs | k3 |
|---|---|---|---|
| float32 vs float32, exact | 9.5e-7 | 1.5e-7 | 3.6e-14 |
| float32, weights cast through bf16 | 2.5e-3 | 6.7e-4 | 3.5e-7 |
| float32, one layer x1.01 | 1.3e-2 | 3.4e-3 | 8.9e-6 |
| float32, two embedding rows swapped | 0.34 | 1.2e-2 | 3.9e-4 |
| bf16 vs bf16, exact | 4.1e-3 | 1.1e-3 | 1.1e-6 |
| bf16 vs float32, exact | 4.6e-3 | 1.1e-3 | 1.0e-6 |

float32's tolerance sits ~100x above its exact figures and ~25x or more below the nearest wrong
case; bf16's ~20x (max), ~9x (mean), ~100x (k3) above its exact figures. Under bf16's tolerance
the swapped rows are still refused (by the max), a layer off by 1 % is not: bf16 noise hides it.
A real checkpoint (more layers, logits ~100x larger than this random model's) may need wider
figures in bf16; the worker's flag sets them, and the check on the 445 MB checkpoint is to do.
float16 takes bf16's numbers (not measured apart).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec
from msgspec import Meta

from rollq.protocol import InvalidInput, pack_floats, pack_tokens, typed, unpack_floats, unpack_tokens

if TYPE_CHECKING:
    import torch

MAX_CANARY_SEQUENCES = 64
MAX_CANARY_SEQUENCE_TOKENS = 4096
MAX_CANARY_TOKENS = 32_768
"""All sequences together: what a worker scores before it opens a version (one prefill)."""
MAX_CANARY_BYTES = 8 * MAX_CANARY_TOKENS + 64 * MAX_CANARY_SEQUENCES + 1024
DEFAULT_SEQUENCES = 8
DEFAULT_LENGTH = 128
"""The default canary: 8 sequences of 128 tokens, a walk through the vocabulary
(`default_sequences`) that holds each token id once, up to 1,024 of them."""

Dtype = Literal["float32", "bfloat16", "float16"]
_PRECISION = {"float32": 0, "float16": 1, "bfloat16": 2}
"""Coarser last: the check uses the tolerance of the coarser of the trainer's and engine's."""

NonNegative = Annotated[float, Meta(ge=0.0)]


class Tolerance(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """The largest figures a version may show and still serve (see the module's docstring)."""

    max_abs: NonNegative
    mean_abs: NonNegative
    kl: NonNegative


TOLERANCES: dict[str, Tolerance] = {
    # The figures behind them: the module's docstring.
    "float32": Tolerance(max_abs=1e-4, mean_abs=1e-5, kl=1e-9),
    "float16": Tolerance(max_abs=0.1, mean_abs=0.01, kl=1e-4),
    "bfloat16": Tolerance(max_abs=0.1, mean_abs=0.01, kl=1e-4),
}

Sequence = Annotated[bytes, Meta(min_length=8, max_length=4 * MAX_CANARY_SEQUENCE_TOKENS)]
"""int32 token ids, two at least (the first has no logprob)."""
Logprobs = Annotated[bytes, Meta(max_length=4 * MAX_CANARY_SEQUENCE_TOKENS)]
"""float32 logprob of each token after the first, given the tokens before it."""


class Canary(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A publish's reference: sequences and the trainer's logprobs of them under its version."""

    sequences: Annotated[list[Sequence], Meta(min_length=1, max_length=MAX_CANARY_SEQUENCES)]
    logprobs: Annotated[list[Logprobs], Meta(min_length=1, max_length=MAX_CANARY_SEQUENCES)]
    dtype: Dtype
    """The dtype the trainer's model computed in."""
    tolerance: Tolerance | None = None
    """This publish's override of the worker's tolerance (None: the worker's)."""

    def token_ids(self) -> list[list[int]]:
        return [unpack_tokens(s) for s in self.sequences]


class Verdict(msgspec.Struct, omit_defaults=True, gc=False):
    """The check's outcome with its figures: what a worker reports, accepted or refused."""

    accepted: bool
    max_abs: float
    mean_abs: float
    kl: float
    tokens: int
    worst: tuple[int, int]
    """(sequence, position) of the largest |Δ|."""
    tolerance: Tolerance
    dtype: str
    """The coarser of the trainer's and the engine's dtype: whose tolerance applied by default."""

    def describe(self) -> str:
        t = self.tolerance
        word = "accepted" if self.accepted else "refused"
        return (f"canary {word}: max |Δ logprob| {self.max_abs:.3g} (tolerance {t.max_abs:.3g}), "
                f"mean {self.mean_abs:.3g} ({t.mean_abs:.3g}), KL k3 {self.kl:.3g} ({t.kl:.3g}) "
                f"over {self.tokens} tokens ({self.dtype}); worst at sequence {self.worst[0]} "
                f"position {self.worst[1]}")


class CanaryRefused(Exception):
    """A version refused by its canary: the engine serves its previous weights. `verdict`: the
    figures (None: the engine could not score the canary at all, `reason` says why)."""

    def __init__(self, version: int, verdict: Verdict | None, reason: str = ""):
        self.version, self.verdict = version, verdict
        super().__init__(f"version {version}: " + (verdict.describe() if verdict is not None else reason))


class CanaryCheck(msgspec.Struct, omit_defaults=True, gc=False):
    """One check a worker ran, as its heartbeat reports it (`WorkerState.canaries`): which
    version, what the engine held it against (`adapter`: an adapter version's check), the
    verdict and when (the worker's wall clock)."""

    version: int
    verdict: Verdict
    at: float
    adapter: bool = False


MAX_REPORTED_CHECKS = 4
"""A heartbeat carries a worker's latest checks, this many at most (newest last)."""


# --- The wire --------------------------------------------------------------------------------

_decoder = msgspec.msgpack.Decoder(Canary)


def encode_canary(canary: Canary, field: str = "canary") -> bytes:
    """A canary built in Python -> its bytes, checked as a worker will check them (msgspec checks
    the constraints only as it decodes): the token budget first, in its own words."""
    validate_canary(canary, field)
    data = msgspec.msgpack.encode(canary)
    decode_canary(data, field)
    return data


def decode_canary(data: bytes, field: str = "canary") -> Canary:
    """Untrusted bytes -> a Canary: size first, then a typed decode, then the checks in code."""
    if len(data) > MAX_CANARY_BYTES:
        raise InvalidInput(field, f"is {len(data)} bytes; the limit is {MAX_CANARY_BYTES}")
    try:
        canary = _decoder.decode(data)
    except msgspec.ValidationError:
        # Again as untyped values, for rollq's words naming the field and the limit.
        canary = typed(field, msgspec.msgpack.decode(data), Canary)
    except msgspec.DecodeError as e:
        raise InvalidInput(field, f"malformed: {e}") from None
    validate_canary(canary, field)
    return canary


def canary_of(entry: Any) -> Canary | None:
    """A registry entry's canary (`VersionEntry.canary`), decoded and checked (InvalidInput
    names it), or None when it was published without one."""
    return decode_canary(entry.canary, f"version {entry.version}'s canary") if entry.canary else None


def validate_canary(canary: Canary, field: str = "canary") -> None:
    """What msgspec's constraints cannot say: shapes that agree, the token budget, logprobs."""
    if len(canary.sequences) != len(canary.logprobs):
        raise InvalidInput(f"{field}.logprobs", f"has {len(canary.logprobs)} entries for "
                           f"{len(canary.sequences)} sequences; give one per sequence")
    total = 0
    for i, (seq, lps) in enumerate(zip(canary.sequences, canary.logprobs)):
        if len(seq) % 4 or len(lps) % 4:
            raise InvalidInput(f"{field}.sequences[{i}]", "int32 ids and float32 logprobs take 4 bytes each")
        n = len(seq) // 4
        total += n
        if len(lps) // 4 != n - 1:
            raise InvalidInput(f"{field}.logprobs[{i}]", f"has {len(lps) // 4} values for {n} tokens; "
                               f"give one per token after the first ({n - 1})")
        if min(unpack_tokens(seq)) < 0:
            raise InvalidInput(f"{field}.sequences[{i}]", "holds a negative token id")
        if not all(-math.inf < v <= 0.0 for v in unpack_floats(lps)):
            raise InvalidInput(f"{field}.logprobs[{i}]", "holds a value that is not a finite log "
                               "probability (<= 0)")
    if total > MAX_CANARY_TOKENS:
        raise InvalidInput(f"{field}.sequences", f"hold {total} tokens; the limit is {MAX_CANARY_TOKENS}")


# --- The trainer's side ----------------------------------------------------------------------

def default_sequences(vocab_size: int, *, count: int = DEFAULT_SEQUENCES,
                      length: int = DEFAULT_LENGTH) -> list[list[int]]:
    """A deterministic walk through the vocabulary, no data needed: token k of the walk is
    (k * stride + 1) mod vocab_size with a stride coprime to it near 0.618 of it, so the first
    vocab_size tokens of the walk are every id once, in an order that puts far ids side by side.
    A wrong row of the embedding shows only if the canary holds its token: the default holds every
    id when count * length >= vocab_size (the tests' models), a sample of them otherwise."""
    if vocab_size < 2:
        raise InvalidInput("vocab_size", f"{vocab_size} is below 2")
    stride = max(1, round(vocab_size * 0.6180339887))
    while math.gcd(stride, vocab_size) != 1:
        stride += 1
    walk = [(k * stride + 1) % vocab_size for k in range(count * length)]
    return [walk[i * length:(i + 1) * length] for i in range(count)]


def reference(model: Any, sequences: list[list[int]] | None = None, *, texts: list[str] | None = None,
              tokenizer: Any = None, tolerance: Tolerance | None = None) -> Canary:
    """The trainer's canary for the version `model` holds (a transformers causal LM), computed in
    the model's own dtype, logprobs from its logits in float32 as vLLM's sampler takes them.

    Sequences: `sequences` (token ids), or `texts` tokenized by `tokenizer`, or
    `default_sequences` of the tokenizer's vocabulary (the model's when no tokenizer is given)."""
    import torch

    if sequences is None and texts is not None:
        if tokenizer is None:
            raise InvalidInput("tokenizer", "texts need the tokenizer that turns them into token ids")
        sequences = [tokenizer(t).input_ids for t in texts]
    if sequences is None:
        vocab = model.config.vocab_size if tokenizer is None else min(len(tokenizer), model.config.vocab_size)
        sequences = default_sequences(vocab)
    param = next(model.parameters())
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(param.dtype)
    if dtype is None:
        raise InvalidInput("model", f"computes in {param.dtype}; a canary knows float32, bfloat16, float16")
    if any(len(ids) < 2 for ids in sequences):
        raise InvalidInput("sequences", "a sequence needs two tokens at least (the first has no logprob)")
    logprobs = _logprobs(model, sequences, param.device)
    canary = Canary(sequences=[pack_tokens(s) for s in sequences],
                    logprobs=[pack_floats(lp) for lp in logprobs], dtype=dtype, tolerance=tolerance)
    validate_canary(canary)
    return canary


def _logprobs(model: Any, sequences: list[list[int]], device: torch.device) -> list[list[float]]:
    """Each token's logprob after the first, sequences of one length in one batch (the default's
    eight are one forward pass), in eval mode (no dropout), the model's mode given back after."""
    import torch

    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(sequences):
        by_length.setdefault(len(ids), []).append(i)
    out: list[list[float]] = [[] for _ in sequences]
    training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            for rows in by_length.values():
                x = torch.tensor([sequences[i] for i in rows], device=device)
                logits = model(x, attention_mask=torch.ones_like(x)).logits[:, :-1].float()
                lp = torch.log_softmax(logits, dim=-1).gather(-1, x[:, 1:, None])[..., 0]
                for i, values in zip(rows, lp.tolist()):
                    out[i] = values
    finally:
        model.train(training)
    return out


# --- The verdict -----------------------------------------------------------------------------

def coarser(a: str, b: str) -> str:
    return max(a, b, key=lambda d: _PRECISION.get(d, 2))


def compare(canary: Canary, engine: list[list[float]], *, engine_dtype: str,
            tolerance: Tolerance | None = None) -> Verdict:
    """The engine's logprobs of the canary's sequences (one list per sequence, tokens after the
    first) against the trainer's. Tolerance: the publish's override, else `tolerance` (the
    worker's), else `TOLERANCES` of the coarser dtype. A NaN or infinite logprob refuses."""
    dtype = coarser(canary.dtype, engine_dtype)
    limit = canary.tolerance or tolerance or TOLERANCES[dtype]
    if len(engine) != len(canary.logprobs):
        raise ValueError(f"the engine scored {len(engine)} sequences of {len(canary.logprobs)}")
    worst, top, total, k3, n = (0, 0), -1.0, 0.0, 0.0, 0
    for i, (ours, theirs) in enumerate(zip(engine, canary.logprobs)):
        theirs = unpack_floats(theirs)
        if len(ours) != len(theirs):
            raise ValueError(f"sequence {i}: the engine scored {len(ours)} tokens of {len(theirs)}")
        for j, (q, p) in enumerate(zip(ours, theirs)):
            d = q - p
            a = abs(d) if math.isfinite(d) else math.inf
            if a > top:
                top, worst = a, (i, j + 1)
            total += a
            k3 += math.expm1(d) - d if a < 700 else math.inf  # r - 1 - log r, r = e^Δ
            n += 1
    mean, kl = total / n, k3 / n
    accepted = top <= limit.max_abs and mean <= limit.mean_abs and kl <= limit.kl
    return Verdict(accepted=accepted, max_abs=top, mean_abs=mean, kl=kl, tokens=n, worst=worst,
                   tolerance=limit, dtype=dtype)
