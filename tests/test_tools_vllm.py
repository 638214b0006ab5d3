"""Tool calling as vLLM's server does it, through the queue: rollq's gateway and workers started
with vLLM's flags (`--enable-auto-tool-choice --tool-call-parser hermes`) against vLLM's own server
with the same flags, on a model whose weights spell hermes tool calls (tests/models.py
`make_tool_model`), and unchanged agent clients (openai, langchain-openai, openai-agents) running
a tool round trip on both.
"""

from __future__ import annotations

import json

import aiohttp
import httpx
import openai
import pytest
from models import WEATHER_TOOL
from streams import join, sse
from test_chat_vllm import assert_same
from vllm_servers import TOOL_MAX_MODEL_LEN

MAX_MODEL_LEN = TOOL_MAX_MODEL_LEN
USER = {"role": "user", "content": "What is the weather in Paris and Tokyo?"}
CALLS = [{"id": f"call_{i}", "type": "function",
          "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
         for i, city in enumerate(["Paris", "Tokyo"])]
HISTORY = [USER, {"role": "assistant", "content": None, "tool_calls": CALLS},
           {"role": "tool", "tool_call_id": "call_0", "content": "sunny"},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
BASE = dict(messages=[USER], tools=[WEATHER_TOOL], max_tokens=48, temperature=0, return_token_ids=True)
CASES = {
    "tool_choice absent": {},
    "auto": dict(tool_choice="auto"),
    "none": dict(tool_choice="none"),
    "required": dict(tool_choice="required"),
    "named": dict(tool_choice=NAMED),
    "one call only": dict(parallel_tool_calls=False),
    "fields SDKs send": dict(parallel_tool_calls=True, metadata={"run": "1"}, store=False,
                             reasoning_effort="low"),
    "round trip": dict(messages=HISTORY),
    "unreadable call": dict(messages=[USER, {"role": "assistant", "content": "<|broken|>"}],
                            add_generation_prompt=False, continue_final_message=True),
    "logprobs": dict(logprobs=True, top_logprobs=2),
    "n2 seeded": dict(n=2, temperature=1.0, seed=3),
    "no tools": dict(tools=None),
}
REFUSED = {
    "tools empty": dict(tools=[]),
    "n2 greedy": dict(n=2),
    "named unknown": dict(tool_choice={"type": "function", "function": {"name": "nope"}}),
    "named without name": dict(tool_choice={"type": "function", "function": {}}),
    "required without tools": dict(tools=None, tool_choice="required"),
    "tool_choice bad": dict(tool_choice="sometimes"),
}


@pytest.fixture(scope="module")
def vllm_server(hermes_server):
    """The session's vLLM server on the tool model (tests/vllm_servers.py, shared with
    test_conversations_vllm)."""
    return hermes_server


@pytest.fixture(scope="module")
def tool_engine(vllm_server, hermes_engine):
    """The session's hermes engine (tests/vllm_servers.py), started while vLLM's server starts."""
    return hermes_engine


@pytest.fixture
async def gateway(make_gateway, make_worker, tool_engine):
    make_worker(engine=tool_engine, max_inflight=8, max_inflight_seqs=32)
    return await make_gateway()


async def _post(http, url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        return r.status, await r.json()


async def test_tool_calls_equal_vllms_own_server(gateway, vllm_server, policy):
    theirs_url = await vllm_server.ready()
    answers = {}
    async with aiohttp.ClientSession() as http:
        for name, case in CASES.items():
            body = {k: v for k, v in (BASE | case).items() if v is not None}
            status, theirs = await _post(http, theirs_url, body | {"model": "tiny"})
            assert status == 200, (name, theirs)
            status, ours = await _post(http, gateway.url, body | {"model": policy}, gateway.headers())
            assert status == 200, (name, ours)
            try:
                assert_same(ours, theirs)
            except AssertionError as e:
                raise AssertionError(f"case {name}: {e}\nvLLM: {theirs}\nrollq: {ours}"[:6000]) from None
            answers[name] = theirs["choices"][0]
        for name, case in REFUSED.items():
            body = {k: v for k, v in (BASE | case).items() if v is not None}
            status, theirs = await _post(http, theirs_url, body | {"model": "tiny"})
            assert status == 400, (name, theirs)
            status, ours = await _post(http, gateway.url, body | {"model": policy}, gateway.headers())
            assert status == 400 and ours["error"]["message"], (name, ours)
        # Streamed (tools, tool_choice absent): the joined tool-call deltas and the finish reason
        # equal vLLM's streamed ones (call ids aside: each server makes its own).
        streamed = []
        for url, model, headers in ((theirs_url, "tiny", None), (gateway.url, policy, gateway.headers())):
            body = {k: v for k, v in BASE.items() if v is not None} | {"model": model, "stream": True}
            chunks = await sse(http, f"{url}/v1/chat/completions", body, headers)
            assert chunks[-1] == "[DONE]", chunks
            [choice] = join(chunks[:-1]).values()
            calls = [c for _, c in sorted(choice.get("tool_calls", {}).items())]
            assert all(c.get("id") for c in calls), calls
            streamed.append((choice["finish_reason"], [{k: v for k, v in c.items() if k != "id"}
                                                       for c in calls]))
        assert streamed[0] == streamed[1] and len(streamed[0][1]) == 2, streamed
    # What the cases compared: two parsed calls where vLLM parses, markup where it must not.
    absent = answers["tool_choice absent"]
    assert absent["finish_reason"] == "tool_calls" and absent["message"]["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in absent["message"]["tool_calls"]] == \
        [{"city": "Paris"}, {"city": "Tokyo"}]
    assert len(answers["one call only"]["message"]["tool_calls"]) == 1
    assert "tool_calls" not in answers["none"]["message"] and \
        answers["none"]["message"]["content"].startswith("<tool_call>")
    assert answers["round trip"]["message"]["content"] == "It is sunny in both cities."
    broken = answers["unreadable call"]
    assert broken["finish_reason"] == "stop" and "tool_calls" not in broken["message"]
    assert broken["message"]["content"].startswith('<tool_call>{"name": "get_weather"')


async def test_submit_chat_samples_carry_their_tool_calls(make_client, make_worker, tool_engine):
    make_worker(engine=tool_engine, max_inflight=8, max_inflight_seqs=32)
    client = make_client()
    await client.submit_chat([[USER], HISTORY], 1, {"temperature": 0, "max_tokens": 48}, tools=[WEATHER_TOOL])
    by_prompt = sorted(await client.take(2, timeout_s=120), key=lambda r: r.group_index)
    [call], [answer] = (r.samples for r in by_prompt)
    assert call.parsed and call.content is None and call.text.startswith("<tool_call>")
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in call.tool_calls] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"})]
    assert all(c["id"].startswith("chatcmpl-tool-") for c in call.tool_calls)
    assert answer.parsed and answer.tool_calls == [] and answer.content == "It is sunny in both cities."


# --- unchanged clients: each runs the tool for real, and ends with vLLM's answer ---------------------


def _weather_calls() -> tuple[list[str], object]:
    ran: list[str] = []

    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return "sunny"

    return ran, get_weather


async def _openai_loop(base_url: str, api_key: str, model: str) -> tuple[str, list[str]]:
    ran, get_weather = _weather_calls()
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        messages: list = [USER]
        for _ in range(3):
            reply = await client.chat.completions.create(model=model, messages=messages, tools=[WEATHER_TOOL],
                                                         max_tokens=48, temperature=0)
            message = reply.choices[0].message
            if not message.tool_calls:
                return message.content, ran
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": get_weather(**json.loads(call.function.arguments))})
    raise AssertionError("no final answer in 3 turns")


async def _langchain_loop(base_url: str, api_key: str, model: str) -> tuple[str, list[str]]:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    ran, get_weather = _weather_calls()
    weather = tool(get_weather)
    async with httpx.AsyncClient() as http:  # else langchain keeps a client open past the test
        llm = ChatOpenAI(base_url=base_url, api_key=api_key, model=model, temperature=0, max_tokens=48,
                         max_retries=0, http_async_client=http).bind_tools([weather])
        messages: list = [HumanMessage(USER["content"])]
        for _ in range(3):
            reply = await llm.ainvoke(messages)
            if not reply.tool_calls:
                return reply.content, ran
            messages.append(reply)
            for call in reply.tool_calls:
                messages.append(ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"]))
    raise AssertionError("no final answer in 3 turns")


async def _agents_loop(base_url: str, api_key: str, model: str) -> tuple[str, list[str]]:
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool
    from agents import set_tracing_disabled

    set_tracing_disabled(True)
    ran, get_weather = _weather_calls()
    async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as client:
        agent = Agent(name="weather", instructions=None, tools=[function_tool(get_weather)],
                      model=OpenAIChatCompletionsModel(model=model, openai_client=client),
                      model_settings=ModelSettings(temperature=0, max_tokens=48))
        result = await Runner.run(agent, USER["content"], max_turns=3)
    return result.final_output, ran


@pytest.mark.parametrize("loop", [_openai_loop, _langchain_loop, _agents_loop],
                         ids=["openai", "langchain-openai", "openai-agents"])
async def test_agent_clients_run_the_tool_and_answer_as_through_vllm(gateway, vllm_server, policy, loop):
    theirs_url = await vllm_server.ready()
    theirs, ran_theirs = await loop(f"{theirs_url}/v1", "-", "tiny")
    ours, ran_ours = await loop(f"{gateway.url}/v1", gateway.tokens["alice"], policy)
    assert ours == theirs == "It is sunny in both cities."
    assert ran_ours == ran_theirs == ["Paris", "Tokyo"]
