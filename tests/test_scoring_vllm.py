"""A scored job through a real vLLM engine (the session's) and a real `rollq scorer` process:
the rewards equal the function's on the engine's samples. The session's tiny model has no
tokenizer: the scored job's `text_if_tokenizer` gives rewards the token ids alone, and no
failure."""

from __future__ import annotations

import uuid

import scoring_rewards
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
