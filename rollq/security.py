"""Redis ACL rules that give each trainer its own keys only, and workers their policy's keys.

    ACL SETUSER <trainer_acl(policy, "alice", password)...>

A trainer user may submit to and read its own streams, counters and job records, read the
registry and the scorers' heartbeats (scored jobs), and (with `publisher=True`) publish
versions; another trainer's streams are NOPERM, also from inside rollq's Lua scripts (Redis
checks scripts' keys against the caller's ACL).

Keys keep their type: each command that creates a key is granted only on the keys rollq gives
that type (a trainer cannot make its work stream a string, nor the trainers set a sorted set),
so what every worker, scorer and `rollq status` reads is at worst a malformed entry of the right
type, which they skip and log (`queue/members.py`; tests/test_shared_keys.py, key by key).

What this does not isolate: a trainer may raise its own cap (`quota:<trainer>`: the submit
script declares it, and Redis checks declared keys as read-write), add junk members to the
shared sets (skipped by their readers), list or unlist episode keys in the policy's episode
listing (another trainer's episode then loses its version's protection from retention), name
routed streams (workers read them: at worst an empty stream), choose its own image budget (its
client passes it, as its quotas), read every worker's and scorer's heartbeat, write any figures
into its own record of the training-inference gap (they count in the policy's gap, as its
reports do), and run Lua: scripts are ACL-checked command by command, but a script that never
ends blocks Redis for everyone until SCRIPT KILL. Trainers you do not trust get the gateway
(bearer tokens), not Redis.
"""

from __future__ import annotations

from rollq.protocol import DERIVED_SEPARATOR, check_id
from rollq.queue.keys import Keys

_CONNECTION = [
    # The connection (AUTH is always allowed; redis-py's optional CLIENT SETINFO may be refused).
    "+ping", "+echo", "+hello", "+select", "+reset", "+quit", "+client|setname", "+client|getname",
    "+client|id",
    # Redis Cluster: redis-py reads the topology and the commands' key positions (no keys).
    "+cluster|slots", "+command", "+readonly", "+readwrite", "+asking",
    # rollq's scripts, loaded by the client on NOSCRIPT (run: `_SCRIPTS`).
    "+script|load", "+script|exists", "+time", "+wait",
]
"""The commands a trainer user may run on no key."""

_ANY_TYPE = ["+del", "+exists", "+ttl", "+expire"]
_STRINGS = [*_ANY_TYPE, "+get", "+mget", "+set", "+strlen", "+incrby", "+decrby"]
_HASHES = [*_ANY_TYPE, "+hget", "+hmget", "+hgetall", "+hset", "+hsetnx", "+hincrby", "+hincrbyfloat",
           "+hdel"]
_STREAMS = [*_ANY_TYPE, "+xadd", "+xlen", "+xrange", "+xreadgroup", "+xpending", "+xack", "+xdel",
            "+xgroup|create"]
_SORTED_SETS = [*_ANY_TYPE, "+zadd", "+zrem", "+zscore", "+zrange", "+zrangebyscore",
                "+zremrangebyscore"]
_READS = ["+get", "+mget", "+hget", "+hmget", "+hgetall", "+xrange", "+xlen", "+zrange", "+zscore",
          "+exists", "+ttl"]
"""Every command a trainer user may run on keys, named one by one (a category such as `@write`
would bring FUNCTION LOAD, persistent code that survives SCRIPT FLUSH, and `@all -@dangerous`
keeps SCRIPT FLUSH, MEMORY STATS and DBSIZE), and each group only on the keys rollq gives that
type: SET only on its counters and images, XADD only on its streams, ... Keys are checked per
selector: EXPIRE and SET reach only the trainer's own keys, so no trainer can shorten or
overwrite another's."""

_PUBLISHER_COMMANDS = [*_STRINGS, *_HASHES, *_STREAMS, *_SORTED_SETS, "+sadd", "+hdel", "+zcard",
                       "+smembers", "+srem", "+type", "+evalsha", "+eval"]
"""A publisher's, on every key of the policy: a trainer's, and what publishing and its retention
add (`publish.lua`, `retire.lua`, registry/retention.py)."""

_WORKER_COMMANDS = ["+@all", "-@dangerous", "-@admin", "+info", "-function", "-script|flush",
                    "-script|kill", "-memory", "-dbsize"]
"""Workers, the gateway and `rollq status`: every command of the policy's keys but the server's
(INFO for the durability check, SCAN for `rollq status`'s policies); no persistent FUNCTIONs, no
SCRIPT FLUSH or KILL of other clients' scripts, no MEMORY or DBSIZE."""

