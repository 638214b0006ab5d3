"""The policy's shared sets and hashes as their readers take them: a trainer's Redis user may
write them (`rollq/security.py`: SADD to `trainers`, `bounded-jobs` and `scoring-trainers`, ZADD
and ZREM to `episodes`, HSET to `routed`), so a member or field rollq would never have written
is skipped and logged, once per process, never fatal: it costs nobody but its writer. (The ACL
keeps every key's type: a wrong type is not a reader's case.)"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

from rollq.protocol import MAX_VERSION, InvalidInput, check_id, check_trainer_id
from rollq.queue.keys import Keys

log = logging.getLogger("rollq.queue")

_WARNED_MAX = 1024
_warned: set[tuple[str, bytes | str]] = set()
"""What was logged already (bounded): a reader reads its set again every 0.1 s."""


def skip(key: str, member: bytes | str, why: str) -> None:
    """Log a malformed entry of `key` once (per process), naming it (its first 200 characters)."""
    member = member[:200]
    if (key, member) in _warned:
        return
    if len(_warned) >= _WARNED_MAX:
        _warned.clear()
    _warned.add((key, member))
    log.warning("%s: skipping %r (%s); rollq never writes such an entry: a trainer's Redis user did",
                key, member, why)


def _text(value: bytes | str) -> str | None:
    if isinstance(value, str):
        return value
    try:
        return value.decode()
    except UnicodeDecodeError:
        return None


def trainer_ids(key: str, members: Iterable[bytes | str]) -> list[str]:
    """The members of a set of trainer ids (`trainers`, `scoring-trainers`) that are ids, sorted."""
    found = []
    for member in members:
        trainer = _text(member)
        try:
            found.append(check_trainer_id("trainer", trainer))
        except InvalidInput as e:
            skip(key, member, str(e))
    return sorted(found)


Route = tuple[str, str, int, float]
"""A routed stream's trainer, worker, version and when a group was last routed to it (unix s)."""


def routes(keys: Keys, fields: dict[bytes, bytes]) -> tuple[dict[str, Route], list[bytes]]:
    """The `routed` hash as {stream: Route}, and the fields that are no routed stream of this
    policy (or whose time is not a finite number)."""
    found, malformed = {}, []
    for field, value in fields.items():
        stream, at = _text(field), _text(value)
        try:
            if stream is None or at is None:
                raise ValueError("not UTF-8")
            parts = keys.trainer_stream_rest(stream).split(":")
            if len(parts) != 3:
                raise ValueError("not <trainer>:<worker>:<version>")
            trainer, worker = check_trainer_id("trainer", parts[0]), check_id("worker", parts[1])
            version = _version(parts[2])
            if version is None:
                raise ValueError(f"version {parts[2]!r} is not a version number")
            when = float(at)
            if not math.isfinite(when):
                raise ValueError(f"time {at!r} is not a finite number")
        except (ValueError, InvalidInput) as e:
            skip(keys.routed, field, str(e))
            malformed.append(field)
            continue
        found[stream] = (trainer, worker, version, when)
    return found, malformed


def job_keys(keys: Keys, members: Iterable[bytes | str]) -> list[str]:
    """The members of `bounded-jobs` that are job records of this policy."""
    return _records(keys, keys.bounded_jobs, "job", members)


def episode_keys(keys: Keys, members: Iterable[bytes | str]) -> list[str]:
    """The members of `episodes` that are episode records of this policy."""
    return _records(keys, keys.episodes, "episode", members)


def _records(keys: Keys, key: str, kind: str, members: Iterable[bytes | str]) -> list[str]:
    found = []
    for member in members:
        record = _text(member)
        try:
            if record is None:
                raise ValueError("not UTF-8")
            trainer, record_id = keys.record_of(kind, record)
            check_trainer_id("trainer", trainer)
            check_id(f"{kind} id", record_id)
        except (ValueError, InvalidInput) as e:
            skip(key, member, str(e))
            continue
        found.append(record)
    return found


def count(key: str, value: bytes | str | None) -> int:
    """A counter's value (0 for none); one that is no integer: skipped and logged (0)."""
    try:
        return int(value or 0)
    except ValueError:
        skip(key, value, "not a count")
        return 0


def version(key: str, value: bytes | str | None) -> int | None:
    """A version number a record holds (None for none); malformed: skipped and logged (None)."""
    if value is None or value == b"" or value == "":
        return None
    found = _version(_text(value))
    if found is None:
        skip(key, value, "not a version number")
    return found


def _version(text: str | None) -> int | None:
    """A version as rollq writes it (ASCII digits: `int` also takes '+5', ' 5', '1_0', '٥')."""
    if text is not None and text.isascii() and text.isdigit() and int(text) < MAX_VERSION:
        return int(text)
    return None
