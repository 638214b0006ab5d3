"""`stream=True` on /v1/completions through the queue (instant engine: these tests are about the
chunk sequence, not generation; tests/test_streaming_vllm.py compares with vLLM's own server):
joined, the chunks are the unstreamed response; each parses as vLLM's CompletionStreamResponse;
a failed group ends its stream as vLLM ends one with an error."""

from __future__ import annotations

import aiohttp
from streams import join, kinds, sse

from rollq.engine.instant import FAIL_TOKEN

BODY = dict(prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=4, logprobs=0, return_token_ids=True)


async def test_streamed_completions_join_to_the_unstreamed_response(make_gateway, make_worker, policy):
    from vllm.entrypoints.openai.completion.protocol import CompletionStreamResponse

    gw = await make_gateway()
    make_worker()
    url, body = f"{gw.url}/v1/completions", BODY | {"model": policy}
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=body, headers=gw.headers()) as r:
            whole = await r.json()
        options = {"include_usage": True, "continuous_usage_stats": True}
        events = await sse(http, url, body | {"stream": True, "stream_options": options}, gw.headers())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for chunk in chunks:
        CompletionStreamResponse.model_validate(chunk)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("cmpl-")
    joined = join(chunks)
    assert sorted(joined) == [0, 1, 2, 3]
    for choice in whole["choices"]:
        mine = joined[choice["index"]]
        assert mine["text"] == choice["text"] and mine["token_ids"] == choice["token_ids"] != []
        assert mine["tokens"] == choice["logprobs"]["tokens"]
        assert mine["token_logprobs"] == choice["logprobs"]["token_logprobs"]
        assert mine["prompt_token_ids"] == choice["prompt_token_ids"]
        assert (mine["finish_reason"], mine["stop_reason"]) == ("length", None)
    by_kind = kinds(chunks)
    [usage] = by_kind["usage"]
    assert usage["usage"] == {k: whole["usage"][k] for k in ("prompt_tokens", "completion_tokens",
                                                             "total_tokens")}
    assert chunks[-1] is usage  # the usage chunk comes last, before [DONE]
    # Continuous usage: each choice's chunk counts its own prompt and completion.
    assert [c["usage"] for c in by_kind["finish"]] == [
        dict(prompt_tokens=p, completion_tokens=4, total_tokens=p + 4) for p in (3, 3, 2, 2)]
    assert all("system_fingerprint" not in c for c in by_kind["finish"])  # the usage chunk has it


async def test_without_usage_the_finish_chunks_carry_the_fingerprint(make_gateway, make_worker, policy):
    gw = await make_gateway()
    make_worker()
    async with aiohttp.ClientSession() as http:
        events = await sse(http, f"{gw.url}/v1/completions", dict(prompt=[1, 2], max_tokens=3, model=policy,
                                                                  stream=True), gw.headers())
    assert events[-1] == "[DONE]" and len(events) == 2
    [chunk] = events[:-1]
    assert chunk["system_fingerprint"].startswith("rollq-") and "usage" not in chunk
    assert chunk["choices"][0]["logprobs"] is None and chunk["choices"][0]["token_ids"] is None


async def test_a_failed_group_ends_its_stream_with_an_error_event(make_gateway, make_worker, policy):
    """vLLM's server, on an error during generation: `data: {"error": {...}}`, then `[DONE]`."""
    gw = await make_gateway()
    make_worker()
    async with aiohttp.ClientSession() as http:
        body = dict(prompt=[FAIL_TOKEN, 1], max_tokens=3, model=policy, stream=True)
        events = await sse(http, f"{gw.url}/v1/completions", body, gw.headers())
    assert len(events) == 2 and events[-1] == "[DONE]"
    error = events[0]["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error"
    assert error["message"] == "prompt 0: failed: InstantEngine: prompt starts with FAIL_TOKEN"


async def test_stream_options_are_refused_without_stream_naming_the_field(make_gateway, policy):
    gw = await make_gateway()
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        for route, body in (("/v1/completions", {"prompt": [1, 2]}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w1"}]})):
            for options, stream, says in (({"include_usage": True}, False, "stream=True"),
                                          ({"include_obfuscation": True}, True, "include_obfuscation")):
                request = body | {"model": policy, "stream": stream, "stream_options": options}
                async with http.post(route, json=request) as r:
                    error = (await r.json())["error"]
                    assert r.status == 400, error
                assert error["param"] == "stream_options" and says in error["message"], (route, error)
        request = {"model": policy, "prompt": [1, 2], "stream": True, "prompt_logprobs": 2}
        async with http.post("/v1/completions", json=request) as r:  # as vLLM: not in its chunks
            error = (await r.json())["error"]
            assert r.status == 400 and error["param"] == "prompt_logprobs", error


def test_tool_calls_stream_as_vllms_tool_call_deltas():
    """A finished chat whose message has tool calls (as vLLM's parsers return them): each call is
    one delta with its index, id, type, name and arguments; joined they are the message's calls,
    and every chunk parses as vLLM's ChatCompletionStreamResponse."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionStreamResponse

    from rollq.gateway.streaming import StreamOptions, chat_chunks

    calls = [{"id": f"chatcmpl-tool-{k}", "type": "function",
              "function": {"name": f"f{k}", "arguments": f'{{"x": {k}}}'}} for k in range(2)]
    message = dict(role="assistant", content=None, tool_calls=calls, reasoning=None)
    body = dict(id="chatcmpl-1", object="chat.completion", created=7, model="m", system_fingerprint="fp",
                usage=dict(prompt_tokens=5, completion_tokens=9, total_tokens=14, prompt_tokens_details=None),
                choices=[dict(index=0, message=message, logprobs=None, finish_reason="tool_calls",
                              stop_reason=None, token_ids=None)], prompt_token_ids=None, prompt_text=None)
    chunks = list(chat_chunks(body, StreamOptions(include_usage=True), [9]))
    for chunk in chunks:
        ChatCompletionStreamResponse.model_validate(chunk)
    role, finish, usage = chunks
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    [choice] = finish["choices"]
    assert choice["finish_reason"] == "tool_calls" and "content" not in choice["delta"]
    joined = join(chunks)[0]
    assert [(c["id"], c["type"], c["name"], c["arguments"]) for c in joined["tool_calls"].values()] == [
        (c["id"], "function", c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert usage == dict(id="chatcmpl-1", object="chat.completion.chunk", created=7, model="m", choices=[],
                         usage=dict(prompt_tokens=5, completion_tokens=9, total_tokens=14),
                         system_fingerprint="fp")
