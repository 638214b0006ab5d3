"""The training-inference gap (issue 41, deliverable 2): what trainers report of the samples they
train on, summed per policy version and worker, and its readers.

A trainer that recomputes the logprobs of its samples (every PPO/GRPO trainer with importance
ratios does: TRL's `old_per_token_logps`, verl's `old_log_probs`) reports them against the
behaviour logprobs the worker sampled with (TRL's `sampling_per_token_logps`, verl's
`rollout_log_probs`). Per token, Δ = trainer logprob - behaviour logprob, attributed to the
version that sampled the token (`Sample.versions`) and the group's worker. The figures:

- `mean_abs`: mean |Δ| (TRL's `sampling/sampling_logp_difference/mean`, slime's
  `train_rollout_logprob_abs_diff`).
- `kl`: Schulman's k3, mean of r - 1 - log r with r = exp(Δ) = p_trainer / p_behaviour: on tokens
  sampled by the engine an unbiased estimate of KL(behaviour || trainer) per token, never
  negative, ~Δ²/2 for small Δ (verl's `rollout_corr/k3_kl`). The canary's k3 (`canary.compare`)
  is the same formula with Δ = engine - trainer on the trainer's sequences: each is log(p of the
  other side / p of the side the tokens came from), so the two read alike.
- `over_1`: the share of tokens with |Δ| > 1 (a ratio outside [1/e, e]: where truncated or
  masked importance sampling, TRL's and verl's TIS/MIS, cuts or drops tokens).
- `ratio_mean`, `ratio_std`: the importance ratio r = exp(Δ), the factor PPO's and TIS's
  corrections apply (verl reports `rollout_is_mean` and `rollout_is_std`; TRL the ratio's min,
  mean and max). The standard deviation, not the min and max: it is a sum of sums, so records add
  up over trainers and reports; a max could not be kept with HINCRBYFLOAT. Δ is held to ±20 for
  r and k3 (verl's safety bound on the log ratio), so one wild token keeps the sums finite.

Storage: the trainer's own hash (`Keys.gap`), one field per (version, worker, figure), added to
with HINCRBY / HINCRBYFLOAT in one pipeline per report; the readers sum the records of every
trainer in `Keys.gap_trainers` (or of one trainer, for a token without the `observe` scope). A
report is counted once unless its connection drops after Redis ran it (redis-py then sends the
pipeline again: it counts twice); the figures are means, so a repeat moves them little.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import msgspec
from redis.asyncio import Redis

from rollq.protocol import DERIVED_SEPARATOR, MAX_VERSION, InvalidInput, check_id
from rollq.queue import members
from rollq.queue.keys import Keys
from rollq.queue.names import GapField

GAP_VERSIONS = 64
"""Versions a trainer's record keeps: a report that adds a newer one drops the oldest's fields."""
GAP_TTL_S = 7 * 86_400
"""A trainer's record expires this long after its last report."""
LOG_RATIO_BOUND = 20.0
"""|Δ| is held to this for the ratio and k3 (verl's bound): exp(20) squared is still finite."""
OVER = 1.0
"""The |Δ| of `over_1`."""
OUTLIER_FACTOR = 3.0
OUTLIER_FLOOR = 1e-3
"""A worker stands out in a version when its mean |Δ| is above OUTLIER_FACTOR x the median of
the version's other workers and above OUTLIER_FLOOR (float32's own noise is ~1e-6: 3x of that is
no disagreement)."""
LOGPROB_FLOOR = -1e6
"""The least logprob a report may hold (float32 logits give nothing near it; -inf is refused)."""
MAX_REPORT_SAMPLES = 16_384
"""Samples in one report (one call, one HTTP body)."""


@dataclass
class Sums:
    """Running sums of one (version, worker): what a trainer's record holds (`GapField`)."""

    tokens: int = 0
    abs: float = 0.0
    k3: float = 0.0
    over: int = 0
    ratio: float = 0.0
    ratio_sq: float = 0.0

    def add(self, deltas: Iterable[float]) -> None:
        bound = LOG_RATIO_BOUND
        for d in deltas:
            a = abs(d)
            c = d if a <= bound else math.copysign(bound, d)
            r = math.exp(c)
            self.tokens += 1
            self.abs += a
            self.k3 += math.expm1(c) - c  # r - 1 - log r, exact for small Δ
            self.over += a > OVER
            self.ratio += r
            self.ratio_sq += r * r

    def merge(self, other: Sums) -> None:
        for name in ("tokens", "abs", "k3", "over", "ratio", "ratio_sq"):
            setattr(self, name, getattr(self, name) + getattr(other, name))


