"""GPU check: how fast a checkpoint's bytes reach a GPU by each path that docs/architecture.md's
"GPU weight paths (NCCL, CUDA IPC)" relies on, against the device's own copy bandwidth.

Standalone on purpose: the machine this is for has one NVIDIA GPU, PyTorch and safetensors and
nothing else (no vLLM, no rollq, nothing can be installed), so only the standard library, torch
and safetensors are imported here (not numpy: safetensors' own `save_file` needs it, so the file
is written by hand).

Every path moves the same bf16 "checkpoint" (--gib, default 4 GiB: Llama-like decoder layers of
hidden 2048, 9 tensors each, 288 tensors at 4 GiB) into preallocated tensors on the GPU, as an
engine's parameters are, --repeats times (the median is reported; every repetition is in --json):

  device -> device copy          the baseline every ratio is against
  pinned host -> device          a worker that keeps a pinned staging buffer
  pageable host -> device        the same from ordinary memory: does pinning matter?
  device -> pinned host          a trainer's publish copy (its stall), on a GPU
  pinning the host buffer        cudaHostAlloc's own cost, once: can a worker afford it per version?
  fingerprints                   the int64 sum of each tensor's bytes, the design's cheap check
  safetensors load_file          file -> GPU as `load_file(..., device="cuda")` does it, cold and warm
  safe_open per tensor           file -> GPU one tensor at a time into the parameters, cold and warm
  readinto pinned -> device      file -> pinned buffer -> GPU by hand (the copies overlap the reads)
  CUDA IPC                       a trainer process's GPU tensors handed over by IPC handle and
                                 copied into this process's parameters (the colocated path)

Every path's bytes are checked: the destination's fingerprints must equal the source's, or the
check fails loudly (exit 1). "Cold" means the file was dropped from the page cache first
(posix_fadvise DONTNEED, after an fsync; no root needed) and mincore says how much of it was
still resident; "warm" reads it from the page cache.

    python bench/gpu_check.py [--gib 4] [--repeats 3] [--dir /local/disk] [--json out.json]

Exit codes: 0 measured (table on stdout), 1 bytes differ or a step failed, 2 no CUDA GPU (nothing
measured), 3 over the time budget (8 minutes; the rows measured so far are printed).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import queue
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

STARTED = time.monotonic()  # the time budget counts from here, torch's import included

try:
    import torch
except ImportError:
    sys.exit("gpu_check: PyTorch is not installed (import torch failed); this check needs torch with CUDA")

BUDGET_S = 8 * 60
GIB = 2**30
DTYPE = torch.bfloat16
HIDDEN, INTERMEDIATE = 2048, 8192
# One decoder layer: q, k, v, o (hidden x hidden), gate, up, down (hidden x intermediate), 2 norms.
LAYER_BYTES = 2 * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE + 2 * HIDDEN)
SEED, TRAINER_SEED = 1234, 5678
BASELINE = "device -> device copy (baseline)"
PIN = True  # pinned host memory; a CPU dry run of the host and file phases sets it False


class CheckFailed(Exception):
    """Bytes differ, a step failed or the machine is too small: exit 1."""


class OverBudget(Exception):
    """The next step would end past the time budget: exit 3."""


def log(message: str) -> None:
    # Progress goes to stderr, so stdout is the table alone.
    print(f"[{time.monotonic() - STARTED:6.1f} s] {message}", file=sys.stderr, flush=True)


def now() -> float:
    # CLOCK_MONOTONIC is one clock for every process on the machine: the IPC hand-off is timed
    # from the trainer's start to the receiver's end.
    return time.clock_gettime(time.CLOCK_MONOTONIC)


def sync() -> None:
    torch.cuda.synchronize()


# --- the checkpoint ------------------------------------------------------------------------------


def checkpoint_layout(gib: float) -> list[tuple[str, tuple[int, ...]]]:
    """Enough Llama-like layers for `gib`. Every tensor is a power of two bytes (4 KiB, 8 MiB, 32
    MiB): torch's pinned allocator rounds each allocation up to one, which would otherwise pin
    more than is measured. Every size is a multiple of 8 bytes, so each can be viewed as int64."""
    layout = []
    for i in range(max(1, round(gib * GIB / LAYER_BYTES))):
        p = f"model.layers.{i}."
        layout += [(p + f"self_attn.{w}_proj.weight", (HIDDEN, HIDDEN)) for w in "qkvo"]
        layout += [(p + "mlp.gate_proj.weight", (INTERMEDIATE, HIDDEN)),
                   (p + "mlp.up_proj.weight", (INTERMEDIATE, HIDDEN)),
                   (p + "mlp.down_proj.weight", (HIDDEN, INTERMEDIATE)),
                   (p + "input_layernorm.weight", (HIDDEN,)),
                   (p + "post_attention_layernorm.weight", (HIDDEN,))]
    return layout


def nbytes_of(shape: tuple[int, ...]) -> int:
    n = 2  # bf16
    for d in shape:
        n *= d
    return n


def fingerprints(tensors: list[torch.Tensor]) -> list[int]:
    """The int64 sum of each tensor's bytes (wrapping), computed where the tensor lives: one pass at
    memory speed on a GPU, and integer addition gives the same sum in any order, so two processes
    agree bit for bit. These are the fingerprints the design's registry entry would carry."""
    sums = [t.reshape(-1).view(torch.uint8).view(torch.int64).sum() for t in tensors]
    return torch.stack(sums).tolist()


