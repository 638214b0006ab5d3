"""Asynchronous GRPO with rollq: a complete trainer in plain PyTorch, on a tiny model made here.

The task ("even"): the policy earns the fraction of its completion tokens that are even (a random
model scores 0.5, a perfect one 1.0), whatever the prompt.
Each prompt has a token budget drawn from a long-tailed distribution (most answers are short, a
few are very long), as completion lengths are in real RL: a synchronous trainer waits for the
longest sample of every batch.

Each step: take one batch of finished groups, compute group-normalised advantages from their
rewards (computed here, or by `rollq scorer` processes when the jobs name a reward), a clipped
(truncated) importance ratio against the behaviour logprobs rollq returned (per token, so tokens
of older versions are weighted by their own version's probabilities), step the optimiser, publish the
weights as the next version, and submit one more batch. Synchronous mode (`max_staleness=0`)
submits after each update and waits; asynchronous mode keeps `k` batches in flight with
`max_staleness=k`, so generation and training overlap.

    python examples/async_grpo.py --redis-url redis://127.0.0.1:6379/0 --model DIR --mode async
(`rollq demo` runs both modes side by side, with a worker and Redis of its own.)
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollq import GroupResult, RolloutClient

VOCAB, BOS, EOS = 512, 1, 2
BUDGETS = [(16, 0.75), (48, 0.19), (192, 0.06)]
"""Token budgets and their shares: a long tail (the mean is 36 tokens, the longest 192)."""


def make_model(path: Path, seed: int = 0, vocab: int = VOCAB) -> Path:
    """A random 2-layer Llama (head_dim 64), float32 safetensors; nothing is downloaded."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=512, bos_token_id=BOS, eos_token_id=EOS)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def make_batch(rng: random.Random, count: int) -> dict[int, list[list[int]]]:
    """`count` prompts, grouped by their token budget."""
    batch: dict[int, list[list[int]]] = {}
    for _ in range(count):
        budget = rng.choices([b for b, _ in BUDGETS], weights=[w for _, w in BUDGETS])[0]
        prompt = [BOS] + [rng.randrange(3, VOCAB) for _ in range(4)]
        batch.setdefault(budget, []).append(prompt)
    return batch


def reward(prompt: list[int], completion: list[int]) -> float:
    body = [t for t in completion if t != EOS]
    return sum(t % 2 == 0 for t in body) / len(body) if body else 0.0


@dataclass
class StepStats:
    step: int
    wall_s: float
    reward: float
    tokens: int
    staleness: Counter = field(default_factory=Counter)
    wait_s: float = 0.0
    """Time the trainer waited for rollouts this step (the synchronous bubble)."""
    train_s: float = 0.0
    reward_s: float = 0.0
    """Time the trainer spent computing rewards this step (0 when scorers computed them)."""


class GRPOTrainer:
    def __init__(self, model_dir: Path, *, lr: float = 3e-3, max_ratio: float = 2.0):
        self.model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.max_ratio = max_ratio

    def update(self, results: list[GroupResult], rewards: list[list[float]] | None = None) -> float:
        """One GRPO step on whole groups (`rewards`: each group's, per sample; default computed
        here with `reward`); returns the batch's mean reward."""
        rows, advantages, behaviour = [], [], []
        rewards_all = []
        if rewards is None:
            rewards = [[reward(r.prompt_ids, s.token_ids) for s in r.samples] for r in results]
        for group, group_rewards in zip(results, rewards):
            prompt = group.prompt_ids
            values = torch.tensor(group_rewards)
            rewards_all += values.tolist()
            # Group-normalised advantage: each sample against its own group's mean.
            adv = (values - values.mean()) / (values.std() + 1e-4)
            for sample, a in zip(group.samples, adv.tolist()):
                if sample.token_ids:
                    rows.append((prompt, sample.token_ids))
                    advantages.append(a)
                    behaviour.append(torch.tensor(sample.token_logprobs))
        if rows:
            self.optimizer.zero_grad()
            total = sum(len(c) for _, c in rows)
            # Micro-batches of similar lengths: padding short rows to the longest costs time.
            order = sorted(range(len(rows)), key=lambda i: len(rows[i][1]))
            for chunk in (order[i:i + 32] for i in range(0, len(order), 32)):
                self._accumulate([rows[i] for i in chunk], torch.tensor([advantages[i] for i in chunk]),
                                 [behaviour[i] for i in chunk], total)
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
        return sum(rewards_all) / max(1, len(rewards_all))

    def _accumulate(self, rows, advantages, behaviour, total_tokens: int) -> None:
        width = max(len(p) + len(c) for p, c in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width)
        old = torch.zeros(len(rows), width)
        for i, (prompt, completion) in enumerate(rows):
            seq = prompt + completion
            ids[i, :len(seq)] = torch.tensor(seq)
            attention[i, :len(seq)] = 1
            # Position j predicts token j + 1: completion tokens are predicted at these positions.
            start = len(prompt) - 1
            mask[i, start:start + len(completion)] = 1
            old[i, start:start + len(completion)] = behaviour[i]
        logits = self.model(ids, attention_mask=attention).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
        mask, old = mask[:, :-1], old[:, :-1]
        # Importance ratio current / behaviour policy, token by token, truncated at max_ratio:
        # a token sampled by an older version is weighed by that version's own probability.
        # One optimiser step per batch, so a PPO-style clip around 1 would only discard the
        # gradient of stale tokens; truncation keeps it and bounds the variance.
        ratio = torch.exp((logp - old).clamp(-20, 20)).clamp(max=self.max_ratio).detach()
        objective = ratio * advantages[:, None] * logp
        loss = -(objective * mask).sum() / total_tokens  # the batch's token mean, over chunks
        loss.backward()


