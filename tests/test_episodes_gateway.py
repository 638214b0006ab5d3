"""A gateway SIGKILLed mid-turn and restarted with the same --gateway-id takes its episodes over
at start-up: the turn its predecessor left running is applied without any request (also once the
workers pruned the idle trainer from the trainers set), and the episode takes turns again.
(A second live object with one owner: test_episodes_promises.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
from gateway_fixtures import write_tokens
from helpers import turn_queued, wait_until

from rollq.harness.faults import reserved_port
from rollq.queue import jobs
from rollq.queue.keys import Keys
from rollq.queue.names import EpisodeField, EpisodeState

ROOT = Path(__file__).resolve().parents[1]


def spawn_gateway(redis_url: str, tokens: Path, port: int, tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rollq", "gateway", "--redis-url", redis_url, "--tokens", str(tokens),
         "--port", str(port), "--gateway-id", "gw-1", "--weight-store", str(tmp_path / "ws")],
        env=os.environ | {"PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _up(http: aiohttp.ClientSession) -> bool:
    try:
        async with http.get("/health") as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def test_a_gateway_killed_mid_turn_and_restarted_takes_its_episodes_over(
        make_worker, redis, redis_url, policy, tmp_path):
    tokens = write_tokens(tmp_path / "tokens.json", policy)
    make_worker(delay_s=1.5)
    port, gateways = reserved_port(), []
    base = f"/v1/policies/{policy}/episodes"
    derived = "alice~episodes~gw-1"
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}",
                                         headers={"Authorization": f"Bearer {tokens['alice']}"}) as http:
            gateways.append(spawn_gateway(redis_url, tmp_path / "tokens.json", port, tmp_path))
            await wait_until(lambda: _up(http), timeout_s=120, what="the gateway")
            async with http.post(base, json={"prompt": [5, 6], "episode_id": "e1",
                                             "sampling": {"max_tokens": 4}}) as r:
                assert r.status == 201, await r.text()
                sequence = [5, 6, *(await r.json())["episodes"][0]["tokens"]]
            turn = asyncio.ensure_future(http.post(f"{base}/e1.0/turns", json={"tokens": [7]}))
            record_key = Keys(policy).episode("alice", "e1.0")
            await wait_until(lambda: turn_queued(redis, Keys(policy), derived, record_key), what="queued")
            gateways[0].send_signal(signal.SIGKILL)
            gateways[0].wait()
            turn.cancel()
            await wait_until(lambda: redis.xlen(Keys(policy).results(derived)), what="its result")
            # Its work stream is empty now: the workers prune the trainer from the trainers set,
            # while its result waits unapplied (the take-over must not look there).
            await wait_until(lambda: _pruned(redis, policy, derived), what="the trainer pruned")
            gateways.append(spawn_gateway(redis_url, tmp_path / "tokens.json", port, tmp_path))
            await wait_until(lambda: _up(http), timeout_s=120, what="the restarted gateway")
            # No request at all (a GET would open the trainer's Episodes too): the start-up
            # take-over alone applies the turn; read the record from Redis.
            await wait_until(lambda: _idle_in_redis(redis, record_key), what="the turn applied")
            async with http.get(f"{base}/e1.0") as r:
                record = await r.json()
            assert record["turns"] == 2 and record["tokens"][:len(sequence) + 1] == sequence + [7]
            async with http.post(f"{base}/e1.0/turns", json={"tokens": [8]}) as r:
                assert r.status == 200, await r.text()
            await wait_until(lambda: _acked(redis, policy, derived), what="every result acknowledged")

    finally:
        for gateway in gateways:
            gateway.kill()
            gateway.wait()


async def _idle_in_redis(redis, record_key: str) -> bool:
    return await redis.hget(record_key, EpisodeField.STATE) == EpisodeState.IDLE.encode()


async def _pruned(redis, policy: str, trainer: str) -> bool:
    return not await redis.sismember(Keys(policy).trainers, trainer)


async def _acked(redis, policy: str, trainer: str) -> bool:
    return not await jobs.outstanding(redis, Keys(policy), trainer)


async def test_a_take_over_that_meets_redis_unreachable_tries_again(make_client, make_worker, monkeypatch):
    """A gateway restarted into a Redis outage: opening the Episodes it takes over fails at first
    and must be tried again until it holds the owner and its router runs. A GET does not open an
    Episodes, so a trainer that only asks after its unanswered turn would leave it running (the
    CI's episode chaos run: a branch stuck behind a gateway SIGKILL and a Redis fault)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from rollq.gateway import episodes as gateway_episodes

    make_worker()
    episodes = make_client("alice").episodes(owner="gw-1")
    open_now, failed = episodes.open, []

    async def open_once_redis_is_back():
        if len(failed) < 2:
            failed.append("unreachable")
            raise RedisConnectionError("Error 111 connecting: Redis is restarting")
        await open_now()

    monkeypatch.setattr(episodes, "open", open_once_redis_is_back)
    await asyncio.wait_for(gateway_episodes._opened(episodes), timeout=30)
    assert failed == ["unreachable", "unreachable"]
    assert episodes._router is not None and not episodes._router.done()
    await episodes.close()
