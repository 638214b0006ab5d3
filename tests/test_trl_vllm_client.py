"""TRL's own `VLLMClient` (trl 1.16, unchanged) against rollq's gateway, served by one real vLLM
(CPU) worker of a tiny model with a tokenizer and a chat template, checked against transformers.
The model and engine are the session's chat ones (tests/vllm_servers.py).

The client is synchronous (requests), the gateway and worker run on this test's event loop: every
client call goes through `asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio

import pytest
import requests
import torch
from models import greedy, load_reference, token_logprobs

pytest.importorskip("trl")
from trl.generation.vllm_client import VLLMClient  # noqa: E402

LOGPROB_TOLERANCE = 1e-4
PROMPTS = [[1, 20, 21, 22, 23], [1, 40, 41]]
SYSTEM = {"role": "system", "content": "w10 w11 w12"}
USER = {"role": "user", "content": "w20 w21 w22 w23"}


@pytest.fixture(scope="module")
def chat_reference(chat_model):
    from transformers import AutoTokenizer

    return load_reference(chat_model), AutoTokenizer.from_pretrained(chat_model)


@pytest.fixture
async def trl_client(make_gateway, make_worker, chat_engine, policy):
    """TRL's VLLMClient on a gateway without auth (TRL sends no token) that serves only this test's
    policy, and one vLLM worker."""
    make_worker(engine=chat_engine, max_inflight=32, max_inflight_seqs=32)
    gw = await make_gateway(no_auth=True, tokens=None, policies=[policy])
    client = await asyncio.to_thread(VLLMClient, base_url=gw.url, connection_timeout=10)
    yield client
    client.session.close()


@torch.no_grad()
def top_logprobs(model, ids: list[int], start: int, k: int) -> list[list[tuple[int, float]]]:
    """The reference's top-k (token, logprob) for the tokens at positions start.. of `ids`."""
    logits = model(torch.tensor([ids])).logits[0, start - 1:-1].float()
    values, indices = torch.log_softmax(logits, -1).topk(k, -1)
    return [list(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]


def close(a: float, b: float) -> bool:
    return abs(a - b) < LOGPROB_TOLERANCE


async def test_generate_greedy_token_ids_equal_transformers(trl_client, chat_reference, policy):
    model, _ = chat_reference
    assert trl_client.model == policy
    out = await asyncio.to_thread(trl_client.generate, PROMPTS, temperature=0.0, max_tokens=10, logprobs=0)
    assert out["prompt_ids"] == PROMPTS
    for prompt, ids, logprobs, logprob_ids in zip(PROMPTS, out["completion_ids"], out["logprobs"],
                                                 out["logprob_token_ids"]):
        assert ids == greedy(model, prompt, 10)
        assert logprob_ids == [[t] for t in ids]  # logprobs=0: the sampled token alone
        expected = token_logprobs(model, prompt, ids)
        assert all(close(lp, e) for [lp], e in zip(logprobs, expected))


async def test_generate_top_n_logprobs_are_the_references_top_n(trl_client, chat_reference):
    model, _ = chat_reference
    out = await asyncio.to_thread(trl_client.generate, PROMPTS, temperature=0.0, max_tokens=6, logprobs=3)
    for prompt, ids, logprobs, logprob_ids in zip(PROMPTS, out["completion_ids"], out["logprobs"],
                                                 out["logprob_token_ids"]):
        for pos, (values, tokens, expected) in enumerate(
                zip(logprobs, logprob_ids, top_logprobs(model, prompt + ids, len(prompt), 3))):
            # Greedy: the sampled token is the top one, so N entries, sorted by descending logprob.
            assert tokens[0] == ids[pos] and len(tokens) == 3 and values == sorted(values, reverse=True)
            assert tokens == [t for t, _ in expected]
            assert all(close(v, e) for v, (_, e) in zip(values, expected))


async def test_generate_n_samples_with_every_sampling_field_and_a_seed(trl_client):
    sampling = dict(n=3, repetition_penalty=1.1, temperature=0.9, top_p=0.95, top_k=50, min_p=0.01,
                    max_tokens=8, logprobs=1)
    extra = dict(seed=1234, presence_penalty=0.1, frequency_penalty=0.2, min_tokens=8, ignore_eos=True)
    first = await asyncio.to_thread(trl_client.generate, PROMPTS, generation_kwargs=extra, **sampling)
    again = await asyncio.to_thread(trl_client.generate, PROMPTS, generation_kwargs=extra, **sampling)
    other = await asyncio.to_thread(trl_client.generate, PROMPTS, generation_kwargs=extra | {"seed": 99},
                                    **sampling)
    assert first["prompt_ids"] == PROMPTS  # one per prompt, though n=3 choices each
    assert len(first["completion_ids"]) == 6 and all(len(c) == 8 for c in first["completion_ids"])
    assert first["completion_ids"] == again["completion_ids"]  # the seed reached the sampler
    assert first["completion_ids"] != other["completion_ids"]
    assert len({tuple(c) for c in first["completion_ids"][:3]}) > 1  # n samples, not one copied
    for ids, logprob_ids, logprobs in zip(first["completion_ids"], first["logprob_token_ids"],
                                          first["logprobs"]):
        # logprobs=1: the top token and the sampled one (one entry when they coincide), sorted.
        assert all(t in tokens and 1 <= len(tokens) <= 2 for t, tokens in zip(ids, logprob_ids))
        assert all(v == sorted(v, reverse=True) and all(x <= 0 for x in v) for v in logprobs)


async def test_generate_without_logprobs_and_refused_fields(trl_client):
    out = await asyncio.to_thread(trl_client.generate, PROMPTS, max_tokens=3, logprobs=None)
    assert out["logprobs"] is None and out["logprob_token_ids"] is None
    assert len(out["completion_ids"]) == 2 and all(0 < len(c) <= 3 for c in out["completion_ids"])
    with pytest.raises(Exception, match="400") as refused:
        await asyncio.to_thread(trl_client.generate, PROMPTS, max_tokens=3,
                                generation_kwargs={"suffix": "x"})  # (logit_bias is served now)
    assert "suffix" in str(refused.value)


async def test_chat_renders_with_the_template_and_generates_like_transformers(trl_client, chat_reference):
    model, tokenizer = chat_reference
    conversations = [[SYSTEM, USER], [USER]]
    out = await asyncio.to_thread(trl_client.chat, conversations, temperature=0.0, max_tokens=8, logprobs=2,
                                  chat_template_kwargs={"enable_thinking": True})
    for conversation, prompt_ids, ids, logprobs, logprob_ids in zip(
            conversations, out["prompt_ids"], out["completion_ids"], out["logprobs"],
            out["logprob_token_ids"]):
        expected_prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                        tokenize=True, enable_thinking=True)
        expected_prompt = getattr(expected_prompt, "input_ids", expected_prompt)
        assert prompt_ids == expected_prompt  # ... <|assistant|> <|think|>: the kwarg reached the template
        assert prompt_ids[-1] == tokenizer.convert_tokens_to_ids("<|think|>")
        assert ids == greedy(model, prompt_ids, 8)
        expected = top_logprobs(model, prompt_ids + ids, len(prompt_ids), 2)
        for values, tokens, top in zip(logprobs, logprob_ids, expected):
            assert tokens == [t for t, _ in top] and all(close(v, e) for v, (_, e) in zip(values, top))


