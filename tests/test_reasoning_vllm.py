"""`--reasoning-parser` through the gateway, the queue and a real vLLM (CPU) worker, against
vLLM's own server started with the same flag on the same tiny model: the whole chat JSON equal
(ids and timestamps aside), `message.reasoning` and `usage.completion_tokens_details` included.

The model is scripted (tests/models.py `make_reasoning_model`): after a user turn it thinks in
<think> ... </think> and then answers, so deepseek_r1's parser has something to split. The
server also serves vLLM's generate route (`--enable-scale-out`): its text mode needs a model with
a tokenizer, which this one has, so it is compared here (token mode: tests/test_generate_vllm.py).
"""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from models import make_reasoning_model
from streams import join, sse
from test_chat_vllm import assert_same
from vllm_servers import VLLMServer

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
                        "--reasoning-parser", PARSER, "--enable-scale-out")
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


GENERATE_CASES = {
    "greedy": dict(sampling_params=dict(max_tokens=10, temperature=0)),
    "logprobs-0": dict(sampling_params=dict(max_tokens=4, temperature=0, logprobs=0), return_token_ids=True),
    "seeded-n2-logprobs-2": dict(sampling_params=dict(max_tokens=6, n=2, seed=5, logprobs=2)),
    "stop-string": dict(sampling_params=dict(max_tokens=10, temperature=0, stop=[" four"])),
}


async def test_generate_text_mode_equals_vllms_own_server(make_gateway, make_worker, reasoning_engine,
                                                          vllm_server, policy):
    """`output_mode: "text"`: vLLM's text and its content-format logprobs (token strings, bytes,
    max(N, 1) top entries), decoded on the worker."""
    make_worker(engine=reasoning_engine, max_inflight=8, max_inflight_seqs=32)
    gw = await make_gateway()
    theirs_url = await vllm_server.ready()
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{theirs_url}/tokenize", json=dict(model="tiny", messages=[USER])) as r:
            prompt = (await r.json())["tokens"]
        for name, case in GENERATE_CASES.items():
            body = dict(token_ids=prompt, output_mode="text") | case
            async with http.post(f"{theirs_url}/inference/v1/generate", json=body | {"model": "tiny"}) as r:
                assert r.status == 200, (name, await r.text())
                theirs = await r.json()
            async with http.post(f"{gw.url}/inference/v1/generate", json=body | {"model": policy},
                                 headers=gw.headers()) as r:
                assert r.status == 200, (name, await r.text())
                ours = await r.json()
            assert ours.pop("request_id") != theirs.pop("request_id")
            for choice in theirs["choices"]:  # the engine's label; rollq names the policy version
                choice["weight_versions"] = [dict(span, version="0") for span in choice["weight_versions"]]
            try:
                assert_same(ours, theirs)
            except AssertionError as e:
                raise AssertionError(f"case {name}: {e}\nvLLM: {theirs}\nrollq: {ours}"[:6000]) from None
            if name == "greedy":  # what the case compared: vLLM's decoding, the thinking included
                assert ours["output_mode"] == "text"
                assert ours["choices"][0]["text"].startswith("<think>Two and")
