"""A trainer's report of its recomputed logprobs (`RolloutClient.report_logprobs`): the results it
took and its logprobs of their samples -> one tally per (version, worker) (`queue/gap.py`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from rollq.protocol import GroupResult, InvalidInput
from rollq.queue.gap import MAX_REPORT_SAMPLES, Tally, tally_sample


def as_floats(values: Any, field: str) -> list[float]:
    """A list of floats, or a 1-D tensor / array (torch, numpy: anything with `tolist`)."""
    if hasattr(values, "detach"):  # a torch tensor, maybe on a GPU and in bf16
        values = values.detach().float().cpu()
    if hasattr(values, "tolist"):
        values = values.tolist()
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise InvalidInput(field, f"must be a list of floats or a 1-D tensor, got {type(values).__name__}")
    try:
        return [float(v) for v in values]
    except (TypeError, ValueError):
        raise InvalidInput(field, "must hold numbers only (one logprob per sampled token; "
                                  "a 2-D tensor? give one row per sample)") from None


def tally_results(results: Iterable[GroupResult], trainer_logprobs: Sequence[Any]) -> tuple[Tally, int, int]:
    """(tally, samples, tokens counted). `trainer_logprobs`: one entry per sample of `results`,
    in order (result by result, sample by sample); None for a sample not trained on."""
    results = list(results)
    for i, r in enumerate(results):
        if not isinstance(r, GroupResult):
            raise InvalidInput(f"results[{i}]", f"is a {type(r).__name__}; give the GroupResults "
                                                "the samples came in (they name the worker)")
    samples = [(r.worker_id, s) for r in results for s in r.samples]
    if isinstance(trainer_logprobs, (str, bytes)) or not hasattr(trainer_logprobs, "__len__"):
        raise InvalidInput("trainer_logprobs", "must be a list with one entry per sample")
    if len(trainer_logprobs) != len(samples):
        raise InvalidInput("trainer_logprobs", f"has {len(trainer_logprobs)} entries for the "
                                               f"{len(samples)} samples of the results given; give "
                                               "one per sample, in order (None to skip one)")
    if len(samples) > MAX_REPORT_SAMPLES:
        raise InvalidInput("results", f"hold {len(samples)} samples; the limit is {MAX_REPORT_SAMPLES} "
                                      "per report (report in parts)")
    tally: Tally = {}
    counted = reported = 0
    for i, ((worker, sample), given) in enumerate(zip(samples, trainer_logprobs)):
        if given is None:
            continue
        field = f"trainer_logprobs[{i}]"
        counted += tally_sample(tally, worker, sample.versions, sample.token_logprobs,
                                as_floats(given, field), field)
        reported += 1
    return tally, reported, counted

