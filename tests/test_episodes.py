"""Episodes on the queue (issue 15): the record, exact continuation, branches, errors and
retention. The instant engine stands in for generation (named as such: these tests are about the
record and the queue; tests/test_episodes_vllm.py checks generation on real vLLM)."""

import asyncio
import math

import pytest
from helpers import drop_a_reply, turn_queued, wait_until

from rollq.engine.instant import FAIL_TOKEN, expected_tokens
from rollq.client.episodes import EpisodeError, turn_seed
from rollq.engine.instant import InstantEngine
from rollq.protocol import InvalidInput, VersionEntry, pack_tokens
from rollq.queue import jobs
from rollq.queue.keys import Keys
from rollq.queue.scripts import Scripts
from rollq.queue.names import EpisodeField, EpisodeState, Group
from rollq.queue.work import WorkQueue
from rollq.registry.retention import needed_by_episodes, retain
from rollq.status import policy_status

SAMPLING = {"max_tokens": 5}


async def test_each_turn_continues_from_the_exact_ids_and_the_record_holds_mask_and_logprobs(
        make_client, make_worker):
    make_worker()
    client = make_client()
    episodes = client.episodes()
    prompt = [11, 12, 13]
    [first] = await episodes.start(prompt, sampling=SAMPLING)
    expected = prompt + expected_tokens(pack_tokens(prompt), 0, 5, 32_000)
    assert first.tokens == expected[3:]
    mask = [0] * 3 + [1] * 5
    for k, new in enumerate([[21], [22, 23], [24, 25, 26]]):
        turn = await episodes.turn(first.episode_id, new)
        # The prompt the worker saw is exactly the sequence so far plus the new tokens.
        assert turn.tokens == expected_tokens(pack_tokens(expected + new), 0, 5, 32_000), k
        expected += new + turn.tokens
        mask += [0] * len(new) + [1] * 5
    episode = await episodes.end(first.episode_id)
    assert episode.tokens == expected
    assert episode.mask == mask
    assert episode.turns == 4 and episode.state == EpisodeState.ENDED
    assert [math.isnan(x) for x in episode.logprobs] == [m == 0 for m in mask]
    assert [x for x, m in zip(episode.logprobs, mask) if m] == [-1.0] * 20
    assert episode.token_versions == [-1 if m == 0 else 0 for m in mask]
    assert episode.worker and episode.version == 0
    await episodes.close()


async def test_n_branches_continue_each_on_its_own(make_client, make_worker):
    make_worker()
    client = make_client()
    episodes = client.episodes()
    turns = await episodes.start([5, 6], n=3, sampling=SAMPLING, episode_id="grpo")
    assert [t.episode_id for t in turns] == ["grpo.0", "grpo.1", "grpo.2"]
    assert len({tuple(t.tokens) for t in turns}) == 3  # three different samples
    await episodes.turn("grpo.1", [7])
    records = [await episodes.get(f"grpo.{i}") for i in range(3)]
    assert [r.turns for r in records] == [1, 2, 1]
    assert records[1].tokens[:7] == [5, 6, *turns[1].tokens]
    assert records[0].tokens == [5, 6, *turns[0].tokens]
    await episodes.close()


async def test_a_seeded_episodes_later_turns_each_get_a_seed_of_their_own(make_client, make_worker):
    """The start's seed serves the first turn (vLLM gives its n samples seed + i); every later
    turn gets its own, from the seed, the branch and where the turn begins (`turn_seed`): the
    same episode again samples the same, and no two turns share their random draws. Before, each
    later turn of each branch reused the start's seed."""
    seeds: dict[str, int | None] = {}

    class Recording(InstantEngine):
        async def generate_group(self, item):
            seeds[item.job_id] = item.sampling.seed
            return await super().generate_group(item)

    make_worker(engine=Recording())
    episodes = make_client().episodes()
    branches = await episodes.start([1, 2], n=2, sampling=SAMPLING | {"seed": 42}, episode_id="seeded")
    expected = []
    for branch in branches:
        length = 2 + len(branch.tokens)
        for new in ([3], [4, 5]):
            turn = await episodes.turn(branch.episode_id, new)
            expected.append(turn_seed(42, branch.episode_id, length + len(new)))
            length += len(new) + len(turn.tokens)
    first, *later = seeds.values()  # in the order served: one turn at a time
    assert first == 42 and later == expected
    assert len(set(later)) == 4 and 42 not in later
    await episodes.close()


