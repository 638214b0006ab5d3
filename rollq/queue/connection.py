"""Redis connections: binary-safe, retried with jittered backoff on connection errors only.

`connect` is the one place that decides single node or Redis Cluster, from the URL:

- `redis://host:6379/0`, `rediss://...` (TLS), `unix:///path`: one Redis.
- `redis+cluster://host1:7000,host2:7001/` (`rediss+cluster://` for TLS): a Redis Cluster. The
  hosts are seeds; the client learns the rest from the cluster and follows failovers. Give
  several, so a client that starts while one seed is down still finds the cluster.

Query parameters `durable_replicas=N` and `durable_timeout_ms=T` (default 1000) make submit,
finish and publish wait (`WAIT N T`) until N replicas hold their writes before they are
acknowledged; see docs/reliability.md. Other query parameters go to redis-py.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import parse_qsl, urlencode

import redis
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode, ClusterPipeline
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import (ClusterError, ConnectionError, NoScriptError, RedisClusterException,
                              ResponseError, SlotNotCoveredError, TimeoutError, TryAgainError)

DEFAULT_URL = "redis://127.0.0.1:6379/0"
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


class Backoff:
    """Exponential backoff with jitter (saq's), for every retry and poll rollq writes itself: each
    wait is the current delay times a factor in [0.5, 1.5), so processes that lost Redis together
    do not all come back at once; the delay then doubles, up to `cap`. `reset()` after a success."""

    def __init__(self, first: float, cap: float):
        self.first, self.cap, self.delay = first, cap, first

    def next(self) -> float:
        """How long to wait now (jittered); the delay doubles for the wait after."""
        wait = self.delay * (0.5 + random.random())
        self.delay = min(self.delay * 2, self.cap)
        return wait

    async def sleep(self) -> None:
        await asyncio.sleep(self.next())

    def reset(self) -> None:
        self.delay = self.first


@dataclass(frozen=True)
class Durability:
    """How many replicas must hold a write before rollq acknowledges it (0: the primary alone)."""

    replicas: int = 0
    timeout_ms: int = 1000


class NotReplicated(TimeoutError):
    """WAIT timed out before enough replicas held the write. The write is on the primary and may
    still be lost in a failover; repeating the call (same job id) waits again. A TimeoutError, so
    the client's reconnect loop repeats a submit by itself."""


class ClusterUnavailable(ConnectionError):
    """The cluster cannot serve a slot for now (a primary failed and no replica has taken over
    yet, or the client's map of the cluster is being rebuilt). A ConnectionError, so every
    retry loop rides out a failover as it rides out a Redis restart."""


def _unavailable(e: BaseException) -> bool:
    if isinstance(e, (ClusterError, TryAgainError, SlotNotCoveredError)):
        return True
    # redis-py raises its base exception also for a wrong call; only these two are transient.
    return isinstance(e, RedisClusterException) and str(e).startswith(
        ("Redis Cluster cannot be connected", "All slots are not covered"))


def unreachable(e: BaseException) -> bool:
    """Redis could not be reached, or a cluster could not serve the slot for now (a failover):
    worth a one-line warning and a retry, not a traceback."""
    return isinstance(e, (ConnectionError, TimeoutError)) or _unavailable(e)


def _as_unavailable(e: BaseException) -> BaseException:
    return ClusterUnavailable(f"redis cluster unavailable: {e}") if _unavailable(e) else e


@dataclass(frozen=True)
class Target:
    url: str
    """What redis-py parses: the first seed for a cluster, without rollq's own parameters."""
    seeds: list[tuple[str, int]] | None
    """Cluster seed nodes (None: a single Redis)."""
    durability: Durability


def parse_url(url: str) -> Target:
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"{url!r} is not a Redis URL (redis://host:6379/0 or redis+cluster://h1:p1,h2:p2/)")
    location, qmark, query = rest.partition("?")
    params = parse_qsl(query, keep_blank_values=True)
    ours = {k: v for k, v in params if k.startswith("durable_")}
    unknown = set(ours) - {"durable_replicas", "durable_timeout_ms"}
    if unknown:
        raise ValueError(f"unknown URL parameter(s) {sorted(unknown)}; rollq knows durable_replicas "
                         "and durable_timeout_ms")
    durability = Durability(int(ours.get("durable_replicas", 0)), int(ours.get("durable_timeout_ms", 1000)))
    if durability.replicas < 0 or durability.timeout_ms < 1:
        raise ValueError(f"durable_replicas must be >= 0 and durable_timeout_ms >= 1, got {durability}")
    rest_query = urlencode([(k, v) for k, v in params if not k.startswith("durable_")])
    seeds = None
    if scheme in CLUSTER_SCHEMES:
        netloc, slash, path = location.partition("/")
        userinfo, at, hosts = netloc.rpartition("@")
        seeds = [_host_port(h) for h in hosts.split(",") if h]
        if not seeds:
            raise ValueError(f"{url!r} names no cluster node")
        scheme = CLUSTER_SCHEMES[scheme]
        location = f"{userinfo}{at}{seeds[0][0]}:{seeds[0][1]}{slash}{path}"
    return Target(f"{scheme}://{location}" + (f"?{rest_query}" if rest_query else ""), seeds, durability)


