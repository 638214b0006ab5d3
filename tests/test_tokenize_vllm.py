"""`POST /tokenize`, `POST /detokenize` and `/v1/models`' max_model_len against vLLM's own OpenAI
server (issue 26): the same requests to both give the same JSON. The gateway tokenizes with its
`--tokenizer` (the chat model's), in its render helpers; its worker here is an instant one that
reports the server's max_model_len, so one vLLM process serves the module: the session's chat
server (tests/vllm_servers.py).
"""

from __future__ import annotations

import aiohttp
import pytest
from test_chat_vllm import SYSTEM, TOOLS, USER

from rollq.engine.instant import InstantEngine

MAX_MODEL_LEN = 256
"""The session's chat server's --max-model-len (tests/vllm_servers.py)."""
ASSISTANT = {"role": "assistant", "content": "w30 w31"}
TEMPLATE = "{% for m in messages %}{{ m.role }} {{ m.content }} {% endfor %}w99"

TOKENIZE = [
    {"prompt": "w10 w11 w12"},
    {"prompt": "<s> w10 w500 <|end|>", "add_special_tokens": False, "return_token_strs": True},
    {"prompt": "", "return_token_strs": True},
    {"messages": [SYSTEM, USER]},
    {"messages": [USER], "add_generation_prompt": False},
    {"messages": [SYSTEM, USER], "add_special_tokens": True, "return_token_strs": True},
    {"messages": [USER, ASSISTANT], "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [USER], "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": True}},
    {"messages": [USER, ASSISTANT], "chat_template": TEMPLATE, "return_token_strs": True},
]
DETOKENIZE = [{"tokens": [1, 10, 11, 5]}, {"tokens": []}, {"tokens": [3, 200, 7, 2, 511]}]


@pytest.fixture
async def gateway(make_gateway, make_worker, chat_model, policy):
    """A gateway with the chat model's tokenizer (trusting request templates, as the server
    does) and a live worker that reports the server's max_model_len."""
    from rollq.gateway.app import load_tokenizer

    gw = await make_gateway(tokenizer=load_tokenizer(str(chat_model)), trust_request_chat_template=True)
    engine = InstantEngine(vocab_size=512)
    engine.max_model_len = MAX_MODEL_LEN  # what VLLMEngine reports from its model config
    make_worker(engine=engine)
    await gw.live(policy)
    return gw


async def _post(http: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


async def test_tokenize_detokenize_and_models_equal_vllms_own(gateway, chat_server, policy):
    theirs = await chat_server.ready()
    async with aiohttp.ClientSession(headers=gateway.headers()) as ours, aiohttp.ClientSession() as vllm:
        for path, bodies in (("/tokenize", TOKENIZE), ("/detokenize", DETOKENIZE)):
            for body in bodies:
                status, want = await _post(vllm, f"{theirs}{path}", {"model": "tiny", **body})
                assert status == 200, (body, want)
                status, got = await _post(ours, f"{gateway.url}{path}", {"model": policy, **body})
                assert (status, got) == (200, want), body
        # Without `model`: the token's one policy, as vLLM's server's one model.
        status, got = await _post(ours, f"{gateway.url}/tokenize", TOKENIZE[0])
        assert status == 200 and got["tokens"] == [10, 11, 12]
        async with vllm.get(f"{theirs}/v1/models") as r:
            [card] = (await r.json())["data"]
        async with ours.get(f"{gateway.url}/v1/models") as r:
            [mine] = (await r.json())["data"]
        assert mine["max_model_len"] == card["max_model_len"] == MAX_MODEL_LEN


async def test_what_vllm_refuses_rollq_refuses(gateway, chat_server, policy):
    """What vLLM's server refuses up front, the gateway refuses too: a 400 naming the field."""
    theirs = await chat_server.ready()
    # (chat_template_kwargs.tokenize: vLLM 0.32's server answers 200 and the gateway a 400,
    # the stricter side of the rule: tests/test_gateway_render.py.)
    bad = [("/tokenize", {"messages": [USER], "add_generation_prompt": True, "continue_final_message": True}),
           ("/tokenize", {"prompt": 5}), ("/tokenize", {"messages": "w10"}),
           ("/detokenize", {"tokens": [-1]}), ("/detokenize", {"tokens": "w10"})]
    async with aiohttp.ClientSession(headers=gateway.headers()) as ours, aiohttp.ClientSession() as vllm:
        for path, body in bad:
            status, want = await _post(vllm, f"{theirs}{path}", {"model": "tiny", **body})
            assert status == 400, (body, want)
            status, got = await _post(ours, f"{gateway.url}{path}", {"model": policy, **body})
            assert status == 400 and got["error"]["field"], (body, got)
