"""`stream=True` through the queue on a real vLLM (CPU) worker against vLLM's own server, on the
tiny random chat model of tests/test_chat_vllm.py: the same streamed requests to both, chunks
joined per choice equal (ids and timestamps aside), each chunk of rollq's valid in vLLM's own
schema and of the same shape as vLLM's chunk of its kind (role, finish, usage); the unchanged
openai SDK and langchain-openai streaming from the gateway as from vLLM's server."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from streams import join, kinds, shape, sse
import test_chat_vllm as chat
from test_chat_vllm import BASE, COMPLETION_BASE, SYSTEM, USER, assert_same

chat_worker = chat.chat_worker  # test_chat_vllm's worker on the session's chat engine

# The first test of its process's chat modules starts vLLM's server and an engine: seen past 300 s
# on the loaded 2-core box.
pytestmark = pytest.mark.timeout(900)

USAGE = {"stream_options": {"include_usage": True}}
CONTINUOUS = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
CHAT_CASES = {
    "plain": {},
    "logprobs-top3": dict(logprobs=True, top_logprobs=3),
    "n2-seeded": dict(n=2, temperature=1.0, seed=11, max_tokens=8, logprobs=True, top_logprobs=2),
    "usage": USAGE,
    "continuous-usage-n2": CONTINUOUS | dict(n=2, temperature=1.0, seed=3, max_tokens=6),
    "no-token-ids": dict(return_token_ids=False, logprobs=True) | USAGE,
}
COMPLETION_CASES = {
    "plain": {},
    "logprobs-3": dict(logprobs=3),
    "n2-seeded": dict(n=2, temperature=1.0, seed=11, max_tokens=8, logprobs=2),
    "return-token-ids-usage": dict(return_token_ids=True, logprobs=1) | USAGE,
    "continuous-usage": CONTINUOUS | dict(logprobs=0),
    "echo-logprobs": dict(echo=True, logprobs=2, max_tokens=6),
    "two-prompts": dict(prompt=[[1, 4, 20], [1, 30, 31, 32]], n=2, temperature=1.0, seed=5, max_tokens=5,
                        logprobs=1) | CONTINUOUS,
}


def assert_streams_equal(ours: list, theirs: list, model) -> None:
    assert ours[-1] == theirs[-1] == "[DONE]" and "[DONE]" not in ours[:-1]
    ours, theirs = ours[:-1], theirs[:-1]
    for chunk in ours:
        model.model_validate(chunk)
    assert len({c["id"] for c in ours}) == 1 and len({c["created"] for c in ours}) == 1
    assert_same(join(ours), join(theirs))
    mine, vllms = kinds(ours), kinds(theirs)
    assert not mine["other"]  # a choice comes whole: its one delta is its finish chunk
    for kind in ("role", "finish", "usage"):
        assert len(mine[kind]) == len(vllms[kind]), kind
        assert {str(_shape(c)) for c in mine[kind]} == {str(_shape(c)) for c in vllms[kind]}, kind
        if kind == "usage" and mine[kind]:
            assert mine[kind][0]["usage"] == vllms[kind][0]["usage"]
    assert ours[-1]["choices"] == [] if vllms["usage"] else True


def _shape(chunk: dict):
    """A chunk's shape, but for completions' `prompt_token_ids`: vLLM sends them on a choice's
    first chunk only (null later), and rollq's one chunk per choice is its first and its last."""
    choices = [{k: v for k, v in c.items() if k != "prompt_token_ids"} for c in chunk["choices"]]
    return shape(chunk | {"choices": choices})


