"""A trainer's tensors -> one safetensors file image in host memory, ready to write and hash.

`publish_weights` with a state_dict or model packs the tensors here (one memcpy each, straight
into the file's layout) and returns to the trainer; the store then writes the image to disk and
hashes the same bytes in memory at once (`WeightStore.write_image`), so nothing is read back.
The images live in staging buffers the client keeps and reuses (`Staging`): a fresh buffer costs
its page faults (5-10x the copy on this VM), a reused one only the copy, so from the second publish
on the trainer is held for ~one memcpy of the checkpoint.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import threading
from dataclasses import dataclass
from typing import Any

from rollq.registry.safetensors_check import WeightError

_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
           "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
           "uint16": "U16", "uint32": "U32", "uint64": "U64", "bool": "BOOL",
           "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0"}
"""torch dtype name -> safetensors dtype (the names safetensors.torch writes)."""
_ROUND = 64 << 20
"""Buffers kept for reuse are allocated in steps of 64 MiB (a power of two below that), so a
checkpoint that grows a little reuses them. A buffer not kept (an adapter's) is allocated to the
page: populating a 64 MiB step for a 3.7 MB adapter took 21-25 ms, most of its store time."""


@dataclass(eq=False)
class Image:
    """A packed safetensors file: `view` holds its bytes, `buffer` is the staging buffer."""

    buffer: mmap.mmap
    size: int

    @property
    def view(self) -> memoryview:
        return memoryview(self.buffer)[:self.size]


def _header(tensors: dict[str, Any]) -> tuple[bytes, list[tuple[Any, int]]]:
    """The file's header (length + JSON, padded to 8 bytes as safetensors pads it) and each
    tensor with its byte count, in file order."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    spans, offset = [], 0
    for name, t in tensors.items():
        dtype = _DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise WeightError(f"{name}: dtype {t.dtype} cannot be written as safetensors")
        count = t.numel() * t.element_size()
        entries[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + count]}
        spans.append((t, count))
        offset += count
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, spans


def _copy_into(address: int, t: Any, count: int) -> None:
    """One tensor's bytes at `address`: a plain memcpy for a CPU tensor (ctypes releases the GIL
    while it runs); others come to the CPU first (a device tensor: one device-to-host copy)."""
    if count == 0:
        return
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    ctypes.memmove(address, t.data_ptr(), count)


def _allocation(size: int, *, reused: bool) -> int:
    """Bytes to allocate for an image of `size` bytes (see `_ROUND`)."""
    if not reused:
        return -(-max(size, 1) // mmap.PAGESIZE) * mmap.PAGESIZE
    step = _ROUND if size >= _ROUND else 1 << max(size - 1, 1).bit_length()
    return -(-max(size, 1) // step) * step


class Staging:
    """Reusable host buffers for packed checkpoints: one per publish in flight (the store writes
    from it), at most `keep` kept between publishes (each the checkpoint's size)."""

    def __init__(self, keep: int = 2):
        self.keep = keep
        self.free: list[mmap.mmap] = []
        self._lock = threading.Lock()  # packs and stores run in threads, concurrent publishes too

    def pack(self, tensors: dict[str, Any]) -> Image:
        """Copy `tensors` into a buffer as one safetensors file: from here they are ours, and the
        trainer may change its own in place."""
        header, spans = _header(tensors)
        size = len(header) + sum(count for _, count in spans)
        buffer = self._take(size)
        try:
            buffer[:len(header)] = header
            anchor = ctypes.c_char.from_buffer(buffer)  # the buffer's address, for memmove
            address = ctypes.addressof(anchor) + len(header)
            for t, count in spans:
                _copy_into(address, t, count)
                address += count
            del anchor  # an exported pointer would keep the mmap from closing
        except BaseException:
            self.give(buffer)
            raise
        return Image(buffer, size)

    def _take(self, size: int) -> mmap.mmap:
        with self._lock:
            fits = [b for b in self.free if len(b) >= size]
            if fits:
                buffer = min(fits, key=len)
                self.free.remove(buffer)
                return buffer
            self.free.clear()  # all too small for this checkpoint: let them go
        # MAP_POPULATE: the kernel maps every page at once, cheaper than one fault per page.
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        return mmap.mmap(-1, _allocation(size, reused=self.keep > 0), flags=flags)

    def give(self, buffer: mmap.mmap) -> None:
        """A buffer the store is done with (its image written and hashed)."""
        with self._lock:
            if len(self.free) < self.keep:
                self.free.append(buffer)
