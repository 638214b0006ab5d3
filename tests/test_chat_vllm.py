"""Chat through the queue on a real vLLM (CPU) worker, against Hugging Face transformers and
against vLLM's own OpenAI server: the same chat requests to both must give the same JSON.

One vLLM server (a subprocess) and one in-process engine serve this module, on one tiny model
with a word-level tokenizer and a chat template (tests/models.py): the session's, shared with
test_streaming_vllm and test_tokenize_vllm (tests/vllm_servers.py).
"""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from models import greedy, load_reference, make_chat_model, token_logprobs

from rollq.protocol import Sampling

LOGPROB_TOLERANCE = 1e-4
SYSTEM = {"role": "system", "content": "w10 w11 w12"}
USER = {"role": "user", "content": "w20 w21 w22 w23"}
TOOLS = [{"type": "function", "function": {"name": "w33", "description": "w34", "parameters": {}}},
         {"type": "function", "function": {"name": "w44", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def chat_reference(chat_model):
    from transformers import AutoTokenizer

    return load_reference(chat_model), AutoTokenizer.from_pretrained(chat_model)


@pytest.fixture
async def chat_worker(make_worker, chat_engine):
    return make_worker(engine=chat_engine, max_inflight=32, max_inflight_seqs=32)


async def test_submit_chat_renders_and_generates_like_transformers(make_client, chat_worker, chat_reference):
    model, tokenizer = chat_reference
    client = make_client()
    conversation = [SYSTEM, USER]
    await client.submit_chat([conversation], 1, {"temperature": 0, "max_tokens": 10, "logprobs": 2},
                             tools=TOOLS, chat_template_kwargs={"enable_thinking": True})
    [result] = await client.take(1, timeout_s=120)
    assert result.status == "ok", result.reason
    expected_prompt = tokenizer.apply_chat_template(conversation, tools=TOOLS, enable_thinking=True,
                                                    add_generation_prompt=True, tokenize=True)
    expected_prompt = getattr(expected_prompt, "input_ids", expected_prompt)
    # ... <|assistant|> <|think|>: the template kwarg reached the template.
    assert result.prompt_ids == expected_prompt and result.prompt_ids[-2:] == [5, 8]
    [sample] = result.samples
    assert sample.token_ids == greedy(model, expected_prompt, 10)
    expected = token_logprobs(model, expected_prompt, sample.token_ids)
    assert max(abs(a - b) for a, b in zip(sample.token_logprobs, expected)) < LOGPROB_TOLERANCE
    words = tokenizer.convert_ids_to_tokens(sample.token_ids)
    assert sample.text.split() == [w for w in words if w != "</s>"] and sample.token_texts[0] == words[0]
    assert len(sample.top_texts) == len(sample.top_ids) // 4 and sample.top_texts[0] == words[0]


async def test_rendering_errors_fail_their_group_and_the_worker_goes_on(make_client, chat_worker):
    client = make_client()
    jobs = [await client.submit_chat([[USER, {"role": "wizard", "content": "w5"}]], 1, {"max_tokens": 4}),
            await client.submit_chat([[USER]], 1, {"max_tokens": 4},
                                     chat_template="{{ raise_exception('w9 broke') }}"),
            await client.submit_chat([[USER]], 1, {"max_tokens": 300}),  # more than a 256-token context
            await client.submit_chat([[USER]], 1, {"max_tokens": 4},
                                     tools=[TOOLS[0], {"type": "function", "function": {
                                         "name": "w9", "parameters": "not a schema"}}]),
            await client.submit_chat([[USER]], 1, {"max_tokens": 4})]
    by_job = {r.job_id: r for r in await client.take(5, timeout_s=120)}
    unknown_role, raising, too_long, bad_tool, fine = (by_job[j] for j in jobs)
    assert [r.status for r in (unknown_role, raising, too_long, bad_tool)] == ["failed"] * 4
    assert bad_tool.reason == "invalid chat: tools[1].function.parameters: must be an object (a JSON schema)"
    assert unknown_role.reason == "cannot render the chat: VLLMValidationError: unknown role: wizard"
    assert raising.reason.endswith("w9 broke")
    assert "max_completion_tokens=300 cannot be greater than max_model_len=256" in too_long.reason
    assert fine.status == "ok" and len(fine.samples[0].token_ids) == 4


async def test_token_prompts_decode_only_when_asked_and_stop_at_stop_strings(make_client, chat_worker,
                                                                             chat_reference):
    model, tokenizer = chat_reference
    client = make_client()
    prompt = [1, 4, 20, 21, 7, 5]
    greedy_ids = greedy(model, prompt, 12)
    stop_word = tokenizer.convert_ids_to_tokens(greedy_ids[5])
    for sampling in (Sampling(temperature=0, max_tokens=12, logprobs=1),
                     Sampling(temperature=0, max_tokens=12, logprobs=1, return_text=True),
                     Sampling(temperature=0, max_tokens=12, stop=[stop_word])):
        await client.submit([prompt], 1, sampling)
        [result] = await client.take(1, timeout_s=120)
        [sample] = result.samples
        if not sampling.return_text and not sampling.stop:  # the cheap path: nothing decoded
            assert sample.token_ids == greedy_ids and (sample.text, sample.token_texts, sample.top_texts) == \
                ("", [], [])
        elif sampling.return_text:
            assert sample.text.split() == tokenizer.convert_ids_to_tokens(greedy_ids)
            assert sample.token_texts == tokenizer.convert_ids_to_tokens(greedy_ids)
        else:
            first = greedy_ids.index(greedy_ids[5])  # the stop word may occur earlier
            assert sample.finish_reason == "stop" and sample.stop_reason == stop_word
            assert sample.token_ids == greedy_ids[:first + 1]  # vLLM keeps the token, cuts the text
            assert stop_word not in sample.text
            assert sample.text.split() == tokenizer.convert_ids_to_tokens(greedy_ids[:first])


# --- the differential test: rollq's gateway and vLLM's server, the same requests ------------------

BASE = dict(messages=[SYSTEM, USER], max_tokens=12, temperature=0, return_token_ids=True)
CASES = {
    "plain": {},
    "logprobs-top3": dict(logprobs=True, top_logprobs=3),
    "logprobs": dict(logprobs=True),
    "tools-none-kwargs": dict(tools=TOOLS, tool_choice="none",
                              chat_template_kwargs={"enable_thinking": True}),
    "n3-seeded": dict(n=3, temperature=1.0, seed=11, max_tokens=8, logprobs=True, top_logprobs=2,
                      return_tokens_as_token_ids=True),
    "continue-final": dict(messages=[USER, {"role": "assistant", "content": "w40 w41"}],
                           add_generation_prompt=False, continue_final_message=True, max_completion_tokens=6),
    "own-template": dict(chat_template="{% for m in messages %}{{ m.content }} {% endfor %}"),
    # Without return_token_ids vLLM still has the keys, null: the JSON must say so too.
    "no-token-ids": dict(return_token_ids=False, logprobs=True, top_logprobs=2),
    "no-token-ids-tools": dict(return_token_ids=False, tools=TOOLS, tool_choice="none"),
}
IGNORED = {"id", "created", "model", "system_fingerprint"}  # present on both sides; values are the server's
EXTENSIONS = {"policy_versions", "worker_id"}
"""rollq's own keys of a choice: its version segments and the worker that served it (what a
trainer reports its gap against, `queue/gap.py`)."""


def assert_same(ours, theirs, path: str = "$") -> None:
    """Equal JSON (keys, values; floats within LOGPROB_TOLERANCE), rollq's extensions aside."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and set(ours) - EXTENSIONS == set(theirs), \
            f"{path}: keys {sorted(set(ours) - EXTENSIONS)} != vLLM's {sorted(theirs)}"
        for key in set(theirs) - IGNORED:
            assert_same(ours[key], theirs[key], f"{path}.{key}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), f"{path}: {ours} != {theirs}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(theirs, float) and not isinstance(ours, bool):
        assert abs(ours - theirs) < LOGPROB_TOLERANCE, f"{path}: {ours} != {theirs}"
    else:
        assert ours == theirs, f"{path}: {ours!r} != vLLM's {theirs!r}"


async def _post(http: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None) -> dict:
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        data = await r.json()
        assert r.status == 200, data
        return data


async def test_chat_completions_equal_vllms_own_server(make_gateway, chat_worker, chat_server, policy):
    gw = await make_gateway(trust_request_chat_template=True)  # as the server: for "own-template"
    theirs_url = await chat_server.ready()
    async with aiohttp.ClientSession() as http:
        plain = await _post(http, theirs_url, BASE | {"model": "tiny"})
        words = plain["choices"][0]["message"]["content"].split()
        cases = CASES | {"stop": dict(stop=[words[4], "w999"])}
        for name, case in cases.items():
            theirs = await _post(http, theirs_url, BASE | case | {"model": "tiny"})
            ours = await _post(http, gw.url, BASE | case | {"model": policy}, gw.headers())
            try:
                assert_same(ours, theirs)
            except AssertionError as e:
                raise AssertionError(f"case {name}: {e}\nvLLM: {theirs}\nrollq: {ours}"[:6000]) from None
            assert all(c["policy_versions"] == [[0, 0]] for c in ours["choices"])
    assert plain["choices"][0]["finish_reason"] == "length" and len(words) == 12
    assert theirs["choices"][0]["finish_reason"] == "stop" and theirs["choices"][0]["stop_reason"] == words[4]


async def test_the_openai_client_chats_unchanged(make_gateway, chat_worker, chat_server, policy):
    gw = await make_gateway()
    theirs_url = await chat_server.ready()
    request = dict(messages=[SYSTEM, USER], max_tokens=8, temperature=0, logprobs=True, top_logprobs=2)
    token = gw.tokens["alice"]
    async with (openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=token, max_retries=0) as ours,
                openai.AsyncOpenAI(base_url=f"{theirs_url}/v1", api_key="-", max_retries=0) as theirs):
        mine = await ours.chat.completions.create(model=policy, **request)
        vllms = await theirs.chat.completions.create(model="tiny", **request)
    assert mine.object == "chat.completion" and mine.choices[0].message.role == "assistant"
    assert mine.choices[0].message.content == vllms.choices[0].message.content != ""
    assert [t.token for t in mine.choices[0].logprobs.content] == \
        [t.token for t in vllms.choices[0].logprobs.content]
    assert mine.usage == vllms.usage


COMPLETION_BASE = dict(prompt=[1, 4, 20, 21, 7, 5], max_tokens=12, temperature=0)
COMPLETION_CASES = {
    "plain": {},
    "logprobs-0": dict(logprobs=0),
    "logprobs-3": dict(logprobs=3),
    "n3-seeded": dict(n=3, temperature=1.0, seed=11, max_tokens=8, logprobs=2),
    "return-token-ids": dict(return_token_ids=True, logprobs=1),
    "as-token-ids": dict(logprobs=2, return_tokens_as_token_ids=True),
    "echo-logprobs": dict(echo=True, logprobs=2, max_tokens=6),
    # vLLM's quirk, kept: with return_token_ids the echoed text is the completion's only.
    "echo-token-ids": dict(echo=True, logprobs=1, return_token_ids=True, max_tokens=6),
    "echo-text-prompt": dict(prompt="w20 w21 w7 w5", echo=True, max_tokens=6),
    "prompt-logprobs": dict(prompt_logprobs=3, max_tokens=6),
    "prompt-logprobs-0": dict(prompt_logprobs=0, logprobs=1, max_tokens=6),
    "two-prompts": dict(prompt=[[1, 4, 20], [1, 30, 31, 32]], n=2, temperature=1.0, seed=5, max_tokens=5,
                        logprobs=1),
}


async def test_completions_equal_vllms_own_server(make_gateway, chat_worker, chat_server, chat_model,
                                                  policy):
    """The whole JSON of /v1/completions, with and without a tokenizer at the gateway: the
    worker's model has one, so text and token strings are vLLM's own decoding either way."""
    from rollq.gateway.app import load_tokenizer

    gateways = {"no tokenizer": await make_gateway(),
                "tokenizer": await make_gateway(tokenizer=load_tokenizer(str(chat_model)))}
    theirs_url = await chat_server.ready()
    async with aiohttp.ClientSession() as http:
        async def post(url: str, body: dict, headers: dict | None = None) -> dict:
            async with http.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                data = await r.json()
                assert r.status == 200, data
                return data

        plain = await post(theirs_url, COMPLETION_BASE | {"model": "tiny"})
        words = plain["choices"][0]["text"].split()
        cases = COMPLETION_CASES | {"stop": dict(stop=[words[6], "w999"], logprobs=1)}
        for name, case in cases.items():
            theirs = await post(theirs_url, COMPLETION_BASE | case | {"model": "tiny"})
            for which, gw in gateways.items():
                ours = await post(gw.url, COMPLETION_BASE | case | {"model": policy}, gw.headers())
                try:
                    assert_same(ours, theirs)
                except AssertionError as e:
                    raise AssertionError(f"case {name}, gateway with {which}: {e}\nvLLM: {theirs}\n"
                                         f"rollq: {ours}"[:6000]) from None
    assert plain["choices"][0]["text"].startswith(" ")  # vLLM's incremental decoding, kept
    assert theirs["choices"][0]["finish_reason"] == "stop" and theirs["choices"][0]["stop_reason"] == words[6]


async def test_a_worker_whose_model_has_no_tokenizer_fails_chats_and_stop_strings(make_client,
                                                                                   make_vllm_worker):
    make_vllm_worker()  # conftest's engine: a model directory without tokenizer files
    client = make_client()
    chat = await client.submit_chat([[USER]], 1, {"max_tokens": 4})
    stop = await client.submit([[1, 5, 6]], 1, {"max_tokens": 4, "stop": ["w1"]})
    tokens = await client.submit([[1, 5, 6]], 1, {"max_tokens": 4})
    by_job = {r.job_id: r for r in await client.take(3, timeout_s=120)}
    assert by_job[chat].status == "failed" and "no tokenizer" in by_job[chat].reason
    assert by_job[stop].status == "failed" and "no tokenizer" in by_job[stop].reason
    assert by_job[tokens].status == "ok"


async def test_a_model_without_a_chat_template_fails_chats_and_the_worker_goes_on(make_client, make_worker,
                                                                                 tmp_path):
    import json

    from conftest import engine_flags

    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    model = make_chat_model(tmp_path / "m")
    (model / "chat_template.jinja").unlink(missing_ok=True)  # where transformers saves it, or:
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    engine = await VLLMEngine.start(VLLMSettings(**engine_flags(model)).validate())
    try:
        worker, task = make_worker(engine=engine)
        client = make_client()
        chat = await client.submit_chat([[USER]], 1, {"max_tokens": 4})
        [failed] = await client.take(1, timeout_s=120)
        text = await client.submit([[1, 5, 6]], 1, {"max_tokens": 4, "temperature": 0, "stop": ["w999"]})
        [fine] = await client.take(1, timeout_s=120)
        assert not task.done()
    finally:
        worker.stop()
        await asyncio.wait_for(task, 30)
        await engine.close()
    assert failed.job_id == chat and failed.status == "failed", failed
    assert failed.reason.startswith("cannot render the chat: ") and "chat template" in failed.reason, \
        failed.reason
    assert fine.job_id == text and fine.status == "ok" and len(fine.samples[0].token_ids) == 4


async def test_tools_without_a_tool_choice_on_a_worker_without_parser_flags_fail_as_vllms(
        make_gateway, chat_worker, chat_server, policy):
    """vLLM's default with tools is "auto", which a server without --enable-auto-tool-choice
    refuses: so does rollq (it used to answer 200 with the tool-call markup as content)."""
    gw = await make_gateway()
    theirs_url = await chat_server.ready()
    body = BASE | dict(tools=TOOLS)
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{theirs_url}/v1/chat/completions", json=body | {"model": "tiny"}) as r:
            theirs = (r.status, (await r.json())["error"]["message"])
        async with http.post(f"{gw.url}/v1/chat/completions", json=body | {"model": policy},
                             headers=gw.headers()) as r:
            ours = (r.status, (await r.json())["error"]["message"])
    assert theirs[0] == ours[0] == 400 and theirs[1].startswith('"auto" tool choice requires')
    assert ours[1].endswith(theirs[1]), ours
