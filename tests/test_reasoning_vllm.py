"""`--reasoning-parser` through the gateway, the queue and a real vLLM (CPU) worker, against
vLLM's own server started with the same flag on the same tiny model: the whole chat JSON equal
(ids and timestamps aside), `message.reasoning` and `usage.completion_tokens_details` included.

The model is scripted (tests/models.py `make_reasoning_model`): after a user turn it thinks in
<think> ... </think> and then answers, so deepseek_r1's parser has something to split.
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from models import make_reasoning_model
from streams import join, sse
from test_chat_vllm import VLLMServer, assert_same

PARSER = "deepseek_r1"
USER = {"role": "user", "content": "What is 2+2?"}
BASE = dict(messages=[USER], max_tokens=20, temperature=0, return_token_ids=True)
CASES = {
    "thinks-then-answers": {},
    "cut-while-thinking": dict(max_tokens=3),
    "no-markers": dict(chat_template_kwargs={"ramble": True}),
    "seeded-n2-logprobs": dict(n=2, temperature=1.0, seed=3, logprobs=True, top_logprobs=2),
}


@pytest.fixture(scope="module")
def reasoning_model(tmp_path_factory) -> Path:
    return make_reasoning_model(tmp_path_factory.mktemp("reasoning-model") / "m")


@pytest.fixture(scope="module")
def vllm_server(reasoning_model, tmp_path_factory):
    server = VLLMServer(reasoning_model, tmp_path_factory.mktemp("vllm-reasoning") / "server.log",
                        "--reasoning-parser", PARSER)
    yield server
    server.close()


@pytest.fixture(scope="module")
async def reasoning_engine(reasoning_model, vllm_server):
    """The rollq side's engine, started while vLLM's server starts (it depends on it for that)."""
    from conftest import engine_flags

    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    settings = VLLMSettings(**engine_flags(reasoning_model), reasoning_parser=PARSER).validate()
    engine = await VLLMEngine.start(settings)
    yield engine
    await engine.close()


async def _post(http, url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, await r.json()


async def test_reasoning_equals_vllms_own_server(make_gateway, make_worker, reasoning_engine, vllm_server,
                                                 policy):
    make_worker(engine=reasoning_engine, max_inflight=8, max_inflight_seqs=32)
    gw = await make_gateway()
    theirs_url = await vllm_server.ready()
    seen = {}
    async with aiohttp.ClientSession() as http:
        for name, case in CASES.items():
            status, theirs = await _post(http, theirs_url, BASE | case | {"model": "tiny"})
            assert status == 200, (name, theirs)
            status, ours = await _post(http, gw.url, BASE | case | {"model": policy}, gw.headers())
            assert status == 200, (name, ours)
            try:
                assert_same(ours, theirs)
            except AssertionError as e:
                raise AssertionError(f"case {name}: {e}\nvLLM: {theirs}\nrollq: {ours}"[:6000]) from None
            seen[name] = ours
        # Streamed: each choice's joined deltas are the unstreamed answer, and the closing usage
        # chunk (reasoning_tokens included) is vLLM's. (vLLM's own streamed reasoning depends on
        # how its engine batches tokens into deltas: one holding <think> and the next token keeps
        # the marker in `reasoning`. So the stream is compared with the whole answer.)
        usages = []
        for url, model, headers in ((theirs_url, "tiny", None), (gw.url, policy, gw.headers())):
            body = BASE | CASES["seeded-n2-logprobs"] | dict(model=model, stream=True,
                                                          stream_options={"include_usage": True})
            chunks = await sse(http, f"{url}/v1/chat/completions", body, headers)
            assert chunks[-1] == "[DONE]" and not chunks[-2]["choices"], chunks
            usages.append(chunks[-2]["usage"])
        assert_same(usages[1], usages[0])
        whole = seen["seeded-n2-logprobs"]["choices"]
        for i, joined in join(chunks[:-1]).items():
            assert (joined["reasoning"], joined["content"], joined["token_ids"]) == (
                whole[i]["message"]["reasoning"], whole[i]["message"]["content"], whole[i]["token_ids"])
        assert usages[1]["completion_tokens_details"]["reasoning_tokens"] > 0
    # What the cases compared, not merely equal on both sides:
    message = seen["thinks-then-answers"]["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == ("Two and two make four.", "The answer is 4.")
    assert seen["thinks-then-answers"]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 3}
    cut = seen["cut-while-thinking"]["choices"][0]["message"]
    assert cut["reasoning"] == "Two and two make" and cut["content"] is None
