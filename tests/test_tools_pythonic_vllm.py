"""A second tool parser: `--tool-call-parser pythonic` on rollq's workers and on vLLM's server, the
same requests, the whole JSON equal (the scripted model of tests/models.py spells a pythonic call
after <|pythonic|>, and hermes markup after a user turn, which this parser must leave as text)."""

from __future__ import annotations


import aiohttp
import pytest
from test_chat_vllm import assert_same
from vllm_servers import VLLMServer
from test_tools_vllm import BASE, HISTORY, MAX_MODEL_LEN, NAMED, USER, _post

PYTHONIC = [USER, {"role": "assistant", "content": "<|pythonic|>"}]
CASES = {
    "pythonic call": dict(messages=PYTHONIC, add_generation_prompt=False, continue_final_message=True),
    "pythonic call, auto": dict(messages=PYTHONIC, add_generation_prompt=False, continue_final_message=True,
                                tool_choice="auto"),
    "hermes markup is text here": {},
    "required": dict(tool_choice="required"),
    "named": dict(tool_choice=NAMED),
    "round trip": dict(messages=HISTORY),
}


@pytest.fixture(scope="module")
def vllm_server(tool_model, tmp_path_factory):
    server = VLLMServer(tool_model, tmp_path_factory.mktemp("vllm-pythonic") / "server.log",
                        "--enable-auto-tool-choice", "--tool-call-parser", "pythonic",
                        max_model_len=MAX_MODEL_LEN)
    yield server
    server.close()


@pytest.fixture(scope="module")
async def pythonic_engine(tool_model, vllm_server):
    from conftest import engine_flags

    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    settings = VLLMSettings(**engine_flags(tool_model) | dict(max_model_len=MAX_MODEL_LEN),
                            enable_auto_tool_choice=True, tool_call_parser="pythonic").validate()
    engine = await VLLMEngine.start(settings)
    yield engine
    await engine.close()


async def test_pythonic_tool_calls_equal_vllms_own_server(make_gateway, make_worker, pythonic_engine,
                                                          vllm_server, policy):
    make_worker(engine=pythonic_engine, max_inflight=8, max_inflight_seqs=32)
    gw = await make_gateway()
    theirs_url = await vllm_server.ready()
    answers = {}
    async with aiohttp.ClientSession() as http:
        for name, case in CASES.items():
            body = BASE | case
            status, theirs = await _post(http, theirs_url, body | {"model": "tiny"})
            assert status == 200, (name, theirs)
            status, ours = await _post(http, gw.url, body | {"model": policy}, gw.headers())
            assert status == 200, (name, ours)
            try:
                assert_same(ours, theirs)
            except AssertionError as e:
                raise AssertionError(f"case {name}: {e}\nvLLM: {theirs}\nrollq: {ours}"[:6000]) from None
            answers[name] = theirs["choices"][0]
    call = answers["pythonic call"]
    assert call["finish_reason"] == "tool_calls" and [
        (c["function"]["name"], c["function"]["arguments"]) for c in call["message"]["tool_calls"]] == \
        [("get_weather", '{"city": "Paris"}')]
    markup = answers["hermes markup is text here"]
    assert "tool_calls" not in markup["message"] and markup["message"]["content"].startswith("<tool_call>")
