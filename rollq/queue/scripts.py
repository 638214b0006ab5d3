"""The Lua scripts behind every atomic state transition, loaded from `lua/`.

Each script runs behind `names.lua_preamble()`: its names (fields, groups, states, replies) are
Python's, never spelled in the script. redis-py's `Script` runs EVALSHA and loads the script
again on NOSCRIPT, so a Redis restart (which forgets loaded scripts) needs no handling here.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript

from rollq.queue.connection import check_replicated, durability, queue_wait
from rollq.queue.names import lua_preamble

NAMES = ("enqueue", "finish", "renew", "reclaim", "release", "ack", "cancel", "publish", "pin",
         "retire")


@cache
def body(name: str) -> str:
    """The script as written in `lua/` (without the preamble)."""
    return resources.files("rollq.queue").joinpath("lua", f"{name}.lua").read_text()


@cache
def source(name: str) -> str:
    """The script as Redis runs it: the names it uses, then its body."""
    return lua_preamble() + body(name)


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


async def call_durably(script: AsyncScript, redis: Redis, *, keys: list, args: list):
    """`script(keys, args)` on `redis`; when the connection asks for durability (a URL's
    `durable_replicas`), its reply only after WAIT shows that many replicas hold its writes (else
    NotReplicated). Script and WAIT share one pipeline, so one round trip and one connection."""
    wanted = durability(redis)
    if not wanted.replicas:
        return await script(keys=keys, args=args, client=redis)
    async with redis.pipeline(transaction=False) as pipe:
        await script(keys=keys, args=args, client=pipe)
        queue_wait(pipe, keys[0], wanted)
        reply, acked = await pipe.execute(raise_on_error=False)
    if isinstance(reply, Exception):
        raise reply
    check_replicated(acked, wanted)
    return reply
