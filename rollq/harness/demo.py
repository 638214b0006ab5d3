"""`rollq demo`: asynchronous GRPO on CPU, synchronous vs asynchronous, side by side.

Starts what it needs (a private redis-server unless REDIS_URL is set, one vLLM worker and one
`rollq scorer` per run), trains `examples/async_grpo.py`'s tiny model twice with the same
settings, cores and threads, and reports reward, wall time, throughput, staleness and the
speed-up, with a PNG plot. The jobs are scored: the scorer computes each sample's reward
(`rollq/harness/demo_rewards.py`) before the group reaches the trainer.

`--long-tail-reward`: two asynchronous runs instead, with a reward that waits 0-2 s per sample
(long-tailed), computed by the trainer in one run and by the scorer in the other: time per step,
side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import importlib.util
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from rollq.harness.faults import RedisProcess, reserved_port
from rollq.children import stop_child

console = Console()
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "async_grpo.py"


@dataclass
class DemoSettings:
    steps: int = 40
    groups: int = 16
    n: int = 8
    staleness: int = 2
    out_dir: Path = Path("demo-output")
    redis_url: str | None = None
    worker_start_timeout_s: float = 300.0
    gateway_port: int = 8000
    """The dashboard's port (a free one if it is taken); 0: no gateway."""
    hold: bool = False
    """Keep the gateway (and Redis) up after the runs, until Ctrl-C."""
    long_tail_reward: bool = False
    """Run the long-tailed reward in the trainer vs in a scorer, instead of sync vs async."""


@dataclass(frozen=True)
class Run:
    """One training run of the demo: its name, staleness bound and where rewards are computed."""

    name: str
    staleness: int
    scored: str | None
    """The reward its `rollq scorer` computes (the jobs name it); None: the trainer computes it."""
    tail: bool = False
    """The trainer computes `demo_rewards.even_after_a_wait` (not the example's instant reward)."""


def runs_of(s: DemoSettings) -> list[Run]:
    if s.long_tail_reward:
        return [Run("trainer", s.staleness, None, tail=True),
                Run("scorer", s.staleness, "even_long_tail")]
    return [Run("sync", 0, "even"), Run("async", s.staleness, "even")]


SWAP_MODE = "keep"
"""The workers' swap mode. `keep` (in-flight updates, as PipelineRL): a swap freezes the running
sequences with their KV cache, loads, and resumes them; no abort, no prefill again. Each token's
logprob is still that of the distribution that sampled it (the new weights on a context the
old ones encoded), which is what the example's importance ratio needs, and its version label is
exact, so the staleness bound holds as before. `interrupt` (the demo's mode before) cuts every
running sequence at each step's swap and prefills it again; adapter versions do not apply: the
example trains every weight. docs/benchmarks.md compares the two."""


MAX_NUM_SEQS = 264
"""Two async batches of 16 groups x 8 samples fill 256 sequence slots; a keep swap's probe token
runs beside the kept sequences and waits for a free slot, with the worker's gate closed
meanwhile (docs/architecture.md, "What `keep` means"), so 8 spare slots let it run at once."""


class DemoClient:
    """The example's client, with what the demo measures: each publish's duration, and the
    worker's swap mode added to every job's accepted modes (a job lists what it may cross)."""

    def __init__(self, client, swap_mode: str):
        self._client = client
        self.swap_mode = swap_mode
        self.publish_s: list[float] = []

    def __getattr__(self, name: str):
        return getattr(self._client, name)

    async def submit(self, prompts, n: int = 1, sampling=None, **kwargs):
        sampling = dict(sampling or {}) | {"swap_modes": ["drain", self.swap_mode]}
        return await self._client.submit(prompts, n, sampling, **kwargs)

    async def publish_weights(self, *args, **kwargs):
        began = time.monotonic()
        try:
            return await self._client.publish_weights(*args, **kwargs)
        finally:
            self.publish_s.append(time.monotonic() - began)


SWAP_LINE = re.compile(r"now serving version \d+ \(\w+ swap, ([\d.]+) s: ([^)]*)\)")
PHASE = re.compile(r"(\w+) ([\d.]+) s")


def swap_phases(log: Path) -> dict[str, float]:
    """Seconds per swap phase over a run, summed, from the worker's log ("now serving ...";
    the log's lines may be wrapped, so whitespace runs count as one space)."""
    total: Counter = Counter()
    for match in SWAP_LINE.finditer(re.sub(r"\s+", " ", log.read_text(errors="replace"))):
        total["swaps"] += 1
        total["total"] += float(match[1])
        for name, seconds in PHASE.findall(match[2]):
            total[name] += float(seconds)
    return dict(total)


