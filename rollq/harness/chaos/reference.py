"""The known weights of `rollq chaos --weights`: a tiny float32 Llama made on the spot, a few
perturbed weight sets of it, and a transformers reference of each that checks every version
segment of a greedy sample against the weights its label says produced it.

Version v is weight set `v % WEIGHT_SETS` (version 0: the start-up model), so the reference of
every version is known without reading the files the chaos damages.
"""

from __future__ import annotations

from functools import cache
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
    """Greedy continuations under each weight set, cached (prompts and prefixes repeat)."""

    def __init__(self, sets: WeightSets):
        self.sets = sets
        self.greedy = cache(self._greedy)

    @torch.no_grad()
    def _greedy(self, index: int, prefix: tuple[int, ...], count: int) -> tuple[int, ...]:
        """Like vLLM, it ends with EOS (included) when EOS is the argmax."""
        if not count:
            return ()
        model = self.sets.models[index]
        ids = torch.tensor([list(prefix)])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count,
                             do_sample=False, pad_token_id=0, eos_token_id=model.config.eos_token_id)
        return tuple(out[0, len(prefix):].tolist())

    def mislabels(self, prompt: list[int], tokens: list[int],
                  versions: list[tuple[int, int]]) -> list[str]:
        """Each segment must continue greedily, under its version's weights, what came before it.
        Returns one line of evidence per segment that does not: its label and which weight
        sets' continuations it does equal (none: not any known weights)."""
        bounds = [start for _, start in versions[1:]] + [len(tokens)]
        wrong = []
        for (version, start), end in zip(versions, bounds):
            prefix, got = tuple(prompt + tokens[:start]), tuple(tokens[start:end])
            if got == self.greedy(weight_set(version), prefix, end - start):
                continue
            matches = [i for i in range(WEIGHT_SETS) if got == self.greedy(i, prefix, end - start)]
            wrong.append(f"prompt {prompt} segments {versions}: tokens [{start}:{end}] labelled "
                         f"version {version} (weight set {weight_set(version)}) equal the greedy "
                         f"continuation of weight sets {matches}; tokens {list(got)}")
        return wrong
