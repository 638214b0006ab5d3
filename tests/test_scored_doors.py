"""Scored rollouts for every trainer (issue 43): one with a Redis ACL user from `rollq acl`, one
over HTTP (`POST .../jobs` with the reward fields) and TRL's client (`/v1/completions`) each get
their samples back scored by a real `rollq scorer`, with the rewards its function gives; bad
reward fields over HTTP are a 400 naming the field."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
import scoring_fixtures
import scoring_rewards
from helpers import wait_until

from rollq.client import RolloutClient
from rollq.scoring import Completion
from rollq.scoring.records import live_scorers
from rollq.security import trainer_acl

pytest.importorskip("trl")
from rollq.integrations.trl import RollqVLLMClient, rollq_rewards  # noqa: E402

spawn_scorer = scoring_fixtures.spawn_scorer


async def test_acl_http_and_trl_trainers_get_scored_samples_with_their_rewards(
        redis, redis_url, policy, make_worker, make_gateway, spawn_scorer):
    user = f"carol-{policy}"
    await redis.execute_command("ACL", "SETUSER", user, *trainer_acl(policy, "carol", "carol-pw")[1:])
    carol = RolloutClient(redis_url.replace("redis://", f"redis://{user}:carol-pw@"), policy=policy,
                          trainer_id="carol")
    gw = await make_gateway()
    make_worker()
    scorer = spawn_scorer()
    try:
        await redis.acl_log_reset()
        await wait_until(lambda: _offered(redis, carol), timeout_s=60, what="the scorer's beat")
        job = await carol.submit([[1, 2], [3]], n=2, sampling={"max_tokens": 3}, reward="count",
                                 reward_inputs=[5, 6])
        got = sorted(await carol.take(2, timeout_s=60), key=lambda r: r.group_index)
        assert [(r.job_id, r.status, r.reward) for r in got] == [(job, "ok", "count")] * 2
        for r, inputs in zip(got, (5, 6)):
            assert r.rewards == [_count(s.token_ids, inputs) for s in r.samples]
            assert r.scorer_id == scorer.scorer_id
        assert not [e for e in await redis.acl_log() if e["username"] == user]  # nothing refused

        async with aiohttp.ClientSession(gw.url, headers=gw.headers("bob")) as http:
            jobs = f"/v1/policies/{policy}/jobs"
            for bad, field in (({"reward": "count", "reward_inputs": [1]}, "reward_inputs"),
                               ({"reward": "count", "reward_errors": "ignore"}, "reward_errors"),
                               ({"reward": "a b"}, "reward"), ({"deliver": 1}, "deliver"),
                               ({"reward": "count", "dynamic_sampling": 2, "n": 1}, "dynamic_sampling")):
                body = {"prompts": [[1], [2]], "n": 2} | bad
                async with http.post(jobs, json=body) as r:
                    error = (await r.json())["error"]
                    assert (r.status, error["field"]) == (400, field), error
            # A chat takes them too (one conversation: one entry of reward_inputs).
            chat = {"model": policy, "messages": [{"role": "user", "content": "w1"}], "reward": "count"}
            for bad, field in (({"reward_inputs": [1, 2]}, "reward_inputs"),
                               ({"reward_errors": "ignore"}, "reward_errors")):
                async with http.post("/v1/chat/completions", json=chat | bad) as r:
                    error = (await r.json())["error"]
                    assert (r.status, error["field"]) == (400, field), error
            body = {"prompts": [[7, 8], [9]], "n": 2, "sampling": {"max_tokens": 3}, "job_id": "scored",
                    "reward": "acount", "reward_inputs": [10, 20], "reward_errors": "fail"}
            async with http.post(jobs, json=body) as r:
                assert r.status == 201, await r.text()
            views: dict[str, dict] = {}
            while len(views) < 2:  # (unacknowledged: a read returns what it returned before too)
                async with http.get(f"/v1/policies/{policy}/results", params={"wait_ms": 10_000}) as r:
                    views |= {v["id"]: v for v in (await r.json())["results"]}
        for view in views.values():
            tokens = [s["token_ids"] for s in view["samples"]]
            inputs = 10 * (view["group_index"] + 1)
            assert (view["job_id"], view["status"], view["reward"], view["reward_version"]) == \
                ("scored", "ok", "acount", "3")
            assert view["rewards"] == [_count(t, inputs) for t in tokens]
            assert not any(view["reward_errors"])

        # TRL's client (its generation_kwargs go into the /v1/completions body) asks for the
        # reward; rollq_rewards gives TRL what the scorer gave each completion.
        trl = await asyncio.to_thread(RollqVLLMClient, base_url=gw.url, publisher=None,
                                      api_key=gw.tokens["bob"], connection_timeout=10)
        try:
            out = await asyncio.to_thread(trl.generate, [[4, 5], [6]], n=2, max_tokens=3,
                                          generation_kwargs={"reward": "count", "reward_inputs": [7, 8]})
        finally:
            trl.session.close()
        ids = out["completion_ids"]
        rewards = rollq_rewards(lambda: trl)(completion_ids=ids[::-1])
        assert rewards[::-1] == [_count(t, 7 + i // 2) for i, t in enumerate(ids)]
    finally:
        await carol.close()
        await redis.execute_command("ACL", "DELUSER", user)


def _count(tokens: list[int], inputs) -> float:
    """What tests/scoring_rewards.py's `count` (and `acount`) gives a completion of `tokens`."""
    return scoring_rewards.count(Completion("", tokens, "length", 0), inputs)


async def _offered(redis, client) -> bool:
    return any("count" in s.rewards for s in await live_scorers(redis, client.keys))
