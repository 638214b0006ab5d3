"""The version canary in the worker's load path (issue 41), on vLLM's CPU build, the references
computed by transformers: the trainer publishes its version with `canary=True`, the worker loads
what the store holds. Where the two disagree the version is refused with its figures, the
previous version keeps serving, and every group is served once, on an accepted version.

Each wrong version here is a way an engine comes to serve other weights than the trainer's:
one layer off by 1 %, two embedding rows swapped, an lm_head left stale, and weights cast through
bf16 under a float32 tolerance. (An adapter published with a doubled scale: test_adapters_vllm.)

The stale head is made by the follower's test hook (`VersionFollower.spoil`): the checked
snapshot gets the previous version's `lm_head.weight` back before vLLM loads it, as when a tied
head's tensor never reaches the engine. vLLM 0.32 itself loads a trained head into a model
whose config ties it (tried: its `maybe_untie_word_embeddings`), so the store's bytes alone
do not make this case here.
"""
# ruff: noqa: F811 (fixtures imported from swap_fixtures are test arguments by design)

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch
from conftest import engine_flags
from helpers import collect, wait_until
from transformers import LlamaForCausalLM

from rollq.canary import TOLERANCES
from rollq.queue.workers import live_workers
from rollq.registry.safetensors_check import dir_schema
# The swap tests' fixtures: a float32 engine of this module's own, on version 1 per test.
from swap_fixtures import (GREEDY, PROMPTS, Reference, engine_v1, follower,  # noqa: F401
                           perturbed, swap_engine)

F32 = TOLERANCES["float32"]


def trainer_model(config, state: dict) -> LlamaForCausalLM:
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(state)
    return model


def scaled_layer(state: dict) -> dict:
    return state | {k: v * 1.01 for k, v in state.items() if k.startswith("model.layers.1.")}


def swapped_rows(state: dict) -> dict:
    embed = state["model.embed_tokens.weight"].clone()
    embed[[100, 300]] = embed[[300, 100]]  # two ids the default canary holds (it holds all 512)
    return state | {"model.embed_tokens.weight": embed}


def stale_head(snapshot, head) -> None:
    """The snapshot's lm_head.weight replaced by `head` (the previous version's)."""
    from safetensors.torch import load_file, save_file

    for path in snapshot.glob("*.safetensors"):
        tensors = load_file(path)
        if "lm_head.weight" in tensors:
            save_file(tensors | {"lm_head.weight": head.detach().clone()}, path, metadata={"format": "pt"})


def through_bf16(state: dict) -> dict:
    return {k: v.to(torch.bfloat16).float() for k, v in state.items()}


async def _checks(client, version: int):
    """The worker's canary checks as its heartbeat reports them, once the last is of `version`
    (else None: the beat that carries it comes after the refusal is made, not with it)."""
    [beat] = await live_workers(client.redis, client.keys)
    return beat.canaries if beat.canaries and beat.canaries[-1].version == version else None


