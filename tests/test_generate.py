"""`POST /inference/v1/generate` on the instant engine (named as such: these tests are about the
gateway's side, the default `max_tokens` and the version window; tests/test_generate_vllm.py
compares the answers with vLLM's own server)."""

from __future__ import annotations

import aiohttp
import pytest

from rollq.engine.instant import InstantEngine, expected_tokens
from rollq.protocol import pack_tokens

PROMPT = [1, 5, 6, 7]


async def _generate(gw, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http, \
            http.post("/inference/v1/generate", json=body) as r:
        return r.status, await r.json()


@pytest.mark.parametrize("reported", [64, None])
async def test_absent_max_tokens_is_what_the_context_leaves(make_gateway, make_worker, policy, reported):
    engine = InstantEngine(vocab_size=512)
    engine.max_model_len = reported  # what a vLLM worker reports in its heartbeat
    make_worker(engine=engine)
    gw = await make_gateway()
    await gw.live(policy)
    status, body = await _generate(gw, dict(token_ids=PROMPT, sampling_params={}))
    if reported is None:  # no context length known: refused rather than guessed
        assert status == 400 and body["error"]["field"] == "sampling_params.max_tokens", body
        return
    assert status == 200, body
    [choice] = body["choices"]
    assert choice["token_ids"] == expected_tokens(pack_tokens(PROMPT), 0, 64 - len(PROMPT), 512)
    assert body["usage"] == dict(prompt_tokens=4, total_tokens=64, completion_tokens=60,
                                 prompt_tokens_details=None, completion_tokens_details=None)


async def test_version_window_and_versions(make_gateway, make_worker, policy):
    make_worker(engine=InstantEngine(vocab_size=512, version=3))
    gw = await make_gateway()
    status, body = await _generate(gw, dict(token_ids=PROMPT, sampling_params=dict(max_tokens=5, n=2),
                                            exact_version=3, request_id="abc"))
    assert status == 200, body
    assert body["request_id"] == "generate-tokens-abc" and body["model"] == policy
    for choice in body["choices"]:
        assert choice["weight_versions"] == [dict(version="3", start=0, end=5)]
        assert choice["policy_versions"] == [[3, 0]]
    # A window no version can meet fails fast, naming why.
    status, body = await _generate(gw, dict(token_ids=PROMPT, sampling_params=dict(max_tokens=5),
                                            min_version=1, max_version=0))
    assert status == 400 and "max_version" in body["error"]["message"], body
