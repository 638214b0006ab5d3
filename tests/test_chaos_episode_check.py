"""The checker of `rollq chaos --episodes` finds each kind of fault it counts: journals and records
built here by hand (a clean episode, then the same with one fault each)."""

from rollq.harness.chaos.episode_check import check
from rollq.engine.instant import expected_tokens
from rollq.protocol import pack_tokens

START, TURN, END = 100_100_001, 100_100_002, 100_100_003


def _episode():
    """A journal of a start (n=2) and one turn of branch e.0, and the record e.0 ends with."""
    prompt = [START, 7]
    first = [expected_tokens(pack_tokens(prompt), i, 3, 32_000) for i in range(2)]
    tokens = prompt + first[0] + [TURN]
    reply = expected_tokens(pack_tokens(tokens), 0, 3, 32_000)
    tokens += reply
    journal = [{"k": "send", "u": START, "op": "start", "b": ["e.0", "e.1"], "new": prompt},
               {"k": "ok", "u": START, "out": first},
               {"k": "send", "u": TURN, "op": "turn", "b": ["e.0"], "new": [TURN]},
               {"k": "ok", "u": TURN, "out": [reply]}]
    record = {"state": "idle", "tokens": tokens, "mask": [0, 0, 1, 1, 1, 0, 1, 1, 1], "turn_job": ""}
    branch1 = {"state": "idle", "tokens": prompt + first[1], "mask": [0, 0, 1, 1, 1], "turn_job": ""}
    return journal, {("t0", "e.0"): record, ("t0", "e.1"): branch1}


def test_a_clean_run_has_no_findings():
    journal, records = _episode()
    summary = check({"t0": journal}, records)
    assert summary.ok and summary.turns_served == 3 and summary.branches == 2 and summary.episodes == 1
    assert summary.evidence == []


def test_each_fault_is_counted():
    journal, records = _episode()
    lost = dict(records[("t0", "e.0")], tokens=records[("t0", "e.0")]["tokens"][:5],
                mask=records[("t0", "e.0")]["mask"][:5])
    assert check({"t0": journal}, records | {("t0", "e.0"): lost}).lost == 1

    twice = dict(records[("t0", "e.0")])
    twice["tokens"] = twice["tokens"] + twice["tokens"][5:]
    twice["mask"] = twice["mask"] + twice["mask"][5:]
    summary = check({"t0": journal}, records | {("t0", "e.0"): twice})
    assert summary.doubled == 1 and not summary.ok

    wrong = dict(records[("t0", "e.1")], tokens=records[("t0", "e.1")]["tokens"][:4] + [1])
    assert check({"t0": journal}, records | {("t0", "e.1"): wrong}).mismatched == 2  # caller's + engine's

    refused = [*journal[:3], {"k": "refused", "u": TURN, "why": "failed"}]
    assert check({"t0": refused}, records).phantom == 1
    # A failed start leaves its prompt (and nothing else) in the record: not a phantom...
    failed_start = [journal[0], {"k": "refused", "u": START, "why": "expired"}]
    prompt_only = {"state": "idle", "tokens": [START, 7], "mask": [0, 0], "turn_job": ""}
    assert check({"t0": failed_start}, {("t0", "e.0"): prompt_only}).ok
    # ... but samples after it are.
    assert check({"t0": failed_start}, records).phantom == 2

    stuck = dict(records[("t0", "e.1")], state="running", turn_job="e.1.tabc")
    assert check({"t0": journal}, records | {("t0", "e.1"): stuck}).stuck == 1

    ended = {"state": "ended", "tokens": records[("t0", "e.0")]["tokens"][:5],
             "mask": records[("t0", "e.0")]["mask"][:5], "turns": 1}
    during_end = [*journal[:3], {"k": "send", "u": END, "op": "end", "b": ["e.0"], "new": []},
                  {"k": "ok", "u": END, "out": ended}, journal[3]]
    grown = dict(records[("t0", "e.0")], state="ended")
    summary = check({"t0": during_end}, records | {("t0", "e.0"): grown})
    assert summary.changed_after_end == 1 and summary.lost == summary.lost_during_end == 1
    assert summary.ends_during_turn == 1
    assert "while end() was called" in " ".join(summary.evidence)

    hung = [*journal[:3], {"k": "hung", "u": TURN}]
    assert check({"t0": hung}, records).hung == 1
