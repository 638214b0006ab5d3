"""`POST /inference/v1/generate` (vLLM's token-in token-out route) through the gateway, the
queue and a real vLLM (CPU) worker, against vLLM's own server started with `--enable-scale-out`
on the same tiny model (no tokenizer: `--skip-tokenizer-init`, as the session's engine): the
whole JSON equal (ids and timestamps aside); what vLLM refuses up front, rollq refuses up front.

The worker is the session's engine (conftest `vllm_engine`); one vLLM server serves the module.
"""

from __future__ import annotations

import aiohttp
import pytest
from conftest import ENGINE_MAX_MODEL_LEN
from test_chat_vllm import assert_same
from vllm_servers import VLLMServer

ROUTE = "/inference/v1/generate"
PROMPT = [1, 5, 6, 7]


@pytest.fixture(scope="module")
def vllm_server(tiny_model, tmp_path_factory):
    server = VLLMServer(tiny_model, tmp_path_factory.mktemp("vllm-generate") / "server.log",
                        "--enable-scale-out", "--skip-tokenizer-init", max_model_len=ENGINE_MAX_MODEL_LEN)
    yield server
    server.close()


@pytest.fixture
async def gateway(make_gateway, make_vllm_worker, policy):
    make_vllm_worker()
    gw = await make_gateway()
    await gw.live(policy)  # the default max_tokens comes from the workers' max_model_len
    return gw


