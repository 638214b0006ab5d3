"""A tool-use agent written against the plain openai SDK, trained with GRPO through rollq on CPU.

The agent (`agent` below) is an ordinary OpenAI tool loop: `chat.completions.create` with a tool,
run the tool the model called, send the tool message back, take the final answer. It runs
unchanged against the gateway; the trainer gives it a client whose base URL is the gateway and
whose `default_headers` name the episode's conversation (`X-Rollq-Conversation`), and request
options of its own (temperature, the conversation's `seed`, the step's `exact_version`,
`return_token_ids`). The seeds come from `--seed`: the same seed, the same run.

The task ("secret color"): the tool `guess(color)` answers "correct" for one color of four and
"wrong" otherwise; the reward is 1.0 when the call hit it. The tiny random model made here would
not call a tool by itself, so the first turn names the tool (`tool_choice` a named function: vLLM's
constrained decoding makes the arguments well-formed JSON of the tool's schema) and the policy's
learnable choice is the argument; the answer turn is `tool_choice="none"`.

Each step: `groups` GRPO groups of `n` conversations (one question per group), every request
pinned to the step's version (`exact_version`); the trainer fetches each conversation's exact
trajectory (`RolloutClient.conversation(id)`: the ids the engine was prompted with and sampled,
the mask of sampled tokens, their versions), computes group-normalised advantages, takes one
policy-gradient step on the mask-1 tokens only (tool_agent's `EpisodeTrainer.policy_step`) and
publishes the weights as the next version (a step whose groups all have equal rewards, which
teach nothing, takes no optimiser step). The steps are on-policy (one version per step, one
update per batch), so no importance ratio: the behaviour logprobs of constrained tokens are those
of vLLM's grammar-masked distribution, which a plain forward pass does not reproduce.

    python examples/openai_agent_grpo.py --model DIR --make-model     # the tiny model and its tokenizer
    rollq worker --policy agent --engine vllm --model DIR --enable-auto-tool-choice --tool-call-parser hermes
    rollq gateway --tokens tokens.json                                  # a token of trainer T
    python examples/openai_agent_grpo.py --model DIR --token TOKEN --trainer-id T --steps 12
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_grpo import make_model  # noqa: E402
from tool_agent import EpisodeTrainer  # noqa: E402

from rollq import RolloutClient  # noqa: E402
from rollq.conversations import HEADER, Trajectory  # noqa: E402

COLORS = ["red", "green", "blue", "yellow"]
SECRET = "blue"
GUESS = {"type": "function", "function": {
    "name": "guess", "description": "Guess the secret color.", "strict": True,
    "parameters": {"type": "object", "properties": {"color": {"type": "string", "enum": COLORS}},
                   "required": ["color"], "additionalProperties": False}}}
LR = 5e-3
"""Adam's learning rate: at tool_agent's 1e-2 a step on a few informative groups could undo the task."""
QUESTIONS = ["Guess the secret color.", "Which color is the secret?", "Find the secret color, then tell me.",
             "What is the secret color?"]


def guess(color: str) -> str:
    """The tool."""
    return "correct" if color == SECRET else "wrong"


# --- the agent: an OpenAI tool loop; nothing in it knows about rollq ---------------------------

async def agent(client: openai.AsyncOpenAI, model: str, question: str, **options: Any) -> tuple[list, list]:
    """Ask, run the tool the model calls, send its result back, get the answer. Returns the
    messages and the completions."""
    messages: list[Any] = [{"role": "user", "content": question}]
    first = await client.chat.completions.create(
        model=model, messages=messages, tools=[GUESS], max_tokens=96,
        tool_choice={"type": "function", "function": {"name": "guess"}}, **options)
    message = first.choices[0].message
    messages.append(message)
    if not message.tool_calls:  # no call (cut short): the reply is the answer
        return messages, [first]
    for call in message.tool_calls:
        try:
            result = guess(**json.loads(call.function.arguments))
        except (ValueError, TypeError) as e:  # arguments not the tool's
            result = f"error: {e}"
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    final = await client.chat.completions.create(model=model, messages=messages, tools=[GUESS],
                                                 tool_choice="none", max_tokens=16, **options)
    messages.append(final.choices[0].message)
    return messages, [first, final]


def reward(messages: list) -> float:
    """1.0 when a tool call hit the secret (the tool said so), else 0.0."""
    return float(any(isinstance(m, dict) and m.get("role") == "tool" and m["content"] == "correct"
                     for m in messages))


# --- the tiny model: a random Llama with a byte-level BPE tokenizer and a hermes-style template -----

SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{%- elif m.content is string %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_agent_model(path: Path, seed: int = 0) -> Path:
    """async_grpo's random Llama over the vocabulary of a byte-level BPE tokenizer trained here,
    with a chat template that renders tools and hermes tool calls (`<tool_call>{...}</tool_call>`)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    corpus = [*QUESTIONS, "correct wrong guess Tools: system user assistant tool",
              *(f'{{"name": "guess", "arguments": {{"color": "{c}"}}}}' for c in COLORS)]
    core.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    core.add_tokens([AddedToken(t, normalized=False, special=False) for t in ("<tool_call>", "</tool_call>")])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", chat_template=TEMPLATE)
    make_model(path, seed=seed, vocab=len(tokenizer))
    tokenizer.save_pretrained(path)
    return path


