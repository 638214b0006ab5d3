"""Episodes keep the queue's promises (issue 27): a reused id, a trainer killed between the
record's change and the enqueue, end() during a turn, one owner per live object, and a turn's
window read in the same script that begins it. docs/reliability.md ("Episodes") lists each."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import turn_queued, wait_until

from rollq.client.episodes import EpisodeError
from rollq.queue import jobs
from rollq.queue.names import EpisodeState

SAMPLING = {"max_tokens": 4}
ROOT = Path(__file__).resolve().parents[1]


async def test_an_episode_id_reused_after_its_record_expired_starts_again(make_client, make_worker,
                                                                           redis):
    """The start's job id must be fresh: the old start's job record outlives the episode's
    (a day against `ttl_s`), and an enqueue under its id would be taken as a repeat."""
    make_worker()
    client = make_client()
    episodes = client.episodes()
    [first] = await episodes.start([1, 2, 3], sampling=SAMPLING, episode_id="e1", ttl_s=1)
    await episodes.end(first.episode_id)
    await wait_until(lambda: _gone(redis, episodes._key(first.episode_id)), what="expiry")
    [again] = await asyncio.wait_for(episodes.start([1, 2, 3], sampling=SAMPLING, episode_id="e1"), 30)
    assert again.tokens == first.tokens
    assert (await episodes.get("e1.0")).state == EpisodeState.IDLE
    await episodes.close()


async def _gone(redis, key: str) -> bool:
    return not await redis.exists(key)


async def _none_outstanding(client) -> bool:
    return not await jobs.outstanding(client.redis, client.keys, client.trainer_id)


CHILD = r'''
import asyncio, sys
from rollq.client import RolloutClient
url, policy, where = sys.argv[1:4]
async def main():
    client = RolloutClient(url, policy=policy, trainer_id="trainer")
    episodes = client.episodes(owner="run-7")
    async def hang(*args, **kwargs):  # killed here: the record says running, nothing is queued
        print("queuing", flush=True)
        await asyncio.sleep(3600)
    if where == "start":
        episodes._submitter.submit_routed = hang
    first, _ = await episodes.start([1, 2, 3], sampling={"max_tokens": 4}, episode_id="e1", n=2)
    print("started", flush=True)
    episodes._submitter.submit_routed = hang
    await episodes.turn(first.episode_id, [7, 8])
asyncio.run(main())
'''


@pytest.mark.parametrize("where", ["start", "turn"])
async def test_a_trainer_killed_before_its_turn_was_queued_leaves_nothing_running(
        make_client, make_worker, redis_url, policy, where):
    """SIGKILL between episode_start / episode_turn (the record: running) and the enqueue: the
    restarted trainer's recover() frees the turn (idle, the reason recorded) and it goes on."""
    make_worker()
    child = subprocess.Popen([sys.executable, "-c", CHILD, redis_url, policy, where],
                             stdout=subprocess.PIPE, text=True, env=os.environ | {"PYTHONPATH": str(ROOT)})
    try:
        while "queuing" not in (line := await asyncio.to_thread(child.stdout.readline)):
            assert line, "the child trainer exited early"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()
    episodes = make_client().episodes(owner="run-7")
    assert await episodes.recover(timeout_s=30) == (2 if where == "start" else 1)
    branch = "e1.0"
    record = await episodes.get(branch)
    assert record.state == EpisodeState.IDLE and record.reason.startswith("not submitted")
    assert record.turns == (0 if where == "start" else 1)
    turn = await episodes.turn(branch, [7, 8])
    assert (await episodes.get(branch)).tokens[-len(turn.tokens) - 2:] == [7, 8, *turn.tokens]
    await episodes.close()


async def test_end_during_a_running_turn_returns_the_episodes_last_record(make_client, make_worker):
    """end() while a turn runs: the turn is discarded when it finishes (turn() says so), and the
    record end() returned never changes after."""
    make_worker(delay_s=1.0)
    client = make_client()
    episodes = client.episodes()
    [first] = await episodes.start([1, 2, 3], sampling=SAMPLING)
    turn = asyncio.create_task(episodes.turn(first.episode_id, [9, 9]))
    sub = episodes._submitter
    await wait_until(lambda: turn_queued(sub.redis, sub.keys, sub.trainer_id,
                                          episodes._key(first.episode_id)), what="it queued")
    ended = await episodes.end(first.episode_id)
    with pytest.raises(EpisodeError, match="ended while this turn ran") as raised:
        await turn
    assert raised.value.reason == "ended"
    await wait_until(lambda: _none_outstanding(sub), what="the turn acknowledged")
    assert repr(await episodes.get(first.episode_id)) == repr(ended)  # (repr: NaN != NaN)
    assert ended.state == EpisodeState.ENDED and ended.turns == 1
    await episodes.close()


