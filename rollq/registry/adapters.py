"""Adapter (LoRA) versions: the one place that knows what an adapter version's files are.

An adapter version is PEFT's layout, exactly two files: `adapter_config.json` (size-bounded,
decoded as JSON into a typed struct, never unpickled) and `adapter_model.safetensors` (tensors
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]). It applies
on top of a full version (`VersionEntry.base`); workers with adapter support serve it beside
other adapters, with no swap. Checked twice: at publish (shape of the files) and by each worker
on its private copy (rank within its engine's limit, every module present in its model with
matching shapes), so a wrong adapter is refused with a reason instead of reaching vLLM's
engine core.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from rollq.registry.safetensors_check import Schema, WeightError, check_header, open_regular

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
FILES = (CONFIG, WEIGHTS)
MAX_CONFIG_BYTES = 64 * 1024
"""A PEFT adapter config is ~1-2 kB; the bound keeps a forged one cheap to refuse."""
_PREFIX = "base_model.model."


class AdapterConfig(msgspec.Struct, frozen=True):
    """The fields of PEFT's LoRA config that decide how it is served (others are ignored)."""

    r: int
    lora_alpha: int | float
    target_modules: list[str] | str
    peft_type: str = "LORA"
    rank_pattern: dict[str, int] = {}
    alpha_pattern: dict[str, int | float] = {}
    use_rslora: bool = False
    use_dora: bool = False
    bias: str = "none"
    modules_to_save: list[str] | None = None


_CONFIG_DECODER = msgspec.json.Decoder(AdapterConfig)


def parse_config(raw: bytes, where: str = CONFIG) -> AdapterConfig:
    """A LoRA config from JSON bytes, or WeightError naming what is wrong."""
    if len(raw) > MAX_CONFIG_BYTES:
        raise WeightError(f"{where}: {len(raw)} bytes; an adapter config may have at most "
                          f"{MAX_CONFIG_BYTES}")
    try:
        config = _CONFIG_DECODER.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise WeightError(f"{where}: not a LoRA adapter config ({e})") from None
    if config.peft_type.upper() != "LORA":
        raise WeightError(f"{where}: peft_type {config.peft_type[:32]!r}; only LORA adapters are served")
    if config.r < 1 or any(r < 1 for r in config.rank_pattern.values()):
        raise WeightError(f"{where}: rank r={config.r} (and every rank_pattern value) must be >= 1")
    if config.use_dora or config.bias != "none" or config.modules_to_save:
        raise WeightError(f"{where}: DoRA, adapter biases and modules_to_save are not served "
                          "(vLLM's LoRA serves plain low-rank deltas)")
    return config


def read_config(path: Path) -> AdapterConfig:
    """The config file of an adapter directory: a regular file (no link followed), bounded."""
    with open(open_regular(path), "rb", closefd=True) as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    return parse_config(raw, path.name)


def check_files(path: Path) -> None:
    """An adapter directory holds both files (others are ignored and not published)."""
    missing = [name for name in FILES if not (path / name).is_file()]
    if missing:
        raise WeightError(f"{path}: not an adapter directory, missing {missing} (PEFT's "
                          "save_pretrained writes both)")


def is_adapter_dir(path: Path) -> bool:
    return (path / CONFIG).exists()


def check_adapter(directory: Path, base: Schema | None, max_rank: int | None) -> AdapterConfig:
    """The adapter in `directory` fits a model of schema `base` and an engine of `max_rank`.

    Every tensor must be a lora_A / lora_B pair of a linear module of the model, A [r, in] and
    B [out, r] against the module's weight [out, in], r within `max_rank`. (vLLM refuses some of
    this in `add_lora`; a shape it does not check would fail inside its engine core.)
    """
    config = read_config(directory / CONFIG)
    tensors = check_header(directory / WEIGHTS)
    ranks = [config.r, *config.rank_pattern.values()]
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, (_, shape) in tensors.items():
        module, part = _split(name)
        pairs.setdefault(module, {})[part] = shape
    if not pairs:
        raise WeightError(f"{WEIGHTS}: holds no LoRA tensors")
    for module, parts in pairs.items():
        if set(parts) != {"lora_A", "lora_B"}:
            raise WeightError(f"{WEIGHTS}: module {module!r} has {sorted(parts)}, expected lora_A "
                              "and lora_B")
        a, b = parts["lora_A"], parts["lora_B"]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            raise WeightError(f"{WEIGHTS}: module {module!r}: lora_A {list(a)} and lora_B {list(b)} "
                              "are not [r, in] and [out, r]")
        ranks.append(a[0])
        if base is None:
            continue
        weight = base.get(f"{module}.weight")
        if weight is None:
            raise WeightError(f"{WEIGHTS}: module {module!r} is not in the served model (an adapter "
                              "of another base model?)")
        if len(weight[1]) != 2 or (b[0], a[1]) != tuple(weight[1]):
            raise WeightError(f"{WEIGHTS}: module {module!r} is [{b[0]}, {a[1]}] in the adapter, "
                              f"{list(weight[1])} in the served model (an adapter of another base model?)")
    if max_rank is not None and max(ranks) > max_rank:
        raise WeightError(f"adapter rank {max(ranks)} is above this worker's --max-lora-rank "
                          f"{max_rank}")
    return config


def _split(name: str) -> tuple[str, str]:
    """`base_model.model.<module>.lora_A.weight` -> (`<module>`, `lora_A`)."""
    parts = name.split(".")
    if (not name.startswith(_PREFIX) or len(parts) < 5 or parts[-1] != "weight"
            or parts[-2] not in ("lora_A", "lora_B")):
        raise WeightError(f"{WEIGHTS}: tensor {name[:128]!r} is not a LoRA tensor "
                          f"({_PREFIX}<module>.lora_A.weight or .lora_B.weight)")
    return ".".join(parts[2:-2]), parts[-2]
