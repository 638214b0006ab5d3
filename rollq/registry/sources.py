"""What a trainer publishes -> tensors named as vLLM loads them.

Accepted: a `state_dict`, a Hugging Face model, or a PEFT model; sharded ones too (FSDP2 /
DTensor parameters: `gathered`). PEFT adapters are merged into
a copy of the weights (base + each active adapter's delta), never into the trainer's model
(merging and unmerging in place would leave rounding errors in its base weights), and names are
cleaned:
`base_model.model.` and `.base_layer` go, `modules_to_save.default.` replaces the original
module, adapter tensors (`lora_*`) are dropped. Published as an adapter version instead
(`publish_weights(..., adapter_on=base)`), a PEFT model gives only its adapter (`adapter_of`).
"""

from __future__ import annotations

import contextlib
import weakref
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


def _merged_copy(model: Any) -> dict[str, Any]:
    tensors = {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        if not (hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")):
            continue
        if getattr(module, "merged", False):  # the trainer merged it itself: already in
            continue
        key = f"{name}.base_layer.weight"
        for adapter in module.active_adapters:
            delta = module.get_delta_weight(adapter).detach().to("cpu")
            tensors[key] = tensors[key] + delta.to(tensors[key].dtype)
    return tensors


def saveable(tensors: dict[str, Any], *, own: bool = False) -> dict[str, Any]:
    """Detached, contiguous CPU tensors; tensors sharing storage (tied weights) each get their
    own; `own`: all of them copies."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        out[name] = t.clone() if own or key in seen else t
        seen.add(key)
    return out


def tensors_of(source: Any, *, own: bool = False) -> dict[str, Any]:
    """A state_dict, HF model or PEFT model -> {name: tensor} ready for safetensors.

    `own`: every tensor a copy, never a view of the trainer's parameters (a publish that runs
    on while the trainer steps); else CPU tensors may be the trainer's own."""
    if isinstance(source, dict):
        return saveable(clean_peft_names(source), own=own)
    if _is_peft(source):  # the merged copy is ours already
        return saveable(clean_peft_names(_merged_copy(source)))
    if hasattr(source, "state_dict"):
        return saveable(source.state_dict(), own=own)
    raise TypeError(f"cannot publish a {type(source).__name__}: give a directory of safetensors, "
                    "a state_dict or a model")


def named_tensors(source: Any) -> dict[str, Any]:
    """A state_dict, HF model or PEFT model -> {name: tensor} as published, nothing copied (a
    PEFT model's merged copy aside): for `staging.Staging.pack`, which copies every byte once."""
    if isinstance(source, dict):
        return clean_peft_names(source)
    if _is_peft(source):
        return clean_peft_names(_merged_copy(source))
    if hasattr(source, "state_dict"):
        return dict(source.state_dict())
    raise TypeError(f"cannot publish a {type(source).__name__}: give a directory of safetensors, "
                    "a state_dict or a model")


def is_sharded(source: Any) -> bool:
    """Whether `source` (a model or state_dict) holds DTensors, as FSDP2 and tensor-parallel
    models do: every rank holds a piece of each tensor."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support shards nothing
        return False
    if isinstance(source, dict):
        values = source.values()
    elif hasattr(source, "state_dict") and not _is_peft(source):
        values = source.parameters() if hasattr(source, "parameters") else source.state_dict().values()
    else:
        return False
    return any(isinstance(t, DTensor) for t in values)


def gathered(source: Any) -> dict[str, Any] | None:
    """A sharded model's or state_dict's full tensors on rank 0, None on the other ranks.

    Every rank must call it, as for any collective: each DTensor is all-gathered in the
    state_dict's order (the same on every rank), one at a time, and the ranks other than 0 drop
    each full tensor at once, so only rank 0 ever holds the whole model (on CPU)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    state = source if isinstance(source, dict) else source.state_dict()
    keep = dist.get_rank() == 0
    out = {}
    for name, t in state.items():
        full = t.full_tensor() if isinstance(t, DTensor) else t
        if keep:
            out[name] = full.detach().to("cpu").clone()
    return saveable(clean_peft_names(out)) if keep else None


_ADAPTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""PEFT model -> {(adapter, vocab size, its config's repr): (whether PEFT saves embeddings, where
each tensor of its state dict lives: `_where`, None to ask PEFT every time)}."""


def _adapter_tensors(model: Any, name: str) -> dict[str, Any]:
    """PEFT's state dict of adapter `name`. PEFT builds it from the whole model's `state_dict()`
    and reads the base model's config again to decide on embeddings, on every call: 4-6 ms
    quiet and 10-65 ms beside busy loops here, the largest part of an adapter's path to
    serving. So the first call asks PEFT (both ways, to learn its embedding choice) and notes
    which module attribute holds each tensor it returned; later calls read those attributes,
    by module path, so a parameter or module replaced since is read as it is now (PEFT's own
    state dict returns the same tensors). A tensor not found as exactly one parameter or buffer
    (PEFT computed it) keeps PEFT on every call."""
    from peft import get_peft_model_state_dict

    # The adapter's config in the key: an adapter changed (other modules, rank) is asked anew.
    key = (name, getattr(getattr(model, "config", None), "vocab_size", None),
           repr(model.peft_config[name]))
    known = _ADAPTERS.setdefault(model, {})
    if key in known:
        embeddings, where = known[key]
        if where is not None:
            with contextlib.suppress(AttributeError):  # a module gone: PEFT is asked anew
                return {saved: getattr(model.get_submodule(module), attr)
                        for saved, (module, attr) in where.items()}
            del known[key]
            return _adapter_tensors(model, name)
        return get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=embeddings)
    auto = get_peft_model_state_dict(model, adapter_name=name)
    embeddings = bool(auto.keys() - get_peft_model_state_dict(
        model, adapter_name=name, save_embedding_layers=False).keys())
    known[key] = (embeddings, _where(model, auto))
    return auto


def _where(model: Any, tensors: dict[str, Any]) -> dict[str, tuple[str, str]] | None:
    """Each tensor's (module path, attribute) in `model`, found by its storage, shape and
    strides; None when one is not exactly one parameter or buffer of the model."""
    holders: dict[tuple, list[tuple[str, str]]] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for full, t in named:
        module, _, attr = full.rpartition(".")
        holders.setdefault((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype), []).append((module, attr))
    where = {}
    for saved, t in tensors.items():
        found = holders.get((t.data_ptr(), tuple(t.shape), t.stride(), t.dtype), [])
        if len(found) != 1:
            return None
        where[saved] = found[0]
    return where


def adapter_of(model: Any) -> tuple[dict[str, Any], bytes]:
    """A PEFT model's active LoRA adapter -> (its tensors, copied; its config as JSON bytes),
    as PEFT's `save_pretrained` would write them (`adapter_model.safetensors`, `adapter_config.json`)."""
    import enum
    import json

    if not _is_peft(model):
        raise TypeError(f"cannot publish a {type(model).__name__} as an adapter: give a PEFT model "
                        "or a directory PEFT's save_pretrained wrote")
    name = model.active_adapter
    if not isinstance(name, str):
        raise TypeError(f"a PEFT model with several active adapters ({name}) is not one adapter")
    tensors = _adapter_tensors(model, name)

    def plain(value: Any) -> Any:  # what json cannot write: PEFT keeps sets and enums in configs
        if isinstance(value, (set, frozenset)):
            return sorted(value)
        if isinstance(value, enum.Enum):
            return value.value
        return str(value)

    config = json.dumps(model.peft_config[name].to_dict(), default=plain, sort_keys=True)
    return saveable(tensors, own=True), config.encode()