def _host_port(text: str) -> tuple[str, int]:
    host, colon, port = text.rpartition(":")
    if not colon or not port.isdigit():
        raise ValueError(f"cluster node {text!r} must be host:port")
    return host.strip("[]"), int(port)


def connect(url: str = DEFAULT_URL, *, retries: int = 8) -> Redis | RedisCluster:
    """A client for `url` (see the module docstring; user:password@ for ACL)."""
    target = parse_url(url)
    common = dict(decode_responses=False,
                  retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=2.0), retries),
                  retry_on_error=[ConnectionError, TimeoutError], health_check_interval=30)
    if target.seeds is None:
        client = Single.from_url(target.url, **common)
    else:
        client = Cluster.from_url(target.url, startup_nodes=[ClusterNode(h, p) for h, p in target.seeds[1:]],
                                  **common)
    client.rollq_durability = target.durability
    return client


def durability(redis) -> Durability:
    """The durability `connect` read from the URL (clients made elsewhere: none)."""
    return getattr(redis, "rollq_durability", Durability())


def is_cluster(redis) -> bool:
    return isinstance(redis, RedisCluster)


def queue_wait(pipe, key: str, wanted: Durability) -> None:
    """Queue `WAIT` behind the writes queued on `pipe` for `key`'s node: on the same connection,
    so it waits for exactly those writes (WAIT covers its own connection's last write)."""
    if isinstance(pipe, ClusterPipe):
        pipe.wait_for_replicas(key, wanted)
    else:
        pipe.execute_command("WAIT", wanted.replicas, wanted.timeout_ms)


def check_replicated(reply, wanted: Durability) -> None:
    """Raise NotReplicated unless a WAIT reply shows enough replicas."""
    if isinstance(reply, Exception):
        raise NotReplicated(f"WAIT failed ({reply}); the write may not be on a replica") from reply
    if int(reply) < wanted.replicas:
        raise NotReplicated(f"{int(reply)} of {wanted.replicas} replicas acknowledged within "
                            f"{wanted.timeout_ms} ms; the write may be lost in a failover")


class _EvalWhenLost:
    """Scripts by SHA, so a call answered NOSCRIPT is sent again as EVAL, which runs the script
    and caches it where it ran. redis-py's own answer (SCRIPT LOAD, then EVALSHA again) leaves a
    window: a server restarted in between (redis-py's retry reconnects to it) or a promoted
    replica (Redis does not replicate its script cache) answers NOSCRIPT again, which redis-py
    raises: it ended the episodes router, and would any loop that retries only connection errors
    (tests/test_script_lost.py)."""

    script_sources: ClassVar[dict[str, bytes | str]] = {}
    """Every script registered through any client, by SHA (a SHA names its source, so one map
    serves every client, also one that calls a script another registered)."""

    def register_script(self, script):
        registered = super().register_script(script)
        self.script_sources[registered.sha] = script
        return registered

    async def execute_command(self, *args, **options):
        try:
            return await super().execute_command(*args, **options)
        except NoScriptError:
            # On a cluster, the slot's node may be a promoted replica: redis-py would SCRIPT LOAD
            # on the primaries it knows, which after a failover may not include this one. EVAL
            # runs and caches the script wherever it is sent. (Sent through `self`: a subclass's
            # handling, the cluster's error mapping, applies to it too.)
            source = self.script_sources.get(args[1]) if args and args[0] == "EVALSHA" else None
            if source is None:
                raise
            return await self.execute_command("EVAL", source, *args[2:], **options)