class GapFigures(msgspec.Struct):
    """The gap of one version's tokens: on one worker, or on all (`worker` "*")."""

    version: int
    worker: str
    tokens: int
    mean_abs: float
    kl: float
    """k3: mean of r - 1 - log r, r = exp(Δ)."""
    over_1: float
    """Share of tokens with |Δ| > 1."""
    ratio_mean: float
    ratio_std: float
    outlier: bool = False
    """Its mean |Δ| is > OUTLIER_FACTOR x the median of the version's other workers."""


class GapView(msgspec.Struct):
    """The gap per version (`versions`, every worker together) and per version and worker
    (`workers`), oldest version first."""

    versions: list[GapFigures] = []
    workers: list[GapFigures] = []


class GapReported(msgspec.Struct):
    samples: int
    tokens: int
    """Tokens counted (a sample's tokens without a version are not)."""


def figures(version: int, worker: str, s: Sums) -> GapFigures:
    n = max(s.tokens, 1)
    mean = s.ratio / n
    return GapFigures(version, worker, s.tokens, s.abs / n, s.k3 / n, s.over / n, mean,
                      math.sqrt(max(0.0, s.ratio_sq / n - mean * mean)))


Tally = dict[tuple[int, str], Sums]
"""(version, worker) -> sums: one report's, before it is written."""


def tally_sample(tally: Tally, worker: str, spans: Sequence[Sequence[int]], behaviour: Sequence[float],
                 trainer: Sequence[float], field: str) -> int:
    """Add one sample's tokens to `tally`, each to the version that sampled it; returns the tokens
    counted. `field` names the trainer's logprobs in errors. Tokens before the first span (none
    from rollq) and tokens whose behaviour logprob is not finite are not counted."""
    if len(trainer) != len(behaviour):
        raise InvalidInput(field, f"has {len(trainer)} logprobs for a sample of {len(behaviour)} tokens; "
                                  "give one per sampled token, in order")
    check_logprobs(trainer, field)
    counted = 0
    for k, (version, start) in enumerate(spans):
        end = spans[k + 1][1] if k + 1 < len(spans) else len(behaviour)
        deltas = [t - b for t, b in zip(trainer[start:end], behaviour[start:end]) if math.isfinite(b)]
        if deltas:
            tally.setdefault((version, worker), Sums()).add(deltas)
            counted += len(deltas)
    return counted


def check_logprobs(values: Sequence[float], field: str) -> None:
    """Log probabilities, finite and above LOGPROB_FLOOR: the sums of their differences stay
    finite (Redis refuses an increment to infinity)."""
    bad = next((i for i, v in enumerate(values) if not LOGPROB_FLOOR <= v <= 0.0), None)
    if bad is not None:
        raise InvalidInput(f"{field}[{bad}]", f"{values[bad]!r} is not a log probability in "
                                              f"[{LOGPROB_FLOOR:g}, 0]")


def check_spans(spans: Sequence[Sequence[int]], tokens: int, field: str) -> list[tuple[int, int]]:
    """Version segments from outside (an HTTP report): versions in range, starts increasing."""
    out, last = [], -1
    for i, span in enumerate(spans):
        if len(span) != 2:
            raise InvalidInput(f"{field}[{i}]", "must be [version, first token]")
        version, start = span
        if not 0 <= version < MAX_VERSION:
            raise InvalidInput(f"{field}[{i}]", f"version {version} is out of range [0, 2**62)")
        if not out and start != 0:
            raise InvalidInput(f"{field}[{i}]", f"the first segment starts at token 0, not {start}")
        if not last < start <= max(tokens - 1, 0):
            raise InvalidInput(f"{field}[{i}]", f"first token {start} must be above the previous "
                                                f"segment's ({last}) and below the sample's {tokens} tokens")
        out.append((version, start))
        last = start
    return out


def check_worker(worker: str, field: str) -> str:
    return worker if worker == "" else check_id(field, worker)


# --- Redis: the trainer's writes ---------------------------------------------------------------

def _field(version: int, worker: str, figure: GapField) -> str:
    return f"{version}:{worker}:{figure.value}"


async def known_versions(redis: Redis, keys: Keys, trainer: str) -> dict[int, set[str]]:
    """The versions and workers a trainer's record holds now (read once per client)."""
    known: dict[int, set[str]] = {}
    for name in await redis.hgetall(keys.gap(trainer)):
        if (parsed := _parse(name)) is not None:
            known.setdefault(parsed[0], set()).add(parsed[1])
    return known


