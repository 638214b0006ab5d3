"""A multi-turn tool-use agent trained with GRPO through rollq episodes, on a tiny model made here.

The task ("parity tool"): each episode is a prompt, then the policy's tool call (4 tokens), then
the tool's output (`TOOL`, the call's sum mod the vocabulary, `END`: tokens the policy did not
sample, masked out of the loss), then the policy's answer (8 tokens). Reward: half for a valid
call (the fraction of its tokens that are even), half for an answer in the tool's result's
parity (the fraction of its tokens that match it). The answer's half depends on what the tool
said; valid calls make the tool's result even, so a policy that learns to call well and to
answer in the result's parity scores 1.0 (a random model about 0.5). Without the call's half the
task is a saddle: with results of either parity equally likely, no answer does better than 0.5
and no gradient leaves it.

Each step: start `groups` episodes of `n` branches each (GRPO groups of episodes: the branches
share the prompt and go on on their own), run the tool on each branch's call, send its output
as the turn's new tokens, end the episodes, compute group-normalised advantages and train on
the whole sequence with the episode's mask (the policy's own tokens only) and its behaviour
logprobs (truncated importance ratio), then publish the weights as the next version. Every turn
of an episode is served by the version its first turn was (the one-version rule).

    python examples/tool_agent.py --redis-url redis://127.0.0.1:6379/0 --model DIR --steps 20
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_grpo import BOS, VOCAB, GRPOTrainer, make_model  # noqa: E402,F401 (make_model: for callers)

from rollq import RolloutClient  # noqa: E402
from rollq.client.episodes import Episode  # noqa: E402

TOOL, END = 3, 4
"""Tokens that frame the tool's output."""
CALL_TOKENS, ANSWER_TOKENS = 4, 8


def tool(call: list[int]) -> list[int]:
    """The tool: adds up the call's tokens."""
    return [TOOL, sum(call) % VOCAB, END]


def reward(episode: Episode) -> float:
    """Half for the call's even tokens, half for the answer's tokens in the tool result's parity."""
    result = episode.tokens[_tool_at(episode) + 1]
    call, answer = _runs(episode)[0], _runs(episode)[-1]
    valid = sum(t % 2 == 0 for t in call) / len(call)
    matched = sum(t % 2 == result % 2 for t in answer) / len(answer) if answer else 0.0
    return (valid + matched) / 2


def _runs(episode: Episode) -> list[list[int]]:
    """The policy's turns: runs of sampled tokens."""
    runs, current = [], []
    for token, sampled in zip(episode.tokens, episode.mask):
        if sampled:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def _tool_at(episode: Episode) -> int:
    """Where the tool's output starts: after the prompt and the call."""
    first_sampled = episode.mask.index(1)
    return first_sampled + len(_runs(episode)[0])


@dataclass
class StepStats:
    step: int
    wall_s: float
    reward: float
    versions: set


class EpisodeTrainer(GRPOTrainer):
    """async_grpo's trainer (model, optimizer, truncated importance ratio) on whole episodes."""

    def __init__(self, model_dir: Path, *, lr: float = 1e-2, max_ratio: float = 2.0):
        super().__init__(model_dir, lr=lr, max_ratio=max_ratio)

    def update(self, groups: list[list[Episode]]) -> float:
        """One GRPO step on groups of episodes; returns the mean reward."""
        rows, advantages, rewards_all = [], [], []
        for group in groups:
            rewards = torch.tensor([reward(e) for e in group])
            rewards_all += rewards.tolist()
            adv = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
            rows += group
            advantages += adv.tolist()
        self.policy_step([(e.tokens, e.mask, e.logprobs) for e in rows], advantages)
        return sum(rewards_all) / len(rewards_all)

    def policy_step(self, rows: list[tuple[list[int], list[int], list[float | None]]],
                    advantages: list[float], *, importance: bool = True) -> None:
        """One policy-gradient step on whole sequences (tokens, mask, behaviour logprobs: NaN or None
        where not sampled), each with its advantage; the loss counts only mask-1 tokens.
        `importance`: weigh each token by its truncated ratio current / behaviour probability."""
        self.optimizer.zero_grad()
        width = max(len(tokens) for tokens, _, _ in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width)
        old = torch.zeros(len(rows), width)
        for i, (tokens, sampled, logprobs) in enumerate(rows):
            ids[i, :len(tokens)] = torch.tensor(tokens)
            attention[i, :len(tokens)] = 1
            mask[i, :len(tokens)] = torch.tensor(sampled, dtype=torch.float32)
            old[i, :len(tokens)] = torch.tensor([0.0 if x is None or math.isnan(x) else x for x in logprobs])
        logits = self.model(ids, attention_mask=attention).logits
        # Position j predicts token j + 1: token k's logprob is at position k - 1.
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        mask, old = mask[:, 1:], old[:, 1:]
        ratio = torch.exp((logp - old).clamp(-20, 20)).clamp(max=self.max_ratio).detach() if importance \
            else torch.ones_like(logp)
        objective = ratio * torch.tensor(advantages)[:, None] * logp
        loss = -(objective * mask).sum() / mask.sum()  # the tool's tokens (mask 0) never count
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()


async def rollout(episodes, rng: random.Random, n: int, version: int) -> list[Episode]:
    """One GRPO group of episodes: start n branches, run the tool on each call, answer, end."""
    prompt = [BOS] + [rng.randrange(5, VOCAB) for _ in range(4)]
    branches = await episodes.start(prompt, n, {"temperature": 1.0, "max_tokens": CALL_TOKENS,
                                                "extra": {"ignore_eos": True}},
                                    min_version=version, deadline_s=300)

    async def finish(branch) -> Episode:
        await episodes.turn(branch.episode_id, tool(branch.tokens), max_tokens=ANSWER_TOKENS)
        return await episodes.end(branch.episode_id)

    return list(await asyncio.gather(*(finish(b) for b in branches)))


async def train(client: RolloutClient, trainer: EpisodeTrainer, *, steps: int, groups: int, n: int,
                seed: int = 0, on_step=None) -> list[StepStats]:
    """Synchronous GRPO over episodes: roll out with version v, train, publish v + 1."""
    rng = random.Random(seed)
    episodes = client.episodes()
    version, began, stats = 0, time.monotonic(), []
    try:
        for step in range(steps):
            batch = await asyncio.gather(*(rollout(episodes, rng, n, version) for _ in range(groups)))
            served = {v for group in batch for e in group for v in e.token_versions if v >= 0}
            mean_reward = await asyncio.to_thread(trainer.update, batch)
            version += 1
            await client.publish_weights(version, trainer.model.state_dict(), keep=2)
            stats.append(StepStats(step, time.monotonic() - began, mean_reward, served))
            if on_step:
                on_step(stats[-1])
    finally:
        await episodes.close()
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--policy", default="tools")
    parser.add_argument("--model", type=Path, required=True, help="the worker's --model directory")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)

    async def run() -> None:
        async with RolloutClient(args.redis_url, policy=args.policy, trainer_id="tool-agent") as client:
            stats = await train(client, EpisodeTrainer(args.model), steps=args.steps, groups=8, n=8,
                                on_step=lambda s: print(f"step {s.step}: reward {s.reward:.3f} "
                                                        f"(versions {sorted(s.versions)})"))
            print(f"{stats[-1].wall_s:.1f} s, reward {stats[0].reward:.3f} -> {stats[-1].reward:.3f}")

    asyncio.run(run())


if __name__ == "__main__":
    main()
