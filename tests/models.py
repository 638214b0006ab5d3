"""Tiny random Llama models made at test time (no download), and Hugging Face references."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 512


def make_model(path: Path, *, seed: int = 0) -> Path:
    """A 2-layer Llama with head_dim 64 (vLLM's CPU attention rejects 16), float32 safetensors.

    Its logits are nearly flat, so greedy choices have margins of ~1e-2: a float32 engine matches
    the float32 reference token for token; a bf16 engine does not always (see the bf16 test).
    """
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=1024, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def load_reference(path: Path) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


@torch.no_grad()
def greedy(model: LlamaForCausalLM, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy completion; like vLLM it ends with EOS (included) when EOS is the argmax."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                         do_sample=False, pad_token_id=0, eos_token_id=model.config.eos_token_id)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def token_logprobs(model: LlamaForCausalLM, prompt: list[int], completion: list[int]) -> list[float]:
    """log p(completion[i] | prompt + completion[:i]) under the reference, by teacher forcing."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(len(completion)), torch.tensor(completion)].tolist()