async def _score(client, model, completions: list[list[int]], top_n: int) -> int:
    """Score PROMPTS + completions with `get_sequence_logprobs`, check every value against the
    reference; returns how many scored tokens fell outside the top N."""
    sequences = [p + c for p, c in zip(PROMPTS, completions)]
    lengths = [len(p) for p in PROMPTS]
    out = await asyncio.to_thread(client.get_sequence_logprobs, sequences, lengths, top_logprobs=top_n)
    outside = 0
    for seq, start, logprobs, ids, actual, actual_ids in zip(
            sequences, lengths, out["logprobs"], out["logprob_token_ids"], out["actual_logprobs"],
            out["actual_token_ids"]):
        assert actual_ids == [[t] for t in seq[start:]]
        expected = token_logprobs(model, seq[:start], seq[start:])
        assert all(close(a, e) for [a], e in zip(actual, expected))  # each token's own, in the top N or not
        reference_top = top_logprobs(model, seq, start, top_n)
        for values, tokens, top, token in zip(logprobs, ids, reference_top, seq[start:]):
            assert len(values) == len(tokens) == top_n
            assert tokens == [t for t, _ in top] and all(close(v, e) for v, (_, e) in zip(values, top))
            outside += token not in tokens
    return outside


async def test_get_sequence_logprobs_of_greedy_sequences_equal_transformers(trl_client, chat_reference):
    model, _ = chat_reference
    completions = [greedy(model, p, 6) for p in PROMPTS]
    assert await _score(trl_client, model, completions, top_n=4) == 0