_SCRIPTS = ["+evalsha", "+eval"]
"""rollq's scripts: EVAL too, as on a cluster node that lacks a script (a promoted replica, a
flushed cache) the client runs it by EVAL. Redis checks every key a script declares, as
read-write, against one selector (the first of `trainer_acl`'s), and each command inside
against all the rules, one by one (a script that SREMs a shared set, or SETs a work stream, is NOPERM)."""


def _own_keys(keys: Keys, trainer: str) -> dict[str, list[str]]:
    """A trainer's own keys by type. Its own id and the ids rollq derives from it
    (`trainer~purpose~owner`: its episodes), whose routed work streams (`work:<id>:<worker>:<version>`)
    the stream patterns also cover. No chosen id contains `~`, so `alice~*` is nobody else's."""
    ids = (trainer, f"{trainer}{DERIVED_SEPARATOR}*")
    derived = f"{trainer}{DERIVED_SEPARATOR}*"
    return {
        "strings": [k for t in ids for k in (keys.outstanding(t), keys.outstanding_bytes(t),
                                             keys.quota(t), keys.image_bytes(t))]
                   # Each of its `Episodes` objects' owner lease (`episode_owner.lua`: GET, SET PX, DEL).
                   + [keys.image(trainer, "*"), keys.episode_owner(derived)],
        "hashes": [k for t in ids for k in (keys.job(t, "*"), keys.done(t, "*"))]
                  + [keys.episode(trainer, "*"), keys.conversation(trainer, "*")]
                  # Its gap record (`queue/gap.py`: HINCRBY, HINCRBYFLOAT, HDEL of old versions).
                  + [keys.gap(t) for t in ids],
        "streams": [k for t in ids for k in (keys.work(t), keys.results(t))],
        # Its images' holds, and its `Episodes` objects' index of running turns.
        "sorted sets": [keys.image_holds(t) for t in ids] + [keys.episode_running(derived)],
    }


def trainer_acl(policy: str, trainer: str, password: str, *, publisher: bool = False) -> list[str]:
    """A trainer's own keys in full, the registry read-only (read-write for a publisher), and
    only the commands rollq's SDK and scripts use, each on the keys of its type.

    The submit script adds the trainer to the trainers workers claim from (a set) and a job with
    an upper bound to the bounded jobs retention looks at (a sorted set; or a set an older rollq
    left: SADD there too, both types are read); a scored submit lists the trainer for the
    scorers (a set), and a gap report lists it for the gap's readers (a set); episodes also list
    themselves for retention (a sorted set) and name routed streams (a hash). Each shared key
    takes only the commands of its type (SADD, ZADD and ZREM, HSET): nothing lets a trainer
    remove another from the sets, and nothing it adds stops their readers (`queue/members.py`).
    Its images are its own keys (`Keys.image(trainer, ...)`): no other trainer reads, overwrites
    or expires them.
    A publisher changes what every trainer's samples are made with: it is trusted with the
    whole policy's keys (retention reads other trainers' job windows and the workers' pins).
    """
    keys = Keys(policy)
    check_id("trainer", trainer)
    rules = [trainer, "on", "resetpass", f">{password}", "resetkeys", "resetchannels",
             "clearselectors", "-@all", *_CONNECTION]
    if publisher:
        return [*rules, *_PUBLISHER_COMMANDS, f"~{keys.every_key}"]
    own = _own_keys(keys, trainer)
    sets = [keys.trainers, keys.scoring_trainers, keys.gap_trainers]
    listings = [keys.bounded_jobs, keys.episodes]
    # Read only: the registry (every worker's heartbeat included) and the scorers' heartbeats.
    read = [keys.latest, keys.versions, keys.version_events, keys.worker("*"), keys.scorers,
            keys.scorer("*")]
    selectors = [
        (_SCRIPTS, [k for of_type in own.values() for k in of_type] + sets + listings + [keys.routed]),
        (_STRINGS, own["strings"]), (_HASHES, own["hashes"]), (_STREAMS, own["streams"]),
        (_SORTED_SETS, own["sorted sets"]),
        (["+sadd"], sets), (["+zadd", "+zrem"], listings), (["+hset"], [keys.routed]),
        # The submit script: a bounded-jobs set left by an older rollq is added to as a set.
        (["+sadd"], [keys.bounded_jobs]),
    ]
    rules += [*_READS, *(f"%R~{k}" for k in read)]
    return [*rules, *(f"({' '.join([*commands, *(f'~{k}' for k in patterns)])})"
                      for commands, patterns in selectors)]


def worker_acl(policy: str, user: str, password: str) -> list[str]:
    """Workers (and `rollq status`, the gateway) read and write every key of the policy."""
    return [user, "on", "resetpass", f">{password}", "resetkeys", "resetchannels", "clearselectors",
            *_WORKER_COMMANDS, f"~{Keys(policy).every_key}"]
