"""The training-inference gap trainers report (issue 41, deliverable 2): `report_logprobs`' sums
per version and worker, read back exactly; attribution of a sample's tokens to their own
versions; the cap on the record; a trainer's Redis user; refusals naming the field. Real
redis-server; groups served by the instant engine (every behaviour logprob -1.0: these are tests
of the aggregation, not of generation)."""

from __future__ import annotations

import math

import pytest
from redis.exceptions import NoPermissionError

from rollq.client import RolloutClient
from rollq.protocol import GroupResult, InvalidInput, Sample, pack_floats, pack_tokens
from rollq.queue import gap
from rollq.queue.keys import Keys
from rollq.security import trainer_acl

from helpers import collect


def _expected(deltas: list[float]) -> dict:
    n = len(deltas)
    ratios = [math.exp(d) for d in deltas]
    mean = sum(ratios) / n
    return dict(tokens=n, mean_abs=sum(abs(d) for d in deltas) / n,
                kl=sum(r - 1 - math.log(r) for r in ratios) / n,
                over_1=sum(abs(d) > 1 for d in deltas) / n, ratio_mean=mean,
                ratio_std=math.sqrt(sum((r - mean) ** 2 for r in ratios) / n))


def _close(row: gap.GapFigures, expected: dict) -> None:
    assert row.tokens == expected["tokens"], row
    for name in ("mean_abs", "kl", "over_1", "ratio_mean", "ratio_std"):
        assert math.isclose(getattr(row, name), expected[name], rel_tol=1e-9, abs_tol=1e-12), (name, row)


def _result(worker: str, versions: list[tuple[int, int]], behaviour: list[float],
            job: str = "j") -> GroupResult:
    sample = Sample(tokens=pack_tokens(list(range(len(behaviour)))), logprobs=pack_floats(behaviour),
                    finish_reason="length", versions=versions)
    return GroupResult(job, 0, "ok", samples=[sample], worker_id=worker)


async def test_a_report_of_known_deltas_reads_back_exactly_per_version_and_worker(
        make_client, make_worker, redis, policy):
    """Served groups (behaviour logprob -1.0 each), the trainer's logprobs chosen per sample:
    every figure per (version, worker) and per version equals the formula's, and a worker whose
    samples disagree stands out."""
    make_worker("w1")
    make_worker("w2")
    client = make_client("alice")
    await client.submit([[i + 1] for i in range(8)], n=2, sampling={"max_tokens": 4})
    results = await collect(client, 8)
    assert {r.worker_id for r in results} <= {"w1", "w2"}
    shifts = {"w1": [-0.5, 0.0, 0.25, -2.0], "w2": [0.0, -0.01, 0.02, 0.0]}
    given, deltas = [], {}
    for r in results:
        for s in r.samples:
            assert s.versions == [(0, 0)] and s.token_logprobs == [-1.0] * 4
            given.append([-1.0 + d for d in shifts[r.worker_id]])
            deltas.setdefault(r.worker_id, []).extend(shifts[r.worker_id])
    reported = await client.report_logprobs(results, given)
    assert (reported.samples, reported.tokens) == (16, 64)
    view = await gap.read(redis, Keys(policy))
    rows = {row.worker: row for row in view.workers}
    assert set(rows) == set(deltas)
    for worker, ds in deltas.items():
        _close(rows[worker], _expected(ds))
    [version] = view.versions
    assert (version.version, version.worker) == (0, "*")
    _close(version, _expected([d for ds in deltas.values() for d in ds]))
    if len(rows) == 2:  # both workers served: w1's mean |Δ| (0.69) is 69x w2's (0.0075)
        assert rows["w1"].outlier and not rows["w2"].outlier
    # A second report adds to the sums; another trainer's too, and readers sum over trainers.
    await client.report_logprobs(results, given)
    bob = make_client("bob")
    await bob.report_logprobs(results, given)
    again = {row.worker: row for row in (await gap.read(redis, Keys(policy))).workers}
    for worker, ds in deltas.items():
        _close(again[worker], _expected(ds * 3))
    mine = {row.worker: row.tokens for row in (await gap.read(redis, Keys(policy), only="bob")).workers}
    assert mine == {w: len(ds) for w, ds in deltas.items()}


