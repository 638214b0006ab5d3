"""Acceptance: a three-turn tool conversation through an unchanged client (the openai SDK with
`default_headers={"X-Rollq-Conversation": ...}`) on the scripted tool-call model (tests/models.py
`make_tool_model`: its argmax spells hermes calls) through a vLLM worker with vLLM's hermes parser.

Its trajectory holds the ids the engine was prompted with and sampled, turn after turn, with the
mask, logprobs and versions per token. On this template re-rendering drifts: the template writes a
call's arguments back as a JSON string (`"arguments": "{\\"city\\": ...}"`) where the policy sampled
an object, and closes the reply with `<|im_end|>` where it sampled `</s>`; the test counts the turns
whose rendering (the same request without the header: vLLM's rendering) would have differed and
checks the reported drift against that count (the exact prompt keeps the sampled `</s>` and then
writes the template's whole closing, `<|im_end|>\n`: `</s>` is not the end token it closes with).

Issue 42's acceptance, on real families' templates given per request (`FAMILY_TEMPLATES`,
`CHATML_TEMPLATE`) with vLLM's own server on the same model as the reference: each turn continues
with exactly what the template writes after the sampled end token, prompts equal vLLM's server's
where its re-rendering is exact, and the drift counts exactly the turns where it is not, with the
position.
"""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest
from models import CHATML_TEMPLATE, FAMILY_TEMPLATES, WEATHER_TOOL

from rollq.conversations import HEADER
from rollq.engine.chat import first_difference

USER = {"role": "user", "content": "What is the weather in Paris and Tokyo?"}
SAMPLING = dict(tools=[WEATHER_TOOL], max_tokens=48, temperature=0, logprobs=True,
                extra_body={"return_token_ids": True})


@pytest.fixture(scope="module")
def tool_engine(hermes_server, hermes_engine):
    """The session's tool model engine with the hermes parser, shared with test_tools_vllm (and
    started while vLLM's server, the reference, starts)."""
    return hermes_engine


def _contains(ids: list[int], part: list[int]) -> bool:
    return any(ids[i:i + len(part)] == part for i in range(len(ids) - len(part) + 1))


