"""Structured outputs and logit_bias through the gateway, the queue and a real vLLM (CPU)
worker, against vLLM's own OpenAI server on the same tiny model: the whole JSON equal (ids and
timestamps aside); what vLLM refuses up front is a 400 here too; and constraints that would cost
the engine without bound are refused before a worker sees them, with the engine still serving.

The model's tokenizer spells bytes (tests/structured_models.py), so JSON can be generated."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from structured_models import WHITESPACE, make_byte_model
from test_chat_vllm import assert_same
from vllm_servers import VLLMServer, start_engine


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    return make_byte_model(tmp_path_factory.mktemp("byte-model") / "m")


@pytest.fixture(scope="module")
def vllm_server(byte_model, tmp_path_factory):
    server = VLLMServer(byte_model, tmp_path_factory.mktemp("vllm-server") / "server.log")
    yield server
    server.close()


@pytest.fixture(scope="module")
async def byte_engine(byte_model, vllm_server):
    """The rollq side's engine, started while vLLM's server starts."""
    engine = await start_engine(byte_model)
    yield engine
    await engine.close()


@pytest.fixture
async def worker(make_worker, byte_engine):
    return make_worker(engine=byte_engine, max_inflight=32, max_inflight_seqs=32)


SCHEMA = {"type": "object",
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": ["x", "yz"]}},
          "required": ["a", "b"], "additionalProperties": False}
NO_WHITESPACE = {str(t): -100 for t in WHITESPACE}
"""The random model would fill any JSON with whitespace, which vLLM's JSON grammars allow."""
CHAT = "/v1/chat/completions"
USER = {"role": "user", "content": "give me json"}
CHAT_BASE = dict(messages=[USER], max_tokens=200, temperature=0, return_token_ids=True)
CHAT_CASES = {
    "text": dict(response_format={"type": "text"}),
    "json_object": dict(response_format={"type": "json_object"}, logit_bias=NO_WHITESPACE),
    "json_schema": dict(response_format={"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA, "strict": True}}, logit_bias=NO_WHITESPACE),
    "json_schema-n3-seeded": dict(response_format={"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA}}, n=3, temperature=1.0, seed=7, logprobs=True, top_logprobs=2),
    "json_schema-whitespace": dict(response_format={"type": "json_schema", "json_schema": {
        "name": "thing", "schema": SCHEMA}}),
    "so-json": dict(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}),
    "so-regex": dict(structured_outputs={"regex": "[a-f]{3}-[0-9]{2,4}"}, logprobs=True),
    "so-choice": dict(structured_outputs={"choice": ["yes", "no", "w12w13"]}, logprobs=True, top_logprobs=3),
    "so-grammar": dict(structured_outputs={"grammar": 'root ::= "ab" | "c" [0-9]+ "." '}, max_tokens=12),
    # No logprobs: rollq's workers return vLLM's processed logprobs (the distribution sampled
    # from, bias included: what an importance ratio needs), vLLM's server its raw ones by default.
    "logit_bias": dict(logit_bias={"300": 100, "301": 30}, max_tokens=6),
    "logit_bias-negative": dict(logit_bias={str(t): -100 for t in range(9, 200)}, max_tokens=8),
    "override": dict(structured_outputs={"choice": ["no"]}, response_format={"type": "text"}),
}
COMPLETION_BASE = dict(prompt="json: ", max_tokens=200, temperature=0, return_token_ids=True)
COMPLETION_CASES = {
    "so-regex": dict(structured_outputs={"regex": "w[0-9]+ [a-z]{2,5}"}, logprobs=2),
    "so-choice": dict(structured_outputs={"choice": ["left", "right"]}),
    "so-json": dict(structured_outputs={"json": SCHEMA}, logit_bias=NO_WHITESPACE),
    "so-grammar": dict(structured_outputs={"grammar": 'root ::= ("x" | "y") ";"'}),
    "json_object": dict(response_format={"type": "json_object"}),
    "logit_bias": dict(logit_bias={"42": 50}, max_tokens=5),
}


async def _post(http, url: str, route: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with http.post(f"{url}{route}", json=body, headers=headers) as r:
        return r.status, await r.json()


async def _compare(http, gw, theirs_url, policy, route, base, cases):
    for name, case in cases.items():
        # Both sides at once (two processes, two cores); each engine still runs one request at a
        # time, as when they were asked in turn.
        (status, theirs), (our_status, ours) = await asyncio.gather(
            _post(http, theirs_url, route, base | case | {"model": "tiny"}),
            _post(http, gw.url, route, base | case | {"model": policy}, gw.headers()))
        assert status == 200, (name, theirs)
        assert our_status == 200, (name, ours)
        try:
            assert_same(ours, theirs)
        except AssertionError as e:
            raise AssertionError(f"case {name}: {e}\nvLLM: {theirs}\nrollq: {ours}"[:6000]) from None
        yield name, ours


async def test_chat_structured_outputs_equal_vllms_own_server(make_gateway, worker, vllm_server, policy):
    gw = await make_gateway()
    theirs_url = await vllm_server.ready()
    async with aiohttp.ClientSession() as http:
        seen = {name: ours async for name, ours in _compare(
            http, gw, theirs_url, policy, "/v1/chat/completions", CHAT_BASE, CHAT_CASES)}
    # The constraints were applied, not merely equal on both sides:
    # (a random tiny model may spend max_tokens on whitespace the grammar allows: an output cut
    # by the length is equal to vLLM's, above, but not whole JSON)
    for name in ("json_schema", "so-json"):
        choice = seen[name]["choices"][0]
        if choice["finish_reason"] == "stop":
            assert set(json.loads(choice["message"]["content"])) == {"a", "b"}
    choice = seen["json_object"]["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    assert seen["so-choice"]["choices"][0]["message"]["content"] in ("yes", "no", "w12w13")
    assert seen["override"]["choices"][0]["message"]["content"] == "no"
    assert seen["logit_bias"]["choices"][0]["token_ids"] == [300] * 6
    async with aiohttp.ClientSession() as http:  # processed logprobs: the bias is in them
        status, ours = await _post(http, gw.url, CHAT, CHAT_BASE | CHAT_CASES["logit_bias"] | dict(
            model=policy, logprobs=True, top_logprobs=2), gw.headers())
    [first, second] = ours["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert status == 200 and first["logprob"] > -1e-6 and first["token"] == "w35"  # id 300, +100
    assert second["token"] == "w36" and second["logprob"] < -60  # id 301, +30


async def test_completions_structured_outputs_equal_vllms_own_server(make_gateway, worker, vllm_server,
                                                                     policy):
    gw = await make_gateway()
    theirs_url = await vllm_server.ready()
    async with aiohttp.ClientSession() as http:
        seen = {name: ours async for name, ours in _compare(
            http, gw, theirs_url, policy, "/v1/completions", COMPLETION_BASE, COMPLETION_CASES)}
    assert seen["so-choice"]["choices"][0]["text"] in ("left", "right")
    assert set(json.loads(seen["so-json"]["choices"][0]["text"])) == {"a", "b"}
    assert set(seen["logit_bias"]["choices"][0]["token_ids"]) == {42}


REFUSED = {  # vLLM answers these 400 up front; so does rollq, naming the field
    "empty-choice": (dict(structured_outputs={"choice": []}), "structured_outputs.choice"),
    "two-constraints": (dict(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
    "json_object-false": (dict(structured_outputs={"json_object": False}), "structured_outputs.json_object"),
    "empty-grammar": (dict(structured_outputs={"grammar": " "}), "structured_outputs.grammar"),
    "json_schema-missing": (dict(response_format={"type": "json_schema"}), "response_format"),
    "json_schema-no-name": (dict(response_format={"type": "json_schema", "json_schema": {"schema": {}}}),
                            "response_format.json_schema.name"),
    "bad-type": (dict(response_format={"type": "yaml"}), "response_format.type"),
    "too-deep": (dict(response_format={"type": "json_schema", "json_schema": {
        "name": "n", "schema": json.loads('{"items":' * 100 + "{}" + "}" * 100)}}),
        "response_format.json_schema.schema"),
    "bias-key": (dict(logit_bias={"w1": 1.0}), "logit_bias"),
}


async def test_what_vllm_refuses_up_front_is_a_400_naming_the_field(make_gateway, worker, vllm_server,
                                                                     policy):
    gw = await make_gateway()
    theirs_url = await vllm_server.ready()
    async with aiohttp.ClientSession() as http:
        for name, (case, field) in REFUSED.items():
            body = CHAT_BASE | case
            status, theirs = await _post(http, theirs_url, CHAT, body | {"model": "tiny"})
            assert status == 400, (name, theirs)
            status, ours = await _post(http, gw.url, CHAT, body | {"model": policy}, gw.headers())
            assert status == 400 and ours["error"]["field"] == field, (name, ours)


async def test_bombs_never_reach_the_engine_and_what_only_it_can_refuse_fails_the_group(make_client, worker):
    from rollq.protocol import InvalidInput

    client = make_client()
    prompt = [[1, 4, 20, 21, 7, 5]]
    bombs = {"regex": {"regex": "(a*)*b"}, "grammar": {"grammar": 'root ::= ("a"*)* "b"'},
             "json": {"json": '{"a":' * 10_000 + "{}" + "}" * 10_000},
             "choice": {"choice": ["x" * 1000] * 100}}
    for name, so in bombs.items():  # refused by the SDK: nothing is queued
        with pytest.raises(InvalidInput) as e:
            await client.submit(prompt, 1, {"structured_outputs": so})
        assert e.value.field == f"sampling.structured_outputs.{name}"
    # What only the engine can judge fails its group with vLLM's words, and the engine goes on.
    undefined = {"grammar": "root ::= nowhere"}
    jobs = [await client.submit(prompt, 1, {"max_tokens": 4, "structured_outputs": undefined}),
            await client.submit(prompt, 1, {"max_tokens": 4, "logit_bias": {600: 1.0}}),
            await client.submit(prompt, 2, {"max_tokens": 8, "return_text": True, "temperature": 1.0,
                                            "structured_outputs": {"choice": ["ok", "fine"]}})]
    by_job = {r.job_id: r for r in await client.take(3, timeout_s=120)}
    grammar, bias, fine = (by_job[j] for j in jobs)
    assert grammar.status == "failed" and "nowhere" in grammar.reason, grammar.reason
    assert bias.status == "failed" and "out-of-vocab" in bias.reason, bias.reason
    assert fine.status == "ok" and {s.text for s in fine.samples} <= {"ok", "fine"}, fine.reason
