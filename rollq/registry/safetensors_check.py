"""Validate a safetensors file's header ourselves, before any loader reads the file.

The format: 8 bytes little-endian header length N, N bytes of JSON `{name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {str: str}}`, then the tensor data. A forged header
(lengths past the file, overlapping or gapped spans, sizes that do not match shape x dtype) is
refused here with the tensor's name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

MAX_HEADER_BYTES = 100 * 1024 * 1024
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

Schema = dict[str, tuple[str, tuple[int, ...]]]
"""Tensor name -> (dtype, shape)."""


class WeightError(Exception):
    """Weights refused before loading: names the file (and tensor) and the reason."""


def check_header(path: Path) -> Schema:
    """Validate the header against the file; returns the tensors' dtypes and shapes."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise WeightError(f"{path.name}: {size} bytes, too short for a safetensors file")
        length = int.from_bytes(head, "little")
        if length > MAX_HEADER_BYTES or 8 + length > size:
            raise WeightError(f"{path.name}: header length {length} does not fit the file's {size} bytes")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise WeightError(f"{path.name}: header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise WeightError(f"{path.name}: header is not a JSON object")
    data_bytes = size - 8 - length
    schema: Schema = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise WeightError(f"{path.name}: __metadata__ must map strings to strings")
            continue
        schema[name] = _check_tensor(path.name, name, info, data_bytes)
        spans.append(tuple(info["data_offsets"]) + (name,))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise WeightError(f"{path.name}: tensor {name!r} starts at byte {begin}, expected {at} "
                              "(overlapping or gapped data)")
        at = end
    if at != data_bytes:
        raise WeightError(f"{path.name}: tensors cover {at} of {data_bytes} data bytes")
    return schema


def _check_tensor(file: str, name: str, info: object, data_bytes: int) -> tuple[str, tuple[int, ...]]:
    if not isinstance(info, dict):
        raise WeightError(f"{file}: tensor {name!r} has no dtype/shape/offsets")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_BYTES:
        raise WeightError(f"{file}: tensor {name!r} has unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise WeightError(f"{file}: tensor {name!r} has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise WeightError(f"{file}: tensor {name!r} has offsets {offsets!r} outside the data")
    if offsets[1] - offsets[0] != math.prod(shape) * DTYPE_BYTES[dtype]:
        raise WeightError(f"{file}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes, "
                          f"but {dtype}{shape} needs {math.prod(shape) * DTYPE_BYTES[dtype]}")
    return dtype, tuple(shape)


def dir_schema(path: Path) -> Schema:
    schema: Schema = {}
    for f in sorted(path.glob("*.safetensors")):
        schema |= check_header(f)
    return schema


def check_compatible(new: Schema, base: Schema, where: str) -> None:
    """A new version must hold every tensor of the served model, with the same shapes."""
    missing = sorted(set(base) - set(new))
    if missing:
        raise WeightError(f"{where}: missing {len(missing)} tensors of the served model, e.g. {missing[:3]}")
    for name, (_, shape) in new.items():
        if name in base and base[name][1] != shape:
            raise WeightError(f"{where}: tensor {name!r} has shape {list(shape)}, the served model "
                              f"{list(base[name][1])}")
        if name not in base and not name.endswith("lm_head.weight"):  # tied heads may be saved
            raise WeightError(f"{where}: tensor {name!r} is not in the served model")