async def test_wrong_versions_are_refused_and_the_previous_one_serves(follower, make_client, tmp_path,
                                                                      tiny_model, caplog):
    caplog.set_level(logging.INFO, logger="rollq")
    worker = follower()
    trainer = make_client(weight_store=str(tmp_path / "store"))
    base = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    config, weights = base.config, {k: v.clone() for k, v in base.state_dict().items()}
    models = {1: base}
    submitted = 0

    async def some_groups():
        nonlocal submitted
        await trainer.submit(PROMPTS[:8], n=1, sampling=GREEDY | {"max_tokens": 24})
        submitted += 8

    # v2: the trainer's exact weights are accepted, by orders of magnitude.
    models[2] = trainer_model(config, perturbed(weights, 2))
    await some_groups()
    await trainer.publish_weights(2, models[2], canary=True)
    await wait_until(lambda: worker.engine.version == 2, timeout_s=60, what="v2 accepted")
    [accepted] = await wait_until(lambda: _checks(trainer, 2), what="the check in the heartbeat")
    print("exact:", accepted.verdict.describe())
    assert accepted.version == 2 and accepted.verdict.accepted
    assert accepted.verdict.max_abs < F32.max_abs / 30 and accepted.verdict.mean_abs < F32.mean_abs / 30
    assert set(worker.stats.totals.last_swap) >= {"load", "canary"}

    # v3..v6: the store holds other bytes than the trainer's model; each is refused with its
    # figures, beyond the float32 tolerance by an order of magnitude, and v2 serves on.
    models[5] = trainer_model(config, perturbed(weights, 5))
    cases = {
        3: ("one layer x1.01", models[2], scaled_layer(dict(models[2].state_dict()))),
        4: ("two embedding rows swapped", models[2], swapped_rows(dict(models[2].state_dict()))),
        5: ("an lm_head left stale", models[5], dict(models[5].state_dict())),
        6: ("weights cast through bf16", models[2], through_bf16(dict(models[2].state_dict()))),
    }
    worker.follower.spoil = lambda version, snapshot: (
        version == 5 and stale_head(snapshot, models[2].lm_head.weight))
    for version, (what, model, stored) in cases.items():
        await some_groups()
        # The canary of the trainer's model, the files of the bytes the store holds.
        from rollq.canary import reference

        await trainer.publish_weights(version, stored, canary=reference(model))
        await wait_until(lambda version=version: version in worker.versions.cannot_load, timeout_s=60,
                         what=f"v{version} ({what}) refused: serving {worker.engine.version}, "
                              f"{worker.versions.last_error}")
        checks = await wait_until(lambda version=version: _checks(trainer, version),
                                  what="the refusal in the heartbeat")
        refused = checks[-1]
        print(f"{what}: {refused.verdict.describe()}")
        assert refused.version == version and not refused.verdict.accepted
        assert refused.verdict.max_abs > 10 * F32.max_abs and refused.verdict.mean_abs > 10 * F32.mean_abs
        assert "canary refused" in worker.versions.last_error
        assert worker.engine.version == 2  # the previous version serves

    # Every live worker refused v6 (there is one): the registry says so, and a job that only v6
    # could serve fails with the figures rather than waiting for ever.
    marks = await worker.registry.refused_everywhere()
    assert set(marks) >= {6} and "refused by the canary of every live worker" in marks[6]
    only_v6 = await trainer.submit(PROMPTS[:1], n=1, sampling=GREEDY, min_version=6)

    results = await collect(trainer, submitted + 1, timeout_s=120)
    [failed] = [r for r in results if r.job_id == only_v6]
    assert failed.status == "failed" and "canary refused" in failed.reason, failed.reason
    served = [r for r in results if r.job_id != only_v6]
    assert Counter((r.job_id, r.group_index) for r in served) == Counter(
        {(r.job_id, r.group_index): 1 for r in served}) and len(served) == submitted
    reference_of = Reference(models)
    for r in served:
        assert r.status == "ok", r.reason
        for sample in r.samples:
            assert {v for v, _ in sample.versions} <= {1, 2}, sample.versions  # accepted only
            reference_of.check(r.prompt_ids, sample)


async def test_a_keep_swap_refused_hands_its_frozen_groups_back(follower, make_client, tmp_path,
                                                                 tiny_model):
    """A keep swap resumes its frozen requests beside the check (vLLM resumes all or none): on a
    refusal they are aborted, the old weights come back, and each of those groups is handed
    back whole and served again from the start on the version that serves: none keeps a token
    of the refused version, none is lost or doubled."""
    worker = follower(swap_mode="keep")
    trainer = make_client(weight_store=str(tmp_path / "store"))
    base = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    wrong = scaled_layer({k: v.clone() for k, v in base.state_dict().items()})
    await trainer.submit(PROMPTS[:16], n=1, sampling=GREEDY | {"max_tokens": 240, "swap_modes": ["keep"]})
    await wait_until(lambda: len(worker.admission.generating) == 16, what="16 groups running")
    from rollq.canary import reference

    await trainer.publish_weights(2, wrong, canary=reference(base))
    await wait_until(lambda: 2 in worker.versions.cannot_load, timeout_s=60, what="v2 refused")
    results = await collect(trainer, 16, timeout_s=180)
    assert worker.engine._withdrawals == 1  # the frozen requests ran beside the check, then went
    assert sorted(r.group_index for r in results) == list(range(16))
    reference_of = Reference({1: base})
    for r in results:
        assert r.status == "ok", r.reason
        [sample] = r.samples
        assert sample.versions == [(1, 0)], sample.versions
        reference_of.check(r.prompt_ids, sample)
    assert worker.engine.version == 1


