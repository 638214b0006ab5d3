"""Agent conversations' exact trajectories (`X-Rollq-Conversation`), on the instant engine: these
tests are about the record (what is kept, continued, segmented, appended once, refused), not about
generation. The instant engine "renders" a chat as the UTF-8 bytes of each message's JSON, so a
re-rendered assistant turn never equals the ids it sampled: a turn that continued from text would
show it. tests/test_conversations_vllm.py runs a tool conversation through vLLM."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
import pytest
from helpers import drop_a_reply

from rollq import conversations
from rollq.conversations import HEADER
from rollq.protocol import Chat, GroupResult, InvalidInput, Sample, pack_floats, pack_tokens, validate_chat

USER = {"role": "user", "content": "hello"}


def _render(messages: list[dict]) -> list[int]:
    """The instant engine's chat rendering."""
    return list(b"".join(msgspec.json.encode(m) for m in messages))


async def _turn(http, policy: str, messages: list[dict], conversation: str | None = "c1", **fields) -> dict:
    headers = {} if conversation is None else {HEADER: conversation}
    body = dict(model=policy, messages=messages, max_tokens=4, return_token_ids=True, logprobs=True) | fields
    async with http.post("/v1/chat/completions", json=body, headers=headers) as r:
        reply = await r.json()
        assert r.status == 200, reply
    return reply


async def _trajectory(http, policy: str, conversation: str = "c1") -> dict:
    async with http.get(f"/v1/policies/{policy}/conversations/{conversation}") as r:
        body = await r.json()
        assert r.status == 200, body
    return body


async def test_a_conversation_keeps_the_sampled_ids_and_an_edited_history_starts_a_segment(
        make_gateway, make_worker, make_client, policy):
    gw = await make_gateway()
    make_worker()
    async with aiohttp.ClientSession(gw.url, headers=gw.headers("alice")) as http:
        first = await _turn(http, policy, [USER])
        [choice] = first["choices"]
        p1, s1 = first["prompt_token_ids"], choice["token_ids"]
        assert p1 == _render([USER]) and len(s1) == 4
        record = await _trajectory(http, policy)
        assert record["tokens"] == p1 + s1 and record["mask"] == [0] * len(p1) + [1] * 4
        assert record["logprobs"] == [None] * len(p1) + [c["logprob"] for c in choice["logprobs"]["content"]]
        assert record["token_versions"] == [-1] * len(p1) + [0] * 4
        assert record["segments"] == [0] and record["drift"] == 0

        # The SDK's way: the reply's message goes back as it came, then a new user message.
        asked = [USER, choice["message"], {"role": "user", "content": "more"}]
        second = await _turn(http, policy, asked)
        p2, s2 = second["prompt_token_ids"], second["choices"][0]["token_ids"]
        assert p2 == p1 + s1 + _render(asked[2:])  # the sampled ids, not the reply's text rendered
        assert p2 != _render(asked)
        record = await _trajectory(http, policy)
        assert record["tokens"] == p2 + s2 and record["segments"] == [0]
        assert record["mask"] == [0] * len(p1) + [1] * 4 + [0] * (len(p2) - len(p1) - 4) + [1] * 4
        assert record["drift"] == 1  # rendered from text, turn 2's prompt would have differed
        assert [(t["continued"], t["began"], t["drift"], t["prompt_start"], t["sample_start"], t["end"])
                for t in record["turns"]] == [(False, "new", False, 0, len(p1), len(p1) + 4),
                                              (True, "", True, 0, len(p2), len(p2) + 4)]
        # Where it drifted: at the first reply, rendered from its text (its JSON here).
        rendered = _render(asked)
        at = next(i for i, (a, b) in enumerate(zip(p2, rendered)) if a != b)
        assert at == len(p1) and record["turns"][0]["drift_at"] == -1 and record["turns"][1]["drift_at"] == at

        # Edited history: rendered whole, a new segment after the first.
        edited = [{"role": "user", "content": "hello again"}, second["choices"][0]["message"],
                  {"role": "user", "content": "more"}]
        third = await _turn(http, policy, edited)
        p3, s3 = third["prompt_token_ids"], third["choices"][0]["token_ids"]
        assert p3 == _render(edited)
        record = await _trajectory(http, policy)
        assert record["tokens"] == p2 + s2 + p3 + s3 and record["segments"] == [0, len(p2) + 4]
        assert record["turns"][2]["continued"] is False and record["turns"][2]["segment"] == 1
        assert record["turns"][2]["began"] == "edited"
        assert record["drift"] == 1

        # The next turn continues the new segment only.
        fourth = await _turn(http, policy, edited + [third["choices"][0]["message"],
                                                     {"role": "user", "content": "w"}])
        assert fourth["prompt_token_ids"][:len(p3) + 4] == p3 + s3
        record = await _trajectory(http, policy)
        assert record["drift"] == 2 and record["turns"][3]["continued"]
        assert record["segments"] == [0, len(p2) + 4]

        # Without the header: vLLM's rendering, nothing recorded.
        plain = await _turn(http, policy, asked, conversation=None)
        assert plain["prompt_token_ids"] == _render(asked)
        async with http.get(f"/v1/policies/{policy}/conversations/other") as r:
            assert r.status == 404 and (await r.json())["error"]["param"] == "conversation_id"
    # The trainer's client reads the same; another trainer sees none of it.
    mine = await make_client("alice").conversation("c1")
    assert msgspec.json.decode(msgspec.json.encode(mine)) == record
    assert await make_client("bob").conversation("c1") is None
    async with aiohttp.ClientSession(gw.url, headers=gw.headers("bob")) as http, \
            http.get(f"/v1/policies/{policy}/conversations/c1") as r:
        assert r.status == 404


