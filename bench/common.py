"""What several benchmarks share: random Llama models made on the spot (nothing is downloaded),
process CPU time, and the JSON result file."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

from rollq.bench import results_dir
from rollq.children import stop_child

HERE = Path(__file__).resolve().parent


def make_llama(path: Path, *, hidden: int, layers: int, vocab: int, intermediate: int,
               seed: int = 0) -> Path:
    """A random Llama (head_dim 64, as vLLM's CPU attention needs), float32 safetensors."""
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
    return path


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
