"""Pushes: a full version's tensors sent straight into live engines, beside its files.

The registry stays the source of truth: the version's entry lists every tensor with a
fingerprint (BLAKE3 of its bytes, `fingerprint`), computed by the trainer on what it sends, and
the offer (`PushOffer`: transport, address, host) travels in that entry, so a worker learns of
both with the version's announcement. The worker reads the bytes into memory of its own and
fingerprints them there, before any layer of the model is touched (`read_checked`, run inside
vLLM by `engine/transfer.py`); a mismatch refuses the push, and the worker loads the version
from the store's files instead.

Transport `shm` (the CPU analogue of CUDA IPC, for workers on the trainer's machine): the
trainer writes the tensors' raw bytes back to back into one file under /dev/shm (`write_segment`;
dtype and shape travel in the entry, never a pickle). Each worker reads it with `pread` into
buffers of its own: never mapped, since the trainer may unlink or truncate it (a mapped file cut
short faults the reader) and may reuse its memory; a short read is an error, and changed bytes
fail their fingerprint. The trainer removes a segment once a later push replaces it or its
`hold_s` ends: a worker that comes later finds none and loads the files.

No vLLM import here: the client writes segments, the worker builds offers' update infos, and
vLLM's side (`engine/transfer.py`) reads them.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path
from typing import Any

import blake3

from rollq.protocol import PushOffer, TensorDigest

SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "rollq-push-"
_SEGMENT_NAME = re.compile(r"rollq-push-[A-Za-z0-9_.-]{1,200}")
TRANSPORTS = ("shm",)
"""Transports built and tested on CPU. `gloo` (a process-group broadcast over TCP) and vLLM's GPU
engines (`nccl`, `ipc`) are described in docs/architecture.md, "GPU weight paths"."""
BACKENDS = {"shm": "rollq_shm"}
"""rollq transport -> the name its engine is registered under in vLLM's factory."""
_THREADED_FROM = 16 << 20
"""A tensor from this size is hashed on all cores (BLAKE3's pool); below, in place on one."""

# torch dtype name -> bytes per element; the dtypes a push carries (safetensors' set, as staged).
ELEMENT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
                 "int16": 2, "int8": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8,
                 "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e8m0fnu": 1}
_FROM_SAFETENSORS = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
                     "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                     "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool",
                     "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu"}


PUSH_TIMEOUT_S = 120.0
"""A worker's default bound on reading and checking a push (`--push-timeout-s`)."""
HOLD_ENV = "ROLLQ_TEST_PUSH_HOLD"
"""Tests only, never set by rollq: a directory. In a process whose environment names one, the
read of a segment stops after its first tensor if `<dir>/hold` exists (the first reader takes it,
renaming it `<dir>/held-<segment name>`) and waits while that file exists, or until the read is
given up: a push that never finishes, or a segment cut or removed mid-read, made real inside
vLLM's engine process, where no test can patch code."""

REFUSED = "rollq refused the push"
"""Begins every PushRefused message, which is all that crosses from vLLM's engine process."""


class PushRefused(Exception):
    """What a worker received is not what the registry says (fingerprint, size), or could not be
    read: the push is a failed load, and the version comes from the files instead. Raised before
    any weight is touched (`read_checked` reads and checks all before vLLM loads any)."""

    def __init__(self, reason: str):
        super().__init__(f"{REFUSED}: {reason}")


def untouched(error: BaseException) -> bool:
    """Did this failed push leave the engine's weights as they were (refused before loading)?"""
    return REFUSED in str(error)


def fingerprint(data: memoryview | bytes) -> str:
    """BLAKE3 of a tensor's bytes (hex), the same on both sides of a push."""
    size = len(data) if isinstance(data, bytes) else data.nbytes
    hasher = blake3.blake3(max_threads=blake3.blake3.AUTO if size >= _THREADED_FROM else 1)
    hasher.update(data)
    return hasher.hexdigest()


@cache
def host_id() -> str:
    """This machine, as a push offer names it: the host name and this boot's id (a name alone
    may repeat across containers; /dev/shm does not outlive a boot)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def nbytes(t: TensorDigest) -> int:
    count = ELEMENT_BYTES.get(t.dtype)
    if count is None or len(t.shape) > 8 or any(not 0 <= n < 1 << 40 for n in t.shape):
        raise PushRefused(f"push of tensor {t.name}: dtype {t.dtype!r} or shape {t.shape} is not "
                          f"one a push carries (dtypes: {sorted(ELEMENT_BYTES)}, up to 8 dimensions)")
    for n in t.shape:
        count *= n
    return count


def image_tensors(view: memoryview) -> tuple[list[TensorDigest], int]:
    """The tensors of a safetensors file image the client packed itself (`registry/staging.py`),
    fingerprinted, and where its data begins. The image is ours, so its header is trusted; its
    data region holds the tensors back to back in header order, which is what a segment holds."""
    import json

    length = int.from_bytes(view[:8], "little")
    header = json.loads(bytes(view[8:8 + length]))
    start = 8 + length
    tensors = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        begin, end = spec["data_offsets"]
        tensors.append((begin, TensorDigest(name, _FROM_SAFETENSORS[spec["dtype"]], list(spec["shape"]),
                                            fingerprint(view[start + begin:start + end]))))
    tensors.sort(key=lambda pair: pair[0])
    return [t for _, t in tensors], start


def data_start(view: memoryview) -> int:
    """Where a packed image's tensor data begins (after its header)."""
    return 8 + int.from_bytes(view[:8], "little")


