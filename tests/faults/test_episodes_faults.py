"""Episodes through Redis faults: an outage longer than redis-py's retries (and the client's
reconnect window) while the router applies a turn's result loses no turn; one while a turn is
being queued leaves it running no longer than the outage."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest
from helpers import wait_until
from redis.exceptions import ConnectionError as RedisConnectionError

from rollq.queue import jobs
from rollq.queue.connection import connect
from rollq.queue.names import EpisodeField, EpisodeState
from rollq.queue.scripts import source

SAMPLING = {"max_tokens": 3}


async def test_redis_down_while_the_router_applies_a_turn_loses_nothing(durable_redis, make_client,
                                                                        make_worker, monkeypatch):
    """Redis SIGKILLed after the router read a turn's result and before it applied it, back 12 s
    later (past redis-py's retries): the result is applied once Redis is back, then
    acknowledged, and the caller gets its turn; the episode goes on."""
    make_worker(delay_s=0.3)
    client = make_client(reconnect_s=3.0)  # the router must outlast the client's own retries
    episodes = client.episodes(owner="o")
    [first] = await episodes.start([1, 2], sampling=SAMPLING, episode_id="e1")
    apply, outage = episodes._apply, []

    async def apply_after_redis_died(job_id, branches, new_tokens, result, reason=""):
        if not outage and result is not None:
            durable_redis.kill()
            outage.append(asyncio.create_task(asyncio.to_thread(_back_after, durable_redis, 12.0)))
        return await apply(job_id, branches, new_tokens, result, reason)

    monkeypatch.setattr(episodes, "_apply", apply_after_redis_died)
    turn = await asyncio.wait_for(episodes.turn(first.episode_id, [4]), 120)
    # The outage happened; its thread ends once `start` has seen our server answer, which may be
    # a moment after the client already has (CI, load 10: the turn came back first).
    assert outage
    await asyncio.wait_for(outage[0], 30)
    record = await episodes.get(first.episode_id)
    assert record.state == EpisodeState.IDLE and record.turns == 2
    assert record.tokens == [1, 2, *first.tokens, 4, *turn.tokens]
    sub = episodes._submitter
    await wait_until(lambda: _acked(sub), what="the result acknowledged (after it was applied)")
    again = await episodes.turn(first.episode_id, [5])
    assert (await episodes.get(first.episode_id)).tokens[-len(again.tokens) - 1:] == [5, *again.tokens]
    await episodes.close()


@pytest.mark.parametrize("lost", ["enqueue", "turn_reply"])
async def test_a_turn_never_queued_in_an_outage_is_freed_once_redis_is_back(durable_redis, make_client,
                                                                            make_worker, monkeypatch,
                                                                            lost):
    """Redis SIGKILLed after `episode_turn` made the branch `running` and before the turn's job
    was queued (`enqueue`), or before that script's reply was read (`turn_reply`); the call fails
    with a connection error, and so does the undo that would free the branch (Redis is still
    down). Once Redis is back, the same object frees the branch with no further call of it
    (a gateway's Episodes may get none: the trainer whose turn failed may only GET), and the
    episode takes turns again. Before the fix the branch stayed `running` until a restart."""
    make_worker(delay_s=0.1)
    # Few retries of each command and none of the submit: the outage outlasts them at once.
    redis = connect(durable_redis.url, retries=2)
    client = make_client(redis=redis)
    episodes = client.episodes(owner="o")
    episodes._submitter.reconnect_s = 0.0
    [first] = await episodes.start([1, 2], sampling=SAMPLING, episode_id="e1")
    # The router's first ack loads its script: a restart between that load and its EVALSHA is
    # another fault (redis-py reloads once), not this test's.
    await wait_until(lambda: _acked(episodes._submitter), what="the start's result acknowledged")
    if lost == "enqueue":
        submit = episodes._submit

        async def submit_after_redis_died(*args):
            durable_redis.kill()
            return await submit(*args)

        monkeypatch.setattr(episodes, "_submit", submit_after_redis_died)
    else:
        begin = episodes.scripts.episode_turn

        async def turn_whose_reply_is_lost(*args, **kwargs):
            await begin(*args, **kwargs)
            durable_redis.kill()
            raise RedisConnectionError("Connection closed by server.")

        monkeypatch.setattr(episodes.scripts, "episode_turn", turn_whose_reply_is_lost)
    with pytest.raises(RedisConnectionError):
        await episodes.turn(first.episode_id, [4])
    monkeypatch.undo()
    durable_redis.start()
    key = episodes._key(first.episode_id)

    async def freed() -> bool:
        state, reason = await redis.hmget(key, EpisodeField.STATE, EpisodeField.REASON)
        return state.decode() == EpisodeState.IDLE and reason.decode().startswith("not submitted")

    await wait_until(freed, timeout_s=20, what="the unqueued turn freed once Redis is back")
    again = await episodes.turn(first.episode_id, [5])
    record = await episodes.get(first.episode_id)
    assert record.tokens == [1, 2, *first.tokens, 5, *again.tokens] and record.turns == 2
    await episodes.close()
    await redis.aclose()


async def test_a_redis_restart_between_a_scripts_load_and_its_call_does_not_stop_the_router(
        durable_redis, make_client, make_worker, monkeypatch):
    """A restart at the router's script call. redis-py answered NOSCRIPT by loading the script
    and calling it once more, and Redis restarted between the two made that call raise
    NoScriptError, which stopped the router (before 2026-12-06), failing its callers. No rollq
    client makes that second call now (a NOSCRIPT call is sent again as EVAL:
    tests/test_script_lost.py holds that window shut); this keeps the router's side: Redis
    restarted just before its first apply, the start's result is still applied (its caller
    gets its turns, not an error) and acknowledged, and the episode goes on."""
    make_worker(delay_s=0.3)
    client = make_client()
    episodes = client.episodes(owner="o")
    apply_sha = hashlib.sha1(source("episode_apply").encode()).hexdigest()
    send, restarted = episodes.redis.execute_command, []

    async def restart_first(*args, **options):
        if args[:2] == ("EVALSHA", apply_sha) and not restarted:  # the router's first apply
            durable_redis.restart()
            restarted.append(True)
        return await send(*args, **options)

    monkeypatch.setattr(episodes.redis, "execute_command", restart_first)
    [first] = await asyncio.wait_for(episodes.start([1, 2], sampling=SAMPLING, episode_id="e1"), 60)
    assert restarted
    await wait_until(lambda: _acked(episodes._submitter), what="the start's result acknowledged")
    turn = await episodes.turn(first.episode_id, [4])
    record = await episodes.get(first.episode_id)
    assert record.tokens == [1, 2, *first.tokens, 4, *turn.tokens] and record.turns == 2
    await episodes.close()


def _back_after(server, down_s: float) -> None:
    time.sleep(down_s)  # the outage itself (the fault), not a wait for an event
    server.start()


async def _acked(client) -> bool:
    return not await jobs.outstanding(client.redis, client.keys, client.trainer_id)
