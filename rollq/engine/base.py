"""The small protocol between the worker loop and whatever generates tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from rollq.protocol import Sample, WorkItem

if TYPE_CHECKING:
    from rollq.canary import Canary, Tolerance


class Generated(NamedTuple):
    samples: list[Sample]
    """All n samples of the group, in index order."""
    prompt: bytes
    """The prompt's int32 token ids as the engine saw them (tokenized, for text prompts)."""
    prompt_scores: Sample | None = None
    """With `Sampling.prompt_logprobs`: the prompt's tokens scored by the model."""
    image_tokens: int = 0
    """Tokens of `prompt` that its images took."""
    prompt_drift: bool = False
    """A chat with an exact prefix whose whole rendering would have given other ids than `prompt`..."""
    prompt_drift_at: int = -1
    """...from this position of `prompt` on (-1: no drift)."""


class GroupError(Exception):
    """This group cannot be generated (bad sampling values, prompt too long, ...).

    The group ends `failed` with this message; the engine and the worker go on.
    """


class VersionWithdrawn(Exception):
    """The group ran tokens on weights that failed their canary (a keep swap's frozen requests
    resume beside the check): its result must not be written. The worker hands it back,
    refunded, and it is served again from the start on an accepted version."""


class EngineDead(Exception):
    """The engine cannot serve any more. The worker hands back every item it holds and exits."""


@runtime_checkable
class Engine(Protocol):
    """What every engine does. An engine that also receives pushes (`VLLMEngine` started with a
    rollq weight-transfer backend) has `push_transport`, `stage_push`, `push` and
    `restore_point` besides; the follower looks for `push_transport` and pushes only to such."""

    @property
    def version(self) -> int:
        """The policy version now loaded."""
        ...

    @property
    def alive(self) -> bool:
        """False once the engine can serve no more (checked before claiming work)."""
        ...

    @property
    def at_once(self) -> bool:
        """True if `generate_group` answers without ever suspending (the instant engine without
        a delay): the worker then serves the groups of a claim in one task, finished together."""
        ...

    def continues_exactly(self, item: WorkItem) -> bool:
        """May a sample of `item` cut mid-generation (an `interrupt` swap) be continued from its
        prompt + tokens so far, drawing each later token as the uncut request would have?"""
        ...

    async def generate_group(self, item: WorkItem) -> Generated:
        """All `item.n` samples of one prompt group, from one engine request.

        Cancellation aborts the request and re-raises CancelledError.
        """
        ...

    async def swap(self, version: int, path: str, *, interrupt: bool = False,
                   keep: bool = False, canary: Canary | None = None,
                   tolerance: Tolerance | None = None) -> dict[str, float]:
        """Load the weights of `version` from `path` (already verified) and serve them.

        `canary`: the version's reference (`rollq/canary.py`), checked on the loaded weights
        before anything serves them, against `tolerance` (the publish's own, else this, else the
        dtype's default); a refusal raises `CanaryRefused` with the engine back on its old
        weights. An engine that cannot score one raises `CanaryRefused` too.

        `interrupt`: running groups are cut and continue under the new weights (their samples
        get one version segment per version); `keep`: they pause and go on under the new weights
        with their KV cache (segments too); else they finish on the old weights first. On a
        load error the engine serves its old version and the error is raised. Returns the
        seconds spent in each phase (e.g. pause, load, resume), for metrics and benchmarks.
        """
        ...

    async def close(self) -> None: ...
