# ruff: noqa: F811 (fixtures imported from swap_fixtures are test arguments by design)
"""Episodes on real vLLM (CPU), checked against transformers (issue 15, acceptance 1, 2 and 6):
a 4-turn chat episode is one exact token sequence although the template renders earlier turns
differently; with a publish among many episodes, every turn of an episode is served by its one
version (or, when allowed, moves and says so); a retired version is a clear error."""

import asyncio
from itertools import groupby

import pytest
from models import greedy, make_chat_model, token_logprobs

from rollq.client.episodes import EpisodeError, chat_continuation

# The fixtures come from swap_fixtures (imported: tests/conftest.py is not ours to grow).
from swap_fixtures import engine_v1, follower, publisher, swap_engine, versions  # noqa: F401

GREEDY = {"temperature": 0.0, "max_tokens": 6}
THINKING = {"enable_thinking": True}


def sampled_runs(episode):
    """(start, tokens, version) of each run of sampled tokens: one per turn."""
    out, at = [], 0
    for sampled, run in groupby(zip(episode.mask, episode.tokens, episode.token_versions),
                                key=lambda x: x[0]):
        run = list(run)
        if sampled:
            out.append((at, [t for _, t, _ in run], {v for *_, v in run}))
        at += len(run)
    return out


async def test_a_four_turn_chat_episode_is_exact_where_re_rendering_is_not(
        make_client, make_vllm_worker, reference, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_chat_model(tmp_path / "chat"))
    make_vllm_worker()
    episodes = make_client().episodes()
    messages = [{"role": "user", "content": "w20 w21 w22"}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                return_dict=False, **THINKING))
    [first] = await episodes.start(prompt, sampling=GREEDY)
    expected, replies = prompt + first.tokens, [first.tokens]
    news = [[{"role": "tool", "content": "w30 w31"}], [{"role": "user", "content": "w40"}],
            [{"role": "tool", "content": "w50 w51 w52"}]]
    for new_messages in news:
        # What the template writes after the reply's content, past its end token if it sampled it.
        new = chat_continuation(tokenizer, new_messages, replies[-1], **THINKING)
        turn = await episodes.turn(first.episode_id, new)
        expected += new + turn.tokens
        replies.append(turn.tokens)
    episode = await episodes.end(first.episode_id)
    # (1) No drift: the prompt, then each turn's new and sampled tokens, exactly.
    assert episode.tokens == expected
    assert episode.turns == 4 and sum(episode.mask) == sum(map(len, replies))
    # (2) Each reply is the model's greedy continuation of everything before it, and its
    # logprobs are the model's on that exact sequence (transformers, float32).
    for start, tokens, served_by in sampled_runs(episode):
        assert served_by == {0}
        prefix = episode.tokens[:start]
        assert tokens == greedy(reference, prefix, GREEDY["max_tokens"])[:len(tokens)]
        want = token_logprobs(reference, prefix, tokens)
        got = episode.logprobs[start:start + len(tokens)]
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4
    # (3) Re-rendering the conversation changes earlier tokens: the template writes earlier
    # replies without the `<|think|>` its generation prompt put before them.
    conversation = list(messages)
    for reply, new_messages in zip(replies, news):
        conversation += [{"role": "assistant", "content": tokenizer.decode(reply)}, *new_messages]
    naive = list(tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                               tokenize=True, return_dict=False, **THINKING))
    before_last_reply = episode.tokens[:len(episode.tokens) - len(replies[-1])]
    assert naive != before_last_reply
    think = tokenizer.convert_tokens_to_ids("<|think|>")
    assert before_last_reply.count(think) == 4 and naive.count(think) == 1
    await episodes.close()


# Three engines, 13 episodes of 4 turns: 125 s alone, 287 s beside another vLLM run.
@pytest.mark.timeout(600)
async def test_a_publish_among_many_episodes_keeps_each_on_its_version(
        publisher, follower, versions, make_vllm_worker, vllm_engine, tiny_model):
    """A pinned worker holds version 1 and a follower moves to 2 when it is published: episodes
    started on 1 finish on 1 (on the pinned worker), episodes allowed to move (staleness 0) go to
    2 and record it, and episodes started after the publish are served by 2."""
    weights, models = versions
    await vllm_engine.swap(1, str(tiny_model))
    try:
        pinned, _ = make_vllm_worker(pinned=True)
        moving_worker = follower()
        episodes = publisher.episodes()
        prompts = [[1, 7 + 13 * i, 3 + i] for i in range(10)]
        stay = await asyncio.gather(*(episodes.start(p, sampling=GREEDY) for p in prompts[:6]))
        move = await asyncio.gather(*(episodes.start(p, sampling=GREEDY, move=True, max_staleness=0)
                                      for p in prompts[6:]))
        stay, move = [t for [t] in stay], [t for [t] in move]
        assert {t.version for t in stay + move} == {1}
        await publisher.publish_weights(2, weights[2])
        later = await asyncio.gather(*(episodes.start(p, sampling=GREEDY, min_version=2)
                                       for p in prompts[:3]))
        later = [t for [t] in later]
        everyone = stay + move + later
        for k in range(3):
            await asyncio.gather(*(episodes.turn(t.episode_id, [20 + k, 30 + k]) for t in everyone))
        for group, first_versions, last_version in ((stay, 1, 1), (move, 1, 2), (later, 2, 2)):
            for t in group:
                episode = await episodes.end(t.episode_id)
                runs = sampled_runs(episode)
                assert len(runs) == 4 and episode.turns == 4
                assert all(len(vs) == 1 for *_, vs in runs), "a turn served by two versions"
                served = [next(iter(vs)) for *_, vs in runs]
                assert served[0] == first_versions and served[-1] == last_version, served
                assert served == sorted(served)
                for start, tokens, vs in runs:  # each turn is its version's greedy continuation
                    [v] = vs
                    prefix = episode.tokens[:start]
                    assert tokens == greedy(models[v], prefix, GREEDY["max_tokens"])[:len(tokens)]
                if group is stay:
                    assert episode.worker == pinned.queue.consumer
        assert moving_worker.engine.version == 2
        await episodes.close()
    finally:
        await vllm_engine.swap(0, str(tiny_model))


async def test_an_episode_whose_version_was_retired_gets_a_clear_error(
        publisher, follower, versions):
    weights, _ = versions
    worker = follower()
    await publisher.publish_weights(2, weights[2])
    episodes = publisher.episodes()
    [first] = await episodes.start([1, 5, 6], sampling=GREEDY, min_version=2)
    assert first.version == 2
    await publisher.publish_weights(3, weights[3], keep=1)  # the live episode keeps 2
    assert await publisher.registry.get(2) is not None
    for _ in range(100):  # the follower drops its pin of 2 once it serves 3
        if worker.engine.version == 3 and await publisher.redis.zcard(publisher.keys.pins(2)) == 0:
            break
        await asyncio.sleep(0.1)
    assert await publisher.registry.retire(2) == "ok"  # an operator retires it anyway
    with pytest.raises(EpisodeError, match="version 2 is no longer registered") as retired:
        await episodes.turn(first.episode_id, [7])
    assert retired.value.reason == "retired"
    record = await episodes.get(first.episode_id)
    assert record.turns == 1 and record.state == "idle"
    assert not worker.stopping
    # The worker goes on serving.
    [other] = await episodes.start([1, 5, 6], sampling=GREEDY, min_version=3)
    assert other.version == 3
    await episodes.close()