def write_segment(data: memoryview, label: str, over: Path | None = None) -> Path:
    """The tensors' bytes in a new file under /dev/shm, readable by this user only. `over`: a
    segment of this process's no longer offered, renamed to the new name and written over (its
    pages are allocated already: 0.08 s for 445 MB here, where a new file took 0.17-0.19 s); a
    worker still reading it then finds bytes that fail their fingerprints and loads the files.
    Nobody can open the new name before the entry naming it is registered, after this returns."""
    path = SHM_DIR / f"{SEGMENT_PREFIX}{re.sub(r'[^A-Za-z0-9_.-]', '_', label)[:100]}-{uuid.uuid4().hex[:12]}"
    fd = _reused(over, path) if over is not None else None
    if fd is None:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW, 0o600)
    try:
        written = 0
        while written < data.nbytes:
            written += os.write(fd, data[written:])
        os.ftruncate(fd, written)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return path


def _reused(spare: Path, path: Path) -> int | None:
    """`spare` renamed to `path` and opened to write over; None if it is gone (swept, removed) or
    not a regular file of this user's."""
    try:
        os.rename(spare, path)
    except OSError:
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        path.unlink(missing_ok=True)
        return None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
        os.close(fd)
        path.unlink(missing_ok=True)
        return None
    return fd


def sweep_segments(older_than_s: float) -> None:
    """Remove this user's segments older than `older_than_s`, whoever wrote them: a trainer that
    died leaves its last segments (a model's size of memory each) behind, and a segment's offer is
    over once its hold ends. A worker still reading one holds its descriptor: unaffected."""
    give_up = time.time() - older_than_s
    for path in SHM_DIR.glob(f"{SEGMENT_PREFIX}*"):
        try:
            info = path.lstat()
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and info.st_mtime < give_up:
                path.unlink()
        except OSError:  # gone already, or another user's
            pass


def shm_offer(path: Path) -> PushOffer:
    return PushOffer("shm", str(path), host_id())


def reachable(offer: PushOffer | None, transport: str | None) -> bool:
    """May this worker, whose engine receives by `transport`, take `offer`?"""
    return (offer is not None and transport is not None and offer.transport == transport
            and (offer.transport != "shm" or offer.host == host_id()))


def update_info(offer: PushOffer, tensors: list[TensorDigest],
                timeout_s: float = PUSH_TIMEOUT_S) -> dict[str, Any]:
    """vLLM's `update_weights` payload for `offer` (`engine/transfer.py` reads it): the names,
    dtypes and shapes from the registry entry, the fingerprints the receiver must find, and how
    long it may take to read and check them before the push is given up."""
    return {"address": offer.address, "names": [t.name for t in tensors],
            "dtype_names": [t.dtype for t in tensors], "shapes": [list(t.shape) for t in tensors],
            "digests": [t.digest for t in tensors], "timeout_s": timeout_s}


def read_checked(address: str, tensors: list[TensorDigest], empty,
                 given_up: Callable[[], bool] = lambda: False) -> list[tuple[str, Any]]:
    """Every tensor of a shm segment, read into buffers of this process (`empty(t)`: a new
    tensor of `t`'s dtype and shape; `view(tensor)`: its bytes) and fingerprinted there.
    `given_up()`: asked between tensors; True ends the read (its caller stopped waiting).

    Raises PushRefused on any difference from the registry's entry; then nothing was loaded."""
    path = Path(address)
    if path.parent != SHM_DIR or not _SEGMENT_NAME.fullmatch(path.name):
        raise PushRefused(f"push address {address!r} is not a rollq segment under {SHM_DIR}")
    try:
        # O_NONBLOCK: a FIFO at the path would block this open until some writer came, for ever
        # (the fstat below refuses anything but a regular file; tmpfs reads never block).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as e:
        raise PushRefused(f"push segment {address}: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        expected = sum(nbytes(t) for t in tensors)
        if not stat.S_ISREG(info.st_mode) or info.st_size != expected:
            raise PushRefused(f"push segment {address}: {info.st_size} bytes, the entry's tensors "
                              f"take {expected}")
        # Each tensor is hashed in another thread while the next one is read (pread and BLAKE3
        # release the GIL): a read and a hash at once, not one after the other.
        read, offset = [], 0
        with ThreadPoolExecutor(1, thread_name_prefix="rollq-push-check") as hashing:
            for t in tensors:
                if read:
                    _test_hold(path, given_up)
                if given_up():
                    raise PushRefused(f"push segment {address}: read given up")
                tensor, data = empty(t)
                _read_into(fd, data, offset, address)
                read.append((t, tensor, hashing.submit(fingerprint, data)))
                offset += data.nbytes
            for t, _, digest in read:
                if digest.result() != t.digest:
                    raise PushRefused(f"push of tensor {t.name}: its bytes do not match the "
                                      "registry's fingerprint")
        return [(t.name, tensor) for t, tensor, _ in read]
    finally:
        os.close(fd)


def _test_hold(path: Path, given_up: Callable[[], bool]) -> None:
    """The tests' hook (`HOLD_ENV`); nothing unless its variable is set."""
    where = os.environ.get(HOLD_ENV)
    if not where:
        return
    held = Path(where) / f"held-{path.name}"
    try:
        (Path(where) / "hold").rename(held)
    except OSError:  # no hold asked for, or another reader took it
        return
    while held.exists() and not given_up():
        time.sleep(0.01)


def _read_into(fd: int, data: memoryview, offset: int, address: str) -> None:
    done = 0
    while done < data.nbytes:
        n = os.preadv(fd, [data[done:]], offset + done)
        if n == 0:
            raise PushRefused(f"push segment {address} ended early (cut short while read)")
        done += n