async def test_bad_turns_get_clear_errors_and_the_worker_goes_on(make_client, make_worker, redis):
    worker, _ = make_worker(delay_s=0.5)
    client = make_client()
    episodes = client.episodes()
    with pytest.raises(EpisodeError, match="unknown, or expired") as unknown:
        await episodes.turn("nope", [1])
    assert unknown.value.reason == "unknown"
    [first] = await episodes.start([1, 2], sampling=SAMPLING)
    running = asyncio.create_task(episodes.turn(first.episode_id, [3]))
    await asyncio.sleep(0.1)
    with pytest.raises(EpisodeError, match="still running") as busy:
        await episodes.turn(first.episode_id, [4])
    assert busy.value.reason == "running"
    await running
    # A turn the engine fails: nothing is added, the episode is idle again and says why.
    with pytest.raises(EpisodeError, match="ended failed: .*FAIL_TOKEN") as failed:
        await episodes.start([FAIL_TOKEN, 1], sampling=SAMPLING)
    assert failed.value.reason == "failed"
    before = await episodes.get(first.episode_id)
    await episodes.end(first.episode_id)
    with pytest.raises(EpisodeError, match="ended; start a new") as ended:
        await episodes.turn(first.episode_id, [5])
    assert ended.value.reason == "ended"
    # Expired: the record is gone.
    [other] = await episodes.start([9], sampling=SAMPLING, ttl_s=1)
    await asyncio.sleep(1.2)
    with pytest.raises(EpisodeError, match="expired"):
        await episodes.turn(other.episode_id, [1])
    # Another trainer cannot touch it.
    [mine] = await episodes.start([9], sampling=SAMPLING)
    stranger = make_client("stranger").episodes()
    with pytest.raises(EpisodeError, match="unknown"):
        await stranger.turn(mine.episode_id, [1])
    assert before.turns == 2 and not worker.stopping
    await episodes.close()
    await stranger.close()


async def test_a_failed_turn_adds_nothing_and_can_be_sent_again(make_client, make_worker):
    make_worker()
    episodes = make_client().episodes()
    [first] = await episodes.start([1, 2], sampling=SAMPLING)
    with pytest.raises(InvalidInput, match="limit is 131072"):
        await episodes.turn(first.episode_id, [1] * 200_000)
    record = await episodes.get(first.episode_id)
    assert record.turns == 1 and record.state == EpisodeState.IDLE and len(record.tokens) == 7
    assert record.reason.startswith("not submitted: prompts[0]")
    turn = await episodes.turn(first.episode_id, [3])
    assert (await episodes.get(first.episode_id)).tokens == [1, 2, *first.tokens, 3, *turn.tokens]
    await episodes.close()


async def test_a_start_or_turn_whose_reply_was_lost_is_retried_not_refused(make_client, make_worker,
                                                                          monkeypatch):
    """The client retries a script whose connection dropped before its reply arrived, though Redis
    ran it: the start's and the turn's scripts must know their own call again, not answer "taken"
    or "its turn is still running" about the very call that began it."""
    make_worker()
    client = make_client()
    episodes = client.episodes()
    dropped = drop_a_reply(monkeypatch, client.redis, "EVALSHA", lambda reply: reply == b"ok")
    [first] = await episodes.start([1, 2], sampling=SAMPLING, episode_id="lost")
    assert dropped == [b"ok"]
    dropped = drop_a_reply(monkeypatch, client.redis, "EVALSHA",
                           lambda reply: isinstance(reply, list) and len(reply) == 10)
    turn = await episodes.turn(first.episode_id, [3])
    assert dropped and dropped[0][0] == b"ok"
    record = await episodes.get(first.episode_id)
    assert record.turns == 2 and record.tokens == [1, 2, *first.tokens, 3, *turn.tokens]
    with pytest.raises(InvalidInput, match="'lost' is taken"):
        await episodes.start([1, 2], sampling=SAMPLING, episode_id="lost")  # a second start is refused
    await episodes.close()


