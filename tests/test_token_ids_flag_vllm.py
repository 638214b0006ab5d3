"""The gateway's `--return-tokens-as-token-ids` against vLLM's server (`vllm_servers.chat_server`,
the chat-model group's, no new server): on chat and completions, streamed or not, rollq with the
flag answers as vLLM with the request field `return_tokens_as_token_ids: true`, which vLLM 0.32
documents as the same thing (`CompletionRequest`: "None falls back to the server-level
--return-tokens-as-token-ids default"; both routes' `should_return_as_token_id`); a request's
`false` wins over the flag there as here. On `/inference/v1/generate` (no vLLM reference in this
group: its server runs without `--enable-scale-out`) the flag's answer is the flagless one with
every token named `token_id:N`.
"""

from __future__ import annotations

import aiohttp
import pytest
from streams import join, sse
import test_chat_vllm as chat
from test_chat_vllm import BASE, COMPLETION_BASE, assert_same

chat_worker = chat.chat_worker  # test_chat_vllm's worker on the session's chat engine

pytestmark = pytest.mark.timeout(900)  # the first test of the group's process starts the server

AS_IDS = {"return_tokens_as_token_ids": True}
CHAT_CASES = {
    "top3": dict(logprobs=True, top_logprobs=3),
    "n2-seeded": dict(n=2, temperature=1.0, seed=11, max_tokens=8, logprobs=True, top_logprobs=2),
}
COMPLETION_CASES = {
    "logprobs-2": dict(logprobs=2),
    "echo-logprobs": dict(echo=True, logprobs=1, max_tokens=6),  # the echoed prompt's tokens too
}
ROUTES = {"/v1/chat/completions": (BASE, CHAT_CASES), "/v1/completions": (COMPLETION_BASE, COMPLETION_CASES)}


async def _post(http: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None) -> dict:
    async with http.post(url, json=body, headers=headers) as r:
        data = await r.json()
        assert r.status == 200, data
        return data


def _tokens(body: dict) -> list[str]:
    """Every token string of a chat or completion reply's logprobs."""
    names = []
    for choice in body["choices"]:
        logprobs = choice["logprobs"]
        if "content" in logprobs:
            names += [e["token"] for e in logprobs["content"]]
            names += [t["token"] for e in logprobs["content"] for t in e["top_logprobs"]]
        else:
            names += logprobs["tokens"] + [t for top in logprobs["top_logprobs"] if top for t in top]
    return names


async def test_the_flag_answers_as_vllms_server_on_chat_and_completions(make_gateway, chat_worker,
                                                                       chat_server, policy):
    gw = await make_gateway(return_tokens_as_token_ids=True)
    theirs_url = await chat_server.ready()
    async with aiohttp.ClientSession() as http:
        for path, (base, cases) in ROUTES.items():
            for name, case in cases.items():
                theirs = await _post(http, theirs_url + path, base | case | AS_IDS | {"model": "tiny"})
                ours = await _post(http, gw.url + path, base | case | {"model": policy}, gw.headers())
                # The request's false wins over the flag, as on vLLM's server.
                vllm_words = await _post(http, theirs_url + path, base | case | {"model": "tiny"})
                words = await _post(http, gw.url + path, base | case | {"model": policy,
                                                                         "return_tokens_as_token_ids": False},
                                    gw.headers())
                streamed = base | case | {"stream": True}
                theirs_streamed = await sse(http, theirs_url + path, streamed | AS_IDS | {"model": "tiny"})
                ours_streamed = await sse(http, gw.url + path, streamed | {"model": policy}, gw.headers())
                try:
                    assert_same(ours, theirs)
                    assert_same(words, vllm_words)
                    assert_same(join(ours_streamed[:-1]), join(theirs_streamed[:-1]))
                except AssertionError as e:
                    raise AssertionError(f"{path}, case {name}: {e}\nvLLM: {theirs}\nrollq: {ours}"[:6000]) \
                        from None
                named = _tokens(ours)
                assert named and all(t.startswith("token_id:") for t in named)
                assert not any(t.startswith("token_id:") for t in _tokens(words))


async def test_the_flag_names_the_generate_routes_tokens_by_id(make_gateway, chat_worker, policy):
    """Token mode: vLLM's integer `token_id` entries, each with `token: "token_id:N"` beside
    (what verifiers' `renderers` client reads; tests/test_renderers_client_vllm.py drives it);
    text mode: vLLM 0.32's placeholders without bytes (`_logprobs_tokenizer` is None under the
    flag). Logprobs, ranks and ids as without the flag."""
    flagged, plain = await make_gateway(return_tokens_as_token_ids=True), await make_gateway()
    body = dict(token_ids=COMPLETION_BASE["prompt"],
                sampling_params=dict(max_tokens=6, temperature=0, logprobs=2))
    async with aiohttp.ClientSession() as http:
        for mode in ("tokens", "text"):
            request = body | {"output_mode": mode}
            ours = await _post(http, f"{flagged.url}/inference/v1/generate", request, flagged.headers())
            without = await _post(http, f"{plain.url}/inference/v1/generate", request, plain.headers())
            [choice], [before] = ours["choices"], without["choices"]
            assert choice["token_ids"] == before["token_ids"] and len(choice["token_ids"]) == 6
            content, expected = choice["logprobs"]["content"], before["logprobs"]["content"]
            assert [e["logprob"] for e in content] == [e["logprob"] for e in expected]
            for entry, was in zip(content, expected):
                if mode == "tokens":
                    tops = [dict(t, token=f"token_id:{t['token_id']}") for t in was["top_logprobs"]]
                    assert entry == dict(was, token=f"token_id:{was['token_id']}", top_logprobs=tops)
                else:
                    assert entry["bytes"] is None and was["bytes"] == list(was["token"].encode())
                    assert entry["token"].startswith("token_id:") and not was["token"].startswith("token_id:")
                    assert all(t["token"].startswith("token_id:") and t["bytes"] is None
                               for t in entry["top_logprobs"])
                    assert [t["logprob"] for t in entry["top_logprobs"]] == \
                        [t["logprob"] for t in was["top_logprobs"]]
            if mode == "text":
                ids = choice["token_ids"]
                assert [e["token"] for e in content] == [f"token_id:{t}" for t in ids]
                assert choice["text"] == before["text"] != ""
