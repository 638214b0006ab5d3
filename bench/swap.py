"""Swap: time from `publish_weights` to a worker serving the new version, for a checkpoint of
~445 MB (a random float32 Llama: hidden 1024, 8 layers, vocab 8192), split into phases, vs a raw
sequential read of the same files.

A `rollq worker --engine vllm` process serves version 0; this process publishes versions 1, 2, ...
(alternating two checkpoints, as a trainer would publish new weights), first copied into a
weight store on local disk (the default), then registered in place (`copy=False`), and right
after each publish submits a one-token probe group with `min_version` = the new version: its
result marks the moment the worker serves it. Phases:

- store: `publish_weights` copying the files into the store, hashing them, registering them,
  then fsyncing them (trainer: the version is registered, and workers start on it, before the
  fsyncs, which run beside the worker's verify); by reference: hashing them in place;
  `state_dict, wait=False`: writing the trainer's tensors (held in memory) into the store in
  the background, after `trainer stall`, the time the call held the trainer (copying its
  tensors into the client's staging buffer; the first publish of a client also allocates that
  buffer, reported apart). Every publish is made with `wait=False` and the probe submitted as
  soon as the version is announced (registered), so publish -> serving is when a group could
  first be served on it, not when the call returned (since issue 32; before, the probe followed
  the call's return, fsyncs and retention included).
- verify: the worker re-reading and hashing the files, checking headers and shapes.
- drain, pause, load, resume: the worker's swap (`rollq_worker_swap_phase_seconds`).
- push (mode `state_dict + push`, issue 40): the trainer's tensors published with `push="shm"`
  (the worker's engine takes them from the shm segment, staged and fingerprint-checked while it
  serves, then vLLM's `load_weights` from memory while paused): no verify phase; `push` is the
  paused load. Its floor is that `push` phase itself (vLLM's load of tensors already in the
  engine's memory, plus the probe token), and publish -> serving against `copy`'s is issue 40's
  <= 0.6x target.
- canary (modes `copy + canary`, `copy + small canary`): the version's canary scored by the
  worker's engine after the load and before the version serves (issue 41): the default canary
  (8 x 128 tokens walking the vocabulary), or a small one (2 x 32 tokens). The references are
  computed once per checkpoint by transformers before the runs (`reference_s` in the result:
  what a trainer's `canary=True` costs it per publish), so publish -> serving of these modes
  against `copy`'s is the check's cost.

Adapter versions: a second worker (`--enable-lora --max-lora-rank 16`, its own policy) serves
the same checkpoint as version 0, and this process publishes rank-16 LoRA adapters of it (PEFT
models, q/k/v/o projections, as a trainer holds them) as versions 1, 2, ... with
`adapter_on=0`, each with the same probe group submitted once it is announced: publish -> serving is the PEFT
state dict, the adapter's store up to its registration (its two files written while hashed; the
fsyncs follow, beside the worker), the worker's copy, checks and `add_lora`, and the probe's
one token under the adapter. No swap: the full weights never change. That token is a CPU
forward pass of the whole model with LoRA (~50-110 ms here), so each publish's probe is followed
by the same probe on the adapter, now resident: `publish -> servable` (raw publish -> first
token less that resident probe's latency, per publish) is how soon the version could serve.
Under load that difference of two probes swung from -214 to +264 ms per publish, so the <= 50
ms target is judged on the worker's own stamp: `publish -> loaded`, from the call to the
moment the worker put the adapter in its loaded set (`Totals.last_adapter["servable_at"]`, the
same host's wall clock), from which a group waiting for it runs on it. The others are reported
beside it. `publish -> generating` (end to end less the probe's generation time as the worker
measured it) is kept too.

The raw read is the same files read once, sequentially, just before each publish: warm (from
the page cache, as the swap finds them) and cold (the files' pages evicted first,
`POSIX_FADV_DONTNEED`: storage bandwidth). Each publish of full weights starts once the
worker's processes are idle (`worker_idle`: vLLM's shared-memory readers spin for a second
after each message) and the disk is settled (`settle`); the first `WARM_UP` publishes of each
mode are not measured. Reported: end to
end, each phase, and the effective bandwidth (checkpoint bytes / end to end) as a fraction of
each raw read's; and the **engine floor**, per publish: its cold
read plus the worker's `load` phase of the same swap (vLLM's `reload_weights` of the snapshot,
its probe token), what any swap through vLLM pays at least, with publish -> serving / floor
(median of the per-publish ratios; target <= 1.3).

    python bench/swap.py [--repeats 3] [--adapter-repeats 9] [--only full|adapter]
    # table + bench/results/swap.json
    python bench/swap.py --tensor-parallel-size 2
    # copy and push again on a TP=2 worker (vLLM's CPU build, its ranks unbound), added to
    # bench/results/swap.json as `tp`
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import make_llama, stop_process, write_result
from safetensors.torch import load_file

from rollq.client import RolloutClient
from rollq.harness.faults import RedisProcess
from rollq.queue.keys import Keys
from rollq.queue.workers import live_workers

MODEL = dict(hidden=1024, layers=8, vocab=8192, intermediate=2816)
POLICY = "swap"
ADAPTER_POLICY = "swap-lora"
ADAPTER_RANK = 16
WARM_UP = 3
"""Publishes of each mode not measured: a trainer publishes every step, so the steady state is
what counts, where the store and the worker each hold a spare to write the next version over (a
retired version: `keep=2` retires a mode's first publish once its third is written, so its
fourth is the first written over a spare)."""
CANARY = "copy + canary"
SMALL_CANARY = "copy + small canary"
SMALL = dict(count=2, length=32)
"""The small canary's sequences (`rollq.canary.default_sequences`)."""
MEMORY = "state_dict, wait=False"
"""The trainer publishes its tensors and goes on: `trainer stall` is how long the call held it."""
PUSH = "state_dict + push"
PUSH_ENGINE = '{"backend": "rollq_shm"}'
"""The full-weight worker's `weight_transfer_config`: it takes pushes (and files, as any worker)."""
TP_MODES = ("copy", PUSH)
"""The modes run again on a tensor-parallel worker (`--tensor-parallel-size`)."""


