"""What several benchmarks share: random Llama models made on the spot (nothing is downloaded),
optionally with a tokenizer and a hermes tool-call chat template, process CPU time, and the JSON
result file."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

from rollq.harness.bench import results_dir
from rollq.children import stop_child

HERE = Path(__file__).resolve().parent


def make_llama(path: Path, *, hidden: int, layers: int, vocab: int, intermediate: int,
               seed: int = 0, chat: bool = False) -> Path:
    """A random Llama (head_dim 64, as vLLM's CPU attention needs), float32 safetensors; with
    `chat`, also a byte-level tokenizer over its whole vocabulary and `HERMES_TEMPLATE`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(seed)
    heads = hidden // 64
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(config).save_pretrained(path)
    if chat:
        save_byte_tokenizer(path, vocab=vocab, specials=HERMES_SPECIALS, chat_template=HERMES_TEMPLATE)
    return path


# ChatML with tools in the system turn and an assistant's calls as hermes `<tool_call>` JSON:
# what `--tool-call-parser hermes` reads back.
HERMES_SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
HERMES_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{% for tc in m.tool_calls %}<tool_call>{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}</tool_call>{% endfor %}"
    "{%- elif m.content is string %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_vocab(specials: list[str], size: int) -> dict[str, int]:
    """`specials` (ids 0..), every byte-level character, then words "w0", "w1", .. up to `size`."""
    from tokenizers import pre_tokenizers

    vocab = {name: i for i, name in enumerate(specials)}
    vocab |= {c: len(specials) + i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    word = 0
    while len(vocab) < size:
        vocab.setdefault(f"w{word}", len(vocab))
        word += 1
    return vocab


def save_byte_tokenizer(path: Path, *, vocab: int, specials: list[str], chat_template: str) -> None:
    """A byte-level BPE tokenizer (no merges: any text encodes, byte by byte) over `vocab` ids
    (`byte_level_vocab`), `specials[:3]` being unk, bos and eos, saved with `chat_template`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(byte_level_vocab(specials, vocab), merges=[], unk_token=specials[0]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True) for t in specials])
    unk, bos, eos = specials[:3]
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token=unk, bos_token=bos, eos_token=eos,
                            chat_template=chat_template).save_pretrained(path)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (not its children's)."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def stop_process(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM; SIGKILL after `timeout_s`; then whatever is left in its process group (a vLLM
    worker's engine core) — `rollq.children.stop_child`, the one way rollq stops a child."""
    stop_child(proc, timeout_s)


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def write_result(name: str, result: dict) -> Path:
    result = {"benchmark": name, **result, "machine": machine(), "date": time.strftime("%Y-%m-%d")}
    out = results_dir() / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    return out