async def test_an_apply_sent_again_after_its_reply_was_lost_serves_the_turn(make_client, make_worker,
                                                                           monkeypatch):
    """redis-py sends `episode_apply` again when its reply was lost (a dropped connection, a Redis
    restart): the second run finds the turn applied already. The caller gets its turn, not an
    "ended while this turn ran" refusal for a turn the record holds (the chaos run's phantom)."""
    make_worker()
    client = make_client()
    episodes = client.episodes()
    [first] = await episodes.start([1, 2], sampling=SAMPLING, episode_id="twice")
    apply_once = client.scripts.episode_apply

    async def apply_twice(*args, **kwargs):
        await apply_once(*args, **kwargs)  # ran by Redis, its reply lost
        return await apply_once(*args, **kwargs)

    monkeypatch.setattr(client.scripts, "episode_apply", apply_twice)
    turn = await episodes.turn(first.episode_id, [3])
    record = await episodes.get(first.episode_id)
    assert record.turns == 2 and record.tokens == [1, 2, *first.tokens, 3, *turn.tokens]
    await episodes.close()


async def test_a_restarted_client_recovers_the_turns_its_predecessor_left_running(make_client,
                                                                                  make_worker):
    """A trainer that stops mid-turn (its turn's result unread) and starts again with the same
    owner gets the turn applied to its episode by `recover()`, and the episode goes on."""
    make_worker(delay_s=1.0)
    before = make_client().episodes(owner="run-7")
    [first] = await before.start([11, 12], sampling=SAMPLING, episode_id="e")
    turn = asyncio.create_task(before.turn(first.episode_id, [21]))
    await wait_until(lambda: before.get(first.episode_id), what="the record")
    await wait_until(lambda: _running(before, first.episode_id), what="the turn to run")
    sub = before._submitter
    await wait_until(lambda: turn_queued(sub.redis, sub.keys, sub.trainer_id,
                                          before._key(first.episode_id)), what="it queued")
    turn.cancel()
    await before.close()  # the trainer is gone before the turn's result arrives

    after = make_client().episodes(owner="run-7")
    assert await after.recover(timeout_s=30) == 1
    record = await after.get(first.episode_id)
    sequence = [11, 12, *first.tokens, 21]
    assert record.state == EpisodeState.IDLE and record.turns == 2
    assert record.tokens == sequence + expected_tokens(pack_tokens(sequence), 0, 5, 32_000)
    assert record.mask == [0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1]
    again = await after.turn(first.episode_id, [31])  # and it goes on
    assert (await after.get(first.episode_id)).tokens == record.tokens + [31, *again.tokens]
    assert await after.recover(timeout_s=1) == 0  # nothing left
    await after.close()


async def _running(episodes, episode_id: str) -> bool:
    return (await episodes.get(episode_id)).state == EpisodeState.RUNNING


async def test_retention_keeps_the_version_of_a_live_episode(make_client, make_worker, redis, tmp_path):
    client = make_client(weight_store=str(tmp_path / "store"))
    for v in (1, 2, 3):  # registered by hand: retention only reads entries
        await client.registry.register(VersionEntry(v, str(tmp_path / f"v{v}"), [], 0, 0.0, "t",
                                                    owned=False))
    make_worker(engine=InstantEngine(version=2), follow=False, pinned=True)
    episodes = client.episodes()
    [first] = await episodes.start([1], sampling=SAMPLING, exact_version=2)
    assert first.version == 2
    assert await needed_by_episodes(redis, client.keys) == {2}
    removed = await retain(redis, client.keys, None, keep=1)
    assert 2 not in removed and await client.registry.get(2) is not None
    await episodes.end(first.episode_id)
    assert await needed_by_episodes(redis, client.keys) == set()
    assert await redis.zcard(client.keys.episodes) == 0
    await episodes.close()


async def test_the_record_is_named_by_names_py(make_client, make_worker, redis):
    make_worker()
    client = make_client()
    episodes = client.episodes()
    [first] = await episodes.start([1], sampling=SAMPLING)
    record = await redis.hgetall(client.keys.episode(client.trainer_id, first.episode_id))
    assert {k.decode() for k in record} == {f.value for f in EpisodeField}
    await episodes.close()


