"""Scoring as the gateway sees it: the scorers' tallies (`scoring/records.py` `Tally`, one per
scorer per second, on a capped stream) read as they come, added up per trainer and job, and laid
out per second of scoring for the dashboard (rewards' mean and spread, groups scored, scoring
time) and as Prometheus families. The jobs' filtered and resampled counts come from their job
records, the truth the trainer reads too.

A scorer adds its tally just after each whole second (`scoring/stats.py`), for the second before
it: a second's figures are complete here once every live scorer's tally of it can have come, so
the series shows seconds up to 2.5 s before the latest sample, each once, and never a sum of
two scorer periods or none (heartbeat-sized steps drew spikes)."""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from redis.asyncio import Redis

from rollq.queue.keys import Keys
from rollq.queue.names import JobField
from rollq.scoring.records import REWARD_S_BUCKETS, JobTally, add_job_tally, read_tallies

SERIES_POINTS = 900
"""Seconds of scoring history: 15 minutes."""
JOBS_SHOWN = 20
"""Jobs the dashboard lists: those scored most recently."""
JOBS_KEPT = 200
"""Jobs whose figures the gateway keeps (a bounded memory however many jobs run)."""
SECOND_COMPLETE_AFTER_S = 2.5
"""A second's tallies are all in this long after it ended (each scorer adds one just after it);
one later still is counted in the last second shown."""
WINDOW_S = 60
"""The Prometheus gauges of rewards' mean and spread: over the last minute of scoring."""
_JOB_COUNTS = (JobField.GROUPS, JobField.DONE, JobField.OK, JobField.FAILED, JobField.CANCELLED,
               JobField.FILTERED, JobField.RESAMPLED)


@dataclass
class Sums:
    """Tallies added up: for a trainer, a job, or one second of one trainer."""

    written: collections.Counter = field(default_factory=collections.Counter)
    resampled: int = 0
    rewards: int = 0
    total: float = 0.0
    squares: float = 0.0
    missing: int = 0
    scored: int = 0
    reward_s: float = 0.0

    def add(self, t: JobTally | Sums) -> None:
        add_job_tally(self, t)

    @property
    def mean(self) -> float | None:
        return self.total / self.rewards if self.rewards else None

    @property
    def std(self) -> float | None:
        """Population standard deviation of the rewards (None: none)."""
        if not self.rewards:
            return None
        mean = self.total / self.rewards
        variance = self.squares / self.rewards - mean * mean
        # (max() would make a NaN variance 0: a spread shown where the sums are no numbers.)
        return math.sqrt(max(0.0, variance)) if math.isfinite(variance) else None

    def figures(self) -> dict:
        return dict(written=dict(self.written), resampled=self.resampled, rewards=self.rewards,
                    mean=_round(self.mean), std=_round(self.std), missing=self.missing,
                    scored=self.scored, reward_ms=_ms(self.reward_s, self.scored))


def _round(value: float | None) -> float | None:
    """A figure as shown; None for none, and for a sum that is no number (a tally's overflowed
    or NaN sum, kept in Redis by a scorer of before rewards were checked)."""
    return None if value is None or not math.isfinite(value) else round(value, 4)


def _ms(seconds: float, groups: int) -> float | None:
    ms = 1000 * seconds / groups if groups else math.nan
    return round(ms, 2) if math.isfinite(ms) else None


@dataclass
class Second:
    t: float
    trainers: dict[str, Sums]

    @property
    def scored(self) -> int:
        return sum(s.scored for s in self.trainers.values())

    @property
    def reward_s(self) -> float:
        return sum(s.reward_s for s in self.trainers.values())