def token_staleness(version: int, batch: list[GroupResult]) -> Counter:
    """Tokens by staleness (trainer version - the version that sampled them), from the segments."""
    seen: Counter = Counter()
    for group in batch:
        for sample in group.samples:
            ends = [start for _, start in sample.versions[1:]] + [len(sample.token_ids)]
            for (v, start), end in zip(sample.versions, ends):
                seen[version - v] += end - start
    return seen


async def rewards_here(batch: list[GroupResult], score) -> list[list[float]]:
    """The batch's rewards computed by the trainer with `score` (async (prompt, completion) ->
    float), every sample at once: the best a trainer can do with a reward that waits (a
    sandbox, a judge), and its step still waits for the slowest sample."""
    values = iter(await asyncio.gather(*(score(r.prompt_ids, s.token_ids)
                                         for r in batch for s in r.samples)))
    return [[next(values) for _ in r.samples] for r in batch]


async def train(client: RolloutClient, trainer: GRPOTrainer, *, steps: int, groups: int, n: int,
                staleness: int, seed: int = 0, on_step=None, scored: str | None = None,
                score=None) -> list[StepStats]:
    """Run `steps` GRPO steps; `staleness` 0 is synchronous, k > 0 keeps k batches ahead.

    `scored`: the name of a reward `rollq scorer` processes offer; the jobs name it and each
    group arrives with its samples' rewards, computed while the trainer trains. Otherwise the
    trainer computes them: `reward`, or `score` (async (prompt, completion) -> float)."""
    rng = random.Random(seed)
    version, began, stats = 0, time.monotonic(), []
    ahead = max(1, staleness)  # batches in flight; synchronous: one, submitted after each update
    batches: list[set[str]] = []  # the job ids of each step's batch
    arrived: dict[str, list[GroupResult]] = {}

    async def submit() -> None:
        # Consumed `ahead - 1` updates from now: min_version keeps its staleness at that time
        # (trainer version - token version) within `staleness`, whatever worker serves it.
        consumed_at = version + ahead - 1
        jobs = set()
        for budget, prompts in make_batch(rng, groups).items():  # one job per budget
            # A scored job: a sample the reward gave no value fails its group (a raise below).
            reward_of = {} if scored is None else {"reward": scored, "reward_errors": "fail"}
            jobs.add(await client.submit(
                prompts, n=n, sampling={"temperature": 1.0, "max_tokens": budget},
                max_staleness=staleness, min_version=max(0, consumed_at - staleness), **reward_of))
        batches.append(jobs)

    async def take_batch(jobs: set[str]) -> list[GroupResult]:
        """All groups of one step's batch; later batches' early results wait their turn."""
        while sum(len(arrived.get(j, [])) for j in jobs) < groups:
            for result in await client.take(groups, timeout_s=1.0, ack="manual"):
                arrived.setdefault(result.job_id, []).append(result)
        return [r for j in jobs for r in arrived.pop(j, [])]

    for _ in range(ahead):
        await submit()
    for step in range(steps):
        waited = time.monotonic()
        batch = await asyncio.wait_for(take_batch(batches[step]), 600)
        waited = time.monotonic() - waited
        failed = [r for r in batch if r.status != "ok"]
        if failed or len(batch) < groups:
            raise RuntimeError(f"step {step}: {len(failed)} groups failed ({failed[:1]}), "
                               f"{len(batch)} of {groups} arrived")
        staleness_seen = token_staleness(version, batch)
        rewarded = time.monotonic()
        if scored is not None:
            rewards = [list(r.rewards) for r in batch]
        elif score is not None:
            rewards = await rewards_here(batch, score)
        else:
            rewards = None  # `update` computes them: a few microseconds
        trained = time.monotonic()
        # Read off the results when scored: the scorer computed them, the trainer spent nothing.
        rewarded = 0.0 if scored is not None else trained - rewarded
        mean_reward = await asyncio.to_thread(trainer.update, batch, rewards)
        trained = time.monotonic() - trained
        await client.ack(batch)  # after the step that used them: a crash before it loses nothing
        version += 1
        await client.publish_weights(version, trainer.model.state_dict(), keep=staleness + 3)
        if step + ahead < steps:
            await submit()
        tokens = sum(len(s.token_ids) for r in batch for s in r.samples)
        stats.append(StepStats(step, time.monotonic() - began, mean_reward, tokens, staleness_seen,
                               waited, trained, rewarded))
        if on_step:
            on_step(stats[-1])
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--policy", default="grpo")
    parser.add_argument("--model", type=Path, required=True, help="the worker's --model directory")
    parser.add_argument("--mode", choices=["sync", "async"], default="async")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)

    async def run() -> None:
        async with RolloutClient(args.redis_url, policy=args.policy, trainer_id=args.mode) as client:
            stats = await train(client, GRPOTrainer(args.model), steps=args.steps, groups=16, n=8,
                                staleness=0 if args.mode == "sync" else 2,
                                on_step=lambda s: print(f"step {s.step}: reward {s.reward:.3f}"))
            print(f"{args.mode}: {stats[-1].wall_s:.1f} s, final reward {stats[-1].reward:.3f}")

    asyncio.run(run())


if __name__ == "__main__":
    main()
