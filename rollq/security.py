"""Redis ACL rules that give each trainer its own keys only, and workers their policy's keys.

    ACL SETUSER <trainer_acl(policy, "alice", password)...>

A trainer user may submit to and read its own streams, counters and job records, read
the registry, and (with `publisher=True`) publish versions; another trainer's streams are
NOPERM, also from inside rollq's Lua scripts (Redis checks scripts' keys against the caller's
ACL).

What this does not isolate: a trainer may raise its own cap (`quota:<trainer>`: the submit
script declares it, and Redis checks declared keys as read-write), add junk members to the two
shared sets, list or unlist episode keys in the policy's episode listing (another trainer's
episode then loses its version's protection from retention), name routed streams (workers read
them: at worst an empty stream), choose its own image budget (its client passes it, as its
quotas), read every worker's heartbeat, and run Lua: scripts are ACL-checked command by
command, but a script that never ends blocks Redis for everyone until SCRIPT KILL. Trainers you
do not trust get the gateway (bearer tokens), not Redis.
"""

from __future__ import annotations

from rollq.protocol import DERIVED_SEPARATOR, check_id
from rollq.queue.keys import Keys

_TRAINER_COMMANDS = [
    # The connection (AUTH is always allowed; redis-py's optional CLIENT SETINFO may be refused).
    "+ping", "+echo", "+hello", "+select", "+reset", "+quit", "+client|setname", "+client|getname",
    "+client|id",
    # Redis Cluster: redis-py reads the topology and the commands' key positions (no keys).
    "+cluster|slots", "+command", "+readonly", "+readwrite", "+asking",
    # rollq's scripts, loaded by the client on NOSCRIPT: every command inside them is checked too.
    "+evalsha", "+eval", "+script|load", "+script|exists",
    # What the SDK and rollq's scripts do, on the keys the selectors below grant.
    "+get", "+mget", "+set", "+del", "+exists", "+strlen", "+ttl", "+expire", "+incrby", "+decrby",
    "+hget", "+hmget", "+hgetall", "+hset", "+hsetnx", "+hincrby",
    "+xadd", "+xlen", "+xrange", "+xreadgroup", "+xpending", "+xack", "+xdel", "+xgroup|create",
    "+zadd", "+zrem", "+zscore", "+zrange", "+zrangebyscore", "+zremrangebyscore", "+sadd",
    "+time", "+wait",
]
"""Every command a trainer user may run, named one by one (a category such as `@write` would
bring FUNCTION LOAD, persistent code that survives SCRIPT FLUSH, and `@all -@dangerous` keeps
SCRIPT FLUSH, MEMORY STATS and DBSIZE). Keys are checked per selector: EXPIRE and SET here reach
only the trainer's own keys, so no trainer can shorten or overwrite another's."""

_PUBLISHER_COMMANDS = ["+hdel", "+zcard", "+smembers", "+srem"]
"""What publishing and its retention add (`publish.lua`, `retire.lua`, registry/retention.py)."""

_WORKER_COMMANDS = ["+@all", "-@dangerous", "-@admin", "+info", "-function", "-script|flush",
                    "-script|kill", "-memory", "-dbsize"]
"""Workers, the gateway and `rollq status`: every command of the policy's keys but the server's
(INFO for the durability check, SCAN for `rollq status`'s policies); no persistent FUNCTIONs, no
SCRIPT FLUSH or KILL of other clients' scripts, no MEMORY or DBSIZE."""

_SUBMIT_SHARED = ["+evalsha", "+eval", "+sadd", "+zadd", "+zrem", "+hset"]
"""What the submit and episode scripts (and an episode's routing) do to the policy's shared keys:
add a member to the trainers and bounded-jobs sets, list an episode for retention (ZADD, ZREM
when it ends), name a routed stream (HSET). EVAL too: on a cluster node that lacks a script (a
promoted replica, a flushed cache) the client runs it by EVAL; the commands inside any script
are still checked against these rules (a script that SREMs a shared set is NOPERM)."""


def trainer_acl(policy: str, trainer: str, password: str, *, publisher: bool = False) -> list[str]:
    """A trainer's own keys in full, the registry read-only (read-write for a publisher), and
    only the commands rollq's SDK and scripts use (`_TRAINER_COMMANDS`).

    The submit script adds the trainer to two shared sets (the trainers workers claim from and
    the bounded jobs retention looks at); episodes also list themselves for retention and name
    routed streams. Redis checks every key a script declares, as read-write, against one
    selector: so one selector holds the trainer's keys and the shared keys with only EVALSHA,
    SADD, ZADD, ZREM and HSET, and nothing lets a trainer remove another from the sets. Its
    images are its own keys (`Keys.image(trainer, ...)`): no other trainer reads, overwrites or
    expires them.
    A publisher changes what every trainer's samples are made with: it is trusted with the
    whole policy's keys (retention reads other trainers' job windows and the workers' pins).
    """
    keys = Keys(policy)
    check_id("trainer", trainer)
    own = []
    # Its own id and the ids rollq derives from it (`trainer~purpose~owner`: its episodes), whose
    # routed work streams (`work:<id>:<worker>:<version>`) the first pattern also covers. No
    # chosen id contains `~`, so `alice~*` is nobody else's.
    for t in (trainer, f"{trainer}{DERIVED_SEPARATOR}*"):
        own += [keys.work(t), keys.results(t), keys.outstanding(t), keys.outstanding_bytes(t),
                keys.quota(t), keys.job(t, "*"), keys.done(t, "*"), keys.image_holds(t),
                keys.image_bytes(t)]
    # Each of its `Episodes` objects' owner lease (`episode_owner.lua`: GET, SET PX, DEL) and
    # index of running turns (`Keys.episode_running`).
    own += [keys.episode(trainer, "*"), keys.image(trainer, "*"), keys.conversation(trainer, "*"),
            keys.episode_owner(f"{trainer}{DERIVED_SEPARATOR}*"),
            keys.episode_running(f"{trainer}{DERIVED_SEPARATOR}*")]
    shared = [keys.trainers, keys.bounded_jobs, keys.episodes, keys.routed]
    registry = [keys.latest, keys.versions, keys.version_events, keys.worker("*")]
    rules = [trainer, "on", f">{password}", "resetkeys", "resetchannels", "-@all", *_TRAINER_COMMANDS]
    if publisher:
        return [*rules, *_PUBLISHER_COMMANDS, f"~{keys.every_key}"]
    rules += [*(f"~{k}" for k in own), *(f"%R~{k}" for k in registry)]
    selector = " ".join([*_SUBMIT_SHARED, *(f"~{k}" for k in own + shared)])
    return [*rules, f"({selector})"]


def worker_acl(policy: str, user: str, password: str) -> list[str]:
    """Workers (and `rollq status`, the gateway) read and write every key of the policy."""
    return [user, "on", f">{password}", "resetkeys", "resetchannels", *_WORKER_COMMANDS,
            f"~{Keys(policy).every_key}"]
