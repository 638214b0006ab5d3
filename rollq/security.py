"""Redis ACL rules that give each trainer its own keys only, and workers their policy's keys.

    ACL SETUSER <trainer_acl(policy, "alice", password)...>

A trainer user may submit to and read its own streams and counters, look at job records and
the registry, and (with `publisher=True`) publish versions; another trainer's streams are
NOPERM, also from inside rollq's Lua scripts (Redis checks scripts' keys against the caller's
ACL).

What this does not isolate: job records (`job:*`, `done:*`) are policy-wide (job ids are random
unless a trainer chooses them), and the quota hash is writable, so a hostile trainer could
raise its own cap. Trainers you do not trust get the gateway (bearer tokens), not Redis.
"""

from __future__ import annotations

from rollq.protocol import check_id
from rollq.queue.keys import Keys

_COMMANDS = ["+@all", "-@dangerous", "-@admin"]


def trainer_acl(policy: str, trainer: str, password: str, *, publisher: bool = False) -> list[str]:
    keys = Keys(policy)
    check_id("trainer", trainer)
    # Keys a script is given must be writable (Redis checks a script's declared keys as
    # read-write), so the quota hash the submit script reads is writable too.
    own = [keys.work(trainer), keys.results(trainer), keys.outstanding(trainer), keys.job(trainer, "*"),
           keys.done(trainer, "*"), keys.trainers, keys.bounded_jobs, keys.quotas]
    registry = [keys.latest, keys.versions, keys.version_events]
    rules = [trainer, "on", f">{password}", "resetkeys", "resetchannels", *_COMMANDS]
    rules += [f"~{k}" for k in own]
    rules += [f"~{k}" if publisher else f"%R~{k}" for k in registry]
    return rules


def worker_acl(policy: str, user: str, password: str) -> list[str]:
    """Workers (and `rollq status`, the gateway) read and write every key of the policy."""
    return [user, "on", f">{password}", "resetkeys", "resetchannels", *_COMMANDS,
            f"~{Keys(policy).every_key}"]
