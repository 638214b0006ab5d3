"""A scored job through a real vLLM engine (the session's) and a real `rollq scorer` process:
the rewards equal the function's on the engine's samples. The session's tiny model has no
tokenizer: the scored job's `text_if_tokenizer` gives rewards the token ids alone, and no
failure."""

from __future__ import annotations

import uuid

import scoring_rewards
from conftest import engine_flags
from helpers import collect, wait_until
from scoring_fixtures import ScorerProcess

from rollq.scoring import Completion
from rollq.scoring.records import live_scorers


async def test_a_vllm_generated_group_is_scored(make_client, make_vllm_worker, redis_url,
                                                            policy, tmp_path):
    client = make_client()
    make_vllm_worker()
    scorer = ScorerProcess(redis_url, policy, tmp_path, f"s-{uuid.uuid4().hex[:6]}")
    try:
        await wait_until(lambda: live_scorers(client.redis, client.keys), timeout_s=60,
                         what=f"the scorer's beat\n{scorer.report()}")
        job = await client.submit([[1, 2, 3], [4, 5]], n=3, reward="count", reward_inputs=[1, 2],
                                  sampling={"max_tokens": 8, "temperature": 1.0, "seed": 1})
        results = sorted(await collect(client, 2, timeout_s=120), key=lambda r: r.group_index)
    finally:
        scorer.close()
    for r in results:
        assert r.status == "ok", r.reason
        assert (r.job_id, r.status, r.reward, r.scorer_id) == (job, "ok", "count", scorer.scorer_id)
        assert all(s.token_ids for s in r.samples) and len({s.tokens for s in r.samples}) > 1
        assert r.rewards == [scoring_rewards.count(Completion(s.text, s.token_ids, s.finish_reason, i),
                                                     r.group_index + 1)
                             for i, s in enumerate(r.samples)]



def _generated_tokens() -> float:
    """vLLM's own count of the tokens its engine generated (its Prometheus counter, in this
    process: the last engine started here registered it)."""
    from prometheus_client import REGISTRY

    return sum(s.value for metric in REGISTRY.collect() if metric.name == "vllm:generation_tokens"
               for s in metric.samples if s.name == "vllm:generation_tokens_total")


async def _core_idle(engine) -> bool:
    """The engine core's own word (not the front end's): it has no request left to step."""
    return not await engine.llm.engine_core.call_utility_async("has_work")


async def test_over_sampling_aborts_the_groups_still_generating_in_the_engine(
        make_client, make_worker, tiny_model, redis_url, policy, tmp_path):
    """deliver=2 of 4 groups: the 2 short ones are scored and picked while the 2 long ones are
    still generating; the pick that fills the job cancels it, and the worker aborts their vLLM
    requests: they end `cancelled` by the worker, the engine core holds no request afterwards,
    and it generated fewer tokens for them than they asked for."""
    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    # Its own engine, with the model's whole context (1024): the long groups' 16 x 1000 tokens
    # take several times longer than the short groups' way through generation, scoring and the
    # pick, even on a loaded machine (the session engine's 256 left too small a margin).
    context, n, long_prompt = 1024, 8, 1000
    max_tokens = context - 24
    engine = await VLLMEngine.start(VLLMSettings(**engine_flags(tiny_model) | {"max_model_len": context}
                                                 ).validate())
    scorer = ScorerProcess(redis_url, policy, tmp_path, f"s-{uuid.uuid4().hex[:6]}")
    # A cancelled job is seen within lease/3.
    worker, task = make_worker(engine=engine, max_inflight=32, max_inflight_seqs=32, lease_s=1.5)
    try:
        client = make_client()
        await wait_until(lambda: live_scorers(client.redis, client.keys), timeout_s=60,
                         what=f"the scorer's beat\n{scorer.report()}")
        before = _generated_tokens()
        # One sampling for every group: the context stops the two 1000-token prompts after 24
        # tokens; the two 3-token ones would run all 1000 (no EOS).
        prompts = [[3 + i] * long_prompt for i in range(2)] + [[1, 2, 3 + i] for i in range(2)]
        # (No seed: on vLLM's CPU build a seeded request whose prefill is split over steps
        # kills the engine core: "CPU Generator does not use offset".)
        job = await client.submit(prompts, n=n, reward="acount", reward_inputs=[0, 1, 2, 3], deliver=2,
                                  sampling={"max_tokens": max_tokens, "temperature": 1.0,
                                            "extra": {"ignore_eos": True}})
        results = {r.group_index: r for r in await collect(client, 4, timeout_s=300)}
        # Aborted in the engine, not left running: its core holds no request (it would hold the
        # 16 long samples for their remaining tokens), ...
        assert engine.llm.get_num_unfinished_requests() == 0
        await wait_until(lambda: _core_idle(engine), timeout_s=10, what="the engine core to hold no request")
        generated = _generated_tokens() - before
    finally:
        scorer.close()
        worker.stop()
        await task
        await engine.close()
    # The two short groups delivered, scored; the two long ones cancelled by the worker while
    # they ran (its reason and id; the scorer's "over-sampled" ends groups already generated).
    assert sorted(results) == [0, 1, 2, 3]
    for g in (0, 1):
        r = results[g]
        assert (r.status, r.reward, r.scorer_id) == ("ok", "acount", scorer.scorer_id), r.reason
        assert [len(s.token_ids) for s in r.samples] == [context - long_prompt] * n
    for g in (2, 3):
        r = results[g]
        assert (r.status, r.reason, r.samples) == ("cancelled", "job cancelled", []), r
        assert r.worker_id and not r.scorer_id
    status = await client.status(job)
    assert (status.state, status.ok, status.cancelled, status.done) == ("done", 2, 2, 4)
    # ... and what it generated for the long groups stops short of their 2 x 8 x 1000 tokens
    # (30-41 % in runs here: the pick and the worker's next renewal take seconds under load).
    cut = generated - 2 * n * (context - long_prompt)
    print(f"long groups: {cut:.0f} of {2 * n * max_tokens} tokens generated before the abort")
    assert 0 < cut < 0.9 * 2 * n * max_tokens, cut