def raw_read(files: list[Path], *, cold: bool = False) -> float:
    """Seconds to read the files once, sequentially; `cold`: from storage, these files' pages
    evicted from the page cache first (and only theirs: dropping every cache, as this bench did
    until 2026-12-06, also evicted the worker's spare snapshot, the store's files and every
    process's code, so the swap measured next paid for the floor's measurement; the cold read
    itself is the same, 0.161-0.173 s both ways for this checkpoint)."""
    if cold:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fdatasync(fd)  # (dirty pages are not evicted)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    began = time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(8 << 20):
                pass
    return time.perf_counter() - began


async def wait_worker(client: RolloutClient, worker: subprocess.Popen, timeout_s: float = 900,
                      policy: str = POLICY) -> None:
    give_up = time.monotonic() + timeout_s
    while not await client.redis.exists(Keys(policy).workers):
        if worker.poll() is not None or time.monotonic() > give_up:
            raise RuntimeError("the rollq worker did not start")
        await asyncio.sleep(0.5)


async def last_swap(client: RolloutClient, version: int, timeout_s: float = 30) -> dict[str, float]:
    """The worker's phase times for `version`, from its heartbeat (beats every lease_s / 3)."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        for w in await live_workers(client.redis, Keys(POLICY)):
            if w.version == version and w.totals.last_swap:
                return w.totals.last_swap
        await asyncio.sleep(0.2)
    raise RuntimeError(f"no heartbeat reported the swap to version {version}")


async def adapter_servable_at(client: RolloutClient, version: int, timeout_s: float = 30) -> float:
    """The worker's wall clock when adapter `version` became servable, from its heartbeat."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        for w in await live_workers(client.redis, Keys(ADAPTER_POLICY)):
            if w.totals.last_adapter.get("version") == version:
                return w.totals.last_adapter["servable_at"]
        await asyncio.sleep(0.05)
    raise RuntimeError(f"no heartbeat reported adapter version {version} loaded")


async def last_event(client: RolloutClient) -> str:
    """The id of the newest version announcement (what `announced` reads after)."""
    newest = await client.redis.xrevrange(client.keys.version_events, count=1)
    return newest[0][0] if newest else "0-0"


