"""The Lua scripts behind every atomic state transition, loaded from `lua/`.

redis-py's `Script` runs EVALSHA and loads the script again on NOSCRIPT, so a Redis restart
(which forgets loaded scripts) needs no handling here.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

NAMES = ("enqueue", "finish", "renew", "reclaim", "release", "ack", "cancel", "publish", "pin",
         "retire")


@cache
def source(name: str) -> str:
    return resources.files("rollq.queue").joinpath("lua", f"{name}.lua").read_text()


class Scripts:
    """The scripts registered on one Redis client."""

    def __init__(self, redis: Redis):
        for name in NAMES:
            setattr(self, name, redis.register_script(source(name)))

    enqueue: AsyncScript
    finish: AsyncScript
    renew: AsyncScript
    reclaim: AsyncScript
    release: AsyncScript
    ack: AsyncScript
    cancel: AsyncScript
    publish: AsyncScript
    pin: AsyncScript
    retire: AsyncScript