async def test_a_second_live_object_with_the_same_owner_is_refused(make_client, make_worker):
    """One owner, one reader of its results: a second live Episodes with that owner is refused
    (two would take each other's results, and their callers would wait for ever); once the first
    is closed, the owner is free at once."""
    make_worker(delay_s=0.1)
    client = make_client()
    first, second = client.episodes(owner="run-7"), client.episodes(owner="run-7")
    # The first keeps its router (and so the lease) for 5 s after its last result; the second
    # waits 1.5 of its own 1 s lease for the owner before it is refused.
    first.owner_lease_s, second.owner_lease_s = 5.0, 1.0
    [a] = await first.start([1, 2], sampling=SAMPLING)
    with pytest.raises(EpisodeError, match="held by another live Episodes object") as refused:
        await second.start([1, 2], sampling=SAMPLING)
    assert refused.value.reason == "owner"
    turns = await asyncio.gather(*(first.turn(a.episode_id, [k]) for k in range(1)),
                                 *(first.start([k, 5], sampling=SAMPLING) for k in range(6)))
    assert len(turns) == 7
    await first.close()
    [b] = await second.start([1, 2], sampling=SAMPLING)  # the owner was given up at close
    assert (await second.turn(b.episode_id, [3])).tokens
    await second.close()


async def test_a_turn_takes_its_window_from_the_script_that_begins_it(make_client, make_worker,
                                                                      monkeypatch):
    """The start applied between a turn's reading of the record and its episode_turn: the turn
    must still be pinned to the version that served the start, not get the episode's window."""
    make_worker(delay_s=0.5)
    client = make_client()
    episodes = client.episodes()
    start = asyncio.create_task(episodes.start([1, 2], sampling=SAMPLING, episode_id="w"))
    await wait_until(lambda: episodes.redis.exists(episodes._key("w.0")), what="the record")
    begin, windows = client.scripts.episode_turn, []

    async def after_the_start(*args, **kwargs):
        await start  # the start is applied (the record idle, its version set) just before
        return await begin(*args, **kwargs)

    async def submitted(job_id, prompt, n, sampling, window, deadline_s, stream):
        windows.append(window)
        return await submit(job_id, prompt, n, sampling, window, deadline_s, stream)

    submit = episodes._submitter.submit_routed
    monkeypatch.setattr(client.scripts, "episode_turn", after_the_start)
    monkeypatch.setattr(episodes._submitter, "submit_routed", submitted)
    turn = await episodes.turn("w.0", [3])
    assert windows == [(0, 0, None)] and turn.version == 0
    await episodes.close()


async def test_a_turn_sent_again_with_its_turn_id_is_appended_once(make_client, make_worker):
    """Without a turn_id a turn sent twice (a retry after a timeout) is two turns: the suspect
    held. With one, the repeat, while it runs or after it was served, gets the same turn back."""
    make_worker(delay_s=0.3)
    episodes = make_client().episodes()
    [first] = await episodes.start([1, 2], sampling=SAMPLING)
    await episodes.turn(first.episode_id, [3])
    await episodes.turn(first.episode_id, [3])
    assert (await episodes.get(first.episode_id)).turns == 3  # no key: each call is a turn
    running = asyncio.create_task(episodes.turn(first.episode_id, [4], turn_id="step-4"))
    sub = episodes._submitter
    await wait_until(lambda: turn_queued(sub.redis, sub.keys, sub.trainer_id,
                                          episodes._key(first.episode_id)), what="it queued")
    again = await episodes.turn(first.episode_id, [4], turn_id="step-4")  # while it runs
    once = await running
    later = await episodes.turn(first.episode_id, [4], turn_id="step-4")  # after it was served
    assert again.tokens == once.tokens == later.tokens and later.new_tokens == [4]
    record = await episodes.get(first.episode_id)
    assert record.turns == 4 and record.tokens[-len(once.tokens) - 1:] == [4, *once.tokens]
    await episodes.close()