async def test_turns_go_to_the_worker_that_served_the_previous_one(make_client, make_worker, redis):
    """Prefix-cache affinity: two workers, 8 episodes of 4 turns; every turn is served where the
    episode's first turn was (its routed stream is read by that worker alone)."""
    make_worker("wa", delay_s=0.2, max_inflight=4)
    make_worker("wb", delay_s=0.2, max_inflight=4)
    client = make_client()
    episodes = client.episodes()
    starts = await asyncio.gather(*(episodes.start([i + 1, 2], sampling=SAMPLING) for i in range(8)))
    firsts = [t for [t] in starts]
    for k in range(3):
        turns = await asyncio.gather(*(episodes.turn(t.episode_id, [k]) for t in firsts))
        assert [t.worker_id for t in turns] == [t.worker_id for t in firsts]
    assert {t.worker_id for t in firsts} == {"wa", "wb"}, "both workers served first turns"
    routed = {k.decode() for k in await redis.hkeys(client.keys.routed)}
    trainer = episodes._submitter.trainer_id
    assert routed == {client.keys.routed_work(trainer, w, 0) for w in ("wa", "wb")}
    # Without affinity, turns go to the shared stream (any worker).
    loose = client.episodes(affinity=False)
    [t] = await loose.start([1], sampling=SAMPLING)
    assert await loose.turn(t.episode_id, [2])
    assert await redis.hlen(client.keys.routed) == 2
    await episodes.close()
    await loose.close()


async def test_a_turn_for_a_full_worker_goes_to_any_worker(make_client, make_worker, redis):
    """Affinity only while the worker has room: with its one slot taken by another episode's
    turn, a turn goes to the shared stream and an idle worker serves it (its cache is lost,
    never its time)."""
    make_worker("full", delay_s=1.0, max_inflight=1)
    client = make_client()
    episodes = client.episodes()
    [a] = await episodes.start([1, 2], sampling=SAMPLING)
    [b] = await episodes.start([3, 4], sampling=SAMPLING)
    assert a.worker_id == b.worker_id == "full"
    make_worker("idle", max_inflight=4)
    routed = client.keys.routed_work(episodes._submitter.trainer_id, "full", 0)
    first = asyncio.create_task(episodes.turn(a.episode_id, [5]))
    try:
        await wait_until(lambda: _held_on(redis, routed), what="the first turn held by its worker")
        second = await episodes.turn(b.episode_id, [6])
        assert second.worker_id == "idle"
        assert (await first).worker_id == "full"
    finally:
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        await episodes.close()


async def _held_on(redis, stream: str) -> bool:
    return bool(await redis.exists(stream)) and (await redis.xpending(stream, Group.WORKERS))["pending"] == 1


async def test_a_worker_claims_turns_routed_to_it_before_shared_groups(redis, policy):
    """With one free slot and both a routed turn and a shared group waiting, the routed turn
    (its prefix cache is here) is claimed first, whatever the round-robin's rotation."""
    keys = Keys(policy)
    queue = WorkQueue(redis, keys, "w1", job_ttl_s=60)
    shared, mine = keys.work("t"), keys.routed_work("t", "w1", 0)
    for stream in (shared, mine):  # (as enqueue makes them: a worker makes no stream)
        await redis.xgroup_create(stream, Group.WORKERS, id="0", mkstream=True)
    for _ in range(4):  # every rotation of the round-robin
        await redis.xadd(shared, {"x": b"s"})
        await redis.xadd(mine, {"x": b"m"})
        [claimed] = await queue.claim([shared, mine], 1)
        assert claimed.stream == mine
        [claimed] = await queue.claim([shared, mine], 1)
        assert claimed.stream == shared


async def test_a_worker_killed_mid_episode_the_episode_goes_on_elsewhere(make_client, spawn_worker, redis):
    """Acceptance 4: the worker serving an episode is SIGKILLed while a turn runs on it; the turn
    is served by the other worker (lease lapsed, its routed stream read by everyone once its
    heartbeat is gone), tokens exact, the turn applied once."""
    flags = {"lease_s": 1.0, "instant_delay_s": 1.5}
    a, b = spawn_worker("ka", **flags), spawn_worker("kb", **flags)
    client = make_client()
    episodes = client.episodes()
    [first] = await episodes.start([3, 4], sampling=SAMPLING, deadline_s=60)
    victim, other = (a, b) if first.worker_id == "ka" else (b, a)
    running = asyncio.create_task(episodes.turn(first.episode_id, [5], deadline_s=60))
    routed = client.keys.routed_work(episodes._submitter.trainer_id, victim.worker_id, 0)

    async def claimed():
        return await redis.exists(routed) and (await redis.xpending(routed, "workers"))["pending"] == 1

    give_up = asyncio.get_running_loop().time() + 10
    while not await claimed():
        assert asyncio.get_running_loop().time() < give_up, "the turn was not routed to its worker"
        await asyncio.sleep(0.02)
    victim.signal(9)
    turn = await asyncio.wait_for(running, 40)
    assert turn.worker_id == other.worker_id
    expected = [3, 4] + first.tokens + [5]
    assert turn.tokens == expected_tokens(pack_tokens(expected), 0, 5, 32_000)
    # The next turn stays on the survivor.
    again = await episodes.turn(first.episode_id, [6], deadline_s=60)
    assert again.worker_id == other.worker_id
    episode = await episodes.get(first.episode_id)
    assert episode.turns == 3 and episode.tokens == expected + turn.tokens + [6] + again.tokens
    await episodes.close()


