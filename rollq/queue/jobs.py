"""Jobs as the trainer sees them: enqueue a batch, look at its record, cancel it."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from redis.asyncio import Redis

from rollq.protocol import QueueFull, decode_meta
from rollq.queue.keys import Keys, base_trainer
from rollq.queue.names import JobField, JobState, Reply
from rollq.queue.scripts import Scripts, call_durably


class JobStatus(msgspec.Struct, frozen=True):
    """A job's record: how many of its groups ended in each terminal status."""

    job_id: str
    trainer_id: str
    state: JobState
    groups: int
    done: int
    ok: int
    failed: int
    expired: int
    cancelled: int
    created_at: float
    deadline: float
    finished_at: float
    meta: dict[str, Any]
    filtered: int = 0
    """Scored jobs with dynamic sampling: groups whose rewards stayed all equal (not delivered)..."""
    resampled: int = 0
    """...and times a group was generated again for it."""

    @property
    def finished(self) -> bool:
        return self.done >= self.groups


class Enqueued(msgspec.Struct, frozen=True):
    created: bool
    """False when the job id existed already (idempotent submit): nothing was added."""


async def enqueue(
    redis: Redis,
    scripts: Scripts,
    keys: Keys,
    *,
    trainer: str,
    job_id: str,
    items: list[bytes],
    quota: int,
    byte_quota: int,
    deadline: float,
    meta: bytes,
    min_version: int = 0,
    max_version: int | None = None,
    stream: str | None = None,
    routed: bool = False,
) -> Enqueued:
    """Write the job record and one work entry per group in one round trip.

    `stream`: a routed work stream of the trainer (`Keys.routed_work`) instead of its own.
    `routed`: the trainer's groups may sit on routed streams (episodes): its byte count is never
    reset for drift (an empty stream says nothing about the others).
    Raises QueueFull when the trainer's outstanding groups plus these would pass its quota (a
    derived id's: its base trainer's groups, its own and all its derived ids', against the
    smaller of `quota` and the base's operator cap), or
    the bytes of its queued items plus these would pass `byte_quota`.
    """
    base = base_trainer(trainer)
    reply = await call_durably(
        scripts.enqueue, redis,
        keys=[keys.job(trainer, job_id), stream or keys.work(trainer), keys.trainers,
              keys.outstanding(trainer), keys.quota(base), keys.bounded_jobs,
              keys.outstanding_bytes(trainer), keys.outstanding(base)],
        args=[trainer, quota, len(items), time.time(), deadline, meta, job_id, min_version,
              "" if max_version is None else max_version, byte_quota, "1" if routed else "0", *items],
    )
    verdict = reply[0].decode()
    if verdict == Reply.BYTES:
        queued, limit, size = int(reply[1]), int(reply[2]), int(reply[3])
        raise QueueFull(f"trainer {trainer!r} has {queued} bytes of prompts queued; this job's "
                        f"{size} bytes would pass its quota of {limit} bytes (max_outstanding_bytes; "
                        "items count until a worker finishes them)", limit=quota, groups=len(items),
                        queued_bytes=queued, byte_limit=limit, job_bytes=size)
    if verdict == Reply.FULL:
        outstanding, limit = int(reply[1]), int(reply[2])
        # Whose quota: the base trainer's, counting every id derived from it.
        who = repr(base) if base == trainer else f"{base!r} (with {trainer!r})"
        if len(items) > limit:
            message = (f"{len(items)} groups can never fit trainer {who}'s quota of {limit} "
                       "(the smaller of max_outstanding and the operator's cap); submit fewer")
        else:
            message = (f"trainer {who} has {outstanding} outstanding groups; {len(items)} more "
                       f"would pass its quota of {limit} (results count until acknowledged)")
        raise QueueFull(message, outstanding=outstanding, limit=limit, groups=len(items))
    return Enqueued(created=verdict == Reply.OK)


async def outstanding(redis: Redis, keys: Keys, trainer: str) -> int:
    return int(await redis.get(keys.outstanding(trainer)) or 0)


async def queued_bytes(redis: Redis, keys: Keys, trainer: str) -> int:
    return int(await redis.get(keys.outstanding_bytes(trainer)) or 0)


async def job_status(redis: Redis, keys: Keys, trainer: str, job_id: str) -> JobStatus | None:
    """The record of `trainer`'s job `job_id` (None: no such job of that trainer)."""
    record = await redis.hgetall(keys.job(trainer, job_id))
    if not record:
        return None
    field = {k.decode(): v for k, v in record.items()}
    return JobStatus(
        job_id=job_id,
        trainer_id=field[JobField.TRAINER].decode(),
        state=JobState(field[JobField.STATE].decode()),
        groups=int(field[JobField.GROUPS]),
        done=int(field[JobField.DONE]),
        ok=int(field[JobField.OK]),
        failed=int(field[JobField.FAILED]),
        expired=int(field[JobField.EXPIRED]),
        cancelled=int(field[JobField.CANCELLED]),
        created_at=float(field[JobField.CREATED_AT]),
        deadline=float(field[JobField.DEADLINE]),
        finished_at=float(field.get(JobField.FINISHED_AT, 0)),
        meta=decode_meta(field[JobField.META]),
        filtered=int(field.get(JobField.FILTERED, 0)),
        resampled=int(field.get(JobField.RESAMPLED, 0)),
    )


async def cancel(redis: Redis, scripts: Scripts, keys: Keys, trainer: str, job_id: str) -> int | None:
    """Mark the job cancelled; returns its groups still without a result (None: no such job)."""
    left = int(await scripts.cancel(keys=[keys.job(trainer, job_id)], client=redis))
    return None if left < 0 else left
