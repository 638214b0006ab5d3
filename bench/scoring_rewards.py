"""The rewards of bench/scoring.py: no-ops, so that what is measured is scoring's own cost."""

from rollq.scoring import Completion, reward


@reward("noop", timeout_s=30)
def noop(completion: Completion, inputs) -> float:
    return 0.0


@reward("noop_async", timeout_s=30)
async def noop_async(completion: Completion, inputs) -> float:
    return 0.0