def verify(what: str, names: list[str], tensors: list[torch.Tensor], expected: list[int]) -> None:
    got = fingerprints(tensors)
    bad = [n for n, g, e in zip(names, got, expected) if g != e]
    if bad:
        raise CheckFailed(f"{what}: the bytes differ from the source's in {len(bad)} of {len(names)} "
                          f"tensors (first: {bad[0]})")


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor], non_blocking: bool = False) -> None:
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=non_blocking)


def release_cached(device: torch.device) -> None:
    # Freed tensors stay in torch's caching allocator: hand them back, so the next phase (and the
    # trainer process, which has its own allocator) finds the memory free.
    if device.type == "cuda":
        torch.cuda.empty_cache()


def zero_all(tensors: list[torch.Tensor]) -> None:
    # Destinations are zeroed before each repetition (untimed), so a copy that did not happen
    # cannot pass the check on bytes left by the previous one.
    for t in tensors:
        t.zero_()


def host_view(t: torch.Tensor) -> memoryview:
    """A writable view of a CPU tensor's bytes without numpy (the tensor must outlive it)."""
    return memoryview((ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr()))


# --- timing, the budget and the table ------------------------------------------------------------


class Budget:
    """The whole run must end within `seconds`: each step is checked before it starts against the
    last time the same step took (or a guess), and a watchdog ends the process if one hangs."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.phase = "start"

    def elapsed(self) -> float:
        return time.monotonic() - STARTED

    def enter(self, phase: str) -> None:
        self.phase = phase
        log(f"== {phase}")

    def check(self, step: str, expect_s: float) -> None:
        if self.elapsed() + expect_s > self.seconds:
            raise OverBudget(f"stopped before '{step}': {self.elapsed():.0f} s spent and ~{expect_s:.0f} s "
                             f"more expected would pass the {self.seconds:.0f} s budget (try a smaller --gib "
                             "or --repeats)")


class Report:
    def __init__(self):
        self.rows: list[dict] = []
        self.info: dict = {}
        self.notes: list[str] = []

    def add(self, path: str, nbytes: int, seconds: list[float], note: str = "", rate: bool = True) -> None:
        """`rate=False`: a step that moves no bytes (an allocation), so no GB/s and no ratio."""
        median = statistics.median(seconds)
        gbps = nbytes / median / 1e9 if rate else None
        self.rows.append(dict(path=path, bytes=nbytes, seconds=median, gb_per_s=gbps, repeats=seconds,
                              note=note))
        log(f"   {path}: {median:.4f} s" + (f", {gbps:.2f} GB/s" if rate else "")
            + f" (each: {', '.join(f'{s:.4f}' for s in seconds)})")

    def ratios(self) -> None:
        base = next((r for r in self.rows if r["path"] == BASELINE), None)
        for r in self.rows:
            r["vs_device_copy"] = (r["gb_per_s"] / base["gb_per_s"] if base and r["gb_per_s"] is not None
                                   else None)

    def markdown(self) -> str:
        self.ratios()
        i = self.info
        lines = [f"GPU check on {i.get('gpu', '?')}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
                 f"{i.get('bytes', 0):,} bytes in {i.get('tensors', '?')} bf16 tensors, median of "
                 f"{i.get('repeats', '?')}; GB/s = bytes / seconds / 1e9 (a copy's bytes counted once).",
                 machine_line(i), "",
                 "| path | bytes | seconds | GB/s | vs device copy |", "|---|---|---|---|---|"]
        for r in self.rows:
            ratio = "–" if r["vs_device_copy"] is None else f"{r['vs_device_copy']:.3f}"
            gbps = "–" if r["gb_per_s"] is None else f"{r['gb_per_s']:.2f}"
            lines.append(f"| {r['path']} | {r['bytes']:,} | {r['seconds']:.4f} | {gbps} | {ratio} |")
        notes = [f"- {r['path']}: {r['note']}" for r in self.rows if r["note"]]
        notes += [f"- {n}" for n in self.notes]
        return "\n".join(lines + ([""] + notes if notes else []))


def machine_line(info: dict) -> str:
    # What bounds the rows: the PCIe link (host <-> device) and the file's filesystem (cold reads).
    smi = info.get("nvidia_smi", {})
    link = "PCIe link unknown (no nvidia-smi)"
    if smi:
        link = (f"PCIe gen {smi.get('pcie.link.gen.current', '?')}/{smi.get('pcie.link.gen.max', '?')} "
                f"x{smi.get('pcie.link.width.current', '?')}/{smi.get('pcie.link.width.max', '?')} "
                f"(current/max), driver {smi.get('driver_version', '?')}")
    return (f"{link}; {info.get('cpus', '?')} CPUs; the file on {info.get('filesystem', '?')} "
            f"({info.get('workdir', '?')}).")


def timed(run_: Run, path: str, repeats: int, step, before=None, after=None, guess_gbps: float = 0.5,
          note="", rate: bool = True) -> None:
    """Time `step` (which must end synchronised) `repeats` times: `before` and `after` (the check of
    the bytes) run outside the timing. `note` may be a function, called once all have run."""
    seconds: list[float] = []
    for _ in range(repeats):
        run_.budget.check(path, seconds[-1] if seconds else run_.nbytes / (guess_gbps * 1e9))
        if before:
            before()
        t0 = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t0)
        if after:
            after()
    run_.report.add(path, run_.nbytes, seconds, note() if callable(note) else note, rate=rate)


class Run:
    """What every phase shares: the layout, the engine-side parameters and their fingerprints."""

    def __init__(self, args, device: torch.device, report: Report, budget: Budget, workdir: Path):
        self.args, self.device, self.report, self.budget, self.workdir = args, device, report, budget, workdir
        self.layout = checkpoint_layout(args.gib)
        self.names = [n for n, _ in self.layout]
        self.nbytes = sum(nbytes_of(s) for _, s in self.layout)
        self.params: list[torch.Tensor] = []
        self.ref: list[int] = []
        self.host: dict[str, list[torch.Tensor]] = {}  # "pageable", "pinned": freed when done with
        self.child = None  # the trainer process, once started

    def verify(self, what: str, tensors: list[torch.Tensor], expected: list[int] | None = None) -> None:
        verify(what, self.names, tensors, self.ref if expected is None else expected)


# --- phase 1: the checkpoint in memory, and the copies between host and device --------------------


def phase_memory(run_: Run) -> None:
    r, dev = run_.args.repeats, run_.device
    run_.budget.enter(f"making the checkpoint: {run_.nbytes:,} bytes in {len(run_.layout)} tensors")
    # The engine's parameters: allocated once, every path below writes into them.
    run_.params = [torch.empty(s, dtype=DTYPE, device=dev) for _, s in run_.layout]
    gen = torch.Generator(device=dev)
    gen.manual_seed(SEED)
    for p in run_.params:
        p.normal_(generator=gen)  # random bits on the GPU: fast, and no two tensors alike
    run_.ref = fingerprints(run_.params)
    pageable = [torch.empty(s, dtype=DTYPE) for _, s in run_.layout]
    copy_all(pageable, run_.params)
    run_.host["pageable"] = pageable

    def clear_params():
        zero_all(run_.params)
        sync()

    run_.budget.enter("device -> device")
    other = [torch.empty_like(p) for p in run_.params]

    def clear_other():
        zero_all(other)
        sync()

    def d2d():
        copy_all(other, run_.params)
        sync()

    timed(run_, BASELINE, r, d2d, before=clear_other, after=lambda: run_.verify("device -> device", other),
          guess_gbps=50)
    other.clear()  # frees them (the closures above still name the list)
    release_cached(dev)

    run_.budget.enter("pinned host memory")
    run_.budget.check("pinning", run_.nbytes / 1e9)

    def pin():
        run_.host["pinned"] = [torch.empty(s, dtype=DTYPE, pin_memory=PIN) for _, s in run_.layout]

    # Once: torch keeps freed pinned blocks for reuse, so a second allocation would measure its cache.
    timed(run_, "pinning the host buffer (cudaHostAlloc), once", 1, pin,
          note="allocation only, no bytes copied; once, as torch caches pinned blocks after that",
          rate=False)
    pinned = run_.host["pinned"]

    def d2h():
        copy_all(pinned, run_.params, non_blocking=True)
        sync()

    # Not checked here: the next row copies these pinned bytes back and checks them.
    timed(run_, "device -> pinned host (a trainer's publish copy)", r, d2h, guess_gbps=5)

    def h2d_pinned():
        copy_all(run_.params, pinned, non_blocking=True)
        sync()

    timed(run_, "pinned host -> device", r, h2d_pinned, before=clear_params,
          after=lambda: run_.verify("pinned host -> device", run_.params), guess_gbps=5)

    def h2d_pageable():
        copy_all(run_.params, pageable)
        sync()

    timed(run_, "pageable host -> device", r, h2d_pageable, before=clear_params,
          after=lambda: run_.verify("pageable host -> device", run_.params), guess_gbps=1)
    run_.host.pop("pageable").clear()

    def fingerprint():
        fingerprints(run_.params)  # .tolist() waits for the GPU

    timed(run_, "fingerprints (int64 sum of each tensor's bytes, on the device)", r, fingerprint,
          guess_gbps=50, note="reads the bytes once, copies nothing")


# --- phase 2: from a safetensors file -------------------------------------------------------------


def write_safetensors(path: Path, names: list[str], tensors: list[torch.Tensor]) -> None:
    """The safetensors format by hand: an 8-byte little-endian header length, a JSON header (padded
    with spaces to 8 bytes, so every tensor starts aligned), then each tensor's bytes in order.
    Then fsync: the page cache drops only clean pages."""
    header, offset = {}, 0
    for name, t in zip(names, tensors):
        size = t.numel() * t.element_size()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for t in tensors:
            f.write(host_view(t))
        f.flush()
        os.fsync(f.fileno())


def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # dirty pages are not dropped (the file was fsynced when written: a no-op)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_fraction(path: Path) -> float | None:
    """How much of the file is in the page cache (mincore(2) over a private mapping, which touches
    no page), so "cold" is a measured fact, not a hope; None where mincore is unavailable."""
    size = os.path.getsize(path)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            buf = (ctypes.c_char * size).from_buffer(mm)
            rc = libc.mincore(ctypes.c_void_p(ctypes.addressof(buf)), ctypes.c_size_t(size), vec)
            del buf
        finally:
            mm.close()
        if rc != 0:
            return None
        flags = bytes(vec)
        return sum(1 for b in flags if b & 1) / len(flags)
    except (OSError, AttributeError, ValueError):
        return None


def readinto_full(f, view: memoryview) -> None:
    # read(2) returns at most ~2 GiB a call, and may return less: loop until the buffer is full.
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise CheckFailed(f"the file ended {len(view) - done:,} bytes early")
        done += n


def read_to_device(path: Path, names: list[str], staging: list[torch.Tensor],
                   params: list[torch.Tensor]) -> None:
    """file -> pinned staging -> device, by hand, reading the header as any loader would: each
    tensor's copy to the GPU is asynchronous from pinned memory, so it runs while the next tensor is
    read from the file."""
    index = {n: i for i, n in enumerate(names)}
    with open(path, "rb", buffering=0) as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        entries = sorted((v["data_offsets"], k) for k, v in header.items() if k != "__metadata__")
        for (begin, end), name in entries:
            i = index[name]
            view = host_view(staging[i])
            if end - begin != len(view):
                raise CheckFailed(f"{name}: {end - begin} bytes in the file, {len(view)} expected")
            f.seek(8 + length + begin)
            readinto_full(f, view)
            params[i].copy_(staging[i], non_blocking=True)
    sync()


def phase_file(run_: Run) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    r, dev, names, params = run_.args.repeats, run_.device, run_.names, run_.params
    pinned = run_.host["pinned"]  # holds the checkpoint's bytes (checked by "pinned host -> device")
    path = run_.workdir / "checkpoint.safetensors"
    run_.budget.enter(f"writing {path}")
    run_.budget.check("writing the file", run_.nbytes / 0.2e9)
    t0 = time.perf_counter()
    write_safetensors(path, names, pinned)
    run_.report.info["file_write_s"] = time.perf_counter() - t0
    log(f"   written and fsynced in {run_.report.info['file_write_s']:.1f} s")

    loaded: dict[str, torch.Tensor] = {}

    def clear():
        loaded.clear()
        zero_all(params)
        sync()

    def by_load_file():
        loaded.update(load_file(str(path), device=str(dev)))
        sync()

    def by_safe_open():
        with safe_open(str(path), framework="pt", device=str(dev)) as f:
            for name, p in zip(names, params):
                p.copy_(f.get_tensor(name))
        sync()

    def by_readinto():
        read_to_device(path, names, pinned, params)

    def clear_staging_too():
        zero_all(pinned)  # else a read that wrote nothing would leave the right bytes in place
        clear()

    methods = [
        ("safetensors load_file(device='cuda')", by_load_file, clear,
         lambda: run_.verify("load_file", [loaded[n] for n in names])),
        ("safe_open(device='cuda'), per tensor -> params", by_safe_open, clear,
         lambda: run_.verify("safe_open", params)),
        ("file -> pinned host (readinto) -> device", by_readinto, clear_staging_too,
         lambda: run_.verify("readinto", params)),
    ]
    for label, step, before, after in methods:
        for temperature in ("cold", "warm"):
            run_.budget.enter(f"{label}, {temperature}")
            resident: list[float | None] = []

            def prepare(before=before, temperature=temperature, resident=resident):
                before()
                if temperature == "cold":
                    drop_from_page_cache(path)
                resident.append(resident_fraction(path))

            timed(run_, f"{label}, {temperature}", r, step, before=prepare, after=after,
                  guess_gbps=0.2 if temperature == "cold" else 1,
                  note=lambda temperature=temperature, resident=resident: cache_note(temperature, resident))
    loaded.clear()
    run_.host.pop("pinned").clear()
    path.unlink()
    release_cached(dev)


def cache_note(temperature: str, resident: list[float | None]) -> str:
    if None in resident:
        return "page cache residency unknown (no mincore)"
    worst = max(resident) if temperature == "cold" else min(resident)
    if temperature == "cold" and worst > 0.05:
        return f"NOT cold: up to {worst:.0%} of the file was still in the page cache (tmpfs? overlay?)"
    if temperature == "warm" and worst < 0.95:
        return f"only {worst:.0%} of the file was in the page cache (too little RAM to keep it?)"
    return f"{worst:.0%} of the file in the page cache before each read"


# --- phase 3: CUDA IPC from a trainer process -----------------------------------------------------


def trainer_process(layout, repeats: int, inbox, outbox) -> None:
    """The trainer: its own process and CUDA context, its own tensors on the same GPU. For each
    hand-off it changes them in place (as an optimizer step would), fingerprints them, and sends
    their CUDA IPC handles; it keeps them unchanged until the receiver says it has copied them,
    as the design requires of a trainer (docs/architecture.md)."""
    try:
        from torch.multiprocessing.reductions import reduce_tensor

        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        gen = torch.Generator(device=device)
        gen.manual_seed(TRAINER_SEED)
        tensors = [torch.empty(s, dtype=DTYPE, device=device).normal_(generator=gen) for _, s in layout]
        sync()
        outbox.put(("ready",))
        for _ in range(repeats):
            if inbox.get(timeout=BUDGET_S) != "go":
                return
            for t in tensors:
                t.neg_()  # a new version: every sign bit flips
            sums = fingerprints(tensors)
            t0 = now()
            # reduce_tensor is what torch's own queues use to send a CUDA tensor: the handle of its
            # allocation, the offset and size of its storage, its shape, and an event to wait on.
            handles = [reduce_tensor(t)[1] for t in tensors]
            outbox.put(("handles", t0, sums, handles))
            if inbox.get(timeout=BUDGET_S) != "released":
                return
        inbox.get(timeout=BUDGET_S)  # "stop": only now may the tensors be freed
    except BaseException:
        outbox.put(("error", traceback.format_exc()))
        raise


def expect(run_: Run, outbox, kind: str) -> tuple:
    # Short polls, so a trainer that died or a run past its budget is noticed; a message that
    # arrives is taken at once, so polling adds nothing to the time measured.
    while True:
        try:
            msg = outbox.get(timeout=1.0)
        except queue.Empty:
            if not run_.child.is_alive():
                raise CheckFailed(f"the trainer process exited (code {run_.child.exitcode}) before sending "
                                  f"'{kind}'") from None
            run_.budget.check(f"waiting for the trainer's '{kind}'", 0)
            continue
        if msg[0] == "error":
            raise CheckFailed(f"the trainer process failed:\n{msg[1]}")
        if msg[0] != kind:
            raise CheckFailed(f"expected '{kind}' from the trainer, got '{msg[0]}'")
        return msg[1:]


def phase_ipc(run_: Run) -> None:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    run_.budget.enter("CUDA IPC: starting the trainer process (spawn)")
    run_.budget.check("starting the trainer process", 60)
    ctx = torch.multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    inbox, outbox = ctx.Queue(), ctx.Queue()
    run_.child = ctx.Process(target=trainer_process, args=(run_.layout, run_.args.repeats, inbox, outbox),
                             name="gpu_check-trainer", daemon=True)
    run_.child.start()
    expect(run_, outbox, "ready")

    run_.budget.enter("CUDA IPC: hand-offs")
    opened, total = [], []
    for i in range(run_.args.repeats):
        run_.budget.check("a CUDA IPC hand-off", total[-1] * 2 if total else 30)
        zero_all(run_.params)
        sync()
        inbox.put("go")
        t0, sums, handles = expect(run_, outbox, "handles")
        # Opening a handle maps the trainer's allocation into this process (cudaIpcOpenMemHandle);
        # the tensors are views of the trainer's memory, copied here into the engine's parameters.
        shared = [rebuild_cuda_tensor(*h) for h in handles]
        t_open = now()
        copy_all(run_.params, shared)
        sync()
        t1 = now()
        opened.append(t_open - t0)
        total.append(t1 - t0)
        run_.verify(f"CUDA IPC hand-off {i + 1}", run_.params, sums)
        del shared  # closes the handles: the next hand-off opens them afresh
        inbox.put("released")
    inbox.put("stop")
    run_.child.join(timeout=60)
    n = len(run_.layout)
    run_.report.add("CUDA IPC: handles (reduce, send, open)", run_.nbytes, opened,
                    note=f"{n} handles; the bytes are reachable, not yet copied; each hand-off opens "
                         "them afresh")
    run_.report.add("CUDA IPC: hand-off + copy into params", run_.nbytes, total,
                    note="from the trainer's first reduce_tensor to the receiver's copy done")


# --- the machine, and the checks before any heavy work --------------------------------------------


def no_gpu_message() -> str:
    build = (f"a CPU-only build of torch {torch.__version__}" if torch.version.cuda is None
             else f"torch {torch.__version__} built for CUDA {torch.version.cuda}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return (f"gpu_check: no CUDA GPU: torch.cuda.is_available() is False ({build}{hint}). This check "
            "measures transfers to a GPU and cannot run without one: nothing was measured.")


def mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def require_resources(run_: Run) -> None:
    """Fail now, not after minutes: the largest moments hold two copies of the checkpoint on the
    GPU (parameters + a destination; in the IPC phase, the trainer's tensors in another process),
    two in host memory (pageable + pinned) and one on disk."""
    n, short = run_.nbytes, []
    free_gpu, _ = torch.cuda.mem_get_info(run_.device)
    if free_gpu < 2 * n + 1.5 * GIB:
        short.append(f"GPU memory: {free_gpu / GIB:.1f} GiB free, {(2 * n + 1.5 * GIB) / GIB:.1f} GiB needed")
    host = mem_available()
    if host is not None and host < 2 * n + GIB:
        short.append(f"host memory: {host / GIB:.1f} GiB available, {(2 * n + GIB) / GIB:.1f} GiB needed")
    disk = shutil.disk_usage(run_.workdir).free
    if disk < n + 256 * 2**20:
        short.append(f"disk at {run_.workdir}: {disk / GIB:.1f} GiB free, {n / GIB + 0.25:.1f} GiB needed")
    if short:
        raise CheckFailed("not enough room for a checkpoint of "
                          f"{n / GIB:.2f} GiB: " + "; ".join(short) + " (use a smaller --gib, or --dir)")


def filesystem_of(path: Path) -> str:
    best, fs = "", "?"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            mount = parts[1]
            if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                best, fs = mount, parts[2]
    except (OSError, IndexError):
        pass
    return fs


def environment(run_: Run) -> dict:
    props = torch.cuda.get_device_properties(run_.device)
    info = dict(gpu=props.name, gpu_memory_gib=round(props.total_memory / GIB, 1),
                capability=f"{props.major}.{props.minor}", torch=torch.__version__, cuda=torch.version.cuda,
                python=platform.python_version(), machine=platform.machine(), cpus=os.cpu_count(),
                bytes=run_.nbytes, tensors=len(run_.layout), repeats=run_.args.repeats,
                workdir=str(run_.workdir), filesystem=filesystem_of(run_.workdir))
    try:
        import safetensors

        info["safetensors"] = safetensors.__version__
    except (ImportError, AttributeError):
        pass
    # The PCIe link bounds every host <-> device row: gen 4 x16 moves ~25 GB/s, gen 5 ~50 GB/s.
    smi = shutil.which("nvidia-smi")
    if smi:
        fields = ("driver_version,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,"
                  "pcie.link.width.max")
        try:
            out = subprocess.run([smi, f"--query-gpu={fields}", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=20).stdout.strip().splitlines()
            if out:
                info["nvidia_smi"] = dict(zip(fields.split(","), (v.strip() for v in out[0].split(","))))
        except (OSError, subprocess.SubprocessError):
            pass
    return info


# --- main ----------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0,
                    help="checkpoint size in GiB (default 4; at least 0.125, one layer of 128 MiB)")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions of each path (default 3; median)")
    ap.add_argument("--dir", default=None,
                    help="where to write the temporary safetensors file (default: the system's temp dir; "
                         "use a local disk, not tmpfs, for cold reads)")
    ap.add_argument("--json", metavar="PATH", default=None, help="also write every number to PATH as JSON")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help=f"abort past this many seconds in all (default {BUDGET_S})")
    args = ap.parse_args(argv)
    if args.gib < 0.125:
        ap.error("--gib must be at least 0.125 (one decoder layer of 128 MiB)")
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # First, before anything heavy: without a GPU there is nothing to measure, and that must not
    # look like a pass (no skip).
    if not torch.cuda.is_available():
        print(no_gpu_message(), file=sys.stderr, flush=True)
        return 2
    try:
        import safetensors.torch  # noqa: F401
    except ImportError:
        print("gpu_check: safetensors is not installed (import safetensors.torch failed)", file=sys.stderr)
        return 1

    report, budget = Report(), Budget(args.budget_s)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    workdir = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=args.dir))
    run_ = Run(args, device, report, budget, workdir)

    def cleanup() -> None:
        if run_.child is not None and run_.child.is_alive():
            run_.child.kill()  # the trainer process this run started, by its handle
        shutil.rmtree(workdir, ignore_errors=True)

    def watchdog() -> None:
        # A step that hangs (a wedged IPC open, a stalled disk) ends the run too, not just a slow one.
        print(f"gpu_check: over the time budget ({budget.seconds:.0f} s) during '{budget.phase}': aborted; "
              "rows measured so far:\n" + report.markdown(), file=sys.stderr, flush=True)
        cleanup()
        os._exit(3)

    timer = threading.Timer(max(1.0, budget.seconds - budget.elapsed()), watchdog)
    timer.daemon = True
    timer.start()
    code = 0
    try:
        report.info = environment(run_)
        fs = report.info["filesystem"]
        if fs in ("tmpfs", "ramfs", "overlay"):
            report.notes.append(f"the file was written to {fs} ({workdir}): cold reads may not be cold; "
                                "pass --dir on a local disk")
        log(f"{report.info['gpu']}: {run_.nbytes:,} bytes in {len(run_.layout)} tensors, "
            f"{args.repeats} repeats, file in {workdir} ({fs}), budget {budget.seconds:.0f} s")
        require_resources(run_)
        phase_memory(run_)
        phase_file(run_)
        phase_ipc(run_)
    except OverBudget as e:
        print(f"gpu_check: over the time budget: {e}", file=sys.stderr)
        code = 3
    except CheckFailed as e:
        print(f"gpu_check: FAILED: {e}", file=sys.stderr)
        code = 1
    except Exception:
        print(f"gpu_check: FAILED in '{budget.phase}':\n{traceback.format_exc()}", file=sys.stderr)
        code = 1
    finally:
        timer.cancel()
        cleanup()
    report.info["elapsed_s"] = round(budget.elapsed(), 1)
    report.info["exit_code"] = code
    print(report.markdown(), flush=True)
    log(f"done in {budget.elapsed():.0f} s, exit code {code}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(info=report.info, rows=report.rows, notes=report.notes),
                                              indent=1) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
