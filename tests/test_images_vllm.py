"""Vision-language rollouts through the queue on a real vLLM (CPU) worker, checked against
Hugging Face transformers (float32) on a tiny Idefics3 made here (tests/vlm.py): token prompts
with images through client -> Redis -> worker -> vLLM -> client, chats with data URLs through the
gateway, and hostile images that must fail their group and nothing else."""

from __future__ import annotations

import base64
import resource

import openai
import pytest
from vlm import IMAGE_PROMPT_TOKENS, Reference, encoded, hostile_images, make_vlm, noise_image

from rollq.images import ImageRef, digest_of

MAX_TOKENS = 8
PROMPT = "<s><|user|> <image> w20 w30 <|end|><|assistant|>"


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return make_vlm(tmp_path_factory.mktemp("vlm") / "m")


@pytest.fixture(scope="module")
def reference(vlm):
    return Reference(vlm)


@pytest.fixture(scope="module")
async def vlm_engine(vlm):
    from conftest import engine_flags

    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    settings = engine_flags(vlm) | dict(engine_args={"limit_mm_per_prompt": {"image": 2}})
    engine = await VLLMEngine.start(VLLMSettings(**settings).validate())
    yield engine
    await engine.close()


@pytest.fixture
async def vlm_worker(make_worker, vlm_engine):
    return make_worker(engine=vlm_engine, max_inflight=8, max_inflight_seqs=32)


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


async def test_image_prompts_through_the_queue_equal_transformers(make_client, vlm_worker, reference):
    images = [noise_image(1), noise_image(2)]
    tokenizer = reference.processor.tokenizer
    prompt_ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    two = "<s><|user|> <image> w40 <image> <|end|><|assistant|>"
    client = make_client()
    ref = await client.upload_image(encoded(images[1]))
    webp = encoded(images[0], "WEBP", lossless=True)
    await client.submit([prompt_ids, prompt_ids, two], 1, {"temperature": 0, "max_tokens": MAX_TOKENS},
                        images=[[encoded(images[0])], [ref], [webp, ref]])
    results = sorted(await client.take(3, timeout_s=300), key=lambda r: r.group_index)
    cases = [(PROMPT, [images[0]]), (PROMPT, [images[1]]), (two, images)]
    completions = []
    for result, (text, shown) in zip(results, cases):
        assert result.status == "ok", result.reason
        expected_prompt, expected = reference.greedy(text, shown, MAX_TOKENS)
        assert result.prompt_ids == expected_prompt  # vLLM expanded each <image> as the processor
        assert result.image_tokens == IMAGE_PROMPT_TOKENS * len(shown)
        assert [s.token_ids for s in result.samples] == [expected]
        completions.append(expected)
    assert completions[0] != completions[1]  # the images, not just the text, decide the tokens


async def test_gateway_chat_with_a_data_url_equals_transformers(make_gateway, vlm_worker, reference, policy):
    image = noise_image(3)
    gw = await make_gateway()
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "w50"},
        {"type": "image_url", "image_url": {"url": data_url(encoded(image))}}]}]
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=gw.tokens["alice"], max_retries=0) as oai:
        reply = await oai.chat.completions.create(
            model=policy, messages=messages, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"return_token_ids": True})
        hf_messages = [{"role": "user", "content": [{"type": "text", "text": "w50"}, {"type": "image"}]}]
        expected_prompt, expected = reference.greedy(reference.chat_text(hf_messages), [image], MAX_TOKENS)
        assert reply.prompt_token_ids == expected_prompt
        assert reply.choices[0].token_ids == expected
        for url, what in ((data_url(hostile_images()["gif"]), "a GIF file"),
                          ("https://example.com/cat.png", "only data:image")):
            messages[0]["content"][1]["image_url"]["url"] = url
            with pytest.raises(openai.BadRequestError) as e:
                await oai.chat.completions.create(model=policy, messages=messages, max_tokens=2)
            error = e.value.body
            assert error["field"] == "messages[0].content[1].image_url.url" and what in error["message"]


async def test_hostile_images_fail_their_group_and_disturb_nothing(make_client, vlm_worker, redis,
                                                                   reference):
    """Each hostile file is written to Redis as a trainer skipping the client's checks could,
    then named by a group: that group ends `failed` with the reason, the worker's RSS stays
    bounded (the bomb would take 2.5 GB), and a good group beside them is served exactly."""
    client = make_client()
    hostile = hostile_images()
    for data in hostile.values():
        await redis.set(client.keys.image(client.trainer_id, digest_of(data)), data)
    good = noise_image(4)
    prompt_ids = reference.processor.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    await client.submit([prompt_ids] * (len(hostile) + 1), 1, {"temperature": 0, "max_tokens": MAX_TOKENS},
                        images=[[ImageRef(digest_of(d))] for d in hostile.values()] + [[encoded(good)]])
    results = sorted(await client.take(len(hostile) + 1, timeout_s=300), key=lambda r: r.group_index)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    reasons = dict(zip(hostile, (r.reason for r in results)))
    print(reasons, f"worker max RSS grew by {grown_mb:.0f} MB")
    assert [r.status for r in results] == ["failed"] * len(hostile) + ["ok"]
    expected = {"png bomb": "too many pixels", "truncated jpeg": "truncated", "gif": "a GIF file",
                "random bytes": "no image format recognized", "svg": "an SVG file"}
    for name, reason in reasons.items():
        assert reason.startswith("image refused: images[0]: ") and expected[name] in reason, reason
    assert grown_mb < 200
    _, completion = reference.greedy(PROMPT, [good], MAX_TOKENS)
    assert [s.token_ids for s in results[-1].samples] == [completion]
    assert vlm_worker[0].engine.alive


async def test_gateway_jobs_carry_token_prompts_with_images(make_gateway, vlm_worker, reference, policy):
    import aiohttp

    image = noise_image(5)
    prompt_ids = reference.processor.tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    gw = await make_gateway()
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        jobs = f"/v1/policies/{policy}/jobs"
        body = {"prompts": [prompt_ids], "sampling": {"temperature": 0, "max_tokens": MAX_TOKENS},
                "images": [[data_url(encoded(image))]]}
        async with http.post(jobs, json=body) as r:
            assert r.status == 201, await r.text()
        got = []
        while not got:
            async with http.get(f"/v1/policies/{policy}/results", params={"wait_ms": "5000"}) as r:
                got = (await r.json())["results"]
        [result] = got
        _, expected = reference.greedy(PROMPT, [image], MAX_TOKENS)
        assert result["status"] == "ok", result["reason"]
        assert result["samples"][0]["token_ids"] == expected
        assert result["image_tokens"] == IMAGE_PROMPT_TOKENS
        body["images"] = [[data_url(hostile_images()["svg"])]]
        async with http.post(jobs, json=body) as r:
            error = (await r.json())["error"]
            assert r.status == 400 and error["field"] == "images[0][0]" and "an SVG file" in error["message"]