async def test_an_episode_is_listed_for_retention_as_long_as_its_ttl(make_client, make_worker, redis):
    make_worker()
    client = make_client()
    episodes = client.episodes()
    [first] = await episodes.start([1], sampling=SAMPLING, ttl_s=7200)
    key = client.keys.episode(client.trainer_id, first.episode_id)
    now = (await redis.time())[0]
    assert 7190 < await redis.zscore(client.keys.episodes, key) - now <= 7200
    assert 7190 < await redis.ttl(key) <= 7200
    await episodes.turn(first.episode_id, [2])
    assert 7190 < await redis.zscore(client.keys.episodes, key) - now <= 7201
    await episodes.close()


async def test_when_no_worker_serves_its_version_any_more_a_turn_fails_clearly(
        make_client, make_worker, tmp_path):
    """Followers only move forward: once every worker serves v2, a turn of an episode on v1 that
    may not move fails (nothing added, the episode idle), and one that may move goes on on v2."""
    import torch

    make_worker()
    client = make_client(weight_store=str(tmp_path / "store"))
    episodes = client.episodes()
    [stay] = await episodes.start([1, 2], sampling=SAMPLING)
    [move] = await episodes.start([1, 2], sampling=SAMPLING, move=True, max_staleness=0)
    await client.publish_weights(1, {"w": torch.zeros(2)})
    with pytest.raises(EpisodeError, match=r"window \[0, 0\] can never be served") as failed:
        await episodes.turn(stay.episode_id, [3], deadline_s=30)
    assert failed.value.reason == "failed"
    record = await episodes.get(stay.episode_id)
    assert record.turns == 1 and record.state == EpisodeState.IDLE and record.reason
    turn = await episodes.turn(move.episode_id, [3], deadline_s=30)
    assert turn.version == 1
    assert (await episodes.get(move.episode_id)).token_versions[-1] == 1
    await episodes.close()


async def test_a_turn_on_an_empty_routed_stream_keeps_the_trainers_queued_bytes(redis, policy):
    """The byte quota's drift reset (an empty stream means nothing queued) must not fire on a
    routed stream while the trainer's bytes sit on its own stream: the count would drop and
    the trainer could pass its quota."""
    keys = Keys(policy)
    scripts = Scripts(redis)
    enqueue = dict(trainer="t", quota=100, byte_quota=10_000, deadline=0.0, meta=b"")
    await jobs.enqueue(redis, scripts, keys, job_id="a", items=[b"x" * 300], routed=True, **enqueue)
    routed = keys.routed_work("t", "w1", 0)
    await jobs.enqueue(redis, scripts, keys, job_id="b", items=[b"y" * 200], stream=routed, routed=True,
                       **enqueue)
    assert await jobs.queued_bytes(redis, keys, "t") == 500


async def test_status_counts_the_groups_on_routed_streams(redis, policy):
    """`rollq status`, the dashboard and the gateway's queue metrics (all `policy_status`) count
    a trainer's turns routed to a worker with its own queue."""
    keys = Keys(policy)
    scripts = Scripts(redis)
    enqueue = dict(trainer="t", quota=100, byte_quota=10_000, deadline=0.0, meta=b"", routed=True)
    await jobs.enqueue(redis, scripts, keys, job_id="a", items=[b"x"], **enqueue)
    routed = keys.routed_work("t", "w1", 0)
    await redis.hset(keys.routed, routed, 0)  # as Episodes does before it routes a turn
    await jobs.enqueue(redis, scripts, keys, job_id="b", items=[b"y", b"z"], stream=routed, **enqueue)
    [queue] = (await policy_status(redis, policy)).queues
    assert (queue.trainer, queue.waiting, queue.running) == ("t", 3, 0)


