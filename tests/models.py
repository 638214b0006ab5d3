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


# A chat template in the style of real ones: roles as special tokens, `raise_exception` on an
# unknown role, the tools handed to the template, and a template kwarg (`enable_thinking`).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|system|> tools:{% for t in tools %} {{ t.function.name }}{% endfor %} <|end|>"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + m.role) }}{% endif %}"
    "<|{{ m.role }}|> {{ m.content }}{% if not loop.last or m.role != 'assistant' %} <|end|>{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{% if enable_thinking %} <|think|>{% endif %}{% endif %}"
)
CHAT_SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>",
                 "<|end|>", "<|think|>"]


def make_chat_model(path: Path, *, seed: int = 0) -> Path:
    """The tiny model plus a word-level tokenizer over its whole vocabulary ("w9" .. "w511" and
    the special tokens above, ids 0..8) and a chat template: a model vLLM's server can chat with."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    make_model(path, seed=seed)
    vocab = {name: i for i, name in enumerate(CHAT_SPECIALS)}
    vocab |= {f"w{i}": i for i in range(len(CHAT_SPECIALS), VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens([AddedToken(t, special=True) for t in CHAT_SPECIALS])
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path


def make_lora(base: Path, out: Path, *, seed: int, r: int = 8, targets=("q_proj", "v_proj")):
    """A PEFT LoRA adapter of `base`, saved to `out` (PEFT's save_pretrained), with random
    non-zero lora_B (PEFT starts it at zero, which would change nothing). Returns the
    transformers model with the adapter merged: the float32 reference of that adapter."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    model = get_peft_model(load_reference(base), LoraConfig(r=r, lora_alpha=2 * r,
                                                           target_modules=list(targets)))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    model.save_pretrained(out)
    return model.merge_and_unload().eval()