# --- GRPO ------------------------------------------------------------------------------------

@dataclass
class Step:
    step: int
    version: int
    """The version every request of the step asked for (`exact_version`)."""
    wall_s: float
    reward: float
    conversations: list[tuple[list, list, Trajectory]] = field(default_factory=list)
    """(messages, completions, trajectory) of each conversation."""


async def train(gateway_url: str, token: str, client: RolloutClient, trainer: EpisodeTrainer, *,
                model: str, steps: int, groups: int, n: int, seed: int = 0, on_step=None) -> list[Step]:
    """Synchronous GRPO: roll out with version v (every request pinned to it), train, publish v + 1."""
    rng = random.Random(seed)
    run = uuid.uuid4().hex[:8]
    version, began, stats = 0, time.monotonic(), []
    async with openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key=token, max_retries=0) as base:
        for step in range(steps):
            options = dict(temperature=1.0,
                           extra_body={"exact_version": version, "return_token_ids": True})

            async def episode(conversation: str, question: str, sample_seed: int, options=options):
                # The agent's own client, as a user would make it: base URL, key, the header.
                own = base.with_options(default_headers={HEADER: conversation})
                messages, completions = await agent(own, model, question, seed=sample_seed, **options)
                return messages, completions, await client.conversation(conversation)

            names = [[f"{run}-{step}-{g}-{i}" for i in range(n)] for g in range(groups)]
            questions = [rng.choice(QUESTIONS) for _ in range(groups)]
            # A seed per conversation (vLLM's per-request generator) makes the run reproducible: the
            # engine's default generator is shared by whatever requests a step batches together.
            seeds = [[rng.randrange(2**31) for _ in group] for group in names]
            # gather keeps the order it was given: the rows below are group-major, sample-minor, however
            # the conversations finished.
            batch = await asyncio.gather(*(asyncio.gather(*(episode(c, q, s) for c, s in zip(group, ss)))
                                           for group, q, ss in zip(names, questions, seeds)))
            rows, advantages, rewards = [], [], []
            for group in batch:
                r = torch.tensor([reward(messages) for messages, _, _ in group])
                rewards += r.tolist()
                advantages += ((r - r.mean()) / (r.std() + 1e-4)).tolist()
                rows += [(t.tokens, t.mask, t.logprobs) for _, _, t in group]
            if any(advantages):  # else no step: Adam would move the weights on its momentum alone
                await asyncio.to_thread(trainer.policy_step, rows, advantages, importance=False)
            stats.append(Step(step, version, time.monotonic() - began, statistics.mean(rewards),
                              [c for group in batch for c in group]))
            version += 1
            await client.publish_weights(version, trainer.model.state_dict(), keep=2)
            if on_step:
                on_step(stats[-1])
    return stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--gateway", default="http://127.0.0.1:8000")
    parser.add_argument("--token", help="a gateway token of the trainer (scope rollouts)")
    parser.add_argument("--trainer-id", help="the token's trainer (whose conversations these are)")
    parser.add_argument("--policy", default="agent")
    parser.add_argument("--model", type=Path, required=True, help="the worker's --model directory")
    parser.add_argument("--make-model", action="store_true", help="write the tiny model to --model first")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--groups", type=int, default=6, help="GRPO groups (of 8 conversations) per step")
    parser.add_argument("--seed", type=int, default=0,
                        help="the questions' and the samples' seed: the same seed, the same run")
    args = parser.parse_args()
    if args.make_model:
        make_agent_model(args.model)
        return
    if not (args.token and args.trainer_id):
        parser.error("--token and --trainer-id are needed to train")
    torch.set_num_threads(1)

    async def run() -> None:
        async with RolloutClient(args.redis_url, policy=args.policy, trainer_id=args.trainer_id) as client:
            stats = await train(args.gateway, args.token, client, EpisodeTrainer(args.model, lr=LR),
                                model=args.policy, steps=args.steps, groups=args.groups, n=8, seed=args.seed,
                                on_step=lambda s: print(f"step {s.step} (version {s.version}): "
                                                        f"reward {s.reward:.3f}"))
            print(f"{stats[-1].wall_s:.1f} s, reward {stats[0].reward:.3f} -> {stats[-1].reward:.3f}")

    asyncio.run(run())


if __name__ == "__main__":
    main()
