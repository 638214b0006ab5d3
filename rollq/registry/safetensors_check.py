"""Validate a safetensors file's header ourselves, before any loader reads the file.

The format: 8 bytes little-endian header length N, N bytes of JSON `{name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {str: str}}`, then the tensor data. A forged header
(lengths past the file, overlapping or gapped spans, sizes that do not match shape x dtype) is
refused here with the tensor's name.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import msgspec

MAX_HEADER_BYTES = 16 * 1024 * 1024
"""The safetensors crate allows 100,000,000 bytes; a real header is ~100 bytes per tensor, so
16 MiB holds over 100,000 tensors and bounds what a forged header costs to parse."""
MAX_DIMS = 32
DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}

Schema = dict[str, tuple[str, tuple[int, ...]]]
"""Tensor name -> (dtype, shape)."""

# The header's only shape: {name: {key: str | [int, ...]}}. Decoding into this type bounds the
# nesting depth (3) and refuses bools, floats, NaN and integers over Python's 4,300 digits, so
# no forged header reaches json's recursion or an unbounded int; the header cap bounds the rest.
_HEADER = msgspec.json.Decoder(dict[str, dict[str, str | list[int]]])
_TENSOR_KEYS = {"dtype", "shape", "data_offsets"}
_KINDS = {stat.S_IFDIR: "a directory", stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


class WeightError(Exception):
    """Weights refused before loading: names the file (and tensor) and the reason."""


def not_regular(name: str, mode: int) -> WeightError:
    if stat.S_ISLNK(mode):
        return WeightError(f"{name}: is a symbolic link; weight directories must hold regular files "
                           "(copy the target in, e.g. `cp -L`)")
    kind = _KINDS.get(stat.S_IFMT(mode), "a special file")
    return WeightError(f"{name}: is not a regular file ({kind})")


def open_regular(path: Path, follow_symlinks: bool = False) -> int:
    """A file descriptor of a regular file, never blocking: O_NONBLOCK keeps a FIFO swapped in
    after any check from holding the thread, O_NOFOLLOW refuses a link swapped in."""
    flags = os.O_RDONLY | os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:
            raise not_regular(path.name, stat.S_IFLNK) from None
        raise WeightError(f"{path.name}: {e.strerror}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise not_regular(path.name, mode)
    os.set_blocking(fd, True)
    return fd


def check_header(path: Path, follow_symlinks: bool = False) -> Schema:
    """Validate the header against the file; returns the tensors' dtypes and shapes."""
    fd = open_regular(path, follow_symlinks)
    with os.fdopen(fd, "rb") as f:
        return check_header_of(f, path.name)


def check_header_of(f, name: str) -> Schema:
    """The header of an open regular file, every cost bounded by MAX_HEADER_BYTES."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise WeightError(f"{name}: {size} bytes, too short for a safetensors file")
    length = int.from_bytes(head, "little")
    if 8 + length > size:
        raise WeightError(f"{name}: header length {length} does not fit the file's {size} bytes")
    if length > MAX_HEADER_BYTES:
        raise WeightError(f"{name}: header of {length} bytes; the limit is {MAX_HEADER_BYTES}")
    raw = f.read(length)
    try:
        header = _HEADER.decode(raw)
    except msgspec.ValidationError as e:
        raise WeightError(f"{name}: header is not a safetensors header ({_explain(raw) or e})") from None
    except msgspec.DecodeError as e:
        raise WeightError(f"{name}: header is not a safetensors header ({e})") from None
    _refuse_duplicates(name, raw)
    return _check_entries(name, header, size, size - 8 - length)


_ENTRIES = msgspec.json.Decoder(dict[str, dict[str, msgspec.Raw]])
_VALUE = msgspec.json.Decoder(str | list[int])


def _explain(raw: bytes) -> str | None:
    """Which entry and field broke the type (msgspec's path hides object keys); None if unknown."""
    try:
        entries = _ENTRIES.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None
    for entry, fields in entries.items():
        for key, value in fields.items():
            try:
                _VALUE.decode(value)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
                return f"{entry[:64]!r} field {key[:64]!r}: {e}"
    return None


def _refuse_duplicates(name: str, raw: bytes) -> None:
    """A repeated key (a tensor name, or `dtype` inside one): loaders disagree on which one wins,
    so refuse it. Safe to parse with json now: the typed decode bounded depth and integers."""

    def check(pairs: list[tuple[str, object]]) -> None:
        if len(pairs) != len({k for k, _ in pairs}):
            seen: set[str] = set()
            dup = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise WeightError(f"{name}: header repeats the key {dup[:64]!r}")

    json.loads(raw, object_pairs_hook=check)


def _check_entries(file: str, header: dict, size: int, data_bytes: int) -> Schema:
    schema: Schema = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            if not all(isinstance(v, str) for v in info.values()):
                raise WeightError(f"{file}: __metadata__ must map strings to strings")
            continue
        schema[name] = _check_tensor(file, name, info, size, data_bytes)
        spans.append(tuple(info["data_offsets"]) + (name,))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise WeightError(f"{file}: tensor {name!r} starts at byte {begin}, expected {at} "
                              "(overlapping or gapped data)")
        at = end
    if at != data_bytes:
        raise WeightError(f"{file}: tensors cover {at} of {data_bytes} data bytes")
    return schema


def _check_tensor(file: str, name: str, info: dict, size: int, data_bytes: int
                  ) -> tuple[str, tuple[int, ...]]:
    if info.keys() != _TENSOR_KEYS:
        raise WeightError(f"{file}: tensor {name!r} has fields {sorted(info)}; expected "
                          f"{sorted(_TENSOR_KEYS)}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        raise WeightError(f"{file}: tensor {name!r} has unknown dtype {str(dtype)[:32]!r}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS:
        raise WeightError(f"{file}: tensor {name!r} shape must be a list of at most {MAX_DIMS} dims")
    # Each dim is at most the file's size, so the product of at most MAX_DIMS of them is cheap.
    if not all(0 <= d <= size for d in shape):
        raise WeightError(f"{file}: tensor {name!r} has a shape dim outside [0, {size}] (the file size)")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes):
        raise WeightError(f"{file}: tensor {name!r} has data_offsets {offsets!r} outside the data")
    need = DTYPE_BYTES[dtype]
    for d in shape:
        need *= d
    if offsets[1] - offsets[0] != need:
        shown = need if need <= size else f"more than the file's {size}"
        raise WeightError(f"{file}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes, "
                          f"but {dtype}{shape} needs {shown}")
    return dtype, tuple(shape)


def dir_schema(path: Path) -> Schema:
    schema: Schema = {}
    for f in sorted(path.glob("*.safetensors")):
        # Follows links: this also reads the operator's own base model (e.g. a Hugging Face
        # cache snapshot, made of links); published versions were refused links by verify().
        schema |= check_header(f, follow_symlinks=True)
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
