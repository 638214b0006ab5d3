"""Issue 28: caller input the gateway renders, tokenizes or walks (gateway/render.py) is capped
first, rendered in helper processes within a time and a memory bound, and a caller's chat
template runs nowhere unless the operator trusts request templates. Each refusal is a 400 naming
the field and the limit. The review scripts each test stands for: ../shared/review-turn3/."""

from __future__ import annotations

import io
import json

import aiohttp
import pytest

from rollq.gateway.render import MAX_DEPTH, RENDER_MEMORY_BYTES, RENDER_TIMEOUT_S
from rollq.protocol import MAX_PROMPT_CHARS

USER = [{"role": "user", "content": "w10"}]
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}w10"
"""ep_template.sh's bomb (12,000 x 12,000 there: 9.4 s of /health on the gateway's loop), made
10^10 iterations so that no machine renders it within the time bound (144 M took < 5 s on an
idle core: the test then saw a 201)."""
BIG = "{% set s = 'x' * 2000000000 %}{{ s|length }}"
"""ep_template_mem.sh's: a 160-byte request, a 2 GB string (0.5 -> 2.5 GB of gateway RSS)."""


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from models import make_chat_model
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_chat_model(tmp_path_factory.mktemp("chat")))


async def _error(response: aiohttp.ClientResponse) -> tuple[int, str, str]:
    body = await response.json()
    error = body.get("error") or {}
    return response.status, error.get("field"), error.get("message", str(body))


def post_big(http: aiohttp.ClientSession, path: str, body: dict):
    """A body of megabytes, streamed (aiohttp warns of large bytes payloads)."""
    return http.post(path, data=io.BytesIO(json.dumps(body).encode()),
                     headers={"Content-Type": "application/json"})


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


async def test_episodes_refuse_a_callers_template_unless_trusted(make_gateway, make_worker, policy,
                                                                 tokenizer):
    """ep_template.sh: before, the episode started (201) with the caller's Jinja run on the gateway."""
    gw = await make_gateway(tokenizer=tokenizer)
    make_worker()
    await gw.live(policy)
    base = f"/v1/policies/{policy}/episodes"
    kwargs = {"chat_template": "{% for i in range(3) %}w{{ 100 + i * 7 }} {% endfor %}"}
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        async with http.post(base, json={"messages": USER, "sampling": {"max_tokens": 2},
                                         "chat_template_kwargs": kwargs}) as r:
            status, field, message = await _error(r)
        assert (status, field) == (400, "chat_template_kwargs.chat_template"), message
        assert "--trust-request-chat-template" in message
        async with http.post(base, json={"messages": USER, "sampling": {"max_tokens": 2}}) as r:
            assert r.status == 201, await r.text()
            [branch] = (await r.json())["episodes"]
        turn = {"messages": [{"role": "tool", "content": "w12"}], "chat_template_kwargs": kwargs}
        async with http.post(f"{base}/{branch['episode_id']}/turns", json=turn) as r:
            status, field, message = await _error(r)
        assert (status, field) == (400, "chat_template_kwargs.chat_template"), message


async def test_a_trusted_template_runs_within_the_time_and_memory_bounds(make_gateway, make_worker, policy,
                                                                        tokenizer):
    """Trusted, a template still runs in a helper process: a loop bomb ends at the time bound, a
    string bomb at the memory bound, both 400s; then a template's own output is used."""
    gw = await make_gateway(tokenizer=tokenizer, trust_request_chat_template=True)
    make_worker()
    await gw.live(policy)
    base = f"/v1/policies/{policy}/episodes"
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        for template, limit in ((LOOP, f"the limit is {RENDER_TIMEOUT_S} s"),
                                (BIG, f"the limit is {RENDER_MEMORY_BYTES // 2**20} MiB")):
            async with http.post(base, json={"messages": USER,
                                             "chat_template_kwargs": {"chat_template": template}}) as r:
                status, field, message = await _error(r)
            assert (status, field) == (400, "messages") and limit in message, message
        own = {"chat_template": "{% for i in range(3) %}w{{ 100 + i * 7 }} {% endfor %}"}
        async with http.post(base, json={"messages": USER, "sampling": {"max_tokens": 1},
                                         "chat_template_kwargs": own}) as r:
            assert r.status == 201, await r.text()
            [branch] = (await r.json())["episodes"]
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http, \
            http.get(f"{base}/{branch['episode_id']}") as r:
        record = await r.json()
    assert record["tokens"][:3] == tokenizer.convert_tokens_to_ids(["w100", "w107", "w114"])


async def test_a_message_too_big_to_render_is_refused_before_rendering(make_gateway, make_worker, policy,
                                                                       tokenizer):
    """ep_misc.sh: an 8 MB message was rendered on the loop (6.8 s of /health), then refused
    for its 2,097,156 tokens; now it is refused by its characters before anything renders it."""
    gw = await make_gateway(tokenizer=tokenizer)
    make_worker()
    await gw.live(policy)
    base = f"/v1/policies/{policy}/episodes"
    big = [{"role": "user", "content": "w10 " * (2 * 1024 * 1024)}]
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        async with post_big(http, base, {"messages": big, "sampling": {"max_tokens": 1}}) as r:
            status, field, message = await _error(r)
        assert (status, field) == (400, "messages"), message
        assert f"has {8 * 1024 * 1024 + 15} characters of text; the limit is {MAX_PROMPT_CHARS}" in message
        # completions' text prompts, tokenized by the gateway: refused the same way
        async with post_big(http, "/v1/completions", {"model": policy, "prompt": "w10 " * 2**20}) as r:
            status, field, message = await _error(r)
        assert (status, field) == (400, "prompt") and f"the limit is {MAX_PROMPT_CHARS}" in message, message
        async with post_big(http, "/v1/completions", {"model": policy, "prompt": [10] * 2**22}) as r:
            status, field, message = await _error(r)
        assert (status, field) == (400, "prompt") and "the limit is 131072" in message, message