@pytest.fixture(scope="module")
async def second_engine(tiny_model):
    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    engine = await VLLMEngine.start(VLLMSettings(**engine_flags(tiny_model)).validate(), version=1)
    yield engine
    await engine.close()


async def test_a_worker_loading_wrong_bytes_shows_everywhere_and_its_gap_stands_out(
        make_worker, engine_v1, second_engine, tiny_model, make_client, make_gateway, redis_url,
        tmp_path, policy):
    """Acceptance 2 of issue 41 with real workers: two vLLM workers follow the registry, one made
    to load wrong bytes (`VersionFollower.spoil`: its checked copy's layer 1 scaled by 1.01).
    v2, published with its canary, is refused by that worker alone: its figures show on
    /metrics, the dashboard (headless chromium), /workers and `rollq status` from its beat.
    v3, published without one, is served by both, the bad worker on its wrong bytes: the
    trainer's report of its own logprobs makes that worker stand out in the gap."""
    from test_gap_gateway import CHROMIUM, _dom, _metrics, _status_cli

    from models import token_logprobs

    if second_engine.version != 1:
        await second_engine.swap(1, str(tiny_model))
    schema = dir_schema(tiny_model)
    good, _ = make_worker("good", engine=engine_v1, base_schema=schema, max_inflight=4)
    bad, _ = make_worker("bad", engine=second_engine, base_schema=schema, max_inflight=4)
    await wait_until(lambda: bad.follower is not None, what="the bad worker following")

    def layer_1_scaled(version, snapshot):
        from safetensors.torch import load_file, save_file

        for path in snapshot.glob("*.safetensors"):
            tensors = load_file(path)
            save_file(scaled_layer(tensors), path, metadata={"format": "pt"})

    bad.follower.spoil = layer_1_scaled
    gw = await make_gateway(policies=[policy])
    trainer = make_client("alice", weight_store=str(tmp_path / "store"))
    base = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    models = {2: trainer_model(base.config, perturbed(weights, 2)),
              3: trainer_model(base.config, perturbed(weights, 3))}
    await trainer.publish_weights(2, models[2], canary=True)
    await wait_until(lambda: good.engine.version == 2 and 2 in bad.versions.cannot_load, timeout_s=60,
                     what="v2 accepted by the good worker, refused by the bad one")
    labels = lambda worker, version: (("policy", policy), ("version", str(version)), ("worker", worker))  # noqa: E731
    import aiohttp

    async with aiohttp.ClientSession(gw.url, headers=gw.headers("alice")) as http:
        async def metrics():
            async with http.get("/metrics") as r:
                m = _metrics(await r.text())
            return m if ("rollq_worker_canary_refused", labels("bad", 2)) in m else None

        m = await wait_until(metrics, timeout_s=15, what="the refusal on /metrics")
        assert m["rollq_worker_canary_refused", labels("bad", 2)] == 1
        assert m["rollq_worker_canary_refused", labels("good", 2)] == 0
        assert m["rollq_worker_canary_max_abs", labels("bad", 2)] > 10 * F32.max_abs
        async with http.get(f"/v1/policies/{policy}/workers") as r:
            workers = {w["worker_id"]: w for w in await r.json()}
        assert workers["bad"]["version"] == 1 and not workers["bad"]["canaries"][-1]["verdict"]["accepted"]
    if CHROMIUM:
        dom = await _dom(f"{gw.url}/?policy={policy}#token={gw.tokens['alice']}")
        assert '<tr class="refused" data-worker="bad">' in dom and "v2 REFUSED" in dom
    out = await _status_cli(redis_url, policy)
    assert "REFUSED" in out and "bad" in out, out

    # v3 without a canary: the bad worker serves its wrong bytes, and the gap tells.
    await trainer.publish_weights(3, models[3])
    await wait_until(lambda: good.engine.version == 3 and bad.engine.version == 3, timeout_s=60,
                     what="both on v3")
    results = []
    for _ in range(6):  # whichever worker claims first: rounds until both have served some
        await trainer.submit([[1, 7 + 13 * i, 3 + i] for i in range(16)], n=2,
                             sampling={"temperature": 1.0, "max_tokens": 16, "logprobs": 0},
                             min_version=3)
        results += await collect(trainer, 16, timeout_s=120)
        if {r.worker_id for r in results} == {"good", "bad"}:
            break
    assert {r.worker_id for r in results} == {"good", "bad"}
    mine = [token_logprobs(models[3], r.prompt_ids, s.token_ids) for r in results for s in r.samples]
    await trainer.report_logprobs(results, mine)
    from rollq.queue.gap import read

    view = await read(trainer.redis, trainer.keys)
    rows = {w.worker: w for w in view.workers if w.version == 3}
    print({w: (round(r.mean_abs, 6), r.outlier) for w, r in rows.items()})
    assert rows["bad"].outlier and not rows["good"].outlier
    assert rows["good"].mean_abs < 1e-4 < rows["bad"].mean_abs