def load_example():
    if not EXAMPLE.exists():
        raise SystemExit(f"{EXAMPLE} not found: run `rollq demo` from a checkout of rollq")
    spec = importlib.util.spec_from_file_location("async_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def private_redis(workdir: Path):
    try:
        server = RedisProcess(workdir, aof=False)
    except RuntimeError:
        raise SystemExit("redis-server is not installed. Install it with `sudo apt-get install "
                         "redis-server` (or `brew install redis`), or set REDIS_URL.") from None
    try:
        yield server.start().url
    finally:
        server.stop()


def _port(wanted: int) -> int:
    """`wanted` if the gateway can bind it, else a reserved port (the gateway binds seconds later)."""
    with socket.socket() as s:
        # As the gateway binds (aiohttp sets SO_REUSEADDR): a port in TIME_WAIT, e.g. one a
        # caller reserved for us, is free for it; a listening one is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", wanted))
        except OSError:
            return reserved_port()
        return wanted


@contextlib.contextmanager
def gateway_process(redis_url: str, port: int, log_path: Path):
    """`rollq gateway` in its own process (the trainer's steps would stall an in-process one)."""
    args = [sys.executable, "-m", "rollq", "gateway", "--redis-url", redis_url, "--port", str(port),
            "--no-auth"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        stop_child(proc, 15)


@contextlib.contextmanager
def worker_process(redis_url: str, policy: str, model: Path, log_path: Path, cpu: str,
                   pin_at_start: bool = True):
    """`pin_at_start`: the worker and its engine processes on core `cpu` from the start; else
    they start on any core (`pin_session` pins them once they serve); vLLM's compute threads
    are bound to `cpu` either way (VLLM_CPU_OMP_THREADS_BIND)."""
    args = [sys.executable, "-m", "rollq", "worker", "--redis-url", redis_url, "--policy", policy,
            "--engine", "vllm", "--model", str(model), "--dtype", "float32",
            "--max-model-len", "256", "--max-num-seqs", str(MAX_NUM_SEQS), "--enforce-eager",
            "--swap-mode", SWAP_MODE, "--poll-s", "0.05", "--lease-s", "10"]
    env = os.environ | {"VLLM_CPU_OMP_THREADS_BIND": cpu, "VLLM_CPU_KVCACHE_SPACE": "1"}
    cores = {int(cpu)} if pin_at_start else set(range(os.cpu_count() or 1))
    with open(log_path, "w") as log:
        # The worker and its engine processes on one core, the trainer on the other.
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, preexec_fn=lambda: os.sched_setaffinity(0, cores))
    try:
        yield proc
    finally:
        stop_worker(proc, log_path, 60)


STOPPED = re.compile(r"worker \S+ stopped")
"""The worker's last line of its own (loop.py): "stopped cleanly" or "stopped: engine failed"."""


def stop_worker(proc: subprocess.Popen, log_path: Path, grace_s: float) -> None:
    """SIGTERM, and once the worker logs that it stopped (what it held handed back, its heartbeat
    removed), SIGKILL it and its engine processes. What is left by then is vLLM's teardown:
    seconds of garbage collection in the engine core (which vLLM itself SIGKILLs after 5 s) and
    in the worker, that the demo's next run or its report would wait for."""
    if proc.poll() is None:
        logged = log_path.stat().st_size
        proc.terminate()
        give_up = time.monotonic() + grace_s
        while proc.poll() is None and time.monotonic() < give_up:
            with open(log_path, errors="replace") as log:
                log.seek(logged)
                # The log's lines may be wrapped: whitespace runs count as one space.
                if STOPPED.search(re.sub(r"\s+", " ", log.read())):
                    break
            time.sleep(0.05)
    stop_child(proc, 0)  # its engine processes too


def pin_session(leader: int, cpu: int) -> None:
    """Every thread of every process in the session `leader` started (a worker and its engine
    processes) onto core `cpu`; threads they start later inherit it."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # After the command's ")": state, ppid, pgrp, session.
            if int(stat.read_text().rsplit(")", 1)[1].split()[3]) != leader:
                continue
            for thread in (stat.parent / "task").iterdir():
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(int(thread.name), {cpu})


REWARDS = "rollq.harness.demo_rewards"


@contextlib.contextmanager
def scorer_process(redis_url: str, policy: str, log_path: Path):
    """`rollq scorer` with the demo's rewards (async: one process runs them all at once)."""
    args = [sys.executable, "-m", "rollq", "scorer", "--redis-url", redis_url, "--policy", policy,
            "--rewards", REWARDS, "--processes", "1", "--max-inflight", "256"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        stop_child(proc, 15)


async def wait_for_worker(redis_url: str, policy: str, proc, timeout_s: float, log: Path,
                          what: str = "worker") -> None:
    """Until the worker (or, `what="scorer"`, the scorer) of `policy` beats."""
    from rollq.queue.connection import connect
    from rollq.queue.keys import Keys
    from rollq.queue.workers import live_workers
    from rollq.scoring.records import live_scorers

    live = live_scorers if what == "scorer" else live_workers
    redis = connect(redis_url)
    try:
        give_up = time.monotonic() + timeout_s
        while not await live(redis, Keys(policy)):
            if proc.poll() is not None or time.monotonic() > give_up:
                raise SystemExit(f"the {what} did not start; its log: {log}")
            await asyncio.sleep(0.5)
    finally:
        await redis.aclose()


@dataclass
class Started:
    """A run's worker (and scorer), launched: they start up while the demo goes on."""

    run: Run
    policy: str
    task: Any
    """Its progress bar."""
    log: Path
    worker: subprocess.Popen
    scorer: subprocess.Popen | None
    stack: contextlib.ExitStack
    """Stops them."""


def start_run(run: Run, s: DemoSettings, redis_url: str, model: Path, progress) -> Started:
    """Launch the run's worker on any core (`ready` pins it to core 0) and its scorer: every
    run's start-up at once, so the demo waits for one engine start-up, not one per run. A run
    waiting for its turn idles (an idle engine sleeps; its worker polls Redis)."""
    policy = f"demo-{run.name}-{uuid.uuid4().hex[:6]}"
    # The bar's clock starts with the training (the table's wall time), not with the worker's
    # start-up: a vLLM engine's tens of seconds are no part of a run's wall time.
    task = progress.add_task(f"{run.name:7} starting worker", total=s.steps, start=False)
    log = s.out_dir / f"worker-{run.name}.log"
    with contextlib.ExitStack() as stack:  # stops what started if the rest fails to
        worker = stack.enter_context(worker_process(redis_url, policy, model, log, cpu="0",
                                                    pin_at_start=False))
        scorer = None
        if run.scored:
            scorer = stack.enter_context(scorer_process(redis_url, policy,
                                                        s.out_dir / f"scorer-{run.name}.log"))
        return Started(run, policy, task, log, worker, scorer, stack.pop_all())


async def ready(started: Started, s: DemoSettings, redis_url: str) -> None:
    """Until the run's scorer and worker beat; then its worker serves from core 0 (the
    trainer has the other)."""
    if started.scorer is not None:
        await wait_for_worker(redis_url, started.policy, started.scorer, 120,
                              s.out_dir / f"scorer-{started.run.name}.log", what="scorer")
    await wait_for_worker(redis_url, started.policy, started.worker, s.worker_start_timeout_s,
                          started.log)
    pin_session(started.worker.pid, 0)


async def run_mode(example, started: Started, s: DemoSettings, redis_url: str, model: Path, progress):
    from rollq import RolloutClient

    run, mode, task, log = started.run, started.run.name, started.task, started.log
    with started.stack:
        trainer = example.GRPOTrainer(model)

        def on_step(st):
            progress.update(task, advance=1,
                            description=f"{mode:7} step {st.step + 1:3}  reward {st.reward:.3f}")

        async with RolloutClient(redis_url, policy=started.policy, trainer_id=mode,
                                 weight_store=str(s.out_dir / "weights")) as client:
            timed = DemoClient(client, SWAP_MODE)
            before = cpu_times()
            progress.start_task(task)
            stats = await example.train(timed, trainer, steps=s.steps, groups=s.groups, n=s.n,
                                        staleness=run.staleness, on_step=on_step, scored=run.scored,
                                        score=_trainer_tail if run.tail else None)
            CPU_BUSY[mode] = busy_percent(before, cpu_times())
    # The worker has stopped: its log holds every swap's line.
    TIMES[mode] = {"publish": sum(timed.publish_s), "swap": swap_phases(log)}
    return stats


async def _trainer_tail(prompt: list[int], completion: list[int]) -> float:
    from rollq.harness.demo_rewards import even_after_a_wait

    return await even_after_a_wait(completion)


TIMES: dict[str, dict] = {}
"""Per run: seconds the trainer spent publishing, and the worker's swaps by phase (summed)."""
CPU_BUSY: dict[str, list[float]] = {}
"""Per run: how busy each core was (%), from /proc/stat: where the time went."""


def cpu_times() -> list[tuple[int, int]]:
    """(busy, total) jiffies of each core; empty where /proc/stat does not exist."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        if line.startswith("cpu") and line[3:4].isdigit():
            values = [int(v) for v in line.split()[1:]]
            idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
            out.append((sum(values) - idle, sum(values)))
    return out


def busy_percent(before, after) -> list[float]:
    return [100 * (b1 - b0) / max(1, t1 - t0) for (b0, t0), (b1, t1) in zip(before, after)]


async def _until_interrupted() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def smoothed(values: list[float], window: int = 5) -> list[float]:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]


def time_to(stats, target: float) -> float | None:
    """Wall time at which the smoothed reward first reaches `target`."""
    for st, r in zip(stats, smoothed([st.reward for st in stats])):
        if r >= target:
            return st.wall_s
    return None


def speedup(sync, asyn) -> tuple[float | None, float]:
    """Wall time for async to reach the sync run's final reward (less 0.02: the reward
    saturates at 1.0), over the sync run's time to reach it; and that reward."""
    target = smoothed([st.reward for st in sync])[-1] - 0.02
    reached_sync, reached_async = time_to(sync, target), time_to(asyn, target)
    if reached_sync is None or reached_async is None:
        return None, target
    return reached_async / reached_sync, target


def generation_rates(sync, asyn) -> dict[str, float]:
    """The synchronous run generates only while its trainer waits (its rollout-time rate); the
    asynchronous run's engine never waits for the trainer, so its rate is over its wall time."""
    rate_sync = sum(st.tokens for st in sync) / max(1e-9, sum(st.wait_s for st in sync))
    rate_async = sum(st.tokens for st in asyn) / asyn[-1].wall_s
    return {"sync": rate_sync, "async": rate_async, "ratio": rate_async / rate_sync}


def report(runs: dict, s: DemoSettings) -> float | None:
    table = Table(title="rollq demo: GRPO on the 'even tokens' task")
    for col in ("run", "reward", "wall", "per step", "waiting", "rewarding", "training", "tok/s"):
        table.add_column(col)
    for mode, stats in runs.items():
        tokens = sum(st.tokens for st in stats)
        table.add_row(mode, f"{stats[0].reward:.3f} → {smoothed([x.reward for x in stats])[-1]:.3f}",
                      f"{stats[-1].wall_s:.1f} s", f"{stats[-1].wall_s / len(stats):.2f} s",
                      f"{sum(x.wait_s for x in stats):.1f} s", f"{sum(x.reward_s for x in stats):.1f} s",
                      f"{sum(x.train_s for x in stats):.1f} s", f"{tokens / stats[-1].wall_s:.0f}")
    console.print(table)
    for run in runs_of(s):
        where = (f"its `rollq scorer` (reward {run.scored!r} of {REWARDS}), while the trainer "
                 "trained; the trainer waited for them within 'waiting'" if run.scored else
                 "the trainer itself, all of a step's samples at once ('rewarding')")
        console.print(f"{run.name} rewards: computed by {where}")
    for mode, stats in runs.items():
        stale = sum((st.staleness for st in stats), start=Counter())
        console.print(f"{mode} staleness (versions behind the trainer: tokens): "
                      + ", ".join(f"{k}: {v}" for k, v in sorted(stale.items())))
    for mode, busy in CPU_BUSY.items():
        console.print(f"{mode} cores busy: " + ", ".join(
            f"core {i} ({'worker' if i == 0 else 'trainer' if i == 1 else 'other'}) {b:.0f} %"
            for i, b in enumerate(busy)))
    for mode, times in TIMES.items():
        swap = times["swap"]
        phases = ", ".join(f"{k} {swap[k]:.1f} s" for k in ("drain", "pause", "load", "resume")
                           if k in swap)
        console.print(f"{mode} time: publish {times['publish']:.1f} s (trainer), "
                      f"{swap.get('swaps', 0):.0f} swaps {swap.get('total', 0.0):.1f} s ({phases}; "
                      f"before them, verify {swap.get('verify', 0.0):.1f} s while serving) (worker), "
                      f"waiting {sum(x.wait_s for x in runs[mode]):.1f} s, "
                      f"training {sum(x.train_s for x in runs[mode]):.1f} s")
    if s.long_tail_reward:
        return report_long_tail(runs)
    sync, asyn = runs["sync"], runs["async"]
    rates = generation_rates(sync, asyn)
    console.print(f"generation: sync {rates['sync']:.0f} tokens/s while the trainer waited, async "
                  f"{rates['async']:.0f} tokens/s over its wall time: [bold]{rates['ratio']:.2f}x[/bold]")
    console.print(f"wall time of {s.steps} steps, async / sync: "
                  f"[bold]{asyn[-1].wall_s / sync[-1].wall_s:.2f}x[/bold]")
    ratio, target = speedup(sync, asyn)
    if ratio is None:
        console.print(f"reward {target:.3f} (sync's final, less 0.02) was not reached by both runs")
    else:
        console.print(f"time to reward {target:.3f} (sync's final, less 0.02), async / sync: "
                      f"[bold]{ratio:.2f}x[/bold] ({time_to(asyn, target):.1f} s vs "
                      f"{time_to(sync, target):.1f} s)")
    return ratio


def report_long_tail(runs: dict) -> float:
    """Time per step with the long-tailed reward in the trainer vs in the scorer; returns the
    ratio scorer / trainer."""
    from rollq.harness.demo_rewards import TAIL_S

    per_step = {mode: stats[-1].wall_s / len(stats) for mode, stats in runs.items()}
    ratio = per_step["scorer"] / per_step["trainer"]
    console.print(f"a reward waiting 0-{TAIL_S:g} s per sample (long-tailed, mean {TAIL_S / 5:g} s), "
                  f"time per step: trainer {per_step['trainer']:.2f} s, scorer "
                  f"{per_step['scorer']:.2f} s, scorer / trainer: [bold]{ratio:.2f}x[/bold]")
    return ratio


def plot(runs: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print("(matplotlib is not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, stats in runs.items():
        ax.plot([st.wall_s for st in stats], smoothed([st.reward for st in stats]), label=mode)
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("reward (moving average of 5 steps)")
    ax.set_title("GRPO with rollq: " + " vs ".join(runs))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    console.print(f"plot: {path}")


async def demo(s: DemoSettings) -> float | None:
    import logging

    import torch

    logging.getLogger("rollq.registry").setLevel(logging.WARNING)  # retention notes per step
    example = load_example()
    s.out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)  # the trainer gets one core, the worker's engine the other
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {1 % os.cpu_count()})
    model = example.make_model(s.out_dir / "model")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        redis_url = s.redis_url or stack.enter_context(private_redis(Path(tmp)))
        if s.gateway_port:
            url = stack.enter_context(gateway_process(redis_url, _port(s.gateway_port),
                                                      s.out_dir / "gateway.log"))
            console.print(f"dashboard (live during the runs): [bold]{url}[/bold]")
        with Progress(TextColumn("{task.description}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                      console=console) as progress:
            started = [start_run(run, s, redis_url, model, progress) for run in runs_of(s)]
            for one in started:
                stack.enter_context(one.stack)  # stopped on the way out if its run never trains
            # Every start-up ends before any run trains: none runs beside another's training.
            await asyncio.gather(*(ready(one, s, redis_url) for one in started))
            for one in started:
                runs[one.run.name] = await run_mode(example, one, s, redis_url, model, progress)
        if s.hold and s.gateway_port:
            console.print(f"the dashboard stays at {url} until Ctrl-C")
            await _until_interrupted()
    ratio = report(runs, s)
    plot(runs, s.out_dir / "reward.png")
    (s.out_dir / "runs.json").write_text(json.dumps(
        {mode: [dataclasses.asdict(st) | {"staleness": dict(st.staleness)} for st in stats]
         for mode, stats in runs.items()}, indent=1))
    (s.out_dir / "cpu_busy.json").write_text(json.dumps(CPU_BUSY))
    rates = {} if s.long_tail_reward else {"generation": generation_rates(runs["sync"], runs["async"])}
    (s.out_dir / "times.json").write_text(json.dumps(TIMES | rates | {"swap_mode": SWAP_MODE}, indent=1))
    return ratio
