"""A trainer process of `rollq chaos --episodes`: runs multi-turn episodes (n branches) through the
Python client or through the gateway's episode routes, and journals every call and its outcome.

The chaos runner SIGKILLs and restarts it with the same trainer id and owner. The journal (one
JSON object a line, fsynced before the call it announces and after the reply it records) is
what the checker (`rollq/harness/chaos/episodes.py`) compares with the episode records:

    {"k": "send", "u": marker, "b": [branches], "op": "start"|"turn"|"end", "new": [...], ...}
    {"k": "ok", "u": marker, "out": [[sampled tokens of branch 0], ...]}   served (or ended: "rec")
    {"k": "refused", "u": marker, "why": ...}    the service said nothing was added
    {"k": "unknown", "u": marker, "why": ...}    no answer (a kill, an outage, a timeout)
    {"k": "hung", "u": marker}                   no answer within the deadline + HANG_S
    {"k": "abandon", "b": branch}                 still running long after a call without answer
    {"k": "life"}, {"k": "recovered", ...}        a (re)start of the process, its recover()
    {"k": "stop"}                                 the trainer finished every episode it ran

Every turn's new tokens are one marker token, unique across trainers and lives, so the checker
finds each turn in a record; a start's prompt begins with its marker.

    python -m rollq.harness.chaos.episode_trainer REDIS_URL JOURNAL INDEX LIFE SEED STOP_FILE [GATEWAY_URL]
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from pathlib import Path

import aiohttp
from redis.exceptions import RedisError

from rollq.harness.chaos.trainer import POLICY
from rollq.client import RolloutClient
from rollq.client.episodes import EpisodeError
from rollq.protocol import InvalidInput

MARKER_BASE = 100_000_000
"""Markers are `MARKER_BASE * (index + 1) + life * 100_000 + count`: above any sampled token."""
MAX_TOKENS = 3
DEADLINE_S = 20.0
HANG_S = 30.0
"""A call that has not returned this long after its turn's deadline is `hung`."""
EPISODES_AT_ONCE = 3
REUSE_TTL_S = 15
"""The ttl of a third of the episodes, whose ids are used again once their records expired."""
HTTP_TRAINER = "anonymous"
"""The trainer of a `--no-auth` gateway."""


class Refused(Exception):
    """The service answered: the call added nothing."""


class Unknown(Exception):
    """No answer: the call may or may not have been applied."""


class SdkDriver:
    def __init__(self, client: RolloutClient, owner: str):
        self.client, self.owner = client, owner
        self.episodes = client.episodes(owner=owner)

    async def _reopen(self) -> None:
        """The object stopped (its owner lease was lost, e.g. in an outage): a trainer opens a
        new one with the same owner, which applies what the old one left."""
        old, self.episodes = self.episodes, self.client.episodes(owner=self.owner)
        await old.close()

    async def call(self, op: str, branch: str, new: list[int], n: int, ep: str, ttl_s: int):
        try:
            if op == "start":
                turns = await self.episodes.start(new, n, {"max_tokens": MAX_TOKENS}, episode_id=ep,
                                                  ttl_s=ttl_s, deadline_s=DEADLINE_S)
                return [t.tokens for t in turns]
            if op == "turn":
                return [(await self.episodes.turn(branch, new, deadline_s=DEADLINE_S)).tokens]
            return _record(await self.episodes.end(branch))
        except EpisodeError as e:
            if e.reason == "owner":  # this object no longer reads the owner's results
                await self._reopen()
                raise Unknown(f"{e.reason}: {e}") from None
            raise Refused(f"{e.reason}: {e}") from None
        except InvalidInput as e:  # (an id still taken)
            raise Refused(str(e)) from None
        except (RedisError, OSError) as e:
            raise Unknown(repr(e)) from None

    async def get(self, branch: str):
        try:
            return _record(await self.episodes.get(branch))
        except EpisodeError as e:
            if e.reason == "owner":
                await self._reopen()
                raise Unknown(str(e)) from None
            return None
        except (RedisError, OSError) as e:
            raise Unknown(repr(e)) from None

    async def close(self):
        await self.episodes.close()


def _record(e) -> dict:
    return {"state": str(e.state), "tokens": e.tokens, "mask": e.mask, "turns": e.turns}


class HttpDriver:
    def __init__(self, session: aiohttp.ClientSession, base: str):
        self.session, self.base = session, f"{base}/v1/policies/{POLICY}/episodes"

    async def _request(self, method: str, path: str, body: dict | None = None):
        try:
            async with self.session.request(method, self.base + path, json=body) as r:
                data = await r.json(content_type=None)
        except (aiohttp.ClientError, OSError, json.JSONDecodeError) as e:
            raise Unknown(repr(e)) from None
        if r.status in (404, 409, 410, 422, 400):
            raise Refused(f"{r.status}: {data}")
        if r.status >= 300:
            raise Unknown(f"{r.status}: {data}")
        return data

    async def call(self, op: str, branch: str, new: list[int], n: int, ep: str, ttl_s: int):
        if op == "start":
            data = await self._request("POST", "", {"prompt": new, "n": n, "episode_id": ep, "ttl_s": ttl_s,
                                                    "sampling": {"max_tokens": MAX_TOKENS},
                                                    "deadline_s": DEADLINE_S})
            return [t["tokens"] for t in data["episodes"]]
        if op == "turn":
            data = await self._request("POST", f"/{branch}/turns", {"tokens": new, "deadline_s": DEADLINE_S})
            return [data["tokens"]]
        data = await self._request("DELETE", f"/{branch}")
        return {k: data[k] for k in ("state", "tokens", "mask", "turns")}

    async def get(self, branch: str):
        try:
            data = await self._request("GET", f"/{branch}")
        except Refused as e:
            if str(e).startswith("404"):
                return None
            raise Unknown(str(e)) from None  # (409: a restarted gateway waits out its old lease)
        return {k: data[k] for k in ("state", "tokens", "mask", "turns")}

    async def close(self):
        pass


