"""The checker of `rollq chaos --episodes`: the trainers' journals against the episode records.

A journal says, per trainer, which calls were sent and how each ended (served with these
tokens, refused, no answer); a record holds what was applied. Every turn's new tokens are one
marker token (a start's prompt begins with one), so a record splits into turns at its markers.
Each branch's life between its start and its end (an *incarnation*: an id may be used again
once its record expired) is checked against the record `end()` returned, else against the one
left in Redis if it is still that incarnation's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import msgspec

from rollq.harness.chaos.episode_trainer import MARKER_BASE
from rollq.engine.instant import expected_tokens
from rollq.protocol import pack_tokens

VOCAB = 32_000
"""The instant engine's default vocabulary: its tokens are a function of the prompt."""
MAX_EVIDENCE = 8
"""Evidence lines kept per kind."""


class EpisodeSummary(msgspec.Struct):
    minutes: float
    seed: int
    episodes: int
    """Starts acknowledged (each of n branches)."""
    branches: int
    turns_served: int
    """Turns (the start's included, per branch) acknowledged as served."""
    turns_by_trainer: dict[str, int]
    turns_unanswered: int
    lost: int
    lost_during_end: int
    """Of `lost`: turns served while their episode was being ended (end() returned without them)."""
    doubled: int
    mismatched: int
    phantom: int
    changed_after_end: int
    stuck: int
    hung: int
    ends_during_turn: int
    """Times a trainer called end() while a turn of that branch ran (on purpose)."""
    unverified: int
    """Branches with served turns and no record to check (expired before anyone read it)."""
    faults: dict[str, int]
    trainer_exits: int
    evidence: list[str]

    @property
    def ok(self) -> bool:
        return not (self.lost or self.doubled or self.mismatched or self.phantom
                    or self.changed_after_end or self.stuck or self.hung)


@dataclass
class Incarnation:
    trainer: str
    branch: str
    index: int
    """The branch's sample index in the start's group."""
    start: int
    """The start's marker."""
    served: list[tuple[int, list[int]]] = field(default_factory=list)
    """(marker, sampled tokens) of each call acknowledged as served, in order."""
    refused: set[int] = field(default_factory=set)
    unanswered: set[int] = field(default_factory=set)
    ended: dict | None = None
    """The record `end()` returned."""
    ending: bool = False
    """`end()` was sent: a turn served after that ran while the episode was being ended."""
    during_end: set[int] = field(default_factory=set)
    last_call: str = ""
    """The last start or turn sent on it and how it ended (for the evidence of a stuck record)."""


@dataclass
class Findings:
    counts: Counter = field(default_factory=Counter)
    evidence: list[str] = field(default_factory=list)

    def add(self, kind: str, line: str) -> None:
        self.counts[kind] += 1
        if self.counts[kind] <= MAX_EVIDENCE:
            self.evidence.append(f"{kind}: {line}")


def incarnations(trainer: str, journal: list[dict], findings: Findings) -> list[Incarnation]:
    found: list[Incarnation] = []
    current: dict[str, Incarnation] = {}
    pending: dict[int, tuple[str, list[Incarnation]]] = {}
    for line in journal:
        kind, u = line.get("k"), line.get("u")
        if kind == "send":
            if line["op"] == "start":
                incs = [Incarnation(trainer, b, i, u) for i, b in enumerate(line["b"])]
                found += incs
                current.update((inc.branch, inc) for inc in incs)
            else:
                incs = [current[line["b"][0]]] if line["b"][0] in current else []
                if line["op"] == "end" and incs:
                    incs[0].ending = True
                    if any(op == "turn" and incs[0] in others for op, others in pending.values()):
                        findings.counts["ends_during_turn"] += 1
            pending[u] = (line["op"], incs)
            for inc in incs if line["op"] != "end" else []:
                inc.last_call = f"{line['op']} {u}: no reply (its trainer was killed)"
        elif kind in ("ok", "refused", "unknown", "hung") and u in pending:
            op, incs = pending.pop(u)
            for inc in incs if op != "end" else []:
                inc.last_call = f"{op} {u}: {kind} {line.get('why', '')}".strip()
            if kind == "ok" and op == "end":
                incs[0].ended = line["out"]
            elif kind == "ok":
                for inc, sampled in zip(incs, line["out"]):
                    inc.served.append((u, sampled))
                    if inc.ending:
                        inc.during_end.add(u)
            elif op != "end":
                for inc in incs:
                    (inc.refused if kind == "refused" else inc.unanswered).add(u)
            if kind == "hung":
                findings.add("hung", f"{trainer}: {op} {u} of {[i.branch for i in incs]} did not return "
                                     "within its deadline + 30 s")
    return found