async def test_a_sample_of_two_versions_counts_each_token_for_its_own_version(make_client, redis, policy):
    """Tokens 0-1 sampled by v3, 2-4 by v4 (a swap mid-sample): v3 gets Δ of the first two only."""
    client = make_client("alice")
    behaviour = [-1.0, -2.0, -0.5, -0.25, -3.0]
    trainer = [-1.5, -2.0, -0.5, -1.5, -0.5]
    result = _result("w7", [(3, 0), (4, 2)], behaviour)
    assert (await client.report_logprobs([result], [trainer])).tokens == 5
    view = await gap.read(redis, Keys(policy))
    rows = {(row.version, row.worker): row for row in view.workers}
    assert set(rows) == {(3, "w7"), (4, "w7")}
    deltas = [t - b for t, b in zip(trainer, behaviour)]
    _close(rows[3, "w7"], _expected(deltas[:2]))
    _close(rows[4, "w7"], _expected(deltas[2:]))
    assert [v.version for v in view.versions] == [3, 4]
    assert rows[4, "w7"].over_1 == pytest.approx(2 / 3)  # -1.25 and +2.5 of (0, -1.25, 2.5)


async def test_a_tensor_per_sample_and_samples_skipped(make_client, redis, policy):
    import torch

    client = make_client("alice")
    results = [_result("w1", [(1, 0)], [-1.0, -1.0]), _result("w2", [(1, 0)], [-2.0, -2.0, -2.0])]
    got = await client.report_logprobs(results, [torch.tensor([-0.5, -1.5], dtype=torch.bfloat16), None])
    assert (got.samples, got.tokens) == (1, 2)
    [row] = (await gap.read(redis, Keys(policy))).workers
    _close(row, _expected([0.5, -0.5]))


async def test_bad_input_is_refused_naming_the_field_and_the_limit(make_client, redis, policy):
    client = make_client("alice")
    results = [_result("w1", [(1, 0)], [-1.0, -1.0]), _result("w1", [(1, 0)], [-1.0])]
    cases = [
        ([[-1.0, -1.0]], "trainer_logprobs", "has 1 entries for the 2 samples"),
        ([[-1.0], [-1.0]], "trainer_logprobs[0]", "has 1 logprobs for a sample of 2 tokens"),
        ([[-1.0, math.nan], [-1.0]], "trainer_logprobs[0][1]", "not a log probability in [-1e+06, 0]"),
        ([[-1.0, -1.0], [0.5]], "trainer_logprobs[1][0]", "[-1e+06, 0]"),
        ([[-1.0, -math.inf], [-1.0]], "trainer_logprobs[0][1]", "[-1e+06, 0]"),
        ([[-1.0, -1.0], "abc"], "trainer_logprobs[1]", "list of floats or a 1-D tensor"),
        ([[-1.0, -1.0], [[-1.0]]], "trainer_logprobs[1]", "numbers only"),
    ]
    for given, field, words in cases:
        with pytest.raises(InvalidInput) as e:
            await client.report_logprobs(results, given)
        assert e.value.field == field and words in str(e.value), (given, str(e.value))
    with pytest.raises(InvalidInput) as e:
        await client.report_logprobs([results[0].samples[0]], [[-1.0, -1.0]])
    assert e.value.field == "results[0]"
    many = [_result("w1", [(1, 0)], [-1.0])] * (gap.MAX_REPORT_SAMPLES + 1)
    with pytest.raises(InvalidInput, match=f"the limit is {gap.MAX_REPORT_SAMPLES}"):
        await client.report_logprobs(many, [[-1.0]] * len(many))
    assert not await redis.exists(Keys(policy).gap("alice"))  # nothing written by a refusal