class Trainer:
    def __init__(self, journal: Path, index: int, life: int, rng: random.Random, stop: Path, driver):
        self.fd = os.open(journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.index, self.life, self.rng, self.stop, self.driver = index, life, rng, stop, driver
        self.count = 0
        self.expired: dict[str, float] = {}
        """Episode ids of this life ended with a short ttl -> when: reused once expired."""

    def write(self, **line) -> None:
        os.write(self.fd, (json.dumps(line) + "\n").encode())
        os.fsync(self.fd)

    def marker(self) -> int:
        self.count += 1
        return MARKER_BASE * (self.index + 1) + self.life * 100_000 + self.count

    async def call(self, op: str, branches: list[str], new: list[int], n: int = 1, ep: str = "",
                   ttl_s: int = 600):
        """One journalled call; its outcome, or None when it added nothing or may not have."""
        u = new[0] if new else self.marker()
        self.write(k="send", u=u, op=op, b=branches, new=new, n=n, ep=ep)
        try:
            out = await asyncio.wait_for(self.driver.call(op, branches[0], new, n, ep, ttl_s),
                                         DEADLINE_S + HANG_S)
        except Refused as e:
            self.write(k="refused", u=u, why=str(e)[:300])
            return None
        except Unknown as e:
            self.write(k="unknown", u=u, why=str(e)[:300])
            return None
        except TimeoutError:
            self.write(k="hung", u=u)
            return None
        self.write(k="ok", u=u, out=out)
        return out

    async def settle(self, branch: str) -> bool:
        """After a call without an answer: wait until the branch is idle again (the turn applied or
        not: its record says) or gone; False if it is still running past a deadline."""
        give_up = asyncio.get_running_loop().time() + DEADLINE_S + HANG_S
        while asyncio.get_running_loop().time() < give_up:
            try:
                record = await self.driver.get(branch)
            except Unknown:
                record = {"state": "running"}
            if record is None or record["state"] != "running":
                return record is not None and record["state"] == "idle"
            await asyncio.sleep(0.5)
        self.write(k="abandon", b=branch, why="running past its deadline")
        return False

    async def episode(self, slot: int) -> None:
        n = self.rng.randint(1, 3)
        marker = self.marker()
        ep, ttl_s = f"t{self.index}-{self.life}-{self.count}", 600
        now = asyncio.get_running_loop().time()
        reusable = [e for e, ended in self.expired.items() if ended + REUSE_TTL_S + 2 < now]
        if reusable and self.rng.random() < 0.5:  # an id whose record expired: a new episode
            ep = self.rng.choice(reusable)
            del self.expired[ep]
        if self.rng.random() < 0.3:
            ttl_s = REUSE_TTL_S
        branches = [f"{ep}.{i}" for i in range(n)]
        out = await self.call("start", branches, [marker, self.rng.randint(3, 999)], n=n, ep=ep,
                              ttl_s=ttl_s)
        if out is None and not await self.settle(branches[0]):
            return
        live = list(branches)
        for _ in range(self.rng.randint(1, 4)):
            if self.stop.exists() and self.rng.random() < 0.5:
                break
            for branch in list(live):
                if self.rng.random() < 0.05:  # end() while the turn runs: the two must agree
                    turn = asyncio.create_task(self.call("turn", [branch], [self.marker()]))
                    await asyncio.sleep(self.rng.uniform(0.0, 0.2))
                    await self.call("end", [branch], [])
                    await turn
                    live.remove(branch)
                elif (await self.call("turn", [branch], [self.marker()]) is None
                      and not await self.settle(branch)):
                    live.remove(branch)
        for branch in live:
            await self.call("end", [branch], [])
        if ttl_s == REUSE_TTL_S and len(live) == n:
            self.expired[ep] = asyncio.get_running_loop().time()

    async def run(self) -> None:
        self.write(k="life", life=self.life, pid=os.getpid())
        slots = [asyncio.create_task(self.loop(i)) for i in range(EPISODES_AT_ONCE)]
        await asyncio.gather(*slots)
        self.write(k="stop")

    async def loop(self, slot: int) -> None:
        while not self.stop.exists():
            await self.episode(slot)


async def main(url: str, journal: Path, index: int, life: int, seed: int, stop: Path,
               gateway: str | None) -> None:
    rng = random.Random(seed)
    if gateway:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=DEADLINE_S + HANG_S)) as s:
            await Trainer(journal, index, life, rng, stop, HttpDriver(s, gateway)).run()
        return
    async with RolloutClient(url, policy=POLICY, trainer_id=f"t{index}", reconnect_s=120) as client:
        driver = SdkDriver(client, owner="chaos")
        trainer = Trainer(journal, index, life, rng, stop, driver)
        # The turns an earlier life left running: applied to their episodes now.
        for attempt in range(10):  # (Redis may be down for a while: a trainer tries again)
            try:
                trainer.write(k="recovered", turns=await driver.episodes.recover(timeout_s=DEADLINE_S))
                break
            except (RedisError, EpisodeError) as e:  # (the killed life's owner lease not lapsed yet)
                trainer.write(k="recover-failed", why=repr(e), attempt=attempt)
                await asyncio.sleep(2)
        await trainer.run()
        await driver.close()


if __name__ == "__main__":
    args = sys.argv[1:]
    asyncio.run(main(args[0], Path(args[1]), int(args[2]), int(args[3]), int(args[4]), Path(args[5]),
                     args[6] if len(args) > 6 else None))