def check_record(inc: Incarnation, record: dict, findings: Findings) -> None:
    tokens, mask = record["tokens"], record["mask"]
    where = f"{inc.trainer}/{inc.branch} (start {inc.start})"
    markers = Counter(t for t, m in zip(tokens, mask) if not m and t >= MARKER_BASE)
    for marker, times in markers.items():
        if times > 1:
            findings.add("doubled", f"{where}: turn {marker} is in the record {times} times")
    runs = _sampled_runs(tokens, mask)
    for marker, sampled in inc.served:
        if marker not in markers:
            during = " (it ran while end() was called)" if marker in inc.during_end else ""
            findings.counts["lost_during_end"] += bool(during)
            findings.add("lost", f"{where}: turn {marker} was acknowledged as served ({sampled}){during} "
                                 f"and is not in the record ({len(tokens)} tokens, "
                                 f"markers {sorted(markers)})")
        elif runs.get(marker, (None, []))[1] != sampled:
            findings.add("mismatched", f"{where}: turn {marker}: its caller got {sampled}, the record "
                                       f"has {runs.get(marker, (None, []))[1]}")
    for marker in inc.refused:
        # A start's prompt is in the record from the start on: only samples after it were added.
        if marker == inc.start and not runs.get(marker, (0, []))[1]:
            continue
        if marker in markers:
            findings.add("phantom", f"{where}: turn {marker} was refused (nothing added) "
                                            "and is in the record")
    for marker, (begin, sampled) in runs.items():
        index = inc.index if marker == inc.start else 0
        want = expected_tokens(pack_tokens(tokens[:begin]), index, len(sampled), VOCAB)
        if sampled != want:
            findings.add("mismatched", f"{where}: turn {marker}'s tokens {sampled} do not continue the "
                                       f"record before them (the engine gives {want})")


def _sampled_runs(tokens: list[int], mask: list[int]) -> dict[int, tuple[int, list[int]]]:
    """marker -> (where the sampled tokens after it begin, those tokens)."""
    runs, marker, begin = {}, None, 0
    for i, (t, m) in enumerate(zip(tokens, mask)):
        if not m and t >= MARKER_BASE:
            marker, begin = t, -1
            runs[marker] = (i + 1, [])
        elif m and marker is not None:
            if begin == -1:
                begin = i
                runs[marker] = (i, [])
            runs[marker][1].append(t)
    return runs


def check(journals: dict[str, list[dict]], records: dict[tuple[str, str], dict]):
    findings = Findings()
    every: list[Incarnation] = []
    for trainer, journal in journals.items():
        every += incarnations(trainer, journal, findings)
    latest = {(inc.trainer, inc.branch): inc for inc in every}
    for inc in every:
        left = records.get((inc.trainer, inc.branch)) if latest[(inc.trainer, inc.branch)] is inc else None
        if left is not None and (not left["tokens"] or left["tokens"][0] != inc.start):
            left = None  # the record of a start that never got this far
        if inc.ended is not None and left is not None and left["state"] == "ended" and (
                left["tokens"] != inc.ended["tokens"] or left["mask"] != inc.ended["mask"]):
            findings.add("changed_after_end", f"{inc.trainer}/{inc.branch}: end() returned "
                         f"{len(inc.ended['tokens'])} tokens, the ended record has {len(left['tokens'])}")
        final = inc.ended or left
        if final is None:
            if inc.served:
                findings.counts["unverified"] += 1
            continue
        check_record(inc, final, findings)
    for (trainer, branch), record in records.items():
        if record["state"] == "running":
            inc = latest.get((trainer, branch))
            last = inc.last_call if inc else "none journalled"
            findings.add("stuck", f"{trainer}/{branch}: still running turn {record['turn_job']} after "
                                  f"every trainer finished (its deadline long past); its last call: {last}; "
                                  f"its job: {record.get('job')}")
    c = findings.counts
    return EpisodeSummary(
        minutes=0, seed=0, episodes=sum(inc.index == 0 and bool(inc.served) for inc in every),
        branches=sum(bool(inc.served) for inc in every),
        turns_served=sum(len(inc.served) for inc in every),
        turns_by_trainer=dict(Counter(inc.trainer for inc in every for _ in inc.served)),
        turns_unanswered=sum(len(inc.unanswered) for inc in every), lost=c["lost"],
        lost_during_end=c["lost_during_end"], doubled=c["doubled"], ends_during_turn=c["ends_during_turn"],
        mismatched=c["mismatched"], phantom=c["phantom"], changed_after_end=c["changed_after_end"],
        stuck=c["stuck"], hung=c["hung"], unverified=c["unverified"], faults={}, trainer_exits=0,
        evidence=findings.evidence)