async def ended(task: asyncio.Task) -> float:
    """When `task` ended (perf_counter), however late it is awaited."""
    await asyncio.wait([task])
    return time.perf_counter()


async def announced(client: RolloutClient, after: str) -> None:
    """Until the registry announces a version after `after` (the stream workers block on)."""
    while not await client.redis.xread({client.keys.version_events: after}, count=1, block=60_000):
        pass


def settle(directory: Path, quiet_s: float = 0.2, timeout_s: float = 30) -> None:
    """Write back what is dirty, then wait until the disk under `directory` has had nothing in
    flight for `quiet_s`: each publish starts from a settled disk. (This machine's root ext4 is
    mounted with `discard`: deleting a checkpoint, as the last run's clean-up or a `keep` does,
    trims its blocks for seconds after, and reads, writes and fsyncs queued behind those trims
    made single publishes 2-4x slower.)"""
    os.sync()
    dev = os.stat(directory).st_dev
    inflight = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/inflight")
    if not inflight.exists():
        return
    quiet_since, give_up = time.monotonic(), time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        if any(int(n) for n in inflight.read_text().split()):
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return
        time.sleep(0.01)


def cpu_seconds(session: int) -> float:
    """CPU time used so far by the processes of one session (the worker and vLLM's processes)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[3]) == session:  # fields after the name: state ppid pgrp session ...
            ticks += int(fields[11]) + int(fields[12])  # utime stime
    return ticks / os.sysconf("SC_CLK_TCK")


def worker_idle(session: int, window_s: float = 0.3, most: float = 0.1, timeout_s: float = 30) -> None:
    """Wait until the worker's processes used under `most` of a core over `window_s`. vLLM's
    readers of its shared-memory queue spin (sched_yield) for 1 s after each message they read
    (`SpinCondition.busy_loop_s`): a publish made within a second of the previous probe shared
    the 2 cores here with that spin, which made the publisher's hash 0.05 -> 0.085-0.12 s."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        before = cpu_seconds(session)
        time.sleep(window_s)
        if cpu_seconds(session) - before <= most * window_s:
            return


async def swap_once(client: RolloutClient, version: int, source: Path, mode: str,
                    worker: int, canary=None) -> dict:
    """`worker`: the session of the worker's processes (`worker_idle`)."""
    files = sorted(source.glob("*.safetensors"))
    worker_idle(worker)
    settle(source)
    raw_cold = raw_read(files, cold=True)  # first: it leaves the files in the page cache
    raw_warm = raw_read(files)
    phases = {}
    tensors = {k: v for f in files for k, v in load_file(str(f)).items()} if mode in (MEMORY, PUSH) \
        else None
    after = await last_event(client)
    began = time.perf_counter()
    # wait=False and the probe submitted as soon as the version is announced (registered), as
    # a trainer's queued group would find it: served as soon as a worker can serve it, whatever
    # the publish still does after registering it (fsyncs, retention). (A group submitted
    # before the version is registered is handed back and claimed again until it is.)
    published = await client.publish_weights(version, source if tensors is None else tensors,
                                             copy=mode != "by reference", keep=2, wait=False,
                                             canary=canary, push="shm" if mode == PUSH else None)
    if mode in (MEMORY, PUSH):  # a trainer's tensors: the call returns once they are copied
        phases["trainer stall"] = time.perf_counter() - began
    stored = asyncio.ensure_future(ended(published))
    await announced(client, after)
    phases["registered"] = time.perf_counter() - began
    await client.submit([[1, 5, 6]], n=1, sampling={"max_tokens": 1}, min_version=version)
    [probe] = await client.take(1, timeout_s=300)
    total_s = time.perf_counter() - began
    phases["hash in place" if mode == "by reference" else "store"] = await stored - began
    if probe.status != "ok" or probe.samples[0].versions[0][0] != version:
        raise RuntimeError(f"probe not served by version {version}: {probe}")
    phases |= await last_swap(client, version)
    print(f"version {version} ({mode}): {total_s:.2f} s end to end, raw read "
          f"{raw_warm:.3f} s warm, {raw_cold or float('nan'):.3f} s cold; "
          + ", ".join(f"{k} {v:.2f} s" for k, v in phases.items())
          + f" (load average {os.getloadavg()[0]:.1f})", flush=True)
    return {"total_s": total_s, "raw_warm_s": raw_warm, "raw_cold_s": raw_cold, "phases": phases}


