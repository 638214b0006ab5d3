"""`rollq chaos --weights`: weight faults against vLLM worker processes while a trainer submits
greedy groups; then every sample is checked against the weights its version labels name.

Faults, dealt from a shuffled deck (a run lasts until it has seen every kind), each 0-1 s after
every worker has decided on the previous one (served or refused it) and delivered a group under
the version it then serves:
- `storm`: three versions published back to back (copied into the store), `keep=1`;
- `corrupted`: a version published by reference (`copy=False`), then a byte of it flipped: half
  of the time with the workers frozen (SIGSTOP) until the damage is done, so each finds it and
  must refuse; else racing their copies (one that copied first serves the intact bytes);
- `rewritten`: a version published by reference, then, once a worker has verified it (it drains
  toward it or loads it), its file rewritten in place with another weight set's bytes;
- `truncated`: a two-shard version published by reference, then one shard cut short (workers
  frozen until then);
- `pushed`: a version's tensors published with `push="shm"`: every worker (started with the
  `rollq_shm` weight-transfer backend) takes it straight into its engine (issue 40);
- `push_cut`: a pushed version whose shm segment is cut short (workers frozen until then, as a
  trainer killed mid-write would leave it): its fingerprints refuse it, and each worker loads the
  version's intact files instead;
- `canary_wrong`: a version published with the canary of another weight set (the trainer's
  model and the engine's bytes disagree): every worker's check refuses it (issue 41), the
  registry marks it refused everywhere, and the previous version serves on.
Every publish uses `keep=1`. Version v is weight set `v % 3` (`rollq/harness/chaos/reference.py`), so the
reference of every label is known whatever happened to the files.

Workers: one per swap mode (drain, interrupt), each its own float32 engine of a tiny model made
on the spot. At the end one clean version is published and every worker must reach it (the
followers still follow after all the refusals), a last round of groups is served, and then:
0 lost, 0 duplicated, every group `ok`, 0 mislabeled segments (transformers greedy under the
labelled version), 0 non-finite logprobs, every worker alive and exiting 0 on SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from rich.console import Console
from safetensors.torch import save_file

from rollq.harness.chaos.reference import (WEIGHT_SETS, Reference, WeightSets, make_tiny_model,
                                           weight_set)
from rollq.children import stop_children
from rollq.client import RolloutClient
from rollq.harness.faults import RedisProcess
from rollq.protocol import GroupResult
from rollq.queue.workers import live_workers

POLICY = "chaos-weights"
FAULTS = ("storm", "corrupted", "rewritten", "truncated", "pushed", "push_cut", "canary_wrong")
PUSH_ENGINE = '{"backend": "rollq_shm"}'
"""Every worker's `weight_transfer_config`: it takes pushes (and files, as any worker)."""
MODES = ("drain", "interrupt")
PROMPTS = [[1, 7 + 13 * i, 3 + i] for i in range(16)]
IN_FLIGHT = 48
"""Groups the trainer keeps submitted and unanswered: enough to keep both engines busy, so
swaps drain and interrupt running groups."""
console = Console()


@dataclass
class WeightChaosSettings:
    minutes: float = 1.0
    workers: int = 2
    seed: int | None = None
    max_tokens: int = 48
    start_s: float = 600.0
    """How long the engines may take to start (minutes on a loaded CPU)."""
    settle_s: float = 240.0


class WeightSummary(msgspec.Struct):
    minutes: float
    seed: int
    workers: int
    submitted_groups: int
    delivered: int
    duplicated: int
    lost: int
    statuses: dict[str, int]
    samples: int
    segments: int
    multi_segment_samples: int
    mislabeled: int
    nonfinite_logprobs: int
    distinguishable_prompts: int
    """Prompts whose greedy continuations under the weight sets all differ: how many of the
    prompts could show a mislabel of a whole sample (0 would make `mislabeled` meaningless)."""
    faults: dict[str, int]
    versions_published: int
    final_version: int
    final_version_reached: bool
    swaps: dict[str, int]
    """Worker id -> versions it swapped to."""
    refusals: dict[str, int]
    """Worker id -> versions it refused or failed to load."""
    workers_alive: int
    exit_codes: list[int]
    evidence: list[str] = []
    """One line per mislabeled segment, lost or failed group (the first 50)."""
    pushes: dict[str, int] = {}
    """Worker id -> versions it took by a push."""
    canary_refusals: dict[str, int] = {}
    """Worker id -> versions its canary check refused."""

    @property
    def ok(self) -> bool:
        return (self.lost == 0 and self.duplicated == 0 and self.mislabeled == 0
                and self.nonfinite_logprobs == 0 and set(self.statuses) == {"ok"}
                and self.final_version_reached and self.workers_alive == self.workers
                and self.exit_codes == [0] * self.workers)


