"""Redis ACL rules that give each trainer its own keys only, and workers their policy's keys.

    ACL SETUSER <trainer_acl(policy, "alice", password)...>

A trainer user may submit to and read its own streams, counters and job records, read
the registry, and (with `publisher=True`) publish versions; another trainer's streams are
NOPERM, also from inside rollq's Lua scripts (Redis checks scripts' keys against the caller's
ACL).

What this does not isolate: a trainer may raise its own cap (`quota:<trainer>`: the submit
script declares it, and Redis checks declared keys as read-write), add junk members to the two
shared sets, and run Lua: scripts are ACL-checked command by command, but a script that never
ends blocks Redis for everyone until SCRIPT KILL. Trainers you do not trust get the gateway
(bearer tokens), not Redis.
"""

from __future__ import annotations

from rollq.protocol import check_id
from rollq.queue.keys import Keys

_COMMANDS = ["+@all", "-@dangerous", "-@admin"]
_TRAINER_DENIED = ["-scan", "-randomkey"]
"""Key names are not a trainer's business (SCAN ignores key permissions)."""
_SUBMIT_SHARED = ["+evalsha", "+sadd"]
"""What the submit script does to the policy's shared sets: add a member, nothing else."""


def trainer_acl(policy: str, trainer: str, password: str, *, publisher: bool = False) -> list[str]:
    """A trainer's own keys in full, the registry read-only (read-write for a publisher).

    The submit script adds the trainer to two shared sets (the trainers workers claim from and
    the bounded jobs retention looks at). Redis checks every key a script declares, as
    read-write, against one selector: so one selector holds the trainer's keys and the shared
    sets with only EVALSHA and SADD, and nothing lets a trainer remove another from either.
    A publisher changes what every trainer's samples are made with: it is trusted with the
    whole policy (retention reads other trainers' job windows and the workers' pins).
    """
    keys = Keys(policy)
    check_id("trainer", trainer)
    own = [keys.work(trainer), keys.results(trainer), keys.outstanding(trainer),
           keys.outstanding_bytes(trainer), keys.quota(trainer), keys.job(trainer, "*"),
           keys.done(trainer, "*")]
    shared = [keys.trainers, keys.bounded_jobs]
    registry = [keys.latest, keys.versions, keys.version_events]
    rules = [trainer, "on", f">{password}", "resetkeys", "resetchannels", *_COMMANDS]
    if publisher:
        return [*rules, f"~{keys.every_key}"]
    rules += [*_TRAINER_DENIED, *(f"~{k}" for k in own), *(f"%R~{k}" for k in registry)]
    selector = " ".join([*_SUBMIT_SHARED, *(f"~{k}" for k in own + shared)])
    return [*rules, f"({selector})"]


def worker_acl(policy: str, user: str, password: str) -> list[str]:
    """Workers (and `rollq status`, the gateway) read and write every key of the policy."""
    return [user, "on", f">{password}", "resetkeys", "resetchannels", *_COMMANDS,
            f"~{Keys(policy).every_key}"]
