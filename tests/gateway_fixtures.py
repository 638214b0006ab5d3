"""A running gateway on a real loopback port, with a token file, for the gateway tests."""

from __future__ import annotations

import asyncio
import json
import secrets
from dataclasses import dataclass
from pathlib import Path

import aiohttp


@dataclass
class RunningGateway:
    url: str
    tokens: dict[str, str]
    """trainer -> bearer token."""
    weight_root: Path

    def headers(self, trainer: str = "alice") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.tokens[trainer]}"}

    async def live(self, policy: str, timeout_s: float = 20) -> None:
        """Wait until the gateway sees a live worker of `policy` (an in-process worker beats
        shortly after it is made; episode routes answer 409 before that)."""
        give_up = asyncio.get_running_loop().time() + timeout_s
        async with aiohttp.ClientSession(self.url, headers=self.headers()) as http:
            while True:
                async with http.get(f"/v1/policies/{policy}/workers") as r:
                    if r.status == 200 and await r.json():  # the live workers' list
                        return
                if asyncio.get_running_loop().time() > give_up:
                    raise AssertionError(f"no live worker of {policy!r} after {timeout_s} s")
                await asyncio.sleep(0.05)


def write_tokens(path: Path, policy: str) -> dict[str, str]:
    """alice and bob may use the test's policy, alice may also publish and observe; mallory may
    use (and publish to) only another policy."""
    tokens = {name: secrets.token_hex(16) for name in ("alice", "bob", "mallory")}
    path.write_text(json.dumps({
        tokens["alice"]: {"trainer": "alice", "policies": [policy],
                          "scopes": ["rollouts", "publish", "observe"]},
        tokens["bob"]: {"trainer": "bob", "policies": [policy]},
        tokens["mallory"]: {"trainer": "mallory", "policies": ["elsewhere"],
                            "scopes": ["rollouts", "publish"]},
    }))
    return tokens


async def sse_events(response: aiohttp.ClientResponse, count: int) -> list[dict]:
    """The first `count` `result` events of a Server-Sent Events response, with their ids."""
    events, event = [], {}
    async for raw in response.content:
        line = raw.decode().rstrip("\n")
        if not line:
            if event.get("event") == "result":
                events.append({"id": event["id"], **json.loads(event["data"])})
                if len(events) == count:
                    return events
            event = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(": ")
            event[name] = value
    return events