@dataclass
class ScoringView:
    after: str = "0"
    """The last tally read (stream id); '0': none yet, read back every tally kept."""
    trainers: dict[str, Sums] = field(default_factory=dict)
    jobs: collections.OrderedDict = field(default_factory=collections.OrderedDict)
    """(trainer, job id) -> Sums, most recently scored last."""
    job_counts: dict[tuple[str, str], dict[str, int]] = field(default_factory=dict)
    reward_s: list[int] = field(default_factory=lambda: [0] * (len(REWARD_S_BUCKETS) + 1))
    open: dict[int, Second] = field(default_factory=dict)
    """Seconds whose tallies may still come."""
    series: collections.deque = field(default_factory=lambda: collections.deque(maxlen=SERIES_POINTS))
    shown_until: int = 0
    caught_up: bool = False
    """False until the first sample: what it reads was scored before this gateway started."""

    async def sample(self, redis: Redis, keys: Keys, now: float) -> None:
        first, self.caught_up = not self.caught_up, True
        while True:
            self.after, tallies = await read_tallies(redis, keys, self.after)
            for tally in tallies:
                self._add(tally, history=first)
            if len(tallies) < 1000:
                break
        if first:  # what was scored before this gateway started: totals, not the series
            self.shown_until = int(now - SECOND_COMPLETE_AFTER_S)
        self._close_seconds(now)
        await self._read_jobs(redis, keys)

    def _add(self, tally, history: bool) -> None:
        # A tally added just after second s + 1 began covers second s (`scoring/stats.py`).
        second = int(tally.at) - 1
        for job in tally.jobs:
            self.trainers.setdefault(job.trainer, Sums()).add(job)
            key = (job.trainer, job.job_id)
            sums = self.jobs.pop(key, None) or Sums()
            sums.add(job)
            self.jobs[key] = sums
            if history:
                continue
            if second > self.shown_until:
                at = self.open.setdefault(second, Second(float(second), {}))
            elif self.series:  # late (a scorer stalled): counted in the last second shown
                at = self.series[-1]
            else:
                continue
            at.trainers.setdefault(job.trainer, Sums()).add(job)
        while len(self.jobs) > JOBS_KEPT:
            gone, _ = self.jobs.popitem(last=False)
            self.job_counts.pop(gone, None)
        self.reward_s = [a + b for a, b in zip(self.reward_s, tally.reward_s)]

    def _close_seconds(self, now: float) -> None:
        """Seconds now complete go to the series, each once, a second with nothing scored as 0."""
        until = int(now - SECOND_COMPLETE_AFTER_S)
        if not self.open and not self.series:
            self.shown_until = until
            return
        for second in range(max(self.shown_until + 1, until - SERIES_POINTS), until + 1):
            self.series.append(self.open.pop(second, None) or Second(float(second), {}))
        self.shown_until = max(self.shown_until, until)
        for second in [s for s in self.open if s <= until]:
            del self.open[second]

    async def _read_jobs(self, redis: Redis, keys: Keys) -> None:
        shown = list(self.jobs)[-JOBS_SHOWN:]
        if not shown:
            return
        async with redis.pipeline(transaction=False) as pipe:
            for trainer, job_id in shown:
                pipe.hmget(keys.job(trainer, job_id), list(_JOB_COUNTS))
            replies = await pipe.execute()
        for key, values in zip(shown, replies):
            if any(v is not None for v in values):  # else expired: keep the last counts read
                self.job_counts[key] = {name.value: int(v or 0) for name, v in zip(_JOB_COUNTS, values)}

    # --- the dashboard and Prometheus ----------------------------------------------------------

    def dashboard(self) -> dict:
        seconds = list(self.series)
        names = sorted({t for s in seconds for t in s.trainers})
        rewards = {name: dict(mean=[_round(s.trainers[name].mean) if name in s.trainers else None
                                    for s in seconds],
                              std=[_round(s.trainers[name].std) if name in s.trainers else None
                                   for s in seconds]) for name in names}
        jobs = [dict(trainer=t, job_id=j, record=self.job_counts.get((t, j)), **self.jobs[t, j].figures())
                for t, j in reversed(list(self.jobs)[-JOBS_SHOWN:])]
        return dict(
            series=dict(t=[s.t for s in seconds], scored_per_s=[s.scored for s in seconds],
                        reward_ms=[_ms(s.reward_s, s.scored) for s in seconds], rewards=rewards),
            trainers={t: s.figures() for t, s in sorted(self.trainers.items())},
            jobs=jobs)

    def recent(self) -> dict[str, Sums]:
        """Per trainer, the last `WINDOW_S` seconds of scoring added up."""
        out: dict[str, Sums] = {}
        for second in list(self.series)[-WINDOW_S:]:
            for trainer, sums in second.trainers.items():
                out.setdefault(trainer, Sums()).add(sums)
        return out

    def families(self, policy: str, into: dict) -> None:
        """Adds this policy's samples to the families `metric_families()` made."""
        for trainer, s in self.trainers.items():
            labels = [policy, trainer]
            for status, count in s.written.items():
                into["scored"].add_metric([policy, trainer, status], count)
            into["resampled"].add_metric(labels, s.resampled)
            into["rewards"].add_metric(labels, s.rewards)
            into["reward_sum"].add_metric(labels, s.total)
            into["missing"].add_metric(labels, s.missing)
        for trainer, s in self.recent().items():
            if s.rewards:
                into["mean"].add_metric([policy, trainer], s.mean)
                std = s.std  # None where the sums are no numbers: Prometheus has a word for that
                into["std"].add_metric([policy, trainer], math.nan if std is None else std)
        cumulative, running = [], 0
        for bound, count in zip([*(str(float(b)) for b in REWARD_S_BUCKETS), "+Inf"], self.reward_s):
            running += count
            cumulative.append((bound, running))
        into["seconds"].add_metric([policy], cumulative, sum(s.reward_s for s in self.trainers.values()))


def metric_families() -> dict:
    tp = ["policy", "trainer"]
    return dict(
        scored=CounterMetricFamily("rollq_scored_groups", "Results scorers wrote, by status (ok, "
                                   "filtered, failed, cancelled).", labels=[*tp, "status"]),
        resampled=CounterMetricFamily("rollq_resampled_groups", "Scored groups whose rewards were all "
                                      "equal, generated again (dynamic sampling).", labels=tp),
        rewards=CounterMetricFamily("rollq_rewards", "Samples given a reward.", labels=tp),
        reward_sum=GaugeMetricFamily("rollq_reward_sum", "Sum of the rewards given (a gauge: rewards "
                                     "may be negative).", labels=tp),
        missing=CounterMetricFamily("rollq_rewards_missing", "Samples left without a reward (the "
                                    "reward raised, timed out or ran out of memory).", labels=tp),
        mean=GaugeMetricFamily("rollq_reward_mean", f"Mean reward over the last {WINDOW_S} s of "
                               "scoring.", labels=tp),
        std=GaugeMetricFamily("rollq_reward_stddev", f"Standard deviation of the rewards over the last "
                              f"{WINDOW_S} s of scoring.", labels=tp),
        seconds=HistogramMetricFamily("rollq_scoring_seconds", "Scoring time of a group (every "
                                      "sample's reward, wall time).", labels=["policy"]),
    )