async def test_get_sequence_logprobs_of_sampled_sequences(trl_client, chat_reference):
    """Scored tokens outside the top N carry vLLM's exact rank (`Sample.token_ranks`), which TRL
    1.16 sorts by; with rank null (workers before token_ranks) TRL raised TypeError."""
    model, _ = chat_reference
    sampled = await asyncio.to_thread(trl_client.generate, PROMPTS, temperature=1.5, max_tokens=6,
                                      generation_kwargs={"seed": 5})
    assert await _score(trl_client, model, sampled["completion_ids"], top_n=4) > 0


async def test_rollqs_client_scores_sampled_sequences(trl_client, chat_reference):
    from rollq.integrations.trl import RollqVLLMClient

    model, _ = chat_reference
    client = await asyncio.to_thread(RollqVLLMClient, trl_client.base_url, publisher=None)
    sampled = await asyncio.to_thread(client.generate, PROMPTS, temperature=1.5, max_tokens=6,
                                      generation_kwargs={"seed": 5})
    assert await _score(client, model, sampled["completion_ids"], top_n=4) > 0
    client.session.close()


async def test_rollqs_client_generates_on_the_version_it_published_only(trl_client):
    from rollq.integrations.trl import RollqVLLMClient

    client = await asyncio.to_thread(RollqVLLMClient, trl_client.base_url, publisher=None)
    out = await asyncio.to_thread(client.generate, PROMPTS, max_tokens=2)  # nothing published: any version
    assert client.policy_versions == [[(0, 0)], [(0, 0)]] and len(out["completion_ids"]) == 2
    client.version = 7  # as if it had published 7, which no worker serves
    with pytest.raises(Exception, match="504") as waited:
        await asyncio.to_thread(client.generate, PROMPTS, max_tokens=2, generation_kwargs={"timeout_s": 2})
    assert "expired" in str(waited.value)
    client.session.close()


async def test_pool_endpoints_trl_reads(trl_client, policy):
    assert await asyncio.to_thread(trl_client.get_world_size) == 1  # one live worker
    await asyncio.to_thread(trl_client.reset_prefix_cache)
    info = await asyncio.to_thread(trl_client.get_server_info)
    assert info["weight_transfer_config"] is None
    assert info["model_config"]["logprobs_mode"] == "processed_logprobs"
    assert info["parallel_config"]["data_parallel_size"] == 1 and info["lora_config"] is None
    # TRL's own check then names the missing NCCL engine, before any GPU is needed.
    with pytest.raises(RuntimeError, match="no weight-transfer engine"):
        await asyncio.to_thread(trl_client.init_communicator, "cpu")


@pytest.mark.parametrize("path", ["/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                                  "/finish_weight_update", "/pause", "/v1/load_lora_adapter"])
async def test_weight_transfer_endpoints_say_how_to_publish(trl_client, path):
    r = await asyncio.to_thread(requests.post, trl_client.base_url + path, json={}, timeout=10)
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith(f"{path} is not served") and "publish_weights" in message
    assert "rollq.integrations.trl" in message

