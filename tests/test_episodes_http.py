"""Episodes over HTTP (`/v1/policies/{p}/episodes`): the same record as the Python client, errors
as statuses, chat messages as the template's continuation (the gateway's tokenizer). The instant
engine stands in for generation (these tests are about the routes)."""

import asyncio

import aiohttp

from rollq.engine.instant import expected_tokens
from rollq.client.episodes import chat_continuation
from rollq.protocol import pack_tokens

SAMPLING = {"max_tokens": 4}


async def test_an_episode_over_http(make_gateway, make_worker, policy):
    gw = await make_gateway()
    make_worker(delay_s=0.3)
    await gw.live(policy)
    base = f"/v1/policies/{policy}/episodes"
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        body = {"prompt": [5, 6], "n": 2, "sampling": SAMPLING, "episode_id": "e1"}
        async with http.post(base, json=body) as r:
            assert r.status == 201, await r.text()
            branches = (await r.json())["episodes"]
        assert [b["episode_id"] for b in branches] == ["e1.0", "e1.1"]
        assert branches[1]["tokens"] == expected_tokens(pack_tokens([5, 6]), 1, 4, 32_000)
        assert branches[0]["versions"] == [[0, 0]] and branches[0]["version"] == 0
        sequence = [5, 6] + branches[0]["tokens"]
        running = asyncio.ensure_future(http.post(f"{base}/e1.0/turns", json={"tokens": [7]}))
        await asyncio.sleep(0.1)
        async with http.post(f"{base}/e1.0/turns", json={"tokens": [8]}) as r:
            assert r.status == 409 and "still running" in (await r.json())["error"]["message"]
        async with await running as r:
            assert r.status == 200, await r.text()
            turn = await r.json()
        assert turn["tokens"] == expected_tokens(pack_tokens(sequence + [7]), 0, 4, 32_000)
        sequence += [7] + turn["tokens"]
        async with http.get(f"{base}/e1.0") as r:
            record = await r.json()
        assert record["tokens"] == sequence and record["turns"] == 2 and record["state"] == "idle"
        assert record["mask"] == [0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1]
        assert [x is None for x in record["logprobs"]] == [m == 0 for m in record["mask"]]
        async with http.delete(f"{base}/e1.0") as r:
            assert (await r.json())["state"] == "ended"
        async with http.post(f"{base}/e1.0/turns", json={"tokens": [9]}) as r:
            assert r.status == 409 and "ended" in (await r.json())["error"]["message"]
        async with http.post(f"{base}/nope/turns", json={"tokens": [9]}) as r:
            assert r.status == 404
        user = {"messages": [{"role": "user", "content": "x"}]}
        async with http.post(f"{base}/e1.1/turns", json=user) as r:
            assert r.status == 400 and "no tokenizer" in (await r.json())["error"]["message"]
        async with http.post(f"{base}/e1.1/turns", json={"tokens": [1], "bogus": 1}) as r:
            assert r.status == 400 and "bogus" in (await r.json())["error"]["message"]
    # Another trainer does not see alice's episodes.
    async with (aiohttp.ClientSession(gw.url, headers=gw.headers("bob")) as http,
                http.get(f"{base}/e1.1") as r):
        assert r.status == 404


async def test_chat_turns_send_the_templates_continuation(make_gateway, make_worker, policy, tmp_path):
    from models import make_chat_model
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_chat_model(tmp_path / "chat"))
    gw = await make_gateway(tokenizer=tokenizer)
    make_worker()
    await gw.live(policy)
    base = f"/v1/policies/{policy}/episodes"
    first = [{"role": "user", "content": "w10 w11"}]
    tool = [{"role": "tool", "content": "w12"}]
    kwargs = {"enable_thinking": True}
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        body = {"messages": first, "sampling": SAMPLING, "chat_template_kwargs": kwargs}
        async with http.post(base, json=body) as r:
            assert r.status == 201, await r.text()
            [branch] = (await r.json())["episodes"]
        async with http.post(f"{base}/{branch['episode_id']}/turns",
                             json={"messages": tool, "chat_template_kwargs": kwargs}) as r:
            assert r.status == 200, await r.text()
            turn = await r.json()
        async with http.get(f"{base}/{branch['episode_id']}") as r:
            record = await r.json()
    prompt = list(tokenizer.apply_chat_template(first, tokenize=True, add_generation_prompt=True,
                                                return_dict=False, **kwargs))
    continuation = chat_continuation(tokenizer, tool, **kwargs)
    assert turn["new_tokens"] == continuation
    assert tokenizer.convert_ids_to_tokens(continuation) == [
        "<|end|>", "<|tool|>", "w12", "<|end|>", "<|assistant|>", "<|think|>"]
    assert record["tokens"] == prompt + branch["tokens"] + continuation + turn["tokens"]


async def test_with_no_worker_a_turn_is_refused_at_once(make_gateway, policy):
    gw = await make_gateway()
    async with (aiohttp.ClientSession(gw.url, headers=gw.headers()) as http,
                http.post(f"/v1/policies/{policy}/episodes", json={"prompt": [1]}) as r):
        assert r.status == 409 and "no live worker" in (await r.json())["error"]["message"]


async def test_a_chatml_turn_after_a_sampled_end_token_goes_on_with_the_templates_newline(
        make_gateway, make_worker, policy):
    """Issue 42 item 1 through the gateway: a `messages` turn after a reply that ended with the
    template's end token (`<|im_end|>`) appends exactly what ChatML writes after it ("\n", then
    the next message); after a reply cut by max_tokens, the whole closing. The instant engine's
    samples are known in advance: a prompt is found whose one sampled token is `<|im_end|>`."""
    from models import CHATML_TEMPLATE
    from test_episodes import chat_tokenizer

    tokenizer = chat_tokenizer(CHATML_TEMPLATE, ["<|im_start|>", "<|im_end|>"])
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ended = next([k] for k in range(10**6) if expected_tokens(pack_tokens([k]), 0, 1, 32_000) == [end])
    gw = await make_gateway(tokenizer=tokenizer)
    make_worker()
    await gw.live(policy)
    base = f"/v1/policies/{policy}/episodes"
    user = [{"role": "user", "content": "fine"}]
    appended = {}
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        for name, prompt in (("ended", ended), ("cut", [ended[0] + 1])):
            body = {"prompt": prompt, "sampling": {"max_tokens": 1}, "episode_id": name}
            async with http.post(base, json=body) as r:
                assert r.status == 201, await r.text()
                [branch] = (await r.json())["episodes"]
            assert (branch["tokens"] == [end]) == (name == "ended")
            async with http.post(f"{base}/{name}.0/turns", json={"messages": user}) as r:
                assert r.status == 200, await r.text()
                turn = await r.json()
            async with http.get(f"{base}/{name}.0") as r:
                record = await r.json()
            assert record["tokens"] == prompt + branch["tokens"] + turn["new_tokens"] + turn["tokens"]
            appended[name] = tokenizer.decode(turn["new_tokens"])
    assert appended["ended"] == "\n<|im_start|>user\nfine<|im_end|>\n<|im_start|>assistant\n"
    assert appended["cut"] == "<|im_end|>" + appended["ended"]