async def write(redis: Redis, keys: Keys, trainer: str, tally: Tally, known: dict[int, set[str]]) -> None:
    """Add a report's sums to the trainer's record in one pipeline, and drop the fields of the
    versions beyond its newest GAP_VERSIONS (`known`: what the record holds, kept up to date)."""
    key = keys.gap(trainer)
    async with redis.pipeline(transaction=False) as pipe:
        for (version, worker), s in sorted(tally.items()):
            pipe.hincrby(key, _field(version, worker, GapField.TOKENS), s.tokens)
            pipe.hincrby(key, _field(version, worker, GapField.OVER), s.over)
            for figure, value in ((GapField.ABS, s.abs), (GapField.K3, s.k3), (GapField.RATIO, s.ratio),
                                  (GapField.RATIO_SQ, s.ratio_sq)):
                pipe.hincrbyfloat(key, _field(version, worker, figure), value)
            known.setdefault(version, set()).add(worker)
        old = sorted(known)[:-GAP_VERSIONS]
        dropped = [_field(v, w, f) for v in old for w in known.pop(v) for f in GapField]
        if dropped:
            pipe.hdel(key, *dropped)
        pipe.expire(key, GAP_TTL_S)
        pipe.sadd(keys.gap_trainers, trainer)
        await pipe.execute()


# --- Redis: the readers ------------------------------------------------------------------------

def _parse(name: bytes | str) -> tuple[int, str, GapField] | None:
    text = name.decode(errors="replace") if isinstance(name, bytes) else name
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isascii() or not parts[0].isdigit():
        return None
    try:
        return int(parts[0]), parts[1], GapField(parts[2])
    except ValueError:
        return None


def _add(into: dict[tuple[int, str], Sums], key: str, record: dict[bytes, bytes]) -> None:
    """A trainer's record into `into`; a field rollq would not write is skipped (its Redis user
    may write anything into its own record: `queue/members.py`)."""
    attr = {GapField.TOKENS: "tokens", GapField.ABS: "abs", GapField.K3: "k3", GapField.OVER: "over",
            GapField.RATIO: "ratio", GapField.RATIO_SQ: "ratio_sq"}
    for name, raw in record.items():
        parsed = _parse(name)
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if parsed is None or not math.isfinite(value) or value < 0 or parsed[0] >= MAX_VERSION:
            members.skip(key, name, "not a gap figure (<version>:<worker>:<figure> -> a finite sum)")
            continue
        version, worker, figure = parsed
        s = into.setdefault((version, worker), Sums())
        counted = int(value) if figure in (GapField.TOKENS, GapField.OVER) else value
        setattr(s, attr[figure], getattr(s, attr[figure]) + counted)


async def read(redis: Redis, keys: Keys, only: str | None = None) -> GapView:
    """The policy's gap summed over every reporting trainer (`only`: one trainer and the ids
    derived from it), its newest GAP_VERSIONS versions."""
    trainers = members.trainer_ids(keys.gap_trainers, await redis.smembers(keys.gap_trainers))
    if only is not None:
        trainers = [t for t in trainers if t == only or t.startswith(only + DERIVED_SEPARATOR)]
    if not trainers:
        return GapView()
    async with redis.pipeline(transaction=False) as pipe:
        for trainer in trainers:
            pipe.hgetall(keys.gap(trainer))
        records = await pipe.execute()
    sums: dict[tuple[int, str], Sums] = {}
    for trainer, record in zip(trainers, records):
        _add(sums, keys.gap(trainer), record)
    return view(sums)


def view(sums: dict[tuple[int, str], Sums]) -> GapView:
    """Figures per version and per (version, worker), the newest GAP_VERSIONS versions, each
    version's workers that stand out marked."""
    versions = sorted({v for (v, _), s in sums.items() if s.tokens})[-GAP_VERSIONS:]
    out = GapView()
    for version in versions:
        rows = [figures(version, w, s) for (v, w), s in sorted(sums.items()) if v == version and s.tokens]
        total = Sums()
        for (v, _), s in sums.items():
            if v == version:
                total.merge(s)
        for row in rows:
            others = [r.mean_abs for r in rows if r is not row]
            row.outlier = bool(others) and row.mean_abs > max(OUTLIER_FLOOR,
                                                              OUTLIER_FACTOR * statistics.median(others))
        out.versions.append(figures(version, "*", total))
        out.workers += rows
    return out