class Single(_EvalWhenLost, Redis):
    """redis-py's async Redis (one server), whose script calls outlive a lost script cache."""


class Cluster(_EvalWhenLost, RedisCluster):
    """redis-py's async RedisCluster, with a pipeline that takes rollq's Lua scripts."""

    def __init__(self, *args, **kwargs):
        # ClusterPipe overrides private parts of redis-py 5's cluster pipeline; redis-py 6
        # rebuilt it, and a WAIT sent to the wrong node would promise durability falsely.
        if (not redis.__version__.startswith("5.") or not hasattr(ClusterPipeline, "_execute")
                or not hasattr(RedisCluster, "_determine_slot")):
            raise RuntimeError(f"rollq's Redis Cluster support is written against redis-py 5.x, found "
                               f"{redis.__version__}; install redis>=5.3,<6 for cluster URLs")
        super().__init__(*args, **kwargs)

    async def execute_command(self, *args, **kwargs):
        try:  # (a NOSCRIPT is sent again as EVAL by `_EvalWhenLost`)
            return await super().execute_command(*args, **kwargs)
        except Exception as e:
            if _unavailable(e):
                raise _as_unavailable(e) from e
            raise

    async def _determine_slot(self, command: str, *args):
        # redis-py asks a node `COMMAND GETKEYS` for commands whose keys move (a round trip
        # before every claim, result read and version poll); a stream read's keys are the first
        # half of what follows STREAMS.
        if isinstance(command, str) and command.upper() in STREAM_READS:
            keys = _stream_keys(command.upper(), args)
            if keys:
                slots = {self.keyslot(k) for k in keys}
                if len(slots) == 1:
                    return slots.pop()
        return await super()._determine_slot(command, *args)

    def pipeline(self, transaction=None, shard_hint=None) -> ClusterPipeline:
        if transaction or shard_hint:  # refused by redis-py's cluster pipeline, with its message
            return super().pipeline(transaction, shard_hint)
        return ClusterPipe(self)


STREAM_READS = {"XREAD": 0, "XREADGROUP": 3}
"""Stream reads, with where their options start (XREADGROUP: after GROUP group consumer)."""


