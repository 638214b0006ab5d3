"""The Lua scripts behind every atomic state transition, loaded from `lua/`.

Each script runs behind `names.lua_preamble()`: its names (fields, groups, states, replies) are
Python's, never spelled in the script. Called alone, redis-py's `Script` runs EVALSHA and loads
the script again on NOSCRIPT. In a pipeline it would first ask SCRIPT EXISTS, one more round
trip per pipeline; `pipelined` sends bare EVALSHA and loads only when Redis answers NOSCRIPT (a
restart forgets loaded scripts).
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from rollq.queue.connection import Durability, check_replicated, durability, queue_wait
from rollq.queue.names import lua_preamble

NAMES = ("enqueue", "finish", "renew", "reclaim", "release", "ack", "cancel", "publish", "pin",
         "retire", "episode_start", "episode_turn", "episode_apply", "episode_end",
         "episode_unsubmitted", "episode_owner", "route_prune", "store_images", "trainer_prune",
         "results_expire", "conversation_append", "conversation_held", "score_requeue", "score_pick")


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
    episode_start: AsyncScript
    episode_turn: AsyncScript
    episode_apply: AsyncScript
    episode_end: AsyncScript
    episode_unsubmitted: AsyncScript
    episode_owner: AsyncScript
    route_prune: AsyncScript
    store_images: AsyncScript
    trainer_prune: AsyncScript
    results_expire: AsyncScript
    conversation_append: AsyncScript
    conversation_held: AsyncScript
    score_requeue: AsyncScript
    score_pick: AsyncScript


Call = tuple[AsyncScript, list, list]
"""A script with its keys and arguments."""


async def pipelined(redis: Redis, calls: list[Call], *, durable_key: str | None = None):
    """Run `calls` in one pipeline (one round trip), each as a bare EVALSHA; returns their replies
    (errors as values) and, when `durable_key` is given and the connection asks for durability,
    the reply of a WAIT sent behind them on the same connection (else None).

    A call answered NOSCRIPT did not run: those calls are sent again, in order, as EVAL (which
    runs the script and caches it: a SCRIPT LOAD first would leave a window in which a restarted
    server loses it again, see connection.py's `_EvalWhenLost`), with a WAIT of their own. A
    cluster pipeline resends such calls itself (connection.py)."""
    wanted = durability(redis) if durable_key is not None else Durability()
    replies, acked = await _send(redis, calls, durable_key, wanted)
    missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
    if missing:
        again, acked_again = await _send(redis, [calls[i] for i in missing], durable_key, wanted,
                                         as_eval=True)
        for i, reply in zip(missing, again):
            replies[i] = reply
        acked = _fewer(acked, acked_again)
    return replies, acked


async def _send(redis: Redis, calls: list[Call], durable_key: str | None, wanted: Durability, *,
                as_eval: bool = False):
    async with redis.pipeline(transaction=False) as pipe:
        for script, keys, args in calls:
            if as_eval:
                pipe.execute_command("EVAL", script.script, len(keys), *keys, *args)
            else:
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        if wanted.replicas:
            queue_wait(pipe, durable_key, wanted)
        replies = await pipe.execute(raise_on_error=False)
    return (replies[:-1], replies[-1]) if wanted.replicas else (replies, None)


def _fewer(acked, acked_again):
    """The weaker of two WAIT replies: the writes of both sends must be on the replicas."""
    if acked is None or isinstance(acked, Exception):
        return acked
    return acked_again if isinstance(acked_again, Exception) else min(int(acked), int(acked_again))


async def call_durably(script: AsyncScript, redis: Redis, *, keys: list, args: list):
    """`script(keys, args)` on `redis`; when the connection asks for durability (a URL's
    `durable_replicas`), its reply only after WAIT shows that many replicas hold its writes (else
    NotReplicated). Script and WAIT share one pipeline, so one round trip and one connection."""
    wanted = durability(redis)
    if not wanted.replicas:
        return await script(keys=keys, args=args, client=redis)
    [reply], acked = await pipelined(redis, [(script, keys, args)], durable_key=keys[0])
    if isinstance(reply, Exception):
        raise reply
    check_replicated(acked, wanted)
    return reply