@pytest.mark.parametrize("route", ["chat", "completions"])
async def test_streams_join_to_vllms_own(make_gateway, chat_worker, chat_server, policy, route):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse
    from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse

    gw = await make_gateway()
    theirs_url = await chat_server.ready()
    if route == "chat":
        base, cases, path, model = BASE, CHAT_CASES, "/v1/chat/completions", ChatCompletionStreamResponse
    else:
        base, cases = COMPLETION_BASE, COMPLETION_CASES
        path, model = "/v1/completions", CompletionStreamResponse
    async with aiohttp.ClientSession() as http:
        for name, case in cases.items():
            body = base | case | {"stream": True}
            theirs = await sse(http, theirs_url + path, body | {"model": "tiny"})
            ours = await sse(http, gw.url + path, body | {"model": policy}, gw.headers())
            try:
                assert_streams_equal(ours, theirs, model)
            except AssertionError as e:
                raise AssertionError(f"case {name}: {e}\nvLLM: {theirs}\nrollq: {ours}"[:8000]) from None


async def test_the_openai_sdk_and_langchain_stream_unchanged(make_gateway, chat_worker, chat_server, policy):
    from langchain_openai import ChatOpenAI

    gw = await make_gateway()
    theirs_url = await chat_server.ready()
    request = dict(messages=[SYSTEM, USER], max_tokens=8, temperature=0, stream=True,
                   stream_options={"include_usage": True})
    streamed = {}
    key = gw.tokens["alice"]
    async with (openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0) as ours,
                openai.AsyncOpenAI(base_url=f"{theirs_url}/v1", api_key="-", max_retries=0) as theirs):
        for side, client, model in (("rollq", ours, policy), ("vllm", theirs, "tiny")):
            chunks = [c async for c in await client.chat.completions.create(model=model, **request)]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            streamed[side] = (text, chunks[-1].usage, chunks[0].choices[0].delta.role)
        completions = {}
        for side, client, model in (("rollq", ours, policy), ("vllm", theirs, "tiny")):
            stream = await client.completions.create(model=model, prompt=COMPLETION_BASE["prompt"],
                                                     max_tokens=6, temperature=0, stream=True)
            completions[side] = "".join([c.choices[0].text async for c in stream])
    assert streamed["rollq"] == streamed["vllm"] and streamed["rollq"][0] != ""
    assert streamed["rollq"][2] == "assistant" and streamed["rollq"][1].completion_tokens == 8
    assert completions["rollq"] == completions["vllm"] != ""

    said = {}
    for side, url, secret, model in (("rollq", gw.url, key, policy), ("vllm", theirs_url, "-", "tiny")):
        llm = ChatOpenAI(base_url=f"{url}/v1", api_key=secret, model=model, temperature=0, max_tokens=8,
                         max_retries=0, stream_usage=True)
        chunks = [c async for c in llm.astream([("system", SYSTEM["content"]), ("user", USER["content"])])]
        said[side] = ("".join(c.content for c in chunks), sum(c.usage_metadata["output_tokens"]
                                                               for c in chunks if c.usage_metadata))
    assert said["rollq"] == said["vllm"] and said["rollq"] == (streamed["vllm"][0], 8)


async def test_a_chat_that_fails_on_the_worker_ends_its_stream_with_an_error(make_gateway, chat_worker,
                                                                             policy):
    """rollq renders chats on the worker, so a chat it cannot render is a failed group: its
    stream is vLLM's for an error during generation (one error event, then [DONE]), which the
    openai SDK raises as APIError. (vLLM's server, rendering before its stream starts, answers a
    400 instead: the SDK raises BadRequestError, a subclass of APIError.)"""
    gw = await make_gateway()
    messages = [USER, {"role": "wizard", "content": "w5"}]
    async with aiohttp.ClientSession() as http:
        events = await sse(http, f"{gw.url}/v1/chat/completions",
                           dict(model=policy, messages=messages, max_tokens=4, stream=True), gw.headers())
    assert len(events) == 2 and events[-1] == "[DONE]"
    assert events[0]["error"]["code"] == 400 and "unknown role: wizard" in events[0]["error"]["message"]
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=gw.tokens["alice"], max_retries=0) as sdk:
        stream = await sdk.chat.completions.create(model=policy, messages=messages, max_tokens=4, stream=True)
        with pytest.raises(openai.APIError, match="unknown role: wizard"):
            [c async for c in stream]