async def test_a_refused_newest_version_leaves_the_one_before_it_served(follower, make_client, tmp_path,
                                                                       tiny_model):
    """v2 (exact) and v3 (wrong) are both registered when the worker first looks: it goes for
    v3, its canary refuses it, and the worker then loads v2, the newest it accepts, rather than
    serving v1 for ever while jobs that need v2 wait (seen failing without the fallback: v1
    served, the v2 job never ran)."""
    trainer = make_client(weight_store=str(tmp_path / "store"))
    base = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    v2 = trainer_model(base.config, perturbed(weights, 2))
    await trainer.publish_weights(2, v2, canary=True)
    from rollq.canary import reference

    await trainer.publish_weights(3, scaled_layer(dict(v2.state_dict())), canary=reference(v2))
    worker = follower()
    job = await trainer.submit(PROMPTS[:4], n=1, sampling=GREEDY, min_version=2)
    results = await collect(trainer, 4, timeout_s=90)
    assert 3 in worker.versions.cannot_load and worker.engine.version == 2
    reference_of = Reference({2: v2})
    for r in results:
        assert r.job_id == job and r.status == "ok", r.reason
        assert r.samples[0].versions == [(2, 0)]
        reference_of.check(r.prompt_ids, r.samples[0])


async def test_serving_none_after_a_refusal_until_a_version_passes(follower, make_client, tmp_path,
                                                                    tiny_model):
    """`--canary-refusal none`: after v2's refusal the worker serves no version (it claims
    nothing: a group any version could serve waits, none is served on v1), says so in its state,
    and serves again once v3 is accepted."""
    worker = follower(canary_refusal="none")
    trainer = make_client(weight_store=str(tmp_path / "store"))
    base = LlamaForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32).eval()
    weights = {k: v.clone() for k, v in base.state_dict().items()}
    v2 = trainer_model(base.config, perturbed(weights, 2))
    from rollq.canary import reference

    await trainer.publish_weights(2, scaled_layer(dict(v2.state_dict())), canary=reference(v2))
    await wait_until(lambda: worker.state == "suspended", timeout_s=60, what="v2 refused, none served")
    await trainer.submit(PROMPTS[:4], n=1, sampling=GREEDY)
    assert not await trainer.take(4, timeout_s=2.0)  # nothing served meanwhile
    v3 = trainer_model(base.config, perturbed(weights, 3))
    await trainer.publish_weights(3, v3, canary=True)
    results = await collect(trainer, 4, timeout_s=90)
    assert worker.state == "serving" and worker.engine.version == 3
    reference_of = Reference({3: v3})
    for r in results:
        assert r.status == "ok" and r.samples[0].versions == [(3, 0)]
        reference_of.check(r.prompt_ids, r.samples[0])