def floor(run: dict) -> float | None:
    """The engine floor of one publish: its cold read + vLLM's load of the same bytes."""
    if "push" in run["phases"]:  # vLLM's load of tensors already in the engine's memory
        return run["phases"]["push"]
    if run["raw_cold_s"] is None:
        return None
    return run["raw_cold_s"] + run["phases"]["load"]


def summary(every: list[dict], size: int) -> dict:
    """Medians of the measured runs (the warm-up ones only give the first publish's stall)."""
    stalls = [r["phases"]["trainer stall"] for r in every if "trainer stall" in r["phases"]]
    runs = [r for r in every if not r.get("warm_up")]
    total = statistics.median(r["total_s"] for r in runs)
    floors = [(r["total_s"], floor(r)) for r in runs if floor(r) is not None]
    warm = statistics.median(r["raw_warm_s"] for r in runs)
    colds = [r["raw_cold_s"] for r in runs if r["raw_cold_s"] is not None]
    cold = statistics.median(colds) if colds else None
    return {"total_s": total, "gb_per_s": size / total / 1e9,
            "stall_first_s": stalls[0] if stalls else None,
            "phases_s": {k: statistics.median(r["phases"][k] for r in runs) for k in runs[0]["phases"]},
            "raw_warm_s": warm, "raw_cold_s": cold, "ratio_vs_warm": warm / total,
            "ratio_vs_cold": cold / total if cold else None,
            "floor_s": statistics.median(f for _, f in floors) if floors else None,
            "ratio_vs_floor": statistics.median(t / f for t, f in floors) if floors else None,
            "runs": every}


