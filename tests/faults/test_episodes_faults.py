"""Episodes through Redis faults: an outage longer than redis-py's retries (and the client's
reconnect window) while the router applies a turn's result loses no turn."""

from __future__ import annotations

import asyncio
import time

from helpers import wait_until

from rollq.queue import jobs
from rollq.queue.names import EpisodeState

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
    assert outage and outage[0].done()
    record = await episodes.get(first.episode_id)
    assert record.state == EpisodeState.IDLE and record.turns == 2
    assert record.tokens == [1, 2, *first.tokens, 4, *turn.tokens]
    sub = episodes._submitter
    await wait_until(lambda: _acked(sub), what="the result acknowledged (after it was applied)")
    again = await episodes.turn(first.episode_id, [5])
    assert (await episodes.get(first.episode_id)).tokens[-len(again.tokens) - 1:] == [5, *again.tokens]
    await episodes.close()


def _back_after(server, down_s: float) -> None:
    time.sleep(down_s)  # the outage itself (the fault), not a wait for an event
    server.start()


async def _acked(client) -> bool:
    return not await jobs.outstanding(client.redis, client.keys, client.trainer_id)
