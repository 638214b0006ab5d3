"""Scored rollouts: a scored job's generated groups go to `rollq scorer` processes, which run the
operator's reward functions (never code that came through the queue) and deliver each group to
its trainer once, with a reward per sample.

Operators write rewards as plain functions in a module they name on the command line
(`rollq scorer --policy P --rewards my_rewards`):

    from rollq.scoring import Completion, reward

    @reward("math", version="2", timeout_s=10)
    def math_reward(completion: Completion, inputs) -> float:
        return float(completion.text.strip() == inputs)

Sync rewards run in child processes (a per-call time and memory limit), async ones in the
scorer's event loop (a per-call time limit; they must not block it).
"""

from rollq.scoring.rewards import Completion, RewardSpec, reward

__all__ = ["Completion", "RewardSpec", "reward"]