async def test_a_turn_sent_again_after_its_reply_was_lost_is_appended_once(make_client, monkeypatch):
    client = make_client("alice")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    sample = Sample(pack_tokens([7, 8]), pack_floats([-0.5, -0.25]), "stop", versions=[(3, 0)],
                    tool_calls=[call])
    result = GroupResult("chatcmpl-1", 0, "ok", samples=[sample], prompt=pack_tokens([1, 2, 3]))
    dropped = drop_a_reply(monkeypatch, client.redis, "EVALSHA")
    reply = {"role": "assistant", "content": None, "tool_calls": sample.tool_calls}
    turn = ("c1", "chatcmpl-1", conversations.Prior(), [USER], reply, result)
    kept = dict(body=b"{}", key="body:x", budget=2**20)
    await conversations.append(client, *turn, **kept)
    assert dropped == [[b"ok"]]  # redis-py sent it again; the script found the job and answered dup
    await conversations.append(client, *turn, **kept)
    record = await client.conversation("c1")
    assert record.tokens == [1, 2, 3, 7, 8] and record.mask == [0, 0, 0, 1, 1]
    assert record.token_versions == [-1, -1, -1, 3, 3] and record.logprobs[3:] == [-0.5, -0.25]
    assert all(v is None for v in record.logprobs[:3])
    [turn] = record.turns
    assert turn.tool_calls == sample.tool_calls and turn.job_id == "chatcmpl-1"
    # The next turn extends it: its prompt begins with the record's ids.
    at = await conversations.prior(client, "c1", [USER, reply, {"role": "tool", "content": "x"}])
    assert at == conversations.Prior(pack_tokens([1, 2, 3, 7, 8]), 2)
    assert await client.redis.ttl(client.keys.conversation("alice", "c1")) > conversations.TTL_S - 60


@pytest.mark.parametrize("header, says", [
    ("a/b", "may contain only letters"), ("x" * 129, "the limit is 128"), ("..", "only dots")])
async def test_a_bad_conversation_header_is_a_400_naming_it(make_gateway, policy, header, says):
    gw = await make_gateway()
    async with aiohttp.ClientSession(gw.url, headers=gw.headers() | {HEADER: header}) as http, \
            http.post("/v1/chat/completions", json=dict(model=policy, messages=[USER])) as r:
        error = (await r.json())["error"]
    assert r.status == 400 and error["param"] == HEADER and says in error["message"], error


@pytest.mark.parametrize("fields, field", [
    (dict(n=2, temperature=1.0), "n"),
    (dict(add_generation_prompt=False, continue_final_message=True), "continue_final_message"),
    (dict(add_generation_prompt=False), "add_generation_prompt"),
    (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content"),
])
async def test_what_a_conversation_cannot_honour_is_refused_naming_the_field(make_gateway, policy, fields,
                                                                             field):
    gw = await make_gateway()
    body = dict(model=policy, messages=[USER]) | fields
    async with aiohttp.ClientSession(gw.url, headers=gw.headers() | {HEADER: "c1"}) as http, \
            http.post("/v1/chat/completions", json=body) as r:
        error = (await r.json())["error"]
    assert r.status == 400 and error["param"] == field and HEADER in error["message"], error


@pytest.mark.parametrize("fields, field", [
    (dict(prefix_tokens=b"\x01\x00\x00", prefix_messages=1), "chat.prefix_tokens"),
    (dict(prefix_tokens=pack_tokens([1])), "chat.prefix_messages"),
    (dict(prefix_tokens=pack_tokens([1]), prefix_messages=2), "chat.prefix_messages"),
    (dict(prefix_tokens=pack_tokens([-1]), prefix_messages=1), "chat.prefix_tokens"),
])
def test_an_exact_prefix_is_checked_naming_the_field(fields, field):
    with pytest.raises(InvalidInput) as e:
        validate_chat(Chat([USER, USER], **fields))
    assert e.value.field == field


def test_messages_extend_when_only_nulls_and_the_shape_of_text_differ():
    reply = {"role": "assistant", "content": "", "refusal": None, "reasoning": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    back = {"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{}"}}]}
    new = {"role": "tool", "tool_call_id": "a", "content": [{"type": "text", "text": "ok"}]}
    assert conversations.extends([USER, reply], [USER, back, new])
    assert not conversations.extends([USER, reply], [USER, back])  # nothing new
    changed = back | {"tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{ }"}}]}
    assert not conversations.extends([USER, reply], [USER, changed, new])


