"""verifiers' training client, unchanged: `renderers.client.generate` (the `renderers` package,
0.1.12) renders the messages to ids itself, POSTs them to `/inference/v1/generate` and parses
the sampled ids; it refuses any logprob entry whose `token` is not `token_id:<id>`, so it needs
the gateway's `--return-tokens-as-token-ids`.

A three-turn tool conversation on the scripted tool model (tests/models.py `make_tool_model`,
the hermes group's engine): calls, the answer after the tool's result, calls again after a new
user turn. Each turn's prompt, sampled ids and logprobs equal the chat route's for the same
messages (vLLM's rendering on the worker gives the renderer's ids here), and the renderer parses
the tool call the chat route's hermes parser reads first. Only the first: the script's second
call begins with the token `\\n<tool_call>`, and renderers' `qwen3` parser finds calls by the id
of `<tool_call>` (vLLM's hermes parser reads text).
"""

from __future__ import annotations

import json

import openai
import pytest
from models import WEATHER_TOOL
from renderers import DefaultRendererConfig, create_renderer
from renderers.client import MalformedGenerateResponseError, generate

USER = {"role": "user", "content": "What is the weather in Paris and Tokyo?"}
SAMPLING = dict(max_tokens=48, temperature=0)


@pytest.fixture(scope="module")
def tool_engine(hermes_engine):
    """The session's tool model engine with the hermes parser, shared with test_tools_vllm."""
    return hermes_engine


@pytest.fixture(scope="module")
def renderer(tool_engine):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_engine.llm.model_config.tokenizer)
    # The model's own chat template (a renderer the package has no family for), hermes calls.
    return create_renderer(tokenizer, DefaultRendererConfig(tool_parser="qwen3"))


def _assistant(reply: dict, turn: int) -> dict:
    """The next turn's message for a reply, as verifiers' loop builds it from the parse."""
    calls = [dict(id=f"call-{turn}-{i}", type="function",
                  function=dict(name=c.name, arguments=json.dumps(c.arguments)))
             for i, c in enumerate(reply["tool_calls"])]
    return dict(role="assistant", content=reply["content"], **({"tool_calls": calls} if calls else {}))


async def test_renderers_client_runs_a_tool_conversation_on_the_generate_route(
        make_gateway, make_worker, tool_engine, renderer, policy):
    make_worker(engine=tool_engine, max_inflight=8, max_inflight_seqs=32)
    gw = await make_gateway(return_tokens_as_token_ids=True)
    token, base_url = gw.tokens["alice"], f"{gw.url}/v1"
    messages: list = [USER]
    replies, chats = [], []
    async with openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0) as client:
        for then in ("tools", {"role": "user", "content": "And now?"}, None):
            reply = await generate(client=client, renderer=renderer, messages=messages, model=policy,
                                   tools=[WEATHER_TOOL], sampling_params=SAMPLING)
            # The chat route, the same messages: the worker renders them (vLLM's renderer).
            chat = await client.chat.completions.create(
                model=policy, messages=messages, tools=[WEATHER_TOOL], logprobs=True,
                extra_body={"return_token_ids": True}, **SAMPLING)
            replies.append(reply)
            chats.append(chat)
            messages.append(_assistant(reply, len(replies)))
            if then == "tools":
                messages += [{"role": "tool", "tool_call_id": c["id"], "content": "sunny"}
                             for c in messages[-1]["tool_calls"]]
            elif then is not None:
                messages.append(then)

    for reply, chat in zip(replies, chats):
        [choice] = chat.choices
        assert reply["prompt_ids"] == chat.model_extra["prompt_token_ids"]
        assert reply["completion_ids"] == choice.model_extra["token_ids"] != []
        assert reply["completion_logprobs"] == pytest.approx([c.logprob for c in choice.logprobs.content],
                                                             abs=1e-6)
        parsed = [dict(name=c.name, arguments=json.dumps(c.arguments)) for c in reply["tool_calls"]]
        first_call = [c.function.model_dump() for c in choice.message.tool_calls or []][:1]
        assert parsed == first_call
    first, second, third = replies
    assert [(c.name, c.arguments) for c in first["tool_calls"]] == [("get_weather", {"city": "Paris"})]
    assert first["finish_reason"] == "tool_calls" and third["tool_calls"] == first["tool_calls"]
    assert second["content"] == "It is sunny in both cities." and second["tool_calls"] == []
    assert second["finish_reason"] == "stop"


async def test_without_the_flag_the_client_refuses_the_reply(make_gateway, make_worker, tool_engine, renderer,
                                                             policy):
    """vLLM 0.32's token-mode entries (an integer `token_id`, no `token`): what rollq answers
    without the flag, and what the client cannot read."""
    make_worker(engine=tool_engine, max_inflight=8, max_inflight_seqs=32)
    gw = await make_gateway()
    token, base_url = gw.tokens["alice"], f"{gw.url}/v1"
    async with openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0) as client:
        with pytest.raises(MalformedGenerateResponseError, match=r"content\[0\]\.token must be 'token_id:"):
            await generate(client=client, renderer=renderer, messages=[USER], model=policy,
                           tools=[WEATHER_TOOL], sampling_params=SAMPLING)
