"""`rollq chaos`: minutes of random faults against a private durable Redis and instant-engine
worker processes while a trainer submits, reads and publishes; then count what came back.

Faults: worker SIGKILL (a replacement starts), worker SIGSTOP for a few seconds, the same two
for the `rollq scorer` processes, Redis SIGKILL and restart (AOF, fsync always), killed client
connections, and trainer SIGKILL (restarted with the same trainer id).
The results are read by a trainer process (`rollq/harness/chaos/trainer.py`) that
breaks out of `results()` at random, commits what it trained on to a log (fsync) and only then
acknowledges. Every `publish_every_s` the runner publishes a new weight version, which the
workers swap to. At the end every acknowledged submit's groups must be in the trainer's
committed log exactly once, and the quota must not drift (`outstanding` equals the results not
acknowledged): the summary says submitted / delivered / duplicated / lost / quota drift, and the
exit code is non-zero on any of them.

Every third job is scored (`reward=`, alternately the sync and the async reward of
`rollq/harness/chaos/rewards.py`, functions of the token ids the trainer recomputes): each of
its groups must reach the committed log once like any other, and each `ok` one with exactly the
recomputed rewards (the summary's `rewards_wrong`, and `rewards_unchecked` for a scored group
logged without a verdict). A third of those use dynamic sampling (`dynamic_sampling` 1 or 2;
even groups have uniform rewards: regenerated, then `filtered`, odd ones are delivered), a third
over-sampling (`deliver` k of the job's groups: at most k `ok`, exactly k when any was
`cancelled`, the job `done` at the end: `oversampled_wrong` counts the jobs that broke one).
A scorer that exits without being killed is counted (`scorer_exits`, restarted): it must not.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from redis.exceptions import RedisError
from rich.console import Console

from rollq.harness.chaos.rewards import ASYNC, SYNC, UNIFORM_ASYNC, UNIFORM_SYNC
from rollq.harness.chaos.trainer import POLICY, is_scored
from rollq.client import RolloutClient
from rollq.harness.faults import RedisProcess
from rollq.queue.connection import connect
from rollq.children import reap_group, stop_children
from rollq.scoring.records import live_scorers, on_offer

FAULTS = ("worker_sigkill", "worker_sigstop", "scorer_sigkill", "scorer_sigstop", "redis_restart",
          "client_kill", "trainer_sigkill")
console = Console()


@dataclass
class ChaosSettings:
    minutes: float = 3.0
    workers: int = 3
    scorers: int = 2
    seed: int | None = None
    publish_every_s: float = 5.0
    settle_s: float = 180.0
    """After the faults stop: how long to wait for the last results."""


class Summary(msgspec.Struct):
    minutes: float
    seed: int
    submitted_jobs: int
    submitted_groups: int
    delivered: int
    duplicated: int
    lost: int
    statuses: dict[str, int]
    faults: dict[str, int]
    versions_published: int
    quota_drift: int = 0
    """`outstanding` minus the results left unacknowledged in the stream, at the end."""
    trainer_exits: int = 0
    """Times the trainer process ended without being killed (restarted; its log says why)."""
    scored_groups: int = 0
    """Groups of acknowledged scored submits (among `submitted_groups`)..."""
    scored_delivered: int = 0
    """...of which in the trainer's committed log..."""
    rewards_right: int = 0
    """...`ok` with every reward exactly the chaos reward of its samples..."""
    rewards_wrong: int = 0
    """...`ok` with a reward missing or other than that..."""
    rewards_unchecked: int = 0
    """...logged without the trainer's verdict (must be none)."""
    dynamic_groups: int = 0
    """Scored groups of dynamic-sampling jobs..."""
    filtered: int = 0
    """...delivered `filtered` (rewards all equal after every regeneration)..."""
    resampled: int = 0
    """...and their regenerations (the jobs' `resampled` counters)."""
    oversampled_jobs: int = 0
    oversampled_wrong: int = 0
    """Over-sampled jobs with more `ok` groups than `deliver`, fewer with some `cancelled`, or
    not `done` at the end."""
    scorer_exits: int = 0
    """Times a scorer process ended without being killed (restarted; its log says why)."""

    @property
    def ok(self) -> bool:
        return (self.lost == 0 and self.duplicated == 0 and self.quota_drift == 0
                and self.rewards_wrong == 0 and self.rewards_unchecked == 0
                and self.oversampled_wrong == 0 and self.scorer_exits == 0)