async def test_the_record_keeps_the_newest_versions_only(make_client, redis, policy, monkeypatch):
    """Capped at GAP_VERSIONS versions (3 here): a newer version's report drops the oldest's
    fields, also for a restarted client (it reads what the record holds first)."""
    monkeypatch.setattr(gap, "GAP_VERSIONS", 3)
    keys = Keys(policy)
    client = make_client("alice")
    for version in range(1, 5):
        await client.report_logprobs([_result("w1", [(version, 0)], [-1.0])], [[-1.5]])
    assert await _versions(redis, keys) == {2, 3, 4}
    assert 0 < await redis.ttl(keys.gap("alice")) <= gap.GAP_TTL_S
    restarted = make_client("alice")
    await restarted.report_logprobs([_result("w2", [(5, 0)], [-1.0])], [[-1.5]])
    assert await _versions(redis, keys) == {3, 4, 5}
    assert [v.version for v in (await gap.read(redis, keys)).versions] == [3, 4, 5]


async def _versions(redis, keys: Keys) -> set[int]:
    return {int(f.split(b":")[0]) for f in await redis.hkeys(keys.gap("alice"))}


async def test_a_trainers_redis_user_reports_into_its_own_record_only(redis, redis_url, policy):
    keys = Keys(policy)
    user = f"alice-{policy}"
    await redis.execute_command("ACL", "SETUSER", user, *trainer_acl(policy, "alice", "pw")[1:])
    alice = RolloutClient(redis_url.replace("redis://", f"redis://{user}:pw@"), policy=policy,
                          trainer_id="alice")
    try:
        await alice.report_logprobs([_result("w1", [(1, 0)], [-1.0])], [[-1.25]])
        await alice.report_logprobs([_result("w1", [(2, 0)], [-1.0])], [[-1.25]])
        [a, b] = (await gap.read(redis, keys)).versions
        assert (a.version, a.tokens, b.version) == (1, 1, 2) and a.mean_abs == pytest.approx(0.25)
        with pytest.raises(NoPermissionError):
            await alice.redis.hincrbyfloat(keys.gap("bob"), "1:w1:abs", 5.0)
    finally:
        await alice.close()
        await redis.execute_command("ACL", "DELUSER", user)


async def test_readers_skip_what_rollq_never_writes(redis, policy):
    keys = Keys(policy)
    await redis.sadd(keys.gap_trainers, b"\xff:x", "alice")
    await redis.hset(keys.gap("alice"), mapping={"junk": 1, "1:w1:n": "abc", "x:w1:n": 1, "1:w1:bogus": 1,
                                                 "1:w1:abs": "inf", "1:w1:k3": -1, "2:w1:n": 2,
                                                 "2:w1:abs": 1.0})
    [row] = (await gap.read(redis, keys)).workers
    assert (row.version, row.tokens, row.mean_abs) == (2, 2, 0.5)


async def test_a_worker_that_disagrees_stands_out(make_client, redis, policy):
    """Mean |Δ| above 3x the median of the version's other workers (and above 1e-3) marks the
    worker; float32-sized differences, however unequal, mark nobody."""
    client = make_client("alice")
    shifts = {"a": 0.01, "b": 0.012, "c": 0.5, "d": 0.011}
    results = [_result(w, [(1, 0)], [-1.0] * 4) for w in shifts]
    results += [_result(w, [(2, 0)], [-1.0] * 4) for w in ("a", "b")]
    given = [[-1.0 - d] * 4 for d in shifts.values()] + [[-1.0 - 1e-6] * 4, [-1.0 - 1e-5] * 4]
    await client.report_logprobs(results, given)
    view = await gap.read(redis, Keys(policy))
    marked = {(row.version, row.worker) for row in view.workers if row.outlier}
    assert marked == {(1, "c")}
