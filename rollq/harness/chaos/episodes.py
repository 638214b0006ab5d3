"""`rollq chaos --episodes`: minutes of trainer, gateway, worker and Redis kills while trainers run
multi-turn episodes (n branches) through the Python client and through the gateway; then every
turn a caller was told was served is looked for in its episode's record.

Trainer processes (`rollq/harness/chaos/episode_trainer.py`) journal every start, turn and end before
sending it and its outcome after. The checker (`check`) splits each branch's final record (the
one `end()` returned, else the one left in Redis) at the turns' marker tokens and counts:

- lost: a turn acknowledged as served whose marker is not in the record;
- doubled: a marker in the record more than once (a turn applied twice);
- mismatched: a served turn whose sampled tokens differ from what its caller got, or are not the
  instant engine's continuation of the record before them (it did not continue the exact ids);
- phantom: a turn its caller was told added nothing (`failed`, `running`...) found in the record;
- changed after end: an ended record in Redis that differs from what `end()` returned;
- stuck: a record left `running` once every trainer has finished (every turn's deadline passed);
- hung: a call that did not return within its deadline + 30 s.

Faults: trainer SIGKILL (restarted with the same trainer id and owner: it `recover()`s), gateway
SIGKILL (restarted with the same `--gateway-id`), worker SIGKILL (a replacement starts), Redis
SIGKILL and restart (AOF, fsync always) after up to 1 s, a Redis outage longer than redis-py's
retries, and `CLIENT KILL` of every connection (lost replies, commands retried). Any count but
`unverified` makes the exit code 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from redis.exceptions import RedisError
from rich.console import Console

from rollq.harness.chaos.episode_check import EpisodeSummary, check
from rollq.harness.chaos.episode_trainer import HTTP_TRAINER
from rollq.harness.chaos.trainer import POLICY
from rollq.children import reap_group, stop_child, stop_children
from rollq.harness.faults import RedisProcess, reserved_port
from rollq.protocol import Status, derived_trainer_id, unpack_tokens
from rollq.queue.connection import connect
from rollq.queue.keys import Keys
from rollq.queue.names import EpisodeField, JobField

FAULTS = ("trainer_sigkill", "gateway_sigkill", "worker_sigkill", "redis_restart", "redis_outage",
          "client_kill")
GATEWAY_ID = "chaosgw"
console = Console()


@dataclass
class EpisodeChaosSettings:
    minutes: float = 3.0
    workers: int = 3
    trainers: int = 3
    """Trainer processes; the last one runs its episodes through the gateway."""
    seed: int | None = None
    outage_s: float = 15.0
    """The long Redis outage: redis-py gives up after ~8 retries (~10 s)."""
    settle_s: float = 240.0
    """After the faults stop: how long trainers may take to finish their episodes."""
    workdir: Path | None = None
    """Keep the journals, logs and Redis data here (default: a temporary directory)."""


@dataclass
class _Run:
    settings: EpisodeChaosSettings
    workdir: Path
    redis: RedisProcess
    rng: random.Random
    workers: list[subprocess.Popen] = field(default_factory=list)
    trainers: dict[int, subprocess.Popen] = field(default_factory=dict)
    lives: Counter = field(default_factory=Counter)
    gateway: subprocess.Popen | None = None
    gateway_port: int = 0
    faults: Counter = field(default_factory=Counter)
    trainer_exits: int = 0
    spawned: int = 0

    @property
    def stop_file(self) -> Path:
        return self.workdir / "stop"

    def _log(self, name: str):
        self.spawned += 1
        return open(self.workdir / f"{name}-{self.spawned}.log", "w")  # noqa: SIM115 (child keeps it)

    def spawn_worker(self) -> None:
        log = self._log("worker")
        self.workers.append(subprocess.Popen(
            [sys.executable, "-m", "rollq", "worker", "--redis-url", self.redis.url, "--policy", POLICY,
             "--engine", "instant", "--instant-delay-s", "0.2", "--lease-s", "3", "--poll-s", "0.1",
             "--max-inflight", "16", "--grace-s", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        log.close()

    def spawn_gateway(self) -> None:
        self.gateway_port = self.gateway_port or reserved_port()
        log = self._log("gateway")
        self.gateway = subprocess.Popen(
            [sys.executable, "-m", "rollq", "gateway", "--redis-url", self.redis.url, "--no-auth",
             "--port", str(self.gateway_port), "--gateway-id", GATEWAY_ID, "--policy", POLICY,
             "--weight-store", str(self.workdir / "weights")],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def wait_gateway(self, timeout_s: float = 180) -> None:  # (a loaded machine starts slowly)
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up and self.gateway.poll() is None:
            with contextlib.suppress(OSError), urllib.request.urlopen(
                    f"http://127.0.0.1:{self.gateway_port}/health", timeout=1):
                return
            time.sleep(0.1)
        raise RuntimeError(f"the gateway did not come up (exit code {self.gateway.poll()}); logs in "
                           f"{self.workdir}")

    def journal(self, index: int) -> Path:
        return self.workdir / f"journal-{index}.jsonl"

    def spawn_trainer(self, index: int) -> None:
        self.lives[index] += 1
        http = index == self.settings.trainers - 1
        log = self._log(f"trainer{index}")
        self.trainers[index] = subprocess.Popen(
            [sys.executable, "-m", "rollq.harness.chaos.episode_trainer", self.redis.url,
             str(self.journal(index)), str(index), str(self.lives[index]), str(self.rng.randrange(2**31)),
             str(self.stop_file),
             *([f"http://127.0.0.1:{self.gateway_port}"] if http else [])],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def trainer_id(self, index: int) -> str:
        return HTTP_TRAINER if index == self.settings.trainers - 1 else f"t{index}"


async def _faults(run: _Run, until: float) -> None:
    deck: list[str] = []
    while time.monotonic() < until or deck:  # the last round is finished: every kind happens
        await asyncio.sleep(run.rng.uniform(1.0, 3.0))
        if not deck:  # each kind once per round, in random order: short runs see every kind
            deck = list(FAULTS)
            run.rng.shuffle(deck)
        kind = deck.pop()
        run.faults[kind] += 1
        if kind == "trainer_sigkill":
            index = run.rng.randrange(run.settings.trainers)
            run.trainers[index].kill()
            run.trainers[index].wait()
            run.spawn_trainer(index)
        elif kind == "gateway_sigkill":
            run.gateway.kill()
            run.gateway.wait()
            run.spawn_gateway()
            await asyncio.to_thread(run.wait_gateway)
        elif kind == "worker_sigkill":
            victim = run.workers.pop(run.rng.randrange(len(run.workers)))
            victim.kill()
            victim.wait()
            reap_group(victim.pid)
            run.spawn_worker()
        elif kind == "redis_restart":
            await asyncio.to_thread(run.redis.restart, run.rng.uniform(0.0, 1.0))
        elif kind == "redis_outage":
            await asyncio.to_thread(run.redis.restart, run.settings.outage_s)
        else:  # every connection dropped: replies lost, commands retried by redis-py
            admin = connect(run.redis.url)
            try:
                with contextlib.suppress(RedisError):
                    await admin.client_kill_filter(_type="normal", skipme=True)
            finally:
                await admin.aclose()


async def _watch(run: _Run, done: asyncio.Event) -> None:
    """Restart a trainer that ended by itself before the stop file (its log says why)."""
    while not done.is_set():
        for index, proc in run.trainers.items():
            if proc.poll() is not None and not run.stop_file.exists():
                run.trainer_exits += 1
                console.print(f"[yellow]trainer {index} exited with {proc.returncode}; restarting[/yellow]")
                run.spawn_trainer(index)
        await asyncio.sleep(0.5)


async def chaos_episodes(s: EpisodeChaosSettings) -> EpisodeSummary:
    seed = s.seed if s.seed is not None else random.randrange(2**31)
    with contextlib.ExitStack() as stack:
        workdir = s.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rollq-epchaos-")))
        run = _Run(s, workdir, RedisProcess(workdir / "redis").start(), random.Random(seed))
        try:
            for _ in range(s.workers):
                run.spawn_worker()
            run.spawn_gateway()
            await asyncio.to_thread(run.wait_gateway)
            for index in range(s.trainers):
                run.spawn_trainer(index)
            console.print(f"episode chaos: {s.minutes:g} min, {s.workers} workers, {s.trainers} trainers "
                          f"(one through the gateway), seed {seed}")
            done = asyncio.Event()
            watching = asyncio.create_task(_watch(run, done))
            await _faults(run, time.monotonic() + s.minutes * 60)
            run.stop_file.touch()
            done.set()
            await watching
            give_up = time.monotonic() + s.settle_s
            while any(p.poll() is None for p in run.trainers.values()) and time.monotonic() < give_up:
                await asyncio.sleep(0.5)
            stop_children(run.trainers.values(), 0, group=False)
            journals = {run.trainer_id(i): _read_journal(run.journal(i)) for i in range(s.trainers)}
            records = await _records(run.redis.url)
            (workdir / "records.json").write_text(json.dumps([[*k, v] for k, v in records.items()]))
        finally:
            stop_children(run.trainers.values(), 0, group=False)
            if run.gateway is not None:
                stop_child(run.gateway, 5, group=False)
            stop_children(run.workers, 5)
            run.redis.stop()
    summary = check(journals, records)
    summary.minutes, summary.seed = s.minutes, seed
    summary.faults, summary.trainer_exits = dict(run.faults), run.trainer_exits
    return summary


def _read_journal(path: Path) -> list[dict]:
    lines = []
    for line in path.read_text().splitlines() if path.exists() else []:
        with contextlib.suppress(ValueError):  # a line torn by a kill
            lines.append(json.loads(line))
    return lines


async def _records(url: str) -> dict[tuple[str, str], dict]:
    """(trainer, branch) -> state, tokens, mask, turn job of every episode record left."""
    keys, redis = Keys(POLICY), connect(url)
    prefix = keys.episode("", "")[:-1]  # `...:episode:{trainer}:{id}` with both empty
    found = {}
    try:
        async for key in redis.scan_iter(match=prefix + "*", count=1000):
            trainer, _, branch = key.decode()[len(prefix):].partition(":")
            r = await redis.hgetall(key)

            def raw(f: EpisodeField, r=r) -> bytes:
                return r.get(f.encode(), b"")

            found[(trainer, branch)] = record = {
                "state": raw(EpisodeField.STATE).decode(), "tokens": unpack_tokens(raw(EpisodeField.TOKENS)),
                "mask": list(raw(EpisodeField.MASK)), "turn_job": raw(EpisodeField.TURN_JOB).decode()}
            if record["state"] == "running":  # was its turn queued, and did it end? (for the evidence)
                owner = GATEWAY_ID if trainer == HTTP_TRAINER else "chaos"
                job = await redis.hgetall(keys.job(derived_trainer_id(trainer, "episodes", owner),
                                                   record["turn_job"]))
                record["job"] = ({k.decode(): v.decode() for k, v in job.items()
                                  if k.decode() in (JobField.GROUPS, JobField.DONE, *Status.__args__)}
                                 if job else "never queued")
    finally:
        await redis.aclose()
    return found


def render(summary: EpisodeSummary) -> None:
    colour = "green" if summary.ok else "red"
    for line in summary.evidence:
        console.print(f"[red]{line}[/red]")
    console.print(f"[bold {colour}]turns served {summary.turns_served} (episodes {summary.episodes}, "
                  f"branches {summary.branches}): lost {summary.lost} ({summary.lost_during_end} while "
                  f"end() was called), doubled {summary.doubled}, mismatched {summary.mismatched}, "
                  f"phantom {summary.phantom}, changed after end {summary.changed_after_end}, stuck "
                  f"{summary.stuck}, hung {summary.hung}[/bold {colour}]")
    console.print(f"turns by trainer {summary.turns_by_trainer}; ends during a turn "
                  f"{summary.ends_during_turn}; unanswered calls {summary.turns_unanswered}; unverified "
                  f"branches {summary.unverified}; faults {summary.faults}; trainer exits "
                  f"{summary.trainer_exits}; seed {summary.seed}")