async def test_deeply_nested_bodies_are_400s_naming_the_limit(make_gateway, make_worker, policy, tokenizer,
                                                               caplog):
    """chat_deep500.sh: a 1 KB chat body nested 500 deep was a 500 (RecursionError in the images'
    deepcopy) with a ~1,100-line traceback logged per request. Episodes' messages and template
    arguments are walked by the template: the same limit."""
    gw = await make_gateway(tokenizer=tokenizer)
    make_worker()
    await gw.live(policy)
    deep = nested(500)
    chat = {"model": policy, "max_tokens": 1, "messages": [{"role": "user", "content": "w10", "x": deep}]}
    base = f"/v1/policies/{policy}/episodes"
    cases = [("/v1/chat/completions", chat, "messages"),
             ("/v1/chat/completions", {**chat, "messages": USER, "chat_template_kwargs": {"x": deep}},
              "chat_template_kwargs"),
             (base, {"messages": [{"role": "user", "content": deep}]}, "messages"),
             (base, {"messages": USER, "chat_template_kwargs": {"x": deep}}, "chat_template_kwargs")]
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        for path, body, expected in cases:
            async with http.post(path, json=body) as r:
                status, field, message = await _error(r)
            assert (status, field) == (400, expected), message
            assert f"the limit is {MAX_DEPTH}" in message
        # just within the limit, the chat is served
        fits = {**chat, "messages": [{"role": "user", "content": "w10", "x": nested(MAX_DEPTH - 2)}]}
        async with http.post("/v1/chat/completions", json=fits) as r:
            status, _, message = await _error(r) if r.status != 200 else (200, None, "")
        assert status < 500 and "nested" not in message, message
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"


async def test_tokenize_refuses_hostile_bodies_with_400s_naming_the_field(make_gateway, make_worker, policy,
                                                                          tokenizer, caplog):
    """/tokenize and /detokenize (vLLM's, issue 26): the same caps as chat and episodes, before
    anything is tokenized; a caller's template only when trusted; never a 500."""
    gw = await make_gateway(tokenizer=tokenizer)
    make_worker()
    chat = {"model": policy, "messages": USER}
    cases = [({**chat, "messages": [{"role": "user", "content": "w10", "x": nested(500)}]}, "messages",
              f"the limit is {MAX_DEPTH}"),
             ({**chat, "chat_template": LOOP}, "chat_template", "--trust-request-chat-template"),
             ({**chat, "chat_template_kwargs": {"chat_template": LOOP}}, "chat_template_kwargs.chat_template",
              "--trust-request-chat-template"),
             ({**chat, "chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs.tokenize",
              "refused"),
             ({**chat, "messages": [{"role": "user", "content": [{"type": "text", "text": "w10"}]}]},
              "messages[0].content", "must be a string"),
             ({**chat, "prompt": "w10"}, "prompt", "not both"),
             ({"model": policy}, "prompt", "give a prompt"),
             ({**chat, "continue_final_message": True}, "continue_final_message", "Cannot set both")]
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        async with post_big(http, "/tokenize", {"model": policy, "prompt": "w10 " * (2 * 1024 * 1024)}) as r:
            status, field, message = await _error(r)
        assert (status, field) == (400, "prompt") and f"the limit is {MAX_PROMPT_CHARS}" in message, message
        for body, expected, words in cases:
            async with http.post("/tokenize", json=body) as r:
                status, field, message = await _error(r)
            assert (status, field) == (400, expected) and words in message, (body, message)
        async with http.post("/detokenize", json={"model": policy, "tokens": [10, len(tokenizer)]}) as r:
            status, field, message = await _error(r)
        assert (status, field) == (400, "tokens") and "outside the tokenizer's vocabulary" in message, message
        async with http.post("/tokenize", json={"prompt": "w10 w11"}) as r:  # the token's one policy
            assert r.status == 200 and (await r.json())["tokens"] == [10, 11]
    # The template bomb, trusted, costs a helper its time bound, not the loop.
    trusting = await make_gateway(tokenizer=tokenizer, trust_request_chat_template=True)
    no_tokenizer = await make_gateway()
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{trusting.url}/tokenize", json={**chat, "chat_template": LOOP},
                             headers=trusting.headers()) as r:
            status, field, message = await _error(r)
        assert (status, field) == (400, "messages") and f"{RENDER_TIMEOUT_S} s" in message, message
        for path, body, field_name in (("/tokenize", chat, "messages"),
                                       ("/detokenize", {"tokens": [1]}, "tokens")):
            async with http.post(f"{no_tokenizer.url}{path}", json=body, headers=no_tokenizer.headers()) as r:
                status, field, message = await _error(r)
            assert (status, field) == (400, field_name) and "--tokenizer" in message, message
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