def start_worker(redis_url: str, policy: str, model: Path, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rollq", "worker", "--engine", "vllm", "--redis-url", redis_url,
         "--policy", policy, "--model", str(model), "--dtype", "float32",
         "--max-model-len", "256", "--max-num-seqs", "8", "--enforce-eager", "--poll-s", "0.1",
         "--lease-s", "1.5", *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def make_adapters(base: Path, count: int) -> list:
    """Rank-16 PEFT adapters of the checkpoint, lora_B non-zero (PEFT starts it at zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    adapters = []
    for seed in range(count):
        torch.manual_seed(seed)
        model = get_peft_model(LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32),
                               LoraConfig(r=ADAPTER_RANK, lora_alpha=2 * ADAPTER_RANK,
                                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.01)
        adapters.append(model)
    return adapters


async def probe(client: RolloutClient, version: int) -> tuple[float, object]:
    """Seconds from submitting the one-token probe group (`min_version=version`) to its result."""
    began = time.perf_counter()
    await client.submit([[1, 5, 6]], n=1, sampling={"max_tokens": 1}, min_version=version)
    [result] = await client.take(1, timeout_s=120)
    if result.status != "ok" or result.samples[0].versions[0][0] != version:
        raise RuntimeError(f"probe not served by adapter version {version}: {result}")
    return time.perf_counter() - began, result


async def adapter_once(client: RolloutClient, version: int, adapter) -> dict:
    """Publish an adapter, probe it (raw: publish -> first token), then probe it again now that
    it is resident: the same group on the same engine a moment later, whose latency is what the
    first probe would have taken had the adapter been servable when the publish began."""
    settle(Path(tempfile.gettempdir()))
    after = await last_event(client)
    began, began_at = time.perf_counter(), time.time()
    # wait=False and the probe once the version is announced (see `swap_once`).
    published = await client.publish_weights(version, adapter, adapter_on=0, keep=3, wait=False)
    done = asyncio.ensure_future(ended(published))
    await announced(client, after)
    _, result = await probe(client, version)
    total_s = time.perf_counter() - began
    loaded_s = await adapter_servable_at(client, version) - began_at  # (one host: one clock)
    entry = await published
    stored = await done - began
    resident_s, _ = await probe(client, version)
    print(f"adapter version {version}: {total_s * 1000:.1f} ms end to end, store "
          f"{stored * 1000:.1f} ms, probe generation {result.generation_s * 1000:.1f} ms, "
          f"resident probe {resident_s * 1000:.1f} ms -> servable "
          f"{(total_s - resident_s) * 1000:.1f} ms; in the worker's loaded set "
          f"{loaded_s * 1000:.1f} ms (load {os.getloadavg()[0]:.1f})", flush=True)
    return {"loaded_s": loaded_s, "total_s": total_s, "store_s": stored, "generation_s": result.generation_s,
            "ready_s": total_s - result.generation_s, "resident_s": resident_s,
            "servable_s": total_s - resident_s, "bytes": sum(d.bytes for d in entry.files)}


async def adapter_runs(redis_url: str, tmp: Path, base: Path, repeats: int) -> dict:
    adapters = make_adapters(base, 2)
    worker = start_worker(redis_url, ADAPTER_POLICY, base, "--enable-lora", "--max-loras", "3",
                          "--max-lora-rank", str(ADAPTER_RANK))
    try:
        async with RolloutClient(redis_url, policy=ADAPTER_POLICY, trainer_id="bench",
                                 weight_store=str(tmp / "store-lora")) as client:
            await wait_worker(client, worker, policy=ADAPTER_POLICY)
            # One unmeasured publish: the first LoRA request of an engine pays one-off set-up.
            runs = [await adapter_once(client, v, adapters[v % 2]) for v in range(1, repeats + 2)][1:]
    finally:
        stop_process(worker)
    return {"rank": ADAPTER_RANK, "bytes": runs[0]["bytes"], "repeats": repeats,
            "total_s": statistics.median(r["total_s"] for r in runs),
            "store_s": statistics.median(r["store_s"] for r in runs),
            "generation_s": statistics.median(r["generation_s"] for r in runs),
            "ready_s": statistics.median(r["ready_s"] for r in runs),
            "resident_s": statistics.median(r["resident_s"] for r in runs),
            "servable_s": statistics.median(r["servable_s"] for r in runs),
            "loaded_s": statistics.median(r["loaded_s"] for r in runs), "runs": runs}


async def main(repeats: int, adapter_repeats: int, only: str | None = None, tp: int = 1) -> dict:
    load_before = os.getloadavg()
    modes: dict[str, list[dict]] = {"copy": [], CANARY: [], SMALL_CANARY: [], "by reference": [],
                                    MEMORY: [], PUSH: []}
    if tp > 1:
        modes, only = {mode: [] for mode in TP_MODES}, "full"
    references: dict = {}
    adapter = None
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoints = [make_llama(tmp / f"ckpt{i}", seed=i, **MODEL) for i in range(2)]
        size = sum(f.stat().st_size for f in checkpoints[1].glob("*.safetensors"))
        redis = RedisProcess(tmp, aof=False).start()
        try:
            if only != "adapter":
                references = canaries(checkpoints) if CANARY in modes else {}
                await full_runs(redis.url, tmp, checkpoints, modes, repeats, references, tp)
            if only != "full":
                adapter = await adapter_runs(redis.url, tmp, checkpoints[0], adapter_repeats)
        finally:
            redis.stop()
    return {"bytes": size, "repeats": repeats, "model": MODEL, "tensor_parallel_size": tp,
            "modes": {mode: summary(runs, size) for mode, runs in modes.items() if runs},
            "adapter": adapter, "load": [load_before[0], os.getloadavg()[0]],
            "reference_s": {mode: seconds for mode, (_, seconds) in references.items()}}


def canaries(checkpoints: list[Path]) -> dict[str, tuple[list, float]]:
    """Per canary mode: each checkpoint's canary (transformers, float32) and the median seconds
    one took (what `canary=True` holds a trainer for, per publish)."""
    import torch
    from transformers import LlamaForCausalLM

    from rollq.canary import default_sequences, reference

    out = {}
    models = [LlamaForCausalLM.from_pretrained(c, torch_dtype=torch.float32).eval() for c in checkpoints]
    for mode, sequences in ((CANARY, None), (SMALL_CANARY, default_sequences(MODEL["vocab"], **SMALL))):
        made, took = [], []
        for model in models:
            began = time.perf_counter()
            made.append(reference(model, sequences))
            took.append(time.perf_counter() - began)
        out[mode] = (made, statistics.median(took))
    return out


async def full_runs(redis_url: str, tmp: Path, checkpoints: list[Path],
                    modes: dict[str, list[dict]], repeats: int, references: dict, tp: int = 1) -> None:
    worker = start_worker(redis_url, POLICY, checkpoints[0], "--engine-arg",
                          f"weight_transfer_config={PUSH_ENGINE}", "--tensor-parallel-size", str(tp))
    try:
        async with RolloutClient(redis_url, policy=POLICY, trainer_id="bench",
                                 weight_store=str(tmp / "store")) as client:
            await wait_worker(client, worker)
            version = 0
            for mode, runs in modes.items():
                for i in range(WARM_UP + repeats):
                    version += 1
                    canary = references[mode][0][version % 2] if mode in references else None
                    run = await swap_once(client, version, checkpoints[version % 2], mode,
                                          worker.pid, canary)  # (its own session: start_worker)
                    runs.append(run | {"warm_up": i < WARM_UP})
    finally:
        stop_process(worker)


def report(r: dict) -> None:
    print(f"swap: {r['bytes'] / 1e6:.0f} MB checkpoint, median of {r['repeats']}")
    for mode, m in r["modes"].items():
        cold = f"{m['raw_cold_s']:.3f} s" if m["raw_cold_s"] else "n/a"
        print(f"{mode}: publish -> serving {m['total_s']:.2f} s ({m['gb_per_s']:.2f} GB/s); raw read "
              f"{m['raw_warm_s']:.3f} s warm, {cold} cold")
        if m.get("ratio_vs_floor"):
            print(f"  engine floor (cold read + load) {m['floor_s']:.2f} s; publish -> serving / floor "
                  f"{m['ratio_vs_floor']:.2f} (target <= 1.3)")
        print("  " + ", ".join(f"{k} {v:.2f} s" for k, v in m["phases_s"].items()))
    a = r["adapter"]
    if a:
        print(f"adapter (rank {a['rank']}, {a['bytes'] / 1e6:.1f} MB), median of {a['repeats']}: "
              f"publish -> first token {a['total_s'] * 1000:.1f} ms (raw); the same probe on the "
              f"adapter once resident {a['resident_s'] * 1000:.1f} ms; publish -> servable "
              f"{a['servable_s'] * 1000:.1f} ms (store {a['store_s'] * 1000:.1f} ms, probe "
              f"generation {a['generation_s'] * 1000:.1f} ms, publish -> generating "
              f"{a['ready_s'] * 1000:.1f} ms); publish -> loaded (the worker's stamp) "
              f"{a['loaded_s'] * 1000:.1f} ms (target <= 50 ms)")
    copy = r["modes"].get("copy")
    if copy and PUSH in r["modes"]:
        print(f"{PUSH}: publish -> serving {r['modes'][PUSH]['total_s'] / copy['total_s']:.2f}x copy's "
              f"(target <= 0.6)")
    for mode in (CANARY, SMALL_CANARY):
        if copy and mode in r["modes"]:
            print(f"{mode}: publish -> serving {r['modes'][mode]['total_s'] / copy['total_s']:.2f}x "
                  f"copy's (target <= 1.10 with the default canary); the trainer's reference "
                  f"{r['reference_s'][mode]:.2f} s per publish")
    print(f"load average: {r['load'][0]:.1f} at the start, {r['load'][1]:.1f} at the end")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--adapter-repeats", type=int, default=9)
    parser.add_argument("--only", choices=["full", "adapter"], help="run one part")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help=f"above 1: only {' and '.join(TP_MODES)}, on a worker with this many "
                             "ranks, added to the last result as `tp`")
    args = parser.parse_args()
    result = asyncio.run(main(args.repeats, args.adapter_repeats, args.only, args.tensor_parallel_size))
    report(result)
    if args.tensor_parallel_size > 1:
        import json

        from common import results_dir

        last = results_dir() / "swap.json"
        result = (json.loads(last.read_text()) if last.exists() else {}) | {
            "tp": result | {"date": time.strftime("%Y-%m-%d")}}
    write_result("swap", result)
