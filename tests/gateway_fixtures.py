"""A running gateway on a real loopback port, with a token file, for the gateway tests."""

from __future__ import annotations

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