@dataclass
class _Run:
    settings: ChaosSettings
    workdir: Path
    redis: RedisProcess
    rng: random.Random
    workers: list[subprocess.Popen] = field(default_factory=list)
    scorers: list[subprocess.Popen] = field(default_factory=list)
    acknowledged: dict[str, int] = field(default_factory=dict)
    """job id -> groups, for every submit that returned (scored jobs' ids start with `s`, `d`
    with dynamic sampling, `o` over-sampled)."""
    deliver: dict[str, int] = field(default_factory=dict)
    """Over-sampled job id -> its `deliver`."""
    verdicts: dict = field(default_factory=dict)
    """(job, group) -> the trainer's verdict on a scored group's rewards (`right`, `wrong`, `unscored`)."""
    ended: dict = field(default_factory=dict)
    """(job, group) -> the status the trainer committed it with."""
    scorer_exits: int = 0
    stopping: bool = False
    seen: Counter = field(default_factory=Counter)
    """(job, group) -> times in the trainer's committed log."""
    doubled: set = field(default_factory=set)
    """(job, group) the trainer was handed twice in one life, or again after acknowledging it."""
    statuses: Counter = field(default_factory=Counter)
    faults: Counter = field(default_factory=Counter)
    versions: int = 0
    """The last version number the runner published (or tried to)."""
    failed_publishes: int = 0
    spawned: int = 0
    trainer: subprocess.Popen | None = None
    trainer_exits: int = 0
    log_offset: int = 0

    @property
    def log(self) -> Path:
        return self.workdir / "trained.log"

    def spawn_trainer(self) -> None:
        self.spawned += 1
        out = open(self.workdir / f"trainer-{self.spawned}.log", "w")  # noqa: SIM115 (child keeps it)
        self.trainer = subprocess.Popen(
            [sys.executable, "-m", "rollq.harness.chaos.trainer", self.redis.url, str(self.log),
             str(self.rng.randrange(2**31))], stdout=out, stderr=subprocess.STDOUT)
        out.close()

    def kill_trainer(self) -> None:
        self.trainer.kill()
        self.trainer.wait()

    def read_log(self) -> None:
        """Count the trainer's newly committed lines (complete lines only: a kill can tear one)."""
        if not self.log.exists():
            return
        with open(self.log, "rb") as f:
            f.seek(self.log_offset)
            data = f.read()
        data = data[:data.rfind(b"\n") + 1]
        self.log_offset += len(data)
        for line in data.decode().splitlines():
            kind, *items = line.split()
            if kind == "step-break":
                self.faults["results_break"] += 1
            if kind.startswith("step"):
                for job, group, status in (item.split("/") for item in items):
                    self.seen[(job, int(group))] += 1
                    self.statuses[status] += 1
                    self.ended[(job, int(group))] = status
            elif kind == "rewards":
                for job, group, verdict in (item.split("/") for item in items):
                    self.verdicts[(job, int(group))] = verdict
            elif kind == "dup":
                self.doubled.update((job, int(group)) for job, group in (i.split("/") for i in items))

    def spawn_worker(self) -> None:
        self.spawned += 1
        log = open(self.workdir / f"worker-{self.spawned}.log", "w")  # noqa: SIM115 (child keeps it)
        self.workers.append(subprocess.Popen(
            [sys.executable, "-m", "rollq", "worker", "--redis-url", self.redis.url, "--policy", POLICY,
             "--engine", "instant", "--instant-delay-s", "0.05", "--lease-s", "3", "--poll-s", "0.1",
             "--max-inflight", "16", "--grace-s", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=os.environ | {"COLUMNS": "200"}))
        log.close()

    def spawn_scorer(self) -> None:
        self.spawned += 1
        log = open(self.workdir / f"scorer-{self.spawned}.log", "w")  # noqa: SIM115 (child keeps it)
        self.scorers.append(subprocess.Popen(
            [sys.executable, "-m", "rollq", "scorer", "--redis-url", self.redis.url, "--policy", POLICY,
             "--rewards", "rollq.harness.chaos.rewards", "--processes", "1", "--lease-s", "3",
             "--max-inflight", "16", "--grace-s", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=os.environ | {"COLUMNS": "200"}))
        log.close()

    def stop_workers(self) -> None:
        stop_children(self.workers + self.scorers, 15)


async def _submitter(run: _Run, client: RolloutClient, until: float) -> None:
    index = 0
    while time.monotonic() < until:
        groups = run.rng.randint(1, 20)
        job_id = f"c{index}"
        window = {"max_staleness": 2} if index % 2 else {}
        scored = {}
        if index % 3 == 2 and run.settings.scorers:
            kind = "sdo"[index // 3 % 3]  # plain, dynamic sampling, over-sampling (each sync and async)
            job_id = f"{kind}{index}"  # the group index is its reward input: the trainer recomputes it
            scored = {"reward": SYNC if index % 2 else ASYNC, "reward_inputs": list(range(groups))}
            if kind == "d":
                scored |= {"reward": UNIFORM_SYNC if index % 2 else UNIFORM_ASYNC,
                           "dynamic_sampling": run.rng.randint(1, 2)}
            elif kind == "o":
                scored["deliver"] = run.deliver[job_id] = run.rng.randint(1, groups)
        await client.submit([[index % 1000 + 1, g + 1] for g in range(groups)], n=2,
                            sampling={"max_tokens": 4}, job_id=job_id, **window, **scored)
        run.acknowledged[job_id] = groups
        index += 1
        await asyncio.sleep(run.rng.uniform(0.0, 0.05))


async def _watch_trainer(run: _Run, done: asyncio.Event) -> None:
    """Read the trainer's log as it grows; restart the trainer, or a scorer, that ended by itself."""
    while not done.is_set():
        run.read_log()
        if run.trainer.poll() is not None:
            run.trainer_exits += 1
            console.print(f"[yellow]trainer exited with {run.trainer.returncode}; restarting[/yellow]")
            run.spawn_trainer()
        for scorer in [p for p in run.scorers if p.poll() is not None and not run.stopping]:
            run.scorer_exits += 1
            console.print(f"[red]a scorer exited with {scorer.returncode} (scorer-*.log); restarting[/red]")
            run.scorers.remove(scorer)
            run.spawn_scorer()
        await asyncio.sleep(0.5)


async def _publisher(run: _Run, client: RolloutClient, until: float) -> None:
    import torch

    while time.monotonic() < until:
        await asyncio.sleep(run.settings.publish_every_s)
        run.versions += 1
        try:
            await client.publish_weights(run.versions, {"w": torch.full((4,), float(run.versions))}, keep=3)
        except RedisError as e:  # Redis was down longer than the client retries: go on
            # ... with the next version number: this one may have been registered all the same
            # (its reply lost), and a version is never published twice.
            console.print(f"[yellow]publish of version {run.versions} failed: {e}[/yellow]")
            run.failed_publishes += 1


async def _faults(run: _Run, until: float) -> None:
    admin = connect(run.redis.url)
    kinds = [k for k in FAULTS if run.scorers or not k.startswith("scorer")]
    deck: list[str] = []
    try:
        # Every kind is dealt once even past `until` (a loaded machine stretches a round): every
        # run, the shortest too, sees every kind.
        while time.monotonic() < until or not set(kinds) <= set(run.faults):
            await asyncio.sleep(run.rng.uniform(0.5, 3.0))
            if not deck:  # each kind once per round, in random order
                deck = list(kinds)
                run.rng.shuffle(deck)
            kind = deck.pop()
            run.faults[kind] += 1
            if kind == "trainer_sigkill":
                run.kill_trainer()
                run.spawn_trainer()
            elif kind == "worker_sigkill":
                victim = run.workers.pop(run.rng.randrange(len(run.workers)))
                victim.kill()
                victim.wait()
                reap_group(victim.pid)
                run.spawn_worker()
            elif kind == "scorer_sigkill":
                victim = run.scorers.pop(run.rng.randrange(len(run.scorers)))
                victim.kill()
                victim.wait()
                reap_group(victim.pid)  # its reward child (PR_SET_PDEATHSIG ends it anyway)
                run.spawn_scorer()
            elif kind == "scorer_sigstop":
                victim = run.rng.choice(run.scorers)
                victim.send_signal(signal.SIGSTOP)
                await asyncio.sleep(run.rng.uniform(1.0, 5.0))
                victim.send_signal(signal.SIGCONT)
            elif kind == "worker_sigstop":
                victim = run.rng.choice(run.workers)
                victim.send_signal(signal.SIGSTOP)
                await asyncio.sleep(run.rng.uniform(1.0, 5.0))
                victim.send_signal(signal.SIGCONT)
            elif kind == "redis_restart":
                await asyncio.to_thread(run.redis.restart, run.rng.uniform(0.0, 1.0))
            else:
                with contextlib.suppress(RedisError):
                    await admin.client_kill_filter(_type="normal", skipme=True)
    finally:
        await admin.aclose()


async def chaos(s: ChaosSettings) -> Summary:
    seed = s.seed if s.seed is not None else random.randrange(2**31)
    with tempfile.TemporaryDirectory(prefix="rollq-chaos-") as tmp:
        workdir = Path(tmp)
        run = _Run(s, workdir, RedisProcess(workdir / "redis").start(), random.Random(seed))
        try:
            for _ in range(s.workers):
                run.spawn_worker()
            for _ in range(s.scorers):
                run.spawn_scorer()
            run.spawn_trainer()
            client = RolloutClient(run.redis.url, policy=POLICY, trainer_id="trainer",
                                   weight_store=str(workdir / "weights"), reconnect_s=120)
            import torch  # noqa: F401 (the publisher's; seconds on a loaded machine: not on the clock)

            await _scorers_offer(client, s.scorers)
            until = time.monotonic() + s.minutes * 60
            done = asyncio.Event()
            console.print(f"chaos: {s.minutes:g} min, {s.workers} workers, {s.scorers} scorers, seed {seed}")
            watching = asyncio.create_task(_watch_trainer(run, done))
            await asyncio.gather(_submitter(run, client, until), _publisher(run, client, until),
                                 _faults(run, until))
            expected = {(job, g) for job, groups in run.acknowledged.items() for g in range(groups)}
            give_up = time.monotonic() + s.settle_s
            while not expected <= set(run.seen) and time.monotonic() < give_up:
                await asyncio.sleep(0.2)
            # A duplicate would come from a worker or scorer still serving a group delivered
            # already: once they have exited (finishing what they held) and the trainer has
            # committed and acknowledged every result left, it is in the trainer's log.
            run.stopping = True
            await asyncio.to_thread(run.stop_workers)
            await _results_acknowledged(client)
            done.set()
            await watching
            run.kill_trainer()
            run.read_log()
            drift = await _quota_drift(client)
            jobs = await _scored_jobs(run, client)
            await client.close()
            lost = sorted(expected - set(run.seen))
            if lost:
                await _postmortem(run.redis.url, lost)
        finally:
            if run.trainer is not None and run.trainer.poll() is None:
                run.kill_trainer()
            run.stop_workers()
            run.redis.stop()
    doubled = {k for k, c in run.seen.items() if c > 1} | run.doubled
    scored = {k for k in expected if is_scored(k[0])}
    dynamic = {k for k in scored if k[0].startswith("d")}
    delivered_scored = scored & set(run.seen)
    verdicts = Counter(run.verdicts.get(k, "none") for k in delivered_scored)
    return Summary(
        minutes=s.minutes, seed=seed, submitted_jobs=len(run.acknowledged),
        submitted_groups=len(expected), delivered=len(expected & set(run.seen)),
        duplicated=len(doubled), lost=len(expected - set(run.seen)), statuses=dict(run.statuses),
        faults=dict(run.faults), versions_published=run.versions - run.failed_publishes, quota_drift=drift,
        trainer_exits=run.trainer_exits, scored_groups=len(scored), scored_delivered=len(delivered_scored),
        rewards_right=verdicts["right"], rewards_wrong=verdicts["wrong"],
        rewards_unchecked=verdicts["none"], dynamic_groups=len(dynamic),
        filtered=sum(1 for k in dynamic if run.ended.get(k) == "filtered"), resampled=jobs["resampled"],
        oversampled_jobs=len(run.deliver), oversampled_wrong=jobs["oversampled_wrong"],
        scorer_exits=run.scorer_exits)


async def _scored_jobs(run: _Run, client: RolloutClient) -> Counter:
    """The dynamic-sampling jobs' regenerations, and the over-sampled jobs that broke a rule:
    more `ok` than `deliver`, fewer with a group `cancelled` (the cut came before k were
    picked: only a group that failed after its pick may make up the difference), or not
    `done` (it delivered what it was asked)."""
    found = Counter()
    for job in [j for j in run.acknowledged if j[0] in "do"]:
        status = await client.status(job)
        if job[0] == "d":
            found["resampled"] += status.resampled if status else 0
            continue
        ended = Counter(run.ended.get((job, g)) for g in range(run.acknowledged[job]))
        deliver = run.deliver[job]
        wrong = (status is None or status.state != "done" or ended["ok"] > deliver
                 or (ended["cancelled"] and ended["ok"] + ended["failed"] < deliver))
        if wrong:
            console.print(f"[red]over-sampled job {job} (deliver {deliver}): results {dict(ended)}, "
                          f"state {status.state if status else None}[/red]")
        found["oversampled_wrong"] += wrong
    return found


async def _scorers_offer(client: RolloutClient, scorers: int, timeout_s: float = 60.0) -> None:
    """Wait until the scorers are up and offer both chaos rewards (a scored submit is refused
    before), so that the run's minutes are spent under faults, not starting."""
    give_up = time.monotonic() + timeout_s
    while scorers:
        live = await live_scorers(client.redis, client.keys)
        if len(live) >= scorers and {SYNC, ASYNC} <= set(on_offer(live)):
            return
        if time.monotonic() > give_up:
            raise RuntimeError(f"the chaos scorers did not come up in {timeout_s:g} s (scorer-*.log)")
        await asyncio.sleep(0.1)


async def _results_acknowledged(client: RolloutClient, within_s: float = 3.0) -> None:
    """Until the trainer has acknowledged every result in its stream (it commits each to its log
    first); at most the fixed wait this replaced (a group never committed counts as lost)."""
    give_up = time.monotonic() + within_s
    while await client.redis.xlen(client.keys.results("trainer")) and time.monotonic() < give_up:
        await asyncio.sleep(0.1)


async def _quota_drift(client: RolloutClient) -> int:
    """`outstanding` minus the results still in the stream: every group is finished by now, so
    the two must be equal (an acknowledgement that missed its DECRBY, or counted twice, is drift)."""
    unacked = await client.redis.xlen(client.keys.results("trainer"))
    return await client.outstanding() - unacked


async def _postmortem(url: str, lost: list[tuple[str, int]]) -> None:
    """Where the lost groups are: their job's record, the work stream, the result stream."""
    from rollq.protocol import decode_result, peek_header
    from rollq.queue.keys import Keys
    from rollq.queue.names import Group, JobField, ResultField, WorkField

    keys, redis = Keys(POLICY), connect(url)
    try:
        work = {}
        for entry_id, fields in await redis.xrange(keys.work("trainer")):
            header = peek_header(fields.get(WorkField.ITEM.encode(), b""))
            if header is not None:
                work[(header.job_id, header.group_index)] = entry_id.decode()
        pending = {e["message_id"].decode(): e for e in await redis.xpending_range(
            keys.work("trainer"), Group.WORKERS, "-", "+", 100_000)}
        results = await redis.xrange(keys.results("trainer"))
        unread = {(r.job_id, r.group_index)
                  for r in (decode_result(f[ResultField.RESULT.encode()]) for _, f in results)}
        for job, group in lost[:20]:
            entry = work.get((job, group))
            state = await redis.hget(keys.job("trainer", job), JobField.STATE)
            console.print(
                f"[red]lost {job}/{group}[/red]: job state {state}, "
                f"done {await redis.hget(keys.done('trainer', job), str(group))}, work entry {entry} "
                f"pending {pending.get(entry) if entry else None}, in result stream {(job, group) in unread}")
    finally:
        await redis.aclose()


def render(summary: Summary) -> None:
    colour = "green" if summary.ok else "red"
    console.print(f"[bold {colour}]groups submitted {summary.submitted_groups}, delivered "
                  f"{summary.delivered}, duplicated {summary.duplicated}, lost {summary.lost}, "
                  f"quota drift {summary.quota_drift}[/bold {colour}]")
    console.print(f"jobs {summary.submitted_jobs}; results by status {summary.statuses}; faults "
                  f"{summary.faults}; versions published {summary.versions_published}; trainer exits "
                  f"{summary.trainer_exits}; seed {summary.seed}")
    console.print(f"scored groups {summary.scored_groups}, delivered {summary.scored_delivered}; rewards "
                  f"right {summary.rewards_right}, wrong {summary.rewards_wrong}, unchecked "
                  f"{summary.rewards_unchecked}; scorer exits {summary.scorer_exits}")
    console.print(f"dynamic sampling: {summary.dynamic_groups} groups, {summary.filtered} filtered, "
                  f"{summary.resampled} regenerations; over-sampling: {summary.oversampled_jobs} jobs, "
                  f"{summary.oversampled_wrong} wrong")