async def test_a_tool_conversation_through_the_openai_sdk_keeps_the_sampled_ids(
        make_gateway, make_worker, make_client, tool_engine, policy):
    make_worker(engine=tool_engine, max_inflight=8, max_inflight_seqs=32)
    gw = await make_gateway()
    token, base_url = gw.tokens["alice"], f"{gw.url}/v1"
    turns, rendered = [], []
    async with openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0,
                                  default_headers={HEADER: "agent-1"}) as agent, \
            openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0) as plain:
        messages: list = [USER]
        for then in ("tools", {"role": "user", "content": "And now?"}, None):
            reply = await agent.chat.completions.create(model=policy, messages=messages, **SAMPLING)
            # The same request without the header: vLLM's rendering from the text.
            again = await plain.chat.completions.create(model=policy, messages=messages, **SAMPLING)
            turns.append(reply)
            rendered.append(again.model_extra["prompt_token_ids"])
            message = reply.choices[0].message
            messages.append(message)  # as agent loops do: the SDK's own message object goes back
            if then == "tools":
                for call in message.tool_calls:
                    city = json.loads(call.function.arguments)["city"]
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": f"sunny in {city}"})
            elif then is not None:
                messages.append(then)
    first, second, third = (t.choices[0].message for t in turns)
    cities = [json.loads(c.function.arguments) for c in first.tool_calls]
    assert cities == [{"city": "Paris"}, {"city": "Tokyo"}]
    assert second.content == "It is sunny in both cities." and not second.tool_calls
    assert len(third.tool_calls) == 2  # after a user turn the script calls again

    record = await make_client("alice").conversation("agent-1")
    async with aiohttp.ClientSession(gw.url, headers=gw.headers("alice")) as http, \
            http.get(f"/v1/policies/{policy}/conversations/agent-1") as r:
        over_http = await r.json()
    assert r.status == 200 and over_http["tokens"] == record.tokens and over_http["drift"] == record.drift
    assert record.segments == [0] and [t.continued for t in record.turns] == [False, True, True]

    tokens, sampled_at = record.tokens, set()
    for k, (reply, turn) in enumerate(zip(turns, record.turns)):
        prompt, [choice] = reply.model_extra["prompt_token_ids"], reply.choices
        sampled = choice.model_extra["token_ids"]
        # The trajectory's ids are the engine's: its prompt, then what it sampled.
        assert tokens[turn.prompt_start:turn.sample_start] == prompt
        assert tokens[turn.sample_start:turn.end] == sampled
        sampled_at.update(range(turn.sample_start, turn.end))
        logprobs = [c.logprob for c in choice.logprobs.content]
        assert record.logprobs[turn.sample_start:turn.end] == pytest.approx(logprobs, abs=1e-6)
        [[version, _]] = choice.model_extra["policy_versions"]
        assert record.token_versions[turn.sample_start:turn.end] == [version] * len(sampled)
        assert [c["function"] for c in turn.tool_calls] == \
            [c.function.model_dump() for c in choice.message.tool_calls or []]
        if k:  # each later turn's prompt is everything before, exactly, then the new messages
            assert prompt[:record.turns[k - 1].end] == tokens[:record.turns[k - 1].end]
    assert record.mask == [int(i in sampled_at) for i in range(len(tokens))]
    assert all((v is None) == (i not in sampled_at) for i, v in enumerate(record.logprobs))
    assert all((v == -1) == (i not in sampled_at) for i, v in enumerate(record.token_versions))

    # Drift: the turns whose prompt, rendered from the text, would have had other ids.
    exact = [t.model_extra["prompt_token_ids"] for t in turns]
    drifted = sum(e != r for e, r in zip(exact, rendered))
    assert record.drift == drifted == sum(t.drift for t in record.turns) == 2
    assert exact[0] == rendered[0]  # the first turn is rendered: nothing sampled before it
    # What drifted: the first reply's sampled ids are in the exact prompts, not in the rendered ones.
    first_sampled = turns[0].choices[0].model_extra["token_ids"]
    assert _contains(exact[1], first_sampled) and not _contains(rendered[1], first_sampled)


async def test_a_reply_whose_text_encodes_to_other_ids_is_continued_from_the_sampled_ids(
        make_gateway, make_worker, tool_engine, policy, tmp_path):
    """Pure re-tokenization drift: a sample of single letters (logit_bias lets only c, i, t, y be
    sampled) whose decoded text the byte-level BPE encodes to other ids ("c" "i" -> "ci"). Rendered
    from its text, the next turn would hold those other ids; the exact path holds the sampled ones.
    (On this template the rendering differs elsewhere too: an assistant message renders as
    `<|im_start|>assistant\n`, where the generation prompt the policy saw was `<|assistant|>`.)"""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_engine.llm.model_config.tokenizer)
    make_worker(engine=tool_engine, max_inflight=8, max_inflight_seqs=32)
    gw = await make_gateway()
    token, base_url = gw.tokens["alice"], f"{gw.url}/v1"
    letters = {str(tokenizer.convert_tokens_to_ids(c)): 100 for c in "city"}
    hot = dict(max_tokens=8, temperature=1.0, logit_bias=letters, extra_body={"return_token_ids": True})
    async with openai.AsyncOpenAI(base_url=base_url, api_key=token, max_retries=0) as plain:
        for seed in range(8):
            conversation = f"hot-{seed}"
            agent = plain.with_options(default_headers={HEADER: conversation})
            first = await agent.chat.completions.create(model=policy, messages=[USER], seed=seed, **hot)
            sampled = first.choices[0].model_extra["token_ids"]
            text = first.choices[0].message.content
            if tokenizer.encode(text, add_special_tokens=False) != sampled:
                break
        else:
            raise AssertionError("no sample whose text encodes to other ids in 8 seeds")
        messages = [USER, first.choices[0].message, {"role": "user", "content": "More?"}]
        second = await agent.chat.completions.create(model=policy, messages=messages, max_tokens=4,
                                                     temperature=0, extra_body={"return_token_ids": True})
        rendered = await plain.chat.completions.create(model=policy, messages=messages, max_tokens=4,
                                                       temperature=0, extra_body={"return_token_ids": True})
    p1 = first.model_extra["prompt_token_ids"]
    exact, again = second.model_extra["prompt_token_ids"], rendered.model_extra["prompt_token_ids"]
    assert exact[:len(p1) + len(sampled)] == p1 + sampled
    # Rendered from the text, the reply is its re-encoding; the sampled ids are nowhere in it.
    assert not _contains(again, sampled) and tokenizer.decode(sampled) == text
    record = await gw_conversation(gw, policy, conversation)
    assert record["drift"] == 1 and record["segments"] == [0]
    assert record["tokens"][:len(exact)] == exact


