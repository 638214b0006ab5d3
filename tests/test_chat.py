"""Chat through the queue, without an engine: the wire type, its limits, the client's checks and
the gateway's refusals. Rendering and generation are in test_chat_vllm.py (real vLLM)."""

from __future__ import annotations

import time

import aiohttp
import msgspec
import pytest

from rollq.engine.base import GroupError
from rollq.engine.chat import ChatRenderer
from rollq.protocol import (MAX_CHAT_BYTES, MAX_CHAT_MESSAGES, Chat, InvalidInput, Sample, Sampling, WorkItem,
                            decode_item, encode)

HELLO = [{"role": "user", "content": "w10 w11"}]


def _item(chat: Chat, **fields) -> WorkItem:
    return WorkItem("j", 0, fields.pop("prompt", b""), 1, fields.pop("sampling", Sampling()), time.time(),
                    chat=chat, **fields)


def test_chat_items_round_trip_and_old_items_still_decode():
    chat = Chat(HELLO, tools=[{"type": "function", "function": {"name": "w12"}}],
                chat_template_kwargs={"enable_thinking": True})
    item = decode_item(encode(_item(chat, sampling=Sampling(stop=["w9"], return_text=True))))
    assert item.chat == chat and item.sampling.stop == ["w9"] and item.sampling.return_text
    # An item from before chat existed (no trailing fields) decodes with none of it.
    old = msgspec.msgpack.encode(["j", 0, b"\x01\x00\x00\x00", 1, [], 1.0])
    decoded = decode_item(old)
    assert decoded.chat is None and decoded.sampling.stop == [] and not decoded.sampling.return_text
    old_sample = msgspec.msgpack.decode(msgspec.msgpack.encode([b"", b"", "stop"]), type=Sample)
    assert (old_sample.text, old_sample.token_texts, old_sample.top_texts) == ("", [], [])


@pytest.mark.parametrize("chat, fields, field", [
    (Chat([]), {}, "chat.messages"),
    (Chat([{"content": "w1"}]), {}, "chat.messages[0].role"),
    (Chat([{"role": "user", "content": "w1"}] * (MAX_CHAT_MESSAGES + 1)), {}, "chat.messages"),
    (Chat([{"role": "user", "content": "x" * MAX_CHAT_BYTES}]), {}, "chat"),
    (Chat(HELLO, continue_final_message=True), {}, "chat.continue_final_message"),
    (Chat(HELLO), {"prompt": b"\x01\x00\x00\x00"}, "chat"),
    (Chat(HELLO), {"sampling": Sampling(stop=["w1"] * 65)}, "sampling.stop"),
    (Chat(HELLO), {"sampling": Sampling(stop=[""])}, "sampling.stop"),
    (Chat(HELLO), {"sampling": Sampling(prompt_logprobs=21)}, "sampling.prompt_logprobs"),
])
def test_invalid_chats_name_the_field(chat, fields, field):
    with pytest.raises(InvalidInput) as bad:
        decode_item(encode(_item(chat, **fields)))
    assert bad.value.field == field


async def test_submit_chat_checks_before_sending(make_client):
    client = make_client()
    with pytest.raises(InvalidInput) as bad:
        await client.submit_chat([HELLO, [{"content": "no role"}]], max_staleness=1)
    assert bad.value.field == "conversations[1].messages[0].role"
    with pytest.raises(InvalidInput) as bad:
        await client.submit_chat([HELLO], tools="not a list")
    assert bad.value.field == "tools"
    with pytest.raises(InvalidInput) as bad:
        await client.submit_chat(HELLO)  # one conversation, not a list of them
    assert bad.value.field == "conversations[0]"
    assert await client.outstanding() == 0


async def test_a_worker_without_a_tokenizer_fails_the_group():
    with pytest.raises(GroupError, match="no tokenizer"):
        await ChatRenderer(None, has_tokenizer=False).render(Chat(HELLO), 8)


MALFORMED_TOOLS = [
    ([{"type": "function"}], "tools[0].function"),
    ([{"type": "function", "function": {"name": "w1", "parameters": "w2"}}], "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "w1"}}, {"function": {"parameters": {}}}],
     "tools[1].function.name"),
    ([{"type": "retrieval", "function": {"name": "w1"}}], "tools[0].type"),
    (["w1"], "tools[0]"),
]


@pytest.mark.parametrize("tools, field", MALFORMED_TOOLS)
async def test_a_malformed_tool_fails_its_group_naming_the_field(tools, field):
    # Checked before vLLM is touched: the renderer needs no engine to refuse it.
    with pytest.raises(GroupError) as bad:
        await ChatRenderer(None, has_tokenizer=True).render(Chat(HELLO, tools=tools), 8)
    assert str(bad.value).startswith(f"invalid chat: {field}: ")


@pytest.mark.parametrize("body, field", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream=True, as vLLM
    # vLLM's own up-front refusals (tests/test_tools_vllm.py checks vLLM's server refuses them too).
    ({"tools": []}, "tools"),
    ({"n": 2, "temperature": 0}, "n"),
    ({"tool_choice": "sometimes", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "g"}},
      "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logit_bias": {"w5": 1.0}}, "logit_bias"),  # keys are token ids
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"echo": True}, "echo"),
    ({"functions": []}, "functions"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "w1"}]}, "messages[0].role"),
    ({"max_completion_tokens": 0}, "sampling.max_tokens"),
    ({"stop": ["w1"] * 65}, "sampling.stop"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"chat_template_kwargs": {"chat_template": "{{ messages }}"}}, "chat_template_kwargs.chat_template"),
    *(({"tools": tools}, field) for tools, field in MALFORMED_TOOLS),
])
async def test_gateway_refuses_what_it_does_not_support_naming_the_field(make_gateway, policy, body, field):
    gw = await make_gateway()
    request = {"model": policy, "messages": HELLO, "max_tokens": 4} | body
    async with (aiohttp.ClientSession(gw.url, headers=gw.headers()) as http,
                http.post("/v1/chat/completions", json=request) as r):
        error = (await r.json())["error"]
        assert r.status == 400, error
    assert error["param"] == field, error


async def test_openapi_lists_chat_completions(make_gateway):
    gw = await make_gateway()
    async with aiohttp.ClientSession(gw.url) as http, http.get("/openapi.json") as r:
        doc = await r.json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    schema = doc["components"]["schemas"][body["schema"]["$ref"].rsplit("/", 1)[1]]
    assert {"messages", "tools", "chat_template_kwargs", "max_staleness"} <= set(schema["properties"])
