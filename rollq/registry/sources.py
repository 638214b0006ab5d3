"""What a trainer publishes -> tensors named as vLLM loads them.

Accepted: a `state_dict`, a Hugging Face model, or a PEFT model. PEFT adapters are merged
without changing the trainer's model (merge, copy, unmerge) and their names cleaned:
`base_model.model.` and `.base_layer` go, `modules_to_save.default.` replaces the original
module, adapter tensors (`lora_*`) are dropped.
"""

from __future__ import annotations

from typing import Any

_PEFT_DROP = ("lora_", ".original_module.")


def clean_peft_names(tensors: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for name, tensor in tensors.items():
        if any(part in name for part in _PEFT_DROP):
            continue
        if name.startswith("base_model.model."):
            name = name[len("base_model.model."):]
        name = name.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        out[name] = tensor
    return out


def _is_peft(model: Any) -> bool:
    return hasattr(model, "merge_adapter") and hasattr(model, "unmerge_adapter")


def saveable(tensors: dict[str, Any]) -> dict[str, Any]:
    """Detached, contiguous CPU copies; tensors sharing storage (tied weights) each get their own."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[name] = t.clone() if key in seen else t
        seen.add(key)
    return out


def tensors_of(source: Any) -> dict[str, Any]:
    """A state_dict, HF model or PEFT model -> {name: tensor} ready for safetensors."""
    if isinstance(source, dict):
        return saveable(clean_peft_names(source))
    if _is_peft(source):
        source.merge_adapter()
        try:
            merged = {k: v.detach().to("cpu").clone() for k, v in source.state_dict().items()}
        finally:
            source.unmerge_adapter()
        return saveable(clean_peft_names(merged))
    if hasattr(source, "state_dict"):
        return saveable(source.state_dict())
    raise TypeError(f"cannot publish a {type(source).__name__}: give a directory of safetensors, "
                    "a state_dict or a model")