async def gw_conversation(gw, policy: str, conversation: str) -> dict:
    async with aiohttp.ClientSession(gw.url, headers=gw.headers("alice")) as http, \
            http.get(f"/v1/policies/{policy}/conversations/{conversation}") as r:
        assert r.status == 200
        return await r.json()


END = {"qwen3": "<|im_end|>", "llama3": "<|eot_id|>", "gemma": "<end_of_turn>"}
"""Each family's end-of-turn token, which the tool model samples to end its reply."""
AFTER_END = {"qwen3": "\n<|im_start|>", "llama3": "<|start_header_id|>", "gemma": "\n<start_of_turn>"}
CITY = {"qwen3": "Lyon", "llama3": "Oslo", "gemma": "Rome"}


def _as_sent(message) -> dict:
    return message if isinstance(message, dict) else message.model_dump(exclude_none=True)


@pytest.mark.parametrize("family", list(FAMILY_TEMPLATES))
async def test_each_turn_continues_with_exactly_what_the_template_writes_after_the_reply(
        family, make_gateway, make_worker, make_client, tool_engine, hermes_server, policy):
    """Acceptance (issue 42): a 4-turn tool conversation through the unchanged openai SDK on a real
    family's template (tools in the system prompt, hermes calls; Qwen3's keeps an assistant
    message's thinking only after the last user query). Each turn's prompt is the last prompt,
    the sampled ids (ending with the family's end token), then exactly the text the template
    writes after that end token (Hugging Face's rendering of the same messages). vLLM's server
    prompts the same ids except where its rendering differs (Qwen3 once a user message follows:
    it drops the thinking the policy sampled), and the drift reported is exactly those turns,
    with the position."""
    from transformers import AutoTokenizer

    template = FAMILY_TEMPLATES[family]
    tokenizer = AutoTokenizer.from_pretrained(tool_engine.llm.model_config.tokenizer)
    theirs = await hermes_server.ready()
    make_worker(engine=tool_engine, max_inflight=8, max_inflight_seqs=32)
    gw = await make_gateway(trust_request_chat_template=True)
    shared = dict(tools=[WEATHER_TOOL], temperature=0, chat_template=template)
    prompts, sampled, rendered, sent = [], [], [], []
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=gw.tokens["alice"], max_retries=0,
                                  default_headers={HEADER: family}) as agent, aiohttp.ClientSession() as http:
        messages: list = [USER]
        for turn in range(4):
            reply = await agent.chat.completions.create(
                model=policy, messages=messages, tools=shared["tools"], temperature=0, max_tokens=48,
                extra_body={"return_token_ids": True, "chat_template": template})
            sent.append([_as_sent(m) for m in messages])
            body = dict(model="tiny", messages=sent[-1], max_tokens=1, return_token_ids=True, **shared)
            async with http.post(f"{theirs}/v1/chat/completions", json=body) as r:
                rendered.append((await r.json())["prompt_token_ids"])
            prompts.append(reply.model_extra["prompt_token_ids"])
            sampled.append(reply.choices[0].model_extra["token_ids"])
            message = reply.choices[0].message
            assert [json.loads(c.function.arguments) for c in message.tool_calls] == [{"city": CITY[family]}]
            result = f"sunny in {CITY[family]}"
            messages += [message, *({"role": "tool", "tool_call_id": c.id, "content": result}
                                    for c in message.tool_calls)]
            if turn == 2:
                messages.append({"role": "user", "content": "And tomorrow?"})

    end = tokenizer.convert_tokens_to_ids(END[family])
    for k in range(1, 4):
        before = prompts[k - 1] + sampled[k - 1]
        assert sampled[k - 1][-1] == end and prompts[k][:len(before)] == before
        whole = tokenizer.apply_chat_template(sent[k], tools=[WEATHER_TOOL], chat_template=template,
                                              tokenize=False, add_generation_prompt=True)
        # The reply's end in the template's own rendering: its end token after its (last) call.
        at = whole.index(END[family], whole.rindex("</tool_call>")) + len(END[family])
        assert whole[at:].startswith(AFTER_END[family])
        assert prompts[k][len(before):] == tokenizer.encode(whole[at:], add_special_tokens=False)

    record = await make_client("alice").conversation(family)
    assert record.segments == [0] and [t.continued for t in record.turns] == [False, True, True, True]
    assert record.tokens == prompts[-1] + sampled[-1]
    where = [first_difference(theirs, ours) for theirs, ours in zip(rendered, prompts)]
    assert where == ([-1, -1, -1, len(prompts[0])] if family == "qwen3" else [-1] * 4)
    assert [t.drift_at for t in record.turns] == where  # one segment: positions in its tokens
    assert [t.drift for t in record.turns] == [w >= 0 for w in where]
    assert record.drift == sum(w >= 0 for w in where)
    if family != "qwen3":  # a chat whose re-rendering is exact: vLLM's server's prompts, token for token
        assert prompts == rendered and record.drift == 0