@dataclass
class _Run:
    settings: WeightChaosSettings
    workdir: Path
    rng: random.Random
    sets: WeightSets
    client: RolloutClient
    workers: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    submitted: set = field(default_factory=set)
    received: Counter = field(default_factory=Counter)
    results: list[GroupResult] = field(default_factory=list)
    faults: Counter = field(default_factory=Counter)
    version: int = 0
    jobs: int = 0
    client_url: str = ""

    def spawn_worker(self, index: int, model: Path) -> None:
        worker_id = f"w{index}-{MODES[index % len(MODES)]}"
        log = open(self.workdir / f"{worker_id}.log", "w")  # noqa: SIM115 (child keeps it)
        # Snapshots under the run's dir (TMPDIR): a killed worker's copies go with it. Wide
        # lines: the log lines counted at the end must not wrap.
        env = os.environ | {"COLUMNS": "1000", "PYTHONUNBUFFERED": "1", "TMPDIR": str(self.workdir)}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.workers.append((worker_id, subprocess.Popen(
            [sys.executable, "-m", "rollq", "worker", "--redis-url", self.client_url, "--policy",
             POLICY, "--worker-id", worker_id, "--engine", "vllm", "--model", str(model),
             "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "32",
             "--enforce-eager", "--seed", "0", "--lease-s", "6", "--poll-s", "0.2",
             "--grace-s", "10", "--swap-mode", MODES[index % len(MODES)],
             "--engine-arg", f"weight_transfer_config={PUSH_ENGINE}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)))
        log.close()

    def log_of(self, worker_id: str) -> str:
        return (self.workdir / f"{worker_id}.log").read_text(errors="replace")

    def stop_workers(self) -> list[int]:
        return stop_children([proc for _, proc in self.workers], 60)


async def _wait_workers(run: _Run, until: float, ready) -> None:
    """Until `ready(states)` holds for the live workers' heartbeats; a worker that exits fails."""
    while True:
        for worker_id, proc in run.workers:
            if proc.poll() is not None:
                tail = "\n".join(run.log_of(worker_id).splitlines()[-30:])
                raise RuntimeError(f"worker {worker_id} exited with {proc.returncode}:\n{tail}")
        if ready(await live_workers(run.client.redis, run.client.keys)):
            return
        if time.monotonic() > until:
            raise TimeoutError("workers did not get there in time")
        await asyncio.sleep(0.2)


async def _submitter(run: _Run, faults_done: asyncio.Event) -> None:
    sampling = {"temperature": 0.0, "max_tokens": run.settings.max_tokens, "logprobs": 0}
    while not faults_done.is_set():
        if len(run.submitted) - len(run.received) >= IN_FLIGHT:
            await asyncio.sleep(0.1)
            continue
        prompts = run.rng.sample(PROMPTS, 4)
        job = await run.client.submit(prompts, n=1, sampling=sampling, job_id=f"j{run.jobs}")
        run.jobs += 1
        run.submitted.update((job, g) for g in range(len(prompts)))


async def _reader(run: _Run, workers_gone: asyncio.Event) -> None:
    """Every result, until the workers have exited (nothing more can arrive) and it read them all."""
    while True:
        gone = workers_gone.is_set()
        batch = await run.client.take(64, timeout_s=0.1 if gone else 0.5)
        for r in batch:
            run.received[(r.job_id, r.group_index)] += 1
            run.results.append(r)
        if gone and not batch:
            break
    await run.client.ack()


async def _publish(run: _Run, source, *, copy: bool, **how) -> int:
    run.version += 1
    await run.client.publish_weights(run.version, source, copy=copy, keep=1, **how)
    return run.version


def _save(run: _Run, version: int, weights_of: int, shards: int, name: str = "") -> Path:
    """Weight set of version `weights_of` as `shards` safetensors files in a fresh directory."""
    directory = run.workdir / "by-reference" / (name or f"v{version}")
    directory.mkdir(parents=True)
    names = sorted(run.sets.of(weights_of))
    for i in range(shards):
        part = {k: run.sets.of(weights_of)[k].contiguous() for k in names[i::shards]}
        file = "model.safetensors" if shards == 1 else f"model-0000{i + 1}-of-0000{shards}.safetensors"
        save_file(part, str(directory / file))
    return directory


async def _verified_by_a_worker(run: _Run, version: int, within_s: float = 15.0) -> str:
    """Wait until a worker has checked `version` (it drains toward it, loads it or serves it)."""
    give_up = time.monotonic() + within_s
    while time.monotonic() < give_up:
        for w in await live_workers(run.client.redis, run.client.keys):
            if w.target == version and w.state in ("draining", "swapping"):
                return "rewritten_during_swap"
            if w.version == version:
                return "rewritten_after_load"
        await asyncio.sleep(0.05)
    return "rewritten_unverified"


async def _fault(run: _Run, kind: str) -> None:
    next_version = run.version + 1
    if kind == "storm":
        for _ in range(3):  # within well under a second: the store writes ~2 MB each
            await _publish(run, run.sets.of(run.version + 1), copy=True)
    elif kind == "corrupted":
        directory = _save(run, next_version, next_version, 1)
        frozen = run.rng.random() < 0.5
        run.faults["corrupted_frozen" if frozen else "corrupted_racing"] += 1
        async with _workers_frozen(run, frozen):
            await _publish(run, directory, copy=False)
            _flip_a_byte(directory / "model.safetensors")
    elif kind == "rewritten":
        directory = _save(run, next_version, next_version, 1)
        other = _save(run, next_version, next_version + 1, 1, f"v{next_version}-other")
        await _publish(run, directory, copy=False)
        run.faults[await _verified_by_a_worker(run, next_version)] += 1
        with open(directory / "model.safetensors", "r+b") as f:  # in place: same inode, same size
            f.write((other / "model.safetensors").read_bytes())
    elif kind == "pushed":
        await _publish(run, run.sets.of(next_version), copy=True, push="shm")
    elif kind == "push_cut":
        async with _workers_frozen(run, True):
            await _publish(run, run.sets.of(next_version), copy=True, push="shm")
            entry = await run.client.registry.get(next_version)
            if entry is not None and entry.push is not None:
                segment = Path(entry.push.address)
                with open(segment, "r+b") as f:  # as a trainer killed mid-write leaves it
                    f.truncate(run.rng.randrange(1, segment.stat().st_size))
    elif kind == "canary_wrong":
        from rollq.canary import reference

        other = run.sets.models[weight_set(next_version + 1)]
        await _publish(run, run.sets.of(next_version), copy=True, canary=reference(other))
    else:
        directory = _save(run, next_version, next_version, 2)
        shard = run.rng.choice(sorted(directory.glob("*.safetensors")))
        async with _workers_frozen(run, True):
            await _publish(run, directory, copy=False)
            shard.write_bytes(shard.read_bytes()[: run.rng.randrange(8, shard.stat().st_size)])


def _flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(f.seek(0, os.SEEK_END) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))


@contextlib.asynccontextmanager
async def _workers_frozen(run: _Run, frozen: bool):
    """Workers copy a new version within milliseconds of its announcement, before a damage that
    follows the publish could land: frozen (SIGSTOP, their engines run on), every worker must
    find the damage and refuse; racing, a worker that copied first serves the intact bytes."""
    procs = [proc for _, proc in run.workers if proc.poll() is None] if frozen else []
    for proc in procs:
        proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGCONT)


async def _faults(run: _Run, until: float, done: asyncio.Event) -> None:
    """Until the run's time is up and every kind of fault has been dealt at least once."""
    deck: list[str] = []
    served_from = 0
    try:
        while time.monotonic() < until or set(FAULTS) - set(run.faults):
            await _served_under_each(run, served_from)
            await asyncio.sleep(run.rng.uniform(0.0, 1.0))
            if not deck:
                deck = list(FAULTS)
                run.rng.shuffle(deck)
            kind = deck.pop()
            run.faults[kind] += 1
            await _fault(run, kind)
            await _settled(run, run.version)
            served_from = len(run.results)
    finally:
        done.set()


async def _served_under_each(run: _Run, served_from: int, within_s: float = 4.0) -> None:
    """Until every worker has delivered a group (among `run.results[served_from:]`) whose last
    segment is the version it serves now: each version a worker took is used before the next
    fault. Bounded: a worker that serves nothing is for the final round to find."""
    give_up = time.monotonic() + within_s
    while time.monotonic() < give_up:
        serving = {(w.worker_id, w.version) for w in await live_workers(run.client.redis, run.client.keys)}
        served = {(r.worker_id, r.samples[0].versions[-1][0])
                  for r in run.results[served_from:] if r.samples and r.samples[0].versions}
        if serving and serving <= served:
            return
        await asyncio.sleep(0.1)


_DECIDED = re.compile(r"now serving version (\d+)|version (\d+) refused|swap to version (\d+) failed")


async def _settled(run: _Run, version: int, within_s: float = 30.0) -> None:
    """Pace the faults: wait until every worker has decided on `version` (served or refused
    it, or something newer) before dealing the next one. Unpaced, a loaded machine's worker could
    still be draining toward one version while three more landed, and skip them all: the run
    would then prove less than its faults promise. Bounded: a stuck worker is for the final
    round to find."""
    give_up = time.monotonic() + within_s
    while time.monotonic() < give_up:
        decided = [max((int(next(g for g in m.groups() if g)) for m in _DECIDED.finditer(
            run.log_of(worker_id))), default=0) for worker_id, _ in run.workers]
        if all(v >= version for v in decided):
            return
        await asyncio.sleep(0.2)


async def _final_round(run: _Run) -> bool:
    """A clean version every worker must reach, then one group per prompt served under it."""
    final = await _publish(run, run.sets.of(run.version + 1), copy=True)
    try:
        await _wait_workers(run, time.monotonic() + 180,
                            lambda states: sum(w.version == final for w in states) == len(run.workers))
    except (TimeoutError, RuntimeError):  # stuck or dead: the summary says so, after the rest
        return False
    sampling = {"temperature": 0.0, "max_tokens": run.settings.max_tokens, "logprobs": 0}
    job = await run.client.submit(PROMPTS, n=1, sampling=sampling, job_id="final")
    run.submitted.update((job, g) for g in range(len(PROMPTS)))
    return True


async def _run(run: _Run, model: Path) -> tuple[bool, list[int], int]:
    s = run.settings
    for i in range(s.workers):
        run.spawn_worker(i, model)
    try:
        await _wait_workers(run, time.monotonic() + s.start_s,
                            lambda states: len(states) == len(run.workers))
        console.print(f"chaos --weights: {s.workers} vLLM workers up; {s.minutes:g} min of faults")
        workers_gone = asyncio.Event()
        reading = asyncio.create_task(_reader(run, workers_gone))
        until = time.monotonic() + s.minutes * 60
        faults_done = asyncio.Event()
        await asyncio.gather(_submitter(run, faults_done), _faults(run, until, faults_done))
        reached = await _final_round(run)
        give_up = time.monotonic() + s.settle_s
        while not run.submitted <= set(run.received) and time.monotonic() < give_up:
            await asyncio.sleep(0.2)
        alive = [proc.poll() is None for _, proc in run.workers]
        # A duplicate would come from a worker still serving a group delivered already: once the
        # workers have exited (finishing what they held), it is in the stream for the reader.
        await asyncio.to_thread(run.stop_workers)
        workers_gone.set()
        await reading
    finally:
        codes = run.stop_workers()
    return reached and all(alive), codes, sum(alive)


async def chaos_weights(s: WeightChaosSettings) -> WeightSummary:
    seed = s.seed if s.seed is not None else random.randrange(2**31)
    with tempfile.TemporaryDirectory(prefix="rollq-chaos-weights-") as tmp:
        workdir = Path(tmp)
        model = make_tiny_model(workdir / "model")
        redis = RedisProcess(workdir / "redis").start()
        client = RolloutClient(redis.url, policy=POLICY, trainer_id="trainer",
                               weight_store=str(workdir / "store"))
        run = _Run(s, workdir, random.Random(seed), WeightSets(model), client, client_url=redis.url)
        try:
            reached, codes, alive = await _run(run, model)
            swaps, refusals = _worker_counts(run)
            pushes, canary_refusals = _push_counts(run)
        finally:
            await client.close()
            redis.stop()
        summary = _summarize(run, seed, reached, codes, alive, swaps, refusals)
        summary.pushes, summary.canary_refusals = pushes, canary_refusals
        if not summary.ok:  # the workers' logs are evidence too: keep them past the temp dir
            kept = Path(tempfile.mkdtemp(prefix="rollq-chaos-weights-logs-"))
            for worker_id, _ in run.workers:
                shutil.copy(workdir / f"{worker_id}.log", kept)
            summary.evidence.append(f"worker logs kept in {kept}")
    return summary


def _worker_counts(run: _Run) -> tuple[dict[str, int], dict[str, int]]:
    logs = {worker_id: run.log_of(worker_id) for worker_id, _ in run.workers}
    swaps = {w: text.count("now serving version") for w, text in logs.items()}
    refusals = {w: text.count("still serving version") for w, text in logs.items()}
    return swaps, refusals


_PUSHED = re.compile(r"now serving version \d+ \(\w+ push,")
_CANARY_REFUSED = re.compile(r"version (\d+) refused: version \d+: canary refused")
"""The follower's line (the engine's traceback names the exception before it instead)."""


def _push_counts(run: _Run) -> tuple[dict[str, int], dict[str, int]]:
    """Per worker: versions taken by a push, versions its canary refused (from its log)."""
    logs = {worker_id: run.log_of(worker_id) for worker_id, _ in run.workers}
    return ({w: len(_PUSHED.findall(text)) for w, text in logs.items()},
            {w: len(set(_CANARY_REFUSED.findall(text))) for w, text in logs.items()})


def _summarize(run: _Run, seed: int, reached: bool, codes: list[int], alive: int,
               swaps: dict[str, int], refusals: dict[str, int]) -> WeightSummary:
    reference, evidence = Reference(run.sets), []
    samples = segments = multi = mislabeled = nonfinite = 0
    statuses = Counter(r.status for r in run.results)
    reference.prepare(r.prompt_ids + s.token_ids for r in run.results for s in r.samples)
    for r in run.results:
        if r.status != "ok":
            evidence.append(f"group {r.job_id}/{r.group_index}: {r.status} ({r.reason})")
        for sample in r.samples:
            samples += 1
            segments += len(sample.versions)
            multi += len(sample.versions) > 1
            nonfinite += sum(not math.isfinite(lp) for lp in sample.token_logprobs)
            wrong = reference.mislabels(r.prompt_ids, sample.token_ids, sample.versions)
            mislabeled += len(wrong)
            evidence += [f"group {r.job_id}/{r.group_index} on {r.worker_id}: {w}" for w in wrong]
    continuations = [reference.greedy(i, PROMPTS, run.settings.max_tokens) for i in range(WEIGHT_SETS)]
    distinguishable = sum(len(set(of_prompt)) == WEIGHT_SETS for of_prompt in zip(*continuations))
    lost = sorted(run.submitted - set(run.received))
    evidence += [f"lost {job}/{group}" for job, group in lost]
    return WeightSummary(
        minutes=run.settings.minutes, seed=seed, workers=run.settings.workers,
        submitted_groups=len(run.submitted), delivered=len(run.submitted & set(run.received)),
        duplicated=sum(c > 1 for c in run.received.values()), lost=len(lost),
        statuses=dict(statuses), samples=samples, segments=segments, multi_segment_samples=multi,
        mislabeled=mislabeled, nonfinite_logprobs=nonfinite,
        distinguishable_prompts=distinguishable, faults=dict(run.faults),
        versions_published=run.version, final_version=run.version, final_version_reached=reached,
        swaps=swaps, refusals=refusals, workers_alive=alive, exit_codes=codes,
        evidence=evidence[:50])


def render(summary: WeightSummary) -> None:
    colour = "green" if summary.ok else "red"
    console.print(f"[bold {colour}]groups submitted {summary.submitted_groups}, delivered "
                  f"{summary.delivered}, duplicated {summary.duplicated}, lost {summary.lost}; "
                  f"samples {summary.samples} ({summary.multi_segment_samples} cut by a swap), "
                  f"segments {summary.segments}, mislabeled {summary.mislabeled}, non-finite "
                  f"logprobs {summary.nonfinite_logprobs}[/bold {colour}]")
    console.print(f"prompts whose greedy continuations differ under every weight set: "
                  f"{summary.distinguishable_prompts} of {len(PROMPTS)}")
    console.print(f"statuses {summary.statuses}; faults {summary.faults}; versions published "
                  f"{summary.versions_published}; final version {summary.final_version} reached by "
                  f"every worker: {summary.final_version_reached}; swaps {summary.swaps}; refusals "
                  f"{summary.refusals}; pushes taken {summary.pushes}; canary refusals "
                  f"{summary.canary_refusals}; workers alive {summary.workers_alive}/{summary.workers}, "
                  f"exit codes {summary.exit_codes}; seed {summary.seed}")
    for line in summary.evidence:
        console.print(f"[red]{line}[/red]")
