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
them: at worst an empty stream), overwrite a stored image (workers check each image's digest
before use: a group naming it fails, it never runs on other bytes), choose its own image budget
(its client passes it, as its quotas), read every worker's heartbeat, and run Lua: scripts are
ACL-checked command by command, but a script that never ends blocks Redis for everyone until
SCRIPT KILL. Trainers you do not trust get the gateway
(bearer tokens), not Redis.
"""

from __future__ import annotations

from rollq.protocol import DERIVED_SEPARATOR, check_id
from rollq.queue.keys import Keys

_COMMANDS = ["+@all", "-@dangerous", "-@admin"]
_TRAINER_DENIED = ["-scan", "-randomkey"]
"""Key names are not a trainer's business (SCAN ignores key permissions)."""
_SUBMIT_SHARED = ["+evalsha", "+eval", "+sadd", "+zadd", "+zrem", "+hset"]
"""What the submit and episode scripts (and an episode's routing) do to the policy's shared keys:
add a member to the trainers and bounded-jobs sets, list an episode for retention (ZADD, ZREM
when it ends), name a routed stream (HSET). EVAL too: on a cluster node that lacks a script (a
promoted replica, a flushed cache) the client runs it by EVAL; the commands inside any script
are still checked against these rules (a script that SREMs a shared set is NOPERM)."""


_STORE_IMAGES = ["+evalsha", "+eval", "+set", "+expire", "+strlen"]
"""What `store_images.lua` does to the policy's shared image keys: write one that is missing
(SET NX), extend its expiry, read its size. Its own selector: the submit selector's keys must
not take SET (it replaces a key of any type)."""


def trainer_acl(policy: str, trainer: str, password: str, *, publisher: bool = False) -> list[str]:
    """A trainer's own keys in full, the registry read-only (read-write for a publisher).

    The submit script adds the trainer to two shared sets (the trainers workers claim from and
    the bounded jobs retention looks at); episodes also list themselves for retention and name
    routed streams. Redis checks every key a script declares, as read-write, against one
    selector: so one selector holds the trainer's keys and the shared keys with only EVALSHA,
    SADD, ZADD, ZREM and HSET, and nothing lets a trainer remove another from the sets; a second
    holds its image holds and the shared image keys with only what storing an image needs (no
    DEL: an image another trainer named stays).
    A publisher changes what every trainer's samples are made with: it is trusted with the
    whole policy (retention reads other trainers' job windows and the workers' pins).
    """
    keys = Keys(policy)
    check_id("trainer", trainer)
    own, holds = [], []
    # Its own id and the ids rollq derives from it (`trainer~purpose~owner`: its episodes), whose
    # routed work streams (`work:<id>:<worker>:<version>`) the first pattern also covers. No
    # chosen id contains `~`, so `alice~*` is nobody else's.
    for t in (trainer, f"{trainer}{DERIVED_SEPARATOR}*"):
        own += [keys.work(t), keys.results(t), keys.outstanding(t),
                keys.outstanding_bytes(t), keys.quota(t), keys.job(t, "*"), keys.done(t, "*")]
        holds += [keys.image_holds(t), keys.image_bytes(t)]
    own += holds
    own.append(keys.episode(trainer, "*"))
    shared = [keys.trainers, keys.bounded_jobs, keys.episodes, keys.routed]
    registry = [keys.latest, keys.versions, keys.version_events, keys.worker("*")]
    rules = [trainer, "on", f">{password}", "resetkeys", "resetchannels", *_COMMANDS]
    if publisher:
        return [*rules, f"~{keys.every_key}"]
    rules += [*_TRAINER_DENIED, *(f"~{k}" for k in own), *(f"%R~{k}" for k in registry)]
    selector = " ".join([*_SUBMIT_SHARED, *(f"~{k}" for k in own + shared)])
    # store_images.lua declares the trainer's holds with the image keys: one selector has both.
    images = " ".join([*_STORE_IMAGES, *(f"~{k}" for k in [*holds, keys.image("*")])])
    return [*rules, f"({selector})", f"({images})"]


def worker_acl(policy: str, user: str, password: str) -> list[str]:
    """Workers (and `rollq status`, the gateway) read and write every key of the policy."""
    return [user, "on", f">{password}", "resetkeys", "resetchannels", *_COMMANDS,
            f"~{Keys(policy).every_key}"]