async def test_a_plain_chatml_chat_prompts_as_vllms_server_and_does_not_drift(
        make_gateway, make_worker, make_client, tool_engine, hermes_server, policy):
    """Issue 42's plain chat: three turns of a ChatML conversation without tools, whose rendering
    gives back the sampled ids. rollq's exact prompts (the sampled `<|im_end|>`, then the
    template's newline) are vLLM's server's, token for token, and nothing is counted as drift."""
    theirs = await hermes_server.ready()
    make_worker(engine=tool_engine, max_inflight=8, max_inflight_seqs=32)
    gw = await make_gateway(trust_request_chat_template=True)
    prompts, rendered = [], []
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=gw.tokens["alice"], max_retries=0,
                                  default_headers={HEADER: "plain"}) as agent, \
            aiohttp.ClientSession() as http:
        messages: list = [USER]
        for question in ("And in Lyon?", "Thanks!", "Bye."):
            reply = await agent.chat.completions.create(
                model=policy, messages=messages, temperature=0, max_tokens=48,
                extra_body={"return_token_ids": True, "chat_template": CHATML_TEMPLATE})
            prompts.append(reply.model_extra["prompt_token_ids"])
            body = dict(model="tiny", messages=[_as_sent(m) for m in messages], max_tokens=1, temperature=0,
                        return_token_ids=True, chat_template=CHATML_TEMPLATE)
            async with http.post(f"{theirs}/v1/chat/completions", json=body) as r:
                rendered.append((await r.json())["prompt_token_ids"])
            messages += [reply.choices[0].message, {"role": "user", "content": question}]
    record = await make_client("alice").conversation("plain")
    assert prompts == rendered
    assert record.drift == 0 and [t.continued for t in record.turns] == [False, True, True]
    assert record.tokens[:len(prompts[-1])] == prompts[-1]