def chat_tokenizer(template: str, specials: list[str]):
    """A byte-level BPE tokenizer (kept whitespace: ChatML's "\n" is a token) with `specials` as
    special tokens and `template`, trained here in milliseconds: no model needed."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>", *specials],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(["user assistant model tool system hello there how are you fine"], trainer)
    core.add_special_tokens([AddedToken(t, special=True) for t in specials])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", chat_template=template)


@pytest.mark.parametrize("family", ["chatml", "qwen3", "llama3", "gemma"])
def test_a_chat_continuation_is_what_the_template_writes_after_the_reply(tmp_path, family):
    """Issue 42 item 1, for episodes: the new tokens after a reply are exactly what the template's
    own rendering of the whole conversation has there: after a reply that ended with the
    template's end token (ChatML: "\n<|im_start|>user..." follows a sampled <|im_end|>), and after
    one cut by max_tokens (the whole closing, end token included). Checked against Hugging Face's
    rendering of the whole conversation (these templates re-render this history unchanged; Qwen3's,
    which renders a conversation's last assistant message with an empty <think></think> and
    earlier ones without, was refused before: its continuation was taken as a difference of two
    renderings)."""
    from models import CHATML_TEMPLATE, GEMMA_TEMPLATE, LLAMA3_TEMPLATE, QWEN3_TEMPLATE

    from rollq.client.episodes import chat_continuation

    template, end, specials = {
        "chatml": (CHATML_TEMPLATE, "<|im_end|>", ["<|im_start|>", "<|im_end|>"]),
        "qwen3": (QWEN3_TEMPLATE, "<|im_end|>", ["<|im_start|>", "<|im_end|>"]),
        "llama3": (LLAMA3_TEMPLATE, "<|eot_id|>", ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]),
        "gemma": (GEMMA_TEMPLATE, "<end_of_turn>", ["<start_of_turn>", "<end_of_turn>"]),
    }[family]
    tokenizer = chat_tokenizer(template, specials)

    def render(messages):
        return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                  return_dict=False))

    first = [{"role": "user", "content": "hello there"}]
    reply, new = "how are you", [{"role": "user", "content": "fine"}]
    whole = render([*first, {"role": "assistant", "content": reply}, *new])
    for sampled in (tokenizer.encode(reply, add_special_tokens=False)
                    + [tokenizer.convert_tokens_to_ids(end)],  # ended by its stop token
                    tokenizer.encode(reply, add_special_tokens=False)):  # cut by max_tokens
        assert render(first) + sampled + chat_continuation(tokenizer, new, sampled) == whole
    if family in ("chatml", "qwen3"):  # the "\n" the template writes after <|im_end|> is kept
        after_end = chat_continuation(tokenizer, new, sampled=[tokenizer.convert_tokens_to_ids(end)])
        assert tokenizer.decode(after_end).startswith("\n<|im_start|>user")


async def test_a_turn_skips_the_closings_end_token_only_after_a_reply_that_ended_with_it(
        make_client, make_worker):
    """`Episodes.turn(end_token_at=k)` (the gateway's `messages` turns): new_tokens[k] is the
    closing's end token; it and what comes before it are not appended when the record ends with
    it (the reply sampled it), and are otherwise. The instant engine's last token stands in for a
    sampled end token: its samples are known in advance."""
    make_worker()
    episodes = make_client().episodes()
    prompt = [11, 12, 13]
    [first] = await episodes.start(prompt, sampling=SAMPLING)
    last = first.tokens[-1]
    turn = await episodes.turn(first.episode_id, [9, last, 21, 22], end_token_at=1)
    assert turn.new_tokens == [21, 22]
    other = turn.tokens[-1] + 1  # not the token the reply ended with: all of the closing
    turn2 = await episodes.turn(first.episode_id, [other, 23], end_token_at=0)
    assert turn2.new_tokens == [other, 23]
    episode = await episodes.end(first.episode_id)
    assert episode.tokens == prompt + first.tokens + [21, 22] + turn.tokens + [other, 23] + turn2.tokens
    with pytest.raises(InvalidInput, match="end_token_at"):
        await episodes.turn(first.episode_id, [1], end_token_at=1)
    await episodes.close()