async def test_a_streamed_turn_is_recorded_before_its_chunks(make_gateway, make_worker, policy):
    from streams import sse

    gw = await make_gateway()
    make_worker()
    body = dict(model=policy, messages=[USER], max_tokens=3, stream=True)
    async with aiohttp.ClientSession(gw.url, headers=gw.headers("alice")) as http:
        events = await sse(http, f"{gw.url}/v1/chat/completions", body, gw.headers() | {HEADER: "s1"})
        assert events[-1] == "[DONE]"
        record = await _trajectory(http, policy, "s1")
    assert record["tokens"][:len(_render([USER]))] == _render([USER]) and sum(record["mask"]) == 3


async def test_a_trainers_conversation_records_are_bounded_and_another_trainer_is_served(
        make_gateway, make_worker, make_client, policy):
    """The budget (`--max-conversation-bytes`) counts every record of the trainer until it
    expires; a turn past it is a 400 naming the limit, and the other trainers are still served.
    An expired record's bytes are let go."""
    gw = await make_gateway(max_conversation_bytes=16 * 1024)
    make_worker()
    big = {"role": "user", "content": "w" * 200}  # ~4 KB a record: 13 bytes a token, the reply
    async with aiohttp.ClientSession(gw.url, headers=gw.headers("alice")) as alice, \
            aiohttp.ClientSession(gw.url, headers=gw.headers("bob")) as bob:
        served, refusal = 0, None
        for i in range(10):
            body = dict(model=policy, messages=[big], max_tokens=2)
            async with alice.post("/v1/chat/completions", json=body, headers={HEADER: f"a-{i}"}) as r:
                if r.status != 200:
                    refusal = (r.status, await r.json())
                    break
                served += 1
        assert served and refusal is not None, "the budget never refused a turn"
        status, body = refusal
        assert status == 400 and body["error"]["param"] == HEADER, body
        assert "max_conversation_bytes=16384" in body["error"]["message"], body
        client = make_client("alice")
        keys = client.keys
        records = [await client.redis.hgetall(keys.conversation("alice", f"a-{i}"))
                   for i in range(served + 1)]
        assert not records[-1]  # the refused turn recorded nothing
        held = sum(len(f) + len(v) for record in records for f, v in record.items())
        total = int(await client.redis.hget(keys.conversation_bytes("alice"), ":total"))
        assert held <= 16 * 1024 and total == held
        # Another trainer's conversations (and submits) are served.
        await _turn(bob, policy, [USER], conversation="b-1")
        # Once the records expire (as Redis would: their holds' time passed), alice is served again.
        for i in range(served):
            await client.redis.delete(keys.conversation("alice", f"a-{i}"))
            await client.redis.zadd(keys.conversation_holds("alice"), {f"a-{i}": 1})
        await _turn(alice, policy, [USER], conversation="a-again")
        assert int(await client.redis.hget(keys.conversation_bytes("alice"), ":total")) < 16 * 1024 / served


async def test_the_sdks_retry_of_a_served_turn_is_answered_with_that_turn_not_recorded_again(
        make_gateway, make_worker, make_client, policy, monkeypatch):
    """The openai SDK retries a 5xx with the same body (and `X-Stainless-Retry-Count: 1`): a turn
    served and appended, whose reply was lost (a 503 after the append), is one turn, and the
    SDK gets the recorded reply. Without the retry header the same body is a new turn."""
    import openai

    gw = await make_gateway()
    make_worker()
    real, failed = conversations.append, []

    async def append_then_fail_once(*args, **kwargs):
        await real(*args, **kwargs)
        if not failed:
            failed.append(args[2])
            from rollq.gateway.http import ApiError
            raise ApiError(503, "injected: the reply was lost after the turn was appended")

    monkeypatch.setattr(conversations, "append", append_then_fail_once)
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=gw.tokens["alice"], max_retries=2,
                                  default_headers={HEADER: "r1"}) as agent:
        first = await agent.chat.completions.create(model=policy, messages=[USER], max_tokens=4,
                                                    extra_body={"return_token_ids": True})
        record = await make_client("alice").conversation("r1")
        assert failed == [first.id]  # the reply the SDK got is the turn recorded before the 503
        assert [t.job_id for t in record.turns] == [first.id] and record.segments == [0]
        assert record.tokens[record.turns[0].sample_start:] == first.choices[0].model_extra["token_ids"]
        # The conversation goes on from that turn.
        messages = [USER, first.choices[0].message, {"role": "user", "content": "more"}]
        second = await agent.chat.completions.create(model=policy, messages=messages, max_tokens=4)
        # An idempotency key the SDK sends again on its retries: the same key, the same turn.
        keyed = dict(model=policy, messages=[USER], max_tokens=4, extra_headers={"Idempotency-Key": "k1"})
        failed.clear()
        third = await agent.chat.completions.create(**keyed)
    record = await make_client("alice").conversation("r1")
    assert [t.job_id for t in record.turns] == [first.id, second.id, third.id] and failed == [third.id]
    assert [t.began for t in record.turns] == ["new", "", "edited"]