def _stream_keys(command: str, args) -> list:
    """The keys of `XREAD[GROUP] ... [COUNT n] [BLOCK ms] [NOACK] STREAMS k1 .. kn id1 .. idn`
    (args without the command); [] for anything else (redis-py then asks the server)."""
    i = STREAM_READS[command]
    while i < len(args):
        word = args[i].decode(errors="replace") if isinstance(args[i], bytes) else str(args[i])
        word = word.upper()
        if word == "STREAMS":
            rest = args[i + 1:]
            return list(rest[:len(rest) // 2]) if rest and len(rest) % 2 == 0 else []
        i += {"COUNT": 2, "BLOCK": 2, "NOACK": 1}.get(word, len(args))
    return []


class ClusterPipe(ClusterPipeline):
    """redis-py 5.3's async ClusterPipeline, fixed for what rollq sends through pipelines:

    - redis-py's Script awaits `pipe.evalsha(...)`; the cluster pipeline refuses EVALSHA, and
      awaiting it empties the pipeline. Here EVALSHA is queued, and awaiting returns the pipe.
    - A node without the script (a promoted replica: Redis does not replicate its script cache)
      answers NOSCRIPT; those calls are sent again as EVAL, with any WAIT after them.
    - WAIT has no key, so redis-py would send it to its default node; here it goes to the node of
      a given key, on the connection that carried the writes before it.
    """

    def __init__(self, client: Cluster):
        super().__init__(client)
        self._wait_keys: dict[int, str] = {}

    def __await__(self):
        return self._itself().__await__()

    async def _itself(self) -> ClusterPipe:
        return self

    def evalsha(self, sha, numkeys, *keys_and_args):
        return self.execute_command("EVALSHA", sha, numkeys, *keys_and_args)

    def wait_for_replicas(self, key: str, wanted: Durability) -> ClusterPipe:
        self._wait_keys[len(self._command_stack)] = key
        return self.execute_command("WAIT", wanted.replicas, wanted.timeout_ms)

    async def _execute(self, client, stack, raise_on_error=True, allow_redirections=True):
        # Again on every attempt: a retry after a failover must ask the new primary.
        for cmd in stack:
            if cmd.position in self._wait_keys and (cmd.result is None or isinstance(cmd.result, Exception)):
                cmd.kwargs["target_nodes"] = client.get_node_from_key(self._wait_keys[cmd.position])
        try:
            return await super()._execute(client, stack, raise_on_error, allow_redirections)
        except AttributeError:
            # redis-py 5.3: with errors among the replies it looks up the default node, which is
            # None while another task rebuilds the cluster map (a failover). Every reply is in
            # place by then, so return them as it would have.
            if client.get_default_node() is not None or raise_on_error:
                raise
            return [cmd.result for cmd in stack]

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list:
        stack, waits = list(self._command_stack), dict(self._wait_keys)
        try:
            replies = await super().execute(raise_on_error=False, allow_redirections=allow_redirections)
        except Exception as e:
            if _unavailable(e):
                raise _as_unavailable(e) from e
            raise
        finally:
            self._wait_keys = {}
        replies = [_as_unavailable(r) if isinstance(r, Exception) else r for r in replies]
        for reply in replies:
            # As on one Redis, where a broken connection fails the whole pipeline: callers
            # retry connection errors, and expect only replies of Redis itself in the list.
            if isinstance(reply, (ConnectionError, TimeoutError)):
                raise reply
        missing = [i for i, (cmd, r) in enumerate(zip(stack, replies))
                   if isinstance(r, NoScriptError) and cmd.args[0] == "EVALSHA"]
        if missing:
            await self._resend_as_eval(stack, waits, replies, missing[0])
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies

    async def _resend_as_eval(self, stack, waits, replies, first: int) -> None:
        """Send the NOSCRIPT calls again as EVAL (which caches the script on the slot's node),
        with every WAIT after them, in order, on one connection."""
        sources = self._client.script_sources
        again = [i for i in range(first, len(stack))
                 if (isinstance(replies[i], NoScriptError) and stack[i].args[1] in sources) or i in waits]
        async with self._client.pipeline() as pipe:
            for i in again:
                if i in waits:
                    pipe.wait_for_replicas(waits[i], Durability(*map(int, stack[i].args[1:3])))
                else:
                    pipe.execute_command("EVAL", sources[stack[i].args[1]], *stack[i].args[2:])
            for i, reply in zip(again, await pipe.execute(raise_on_error=False)):
                replies[i] = reply


async def durability_problems(redis: Redis) -> list[str]:
    """Why this Redis could lose acknowledged work: no AOF, or an eviction policy that may drop
    keys. Empty when it looks durable. Read from INFO (CONFIG is often not permitted); on a
    cluster, from every primary."""
    try:
        if is_cluster(redis):
            nodes = await redis.info("persistence", target_nodes=RedisCluster.PRIMARIES)
            memory = await redis.info("memory", target_nodes=RedisCluster.PRIMARIES)
            per_node = [(f"{name}: ", nodes[name], memory[name]) for name in sorted(nodes)]
        else:
            per_node = [("", await redis.info("persistence"), await redis.info("memory"))]
    except ResponseError as e:
        return [f"could not check durability ({e}); grant INFO or check AOF and eviction by hand"]
    problems = []
    for where, persistence, memory in per_node:
        if not int(persistence.get("aof_enabled", 0)):
            problems.append(f"{where}AOF is off (appendonly no): a Redis crash or restart loses queued "
                            "groups and results; run it with --appendonly yes")
        policy = memory.get("maxmemory_policy", "noeviction")
        policy = policy.decode() if isinstance(policy, bytes) else policy
        if policy != "noeviction":
            problems.append(f"{where}maxmemory-policy is {policy}: under memory pressure Redis may "
                            "evict queued work; set maxmemory-policy noeviction")
    return problems


async def check_durability(redis: Redis, *, require: bool, log) -> None:
    """Warn about a Redis that may lose work; with `require`, refuse it (RuntimeError)."""
    problems = await durability_problems(redis)
    for problem in problems:
        log.warning("redis: %s", problem)
    if problems and require:
        raise RuntimeError("--require-durable: " + "; ".join(problems))
