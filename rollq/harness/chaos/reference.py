"""The known weights of `rollq chaos --weights`: a tiny float32 Llama made on the spot, a few
perturbed weight sets of it, and a transformers reference of each that checks every version
segment of a greedy sample against the weights its label says produced it.

Version v is weight set `v % WEIGHT_SETS` (version 0: the start-up model), so the reference of
every version is known without reading the files the chaos damages.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

WEIGHT_SETS = 3
VOCAB = 512


def weight_set(version: int) -> int:
    return version % WEIGHT_SETS


def make_tiny_model(path: Path) -> Path:
    """The tests' tiny Llama (head_dim 64: vLLM's CPU attention needs it), float32 safetensors."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


class WeightSets:
    """State dicts and transformers models of weight sets 0 (the model as saved) .. WEIGHT_SETS-1
    (each a seeded perturbation of set 0, large enough that greedy continuations differ)."""

    def __init__(self, model_dir: Path):
        base_model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        base = {k: v.clone() for k, v in base_model.state_dict().items()}
        self.states = {0: base} | {i: _perturbed(base, i + 1) for i in range(1, WEIGHT_SETS)}
        self.models = {0: base_model}
        for i in range(1, WEIGHT_SETS):
            model = LlamaForCausalLM(base_model.config).eval()
            model.load_state_dict(self.states[i])
            self.models[i] = model

    def of(self, version: int) -> dict[str, torch.Tensor]:
        return self.states[weight_set(version)]


def _perturbed(base: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in base.items()}


class Reference:
    """What each weight set predicts at every position of a token sequence: the argmax of one
    teacher-forced forward pass per (sequence, weight set), batched, cached per sequence.

    A segment tokens[start:end] of a sample is the greedy continuation under weights W of what
    came before it iff W's argmax at each position before one of its tokens is that token, and
    no token but its last is EOS (greedy decoding stops at EOS, as vLLM does). One pass checks
    every segment of a sample, where `generate` needed one decode per (segment, weight set).
    """

    def __init__(self, sets: WeightSets, batch: int = 64):
        self.sets = sets
        self.batch = batch
        self.eos = sets.models[0].config.eos_token_id
        self._argmax: dict[tuple[int, ...], torch.Tensor] = {}
        """sequence -> [WEIGHT_SETS, len(sequence)]: each weight set's next token after each position."""

    @torch.no_grad()
    def prepare(self, sequences: Iterable[Sequence[int]]) -> None:
        """The forward passes of every sequence not seen yet, in batches of equal length (no
        padding: each position sees exactly the tokens before it)."""
        by_length: dict[int, list[tuple[int, ...]]] = {}
        for seq in dict.fromkeys(tuple(s) for s in sequences):
            if seq and seq not in self._argmax:
                by_length.setdefault(len(seq), []).append(seq)
        for group in by_length.values():
            for i in range(0, len(group), self.batch):
                chunk = group[i:i + self.batch]
                ids = torch.tensor(chunk)
                per_set = torch.stack([self.sets.models[w](ids).logits.argmax(-1)
                                       for w in range(WEIGHT_SETS)], dim=1)
                self._argmax.update(zip(chunk, per_set))

    def _predicted(self, sequence: tuple[int, ...]) -> torch.Tensor:
        if sequence not in self._argmax:
            self.prepare([sequence])
        return self._argmax[sequence]

    def continues(self, prompt: list[int], tokens: list[int], start: int, end: int) -> list[int]:
        """The weight sets under which tokens[start:end] is the greedy continuation of
        prompt + tokens[:start]."""
        if start == end:
            return list(range(WEIGHT_SETS))
        if self.eos in tokens[start:end - 1]:  # greedy would have stopped there
            return []
        offset = len(prompt)
        predicted = self._predicted(tuple(prompt + tokens))[:, offset + start - 1:offset + end - 1]
        want = torch.tensor(tokens[start:end])
        return [w for w in range(WEIGHT_SETS) if torch.equal(predicted[w], want)]

    def mislabels(self, prompt: list[int], tokens: list[int],
                  versions: list[tuple[int, int]]) -> list[str]:
        """Each segment must continue greedily, under its version's weights, what came before it.
        Returns one line of evidence per segment that does not: its label and which weight
        sets' continuations it does equal (none: not any known weights)."""
        bounds = [start for _, start in versions[1:]] + [len(tokens)]
        wrong = []
        for (version, start), end in zip(versions, bounds):
            matches = self.continues(prompt, tokens, start, end)
            if weight_set(version) in matches:
                continue
            wrong.append(f"prompt {prompt} segments {versions}: tokens [{start}:{end}] labelled "
                         f"version {version} (weight set {weight_set(version)}) equal the greedy "
                         f"continuation of weight sets {matches}; tokens {tokens[start:end]}")
        return wrong

    @torch.no_grad()
    def greedy(self, index: int, prompts: list[list[int]], count: int) -> list[tuple[int, ...]]:
        """Each prompt's greedy continuation of up to `count` tokens under weight set `index`,
        ending with EOS (included) when EOS is the argmax, as vLLM's does."""
        model, out = self.sets.models[index], {}
        by_length: dict[int, list[tuple[int, ...]]] = {}
        for prompt in dict.fromkeys(tuple(p) for p in prompts):
            by_length.setdefault(len(prompt), []).append(prompt)
        for group in by_length.values():
            ids = torch.tensor(group)  # equal lengths: no padding
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count,
                                       do_sample=False, pad_token_id=0, eos_token_id=self.eos)
            for prompt, row in zip(group, generated[:, ids.shape[1]:].tolist()):
                out[prompt] = tuple(row[:row.index(self.eos) + 1] if self.eos in row else row)
        return [out[tuple(p)] for p in prompts]
