"""The OpenAI-compatible surface with the official `openai` client, through the queue to a real
vLLM (CPU) worker, checked against Hugging Face transformers."""

from __future__ import annotations

import openai
import pytest
from models import VOCAB, greedy, token_logprobs

PROMPTS = [[1, 5, 6, 7], [1, 100, 200]]
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture
async def oai(make_gateway, make_vllm_worker):
    """create(trainer="alice", **gateway settings) -> an AsyncOpenAI client on a fresh gateway."""
    made = []
    make_vllm_worker()

    async def create(trainer: str = "alice", **settings) -> openai.AsyncOpenAI:
        gw = await make_gateway(**settings)
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=gw.tokens[trainer], max_retries=0)
        made.append(client)
        return client

    yield create
    for client in made:
        await client.close()


async def test_greedy_completions_with_logprobs_equal_transformers(oai, reference, policy):
    client = await oai()
    c = await client.completions.create(model=policy, prompt=PROMPTS, max_tokens=12, temperature=0,
                                        logprobs=2, extra_body={"return_token_ids": True})
    assert c.object == "text_completion" and c.model == policy and len(c.choices) == 2
    for i, (prompt, choice) in enumerate(zip(PROMPTS, c.choices)):
        assert choice.index == i and choice.finish_reason == "length"
        assert choice.prompt_token_ids == prompt
        assert choice.token_ids == greedy(reference, prompt, 12)
        expected = token_logprobs(reference, prompt, choice.token_ids)
        assert max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs, expected)) < LOGPROB_TOLERANCE
        # No tokenizer at the gateway: tokens are named by id, as vLLM's return_tokens_as_token_ids.
        assert choice.logprobs.tokens == [f"token_id:{t}" for t in choice.token_ids]
        for token, sampled, top in zip(choice.logprobs.tokens, choice.logprobs.token_logprobs,
                                       choice.logprobs.top_logprobs):
            assert len(top) == 2 and top[token] == pytest.approx(sampled) == max(top.values())
        assert choice.policy_versions == [[0, 0]]
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (7, 24)


async def test_n_samples_come_prompt_major(oai, policy):
    client = await oai()
    c = await client.completions.create(model=policy, prompt=PROMPTS, n=3, max_tokens=5, temperature=1.0,
                                        seed=7, extra_body={"return_token_ids": True})
    assert [ch.index for ch in c.choices] == list(range(6))
    assert [ch.prompt_token_ids for ch in c.choices] == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3
    assert all(len(ch.token_ids) == 5 and all(0 <= t < VOCAB for t in ch.token_ids) for ch in c.choices)
    assert c.usage.completion_tokens == 30


async def test_text_prompts_with_a_gateway_tokenizer(make_gateway, make_vllm_worker, reference, policy,
                                                     tmp_path):
    from rollq.gateway.app import load_tokenizer

    tokenizer = load_tokenizer(str(_word_tokenizer(tmp_path / "tokenizer")))
    gw = await make_gateway(tokenizer=tokenizer)
    make_vllm_worker()
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=gw.tokens["alice"]) as client:
        c = await client.completions.create(model=policy, prompt="w1 w5 w6 w7", max_tokens=6, temperature=0,
                                            logprobs=0)
    [choice] = c.choices
    ids = greedy(reference, [1, 5, 6, 7], 6)
    assert choice.text == tokenizer.decode(ids) and choice.text.split() == [f"w{t}" for t in ids]
    assert choice.logprobs.tokens == [f"w{t}" for t in ids]
    # A gateway that knows the vocabulary refuses an id outside it before anything is queued
    # (issue 21 item 4: such a token killed vLLM's engine core), as vLLM's server does.
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=gw.tokens["alice"]) as client:
        for bad_id in (VOCAB, -1):
            with pytest.raises(openai.BadRequestError) as bad:
                await client.completions.create(model=policy, prompt=[[1, 2], [3, bad_id]], max_tokens=2)
            assert bad.value.body["param"] == "prompt"
            assert f"prompt 1: token id {bad_id} is outside" in bad.value.body["message"]
            assert f"vocabulary of {VOCAB} tokens" in bad.value.body["message"]


async def test_openai_errors(oai, policy):
    with pytest.raises(openai.BadRequestError) as bad:
        await (await oai()).completions.create(model=policy, prompt=[[1, 2]], max_tokens=4, stop=["\n"])
    assert bad.value.body["param"] == "prompt" and "no tokenizer" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:
        await (await oai()).completions.create(model=policy, prompt=[[1, 2]], max_tokens=0)
    assert bad.value.body["param"] == "sampling.max_tokens"
    with pytest.raises(openai.PermissionDeniedError):
        await (await oai("mallory")).completions.create(model=policy, prompt=[[1, 2]], max_tokens=4)
    models = await (await oai()).models.list()
    assert policy in [m.id for m in models.data]


def _word_tokenizer(path):
    """A word-level tokenizer over the tiny model's vocabulary: "w5" is token 5."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="w0").save_pretrained(path)
    return path


async def test_models_carry_the_vllm_workers_max_model_len(make_gateway, make_vllm_worker, policy):
    """A vLLM worker reports its engine's max_model_len in its heartbeat; /v1/models carries it
    (vLLM's model card field), and null once no worker is live."""
    from conftest import ENGINE_MAX_MODEL_LEN

    gw = await make_gateway(policies=[policy])  # listed with or without live workers
    worker, task = make_vllm_worker()
    await gw.live(policy)
    async with openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key=gw.tokens["alice"]) as client:
        [card] = (await client.models.list()).data
        assert card.id == policy and card.max_model_len == ENGINE_MAX_MODEL_LEN
        worker.stop()
        await task
        [card] = (await client.models.list()).data
        assert card.max_model_len is None
