"""A zero adapter for the full weights' requests on vLLM's CPU build (a workaround).

vLLM's CPU LoRA kernels (`vllm/lora/ops/torch_ops`) pick each token's adapter slot by indexing
with its slot number, and a request without an adapter has slot -1: Python indexing makes that
the *last* slot. When the batch also holds adapter requests, the request of the full weights gets
whatever adapter sits in the last slot (seen here: full-version groups sampled exactly the tokens
of an adapter version; a slot keeps its adapter after `remove_lora` and after a weight reload).
The GPU kernels skip slot -1. So on CPU every request of the full weights is sent with this
adapter, whose deltas are exactly zero (lora_B = 0, so y + x·A·B = y bit for bit), pinned in
the engine with a slot of its own (vLLM's max_loras is one above the worker's --max-loras).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from rollq.registry.adapters import CONFIG, WEIGHTS
from rollq.registry.safetensors_check import dir_schema

NO_ADAPTER_ID = 2**31 - 1
"""vLLM's id of the zero adapter; adapter versions use their version number as id."""
_TARGET = re.compile(r"(.*\.(o_proj|down_proj|q_proj|dense))\.weight$")


def needed() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def write_zero_adapter(model: str, into: Path) -> None:
    """A rank-1 adapter of one linear module of `model`, all zeros."""
    import torch
    from safetensors.torch import save_file

    for name, (_, shape) in sorted(dir_schema(Path(model)).items()):
        match = _TARGET.match(name)
        if match and len(shape) == 2:
            break
    else:
        raise RuntimeError(f"{model}: no linear module (o_proj, down_proj, q_proj, dense) to hang "
                           "the CPU build's zero adapter on")
    module, leaf = match.group(1), match.group(2)
    out_features, in_features = shape
    into.mkdir(parents=True, exist_ok=True)
    save_file({f"base_model.model.{module}.lora_A.weight": torch.zeros(1, in_features),
               f"base_model.model.{module}.lora_B.weight": torch.zeros(out_features, 1)},
              str(into / WEIGHTS))
    (into / CONFIG).write_text(json.dumps({"peft_type": "LORA", "r": 1, "lora_alpha": 1,
                                           "target_modules": [leaf]}))
