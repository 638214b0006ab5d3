"""Scored rollouts: a scored job's generated groups go to `rollq scorer` processes, which run the
operator's reward functions (never code that came through the queue) and deliver each group to
its trainer once, with a reward per sample.

Operators write rewards as plain functions in a module they name on the command line
(`rollq scorer --policy P --rewards my_rewards`):

    from rollq.scoring import Completion, reward

    @reward("math", version="2", timeout_s=10)
    def math_reward(completion: Completion, inputs) -> float:
        return float(completion.text.strip() == inputs)

A reward gets each sample as a `Completion` (`text`: '' where the worker's model has no
tokenizer, as on the instant engine; `tokens`; `finish_reason`; `index` in its group) and the
group's `reward_inputs` entry, and returns a finite number (int, float, bool or a NumPy scalar;
delivered as float64): NaN, an infinity or a non-number is a reward error, as a raise is.
Sync rewards run in child processes (a per-call time and memory limit), async ones in the
scorer's event loop (a per-call time limit; they must not block it).
"""

from rollq.scoring.rewards import Completion, RewardSpec, reward

__all__ = ["Completion", "RewardSpec", "reward"]