async def _post(http, url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with http.post(f"{url}{ROUTE}", json=body, headers=headers) as r:
        return r.status, await r.json()


def _same(ours: dict, theirs: dict) -> None:
    """assert_same, with the two sides' names for a weight version aside: rollq names the policy
    version that sampled each span, vLLM its engine's label ("default" when nobody set one)."""
    assert ours.pop("request_id").startswith("generate-tokens-")
    assert theirs.pop("request_id").startswith("generate-tokens-")
    for mine, their in zip(ours["choices"], theirs["choices"]):
        assert [s["version"] for s in mine["weight_versions"]] == ["0"]
        assert mine["policy_versions"] == [[0, 0]]
        for span in their["weight_versions"]:
            span["version"] = "0"
    assert_same(ours, theirs)


CASES = {
    "greedy": dict(sampling_params=dict(max_tokens=8, temperature=0), return_token_ids=True),
    "greedy-logprobs": dict(sampling_params=dict(max_tokens=6, temperature=0, logprobs=3)),
    "seeded-n3-logprobs": dict(sampling_params=dict(max_tokens=6, n=3, seed=7, logprobs=2)),
    # No min_tokens, top_k, logit_bias or temperature but 0 and 1 with logprobs: rollq's workers
    # return the logprobs sampled from (vLLM's processed ones), vLLM's server the raw ones.
    "seeded-n2-logprobs0": dict(sampling_params=dict(max_tokens=5, n=2, seed=11, logprobs=0)),
    # No max_tokens: what the context leaves (252 here); the seeded sample ends by EOS or there.
    "default-max-tokens": dict(sampling_params=dict(seed=3, top_k=50)),
    "prompt-logprobs": dict(sampling_params=dict(max_tokens=3, temperature=0, prompt_logprobs=2),
                            return_token_ids=True),
    "logit-bias": dict(sampling_params=dict(max_tokens=4, seed=5, logit_bias={"300": 100})),
    "ignore-eos": dict(sampling_params=dict(max_tokens=4, temperature=0, ignore_eos=True, min_tokens=2,
                                                  detokenize=False)),
}


async def test_generate_equals_vllms_own_server(vllm_server, gateway, policy):  # server starts first
    theirs_url = await vllm_server.ready()
    seen = {}
    async with aiohttp.ClientSession() as http:
        plain = (await _post(http, theirs_url, dict(token_ids=PROMPT, **CASES["greedy"])))[1]
        stop_at = plain["choices"][0]["token_ids"][2]
        cases = CASES | {"stop-token": dict(sampling_params=dict(max_tokens=8, temperature=0,
                                                                 stop_token_ids=[stop_at]))}
        for name, case in cases.items():
            status, theirs = await _post(http, theirs_url, dict(token_ids=PROMPT, model="tiny", **case))
            assert status == 200, (name, theirs)
            status, ours = await _post(http, gateway.url, dict(token_ids=PROMPT, model=policy, **case),
                                       gateway.headers())
            assert status == 200, (name, ours)
            try:
                _same(ours, theirs)
            except AssertionError as e:
                raise AssertionError(f"case {name}: {e}\nvLLM: {theirs}\nrollq: {ours}"[:6000]) from None
            seen[name] = ours
    # What the cases compared, not merely equal on both sides:
    assert seen["greedy"]["prompt_token_ids"] == PROMPT
    assert len(seen["greedy"]["choices"][0]["token_ids"]) == 8
    three = seen["seeded-n3-logprobs"]["choices"]
    assert len({tuple(c["token_ids"]) for c in three}) == 3
    assert any(p["rank"] > 2 for c in three for p in c["logprobs"]["content"])  # ranks outside the top N
    assert seen["stop-token"]["choices"][0]["stop_reason"] == stop_at
    assert seen["logit-bias"]["choices"][0]["token_ids"] == [300] * 4
    assert seen["default-max-tokens"]["usage"]["completion_tokens"] > 16  # not SamplingParams' 16
    scored = seen["prompt-logprobs"]["prompt_logprobs"]
    assert scored[0] is None and len(scored) == 4 and all(str(t) in p for t, p in zip(PROMPT[1:], scored[1:]))


REFUSED = {  # vLLM's server answers these 400 up front; so does rollq, naming the field
    "no-sampling-params": (dict(token_ids=PROMPT), "sampling_params"),
    "empty-prompt": (dict(token_ids=[], sampling_params={}), "token_ids"),
    "negative-id": (dict(token_ids=[1, -5], sampling_params={}), "token_ids[1]"),
    "temperature": (dict(token_ids=PROMPT, sampling_params=dict(temperature=-1)),
                    "sampling_params.temperature"),
    "max-tokens": (dict(token_ids=PROMPT, sampling_params=dict(max_tokens=0)), "sampling_params.max_tokens"),
    "n": (dict(token_ids=PROMPT, sampling_params=dict(n=0)), "sampling_params.n"),
    "greedy-n2": (dict(token_ids=PROMPT, sampling_params=dict(n=2, temperature=0)), "sampling_params.n"),
    "logprobs": (dict(token_ids=PROMPT, sampling_params=dict(logprobs=30)), "sampling_params.logprobs"),
    "text-no-detokenize": (dict(token_ids=PROMPT, sampling_params=dict(detokenize=False),
                                output_mode="text"), "output_mode"),
    # A model without a tokenizer: vLLM refuses text up front, rollq's worker fails the group.
    "text-mode": (dict(token_ids=PROMPT, sampling_params={}, output_mode="text"), None),
}
ROLLQ_REFUSES = {  # what vLLM's route takes that rollq cannot honour: a 400 naming the field, why
    "stream": (dict(stream=True), "stream"),
    "unknown": (dict(sampling_params=dict(max_tokens=2, bad_words=["x"])), "sampling_params"),
    "cache-salt": (dict(cache_salt="s" * 43), "cache_salt"),
    "features": (dict(content_parts=[{"type": "image_url", "url": "data:,"}]), "content_parts"),
}


async def test_what_vllm_refuses_rollq_refuses(vllm_server, gateway, policy):
    theirs_url = await vllm_server.ready()
    async with aiohttp.ClientSession() as http:
        for name, (body, field) in REFUSED.items():
            status, theirs = await _post(http, theirs_url, body | dict(model="tiny"))
            assert status == 400, (name, theirs)
            status, ours = await _post(http, gateway.url, body | dict(model=policy), gateway.headers())
            assert status == 400 and ours["error"]["field"] == field, (name, ours)
            assert field or "no tokenizer" in ours["error"]["message"], (name, ours)
        for name, (case, field) in ROLLQ_REFUSES.items():
            body = dict(token_ids=PROMPT, model=policy, sampling_params=dict(max_tokens=2)) | case
            status, ours = await _post(http, gateway.url, body, gateway.headers())
            assert status == 400 and ours["error"]["field"] == field, (name, ours)
            message = ours["error"]["message"]
            assert "not supported" in message or "unknown field `bad_words`" in message, (name, message)
        # An id outside the model's vocabulary killed the engine core of vLLM's own server (its
        # route does not check, 0.32); rollq's worker fails the group and goes on serving.
        body = dict(token_ids=[1, 600], sampling_params=dict(max_tokens=2))
        status, ours = await _post(http, gateway.url, body, gateway.headers())
        assert status == 400 and "outside the model's vocabulary of 512" in ours["error"]["message"], ours
        body = dict(token_ids=PROMPT, sampling_params=dict(max_tokens=2))
        status, ours = await _post(http, gateway.url, body, gateway.headers())
        assert status == 200 and len(ours["choices"][0]["token_ids"]) == 2