async def test_a_streamed_retry_gets_the_recorded_turn_as_chunks(make_gateway, make_worker, make_client,
                                                                 policy):
    from streams import sse

    gw = await make_gateway()
    make_worker()
    body = dict(model=policy, messages=[USER], max_tokens=3, stream=True)
    async with aiohttp.ClientSession(gw.url, headers=gw.headers("alice")) as http:
        url, own = f"{gw.url}/v1/chat/completions", gw.headers("alice") | {HEADER: "s2"}
        first = await sse(http, url, body, own)
        again = await sse(http, url, body, own | {conversations.RETRY_HEADER: "1"})
        other = await sse(http, url, body, own)  # the same body, not a retry: a new turn
    def timeless(chunks):  # the stream and the recorded reply are built apart: each has its own clock
        return [c | {"created": 0} if isinstance(c, dict) else c for c in chunks]

    assert timeless(again) == timeless(first) and len(first) > 2
    record = await make_client("alice").conversation("s2")
    assert [t.job_id for t in record.turns] == [first[0]["id"], other[0]["id"]]
    assert [t.began for t in record.turns] == ["new", "edited"]


async def test_a_retry_after_the_client_gave_up_on_a_slow_turn_is_one_turn(
        make_gateway, make_worker, make_client, policy):
    """The SDK gives up on a slow reply (its timeout drops the connection) and sends the request
    again while the first is still being generated: the gateway cancels a request whose client
    went away (`handler_cancellation`), so the first is never recorded, and the retry is the one
    turn, the reply the SDK returns."""
    import openai

    from rollq.engine.instant import InstantEngine

    class Gated(InstantEngine):  # the first group waits until the retry's group has come
        def __init__(self):
            super().__init__()
            self.gate, self.groups = asyncio.Event(), 0

        async def generate_group(self, item):
            self.groups += 1
            if self.groups == 2:
                self.gate.set()
            await self.gate.wait()
            return await super().generate_group(item)

    engine = Gated()
    gw = await make_gateway()
    make_worker(engine=engine)
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=gw.tokens["alice"], max_retries=1,
                                  timeout=1.5, default_headers={HEADER: "slow"}) as agent:
        reply = await agent.chat.completions.create(model=policy, messages=[USER], max_tokens=4)
    await asyncio.sleep(0.5)  # the first group's end, had it been recorded
    record = await make_client("alice").conversation("slow")
    assert engine.groups == 2
    assert [t.job_id for t in record.turns] == [reply.id] and record.segments == [0]


def test_the_templates_closing_goes_on_after_the_sampled_end_token_only():
    """`after_end` (what follows the exact prefix): a sample that ended on the special token the
    template's closing writes first (or after whitespace) continues after it; any other ending
    (a length cut, another special token) is followed by the whole closing. The vLLM tests run
    it on real templates; here, the cases one by one."""
    from rollq.engine.chat import after_end

    class Words:
        names = {1: "<end>", 2: "\n", 3: "<start>", 4: "user", 5: "hi"}

        def decode(self, ids):
            return "".join(self.names[i] for i in ids)

    special, closing = {1, 3}, [1, 2, 3, 4]  # "<end>\n<start>user"
    assert after_end(1, closing, Words(), special) == [2, 3, 4]  # sampled <end>: "\n" follows
    assert after_end(5, closing, Words(), special) == closing  # cut by max_tokens: all of it
    assert after_end(3, closing, Words(), special) == closing  # not the end token it closes with
    assert after_end(1, [2, 1, 3], Words(), special) == [3]  # "\n<end>": the end was sampled for both
    assert after_end(1, [4, 1, 3], Words(), special) == [4, 1, 3]  # text first: nothing assumed
