"""The worker's side of the work streams: claim, reclaim, renew, finish, release.

A lease is the idle time of an entry in the consumer group's pending list: the holder resets it
(`renew`), anyone may take over an entry idle for longer than the lease (`reclaim`, XAUTOCLAIM),
and `finish` writes a result only while the caller still owns the entry (fencing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import msgspec

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from rollq.protocol import ScoreItem, ScoreSpec, encode
from rollq.queue.connection import NotReplicated, check_replicated, durability
from rollq.queue import members
from rollq.queue.keys import Keys, base_trainer
from rollq.queue.names import Group, JobField, JobState, Reply, WorkField
from rollq.queue.prune import PRUNE_EVERY_S, expire_results, prune_trainers
from rollq.queue.scripts import Scripts, pipelined
from rollq.queue.workers import WorkerState

log = logging.getLogger("rollq.worker")

ROUTE_IDLE_S = 60.0
"""A routed work stream nothing was routed to for this long, and empty, is forgotten."""
RESULTS_SWEEP_S = 60.0
"""How often each worker drops the result streams nobody wrote to for `job_ttl_s`."""
FINISH_BATCH = 512
"""Most groups finished by one script call."""
READ_AHEAD_JOBS = 8
"""Most jobs whose state a claim reads in its own round trip (see `claimed_states`)."""
_JOB, _GROUP, _ITEM = (f.encode() for f in (WorkField.JOB, WorkField.GROUP, WorkField.ITEM))
"""Work-entry fields as redis-py returns them."""


@dataclass(slots=True)
class Claimed:
    """A work entry this worker holds."""

    stream: str
    entry_id: str
    data: bytes | None
    """The encoded WorkItem (None when the entry has no payload field)."""
    job_id: str | None
    group_index: int | None
    deliveries: int = 1
    last_error: str = ""
    n: int = 1
    """Samples the group asks for (1 until read from the payload)."""
    settling: bool = False
    """A finish or a hand-back of it was sent: a renewal that finds it gone from this worker's
    pending list raced that call, whose own reply says whether it was still ours."""
    taken_over: bool = False
    """A renewal found it owned by another consumer (and said so)."""
    score: ScoreSpec | None = None
    """The item's reward (a scored job): its `ok` result goes to the trainer's scoring stream."""

    @property
    def key(self) -> tuple[str, str]:
        return (self.stream, self.entry_id)


_ENCODER = msgspec.msgpack.Encoder()


def _lua_string(data: bytes) -> msgspec.Raw:
    """`data` as a msgpack str: Redis' cmsgpack (7.0) cannot read bin, and a Lua string holds
    any bytes."""
    n = len(data)
    if n < 32:
        head = bytes((0xa0 | n,))
    elif n < 0x100:
        head = b"\xd9" + bytes((n,))
    elif n < 0x10000:
        head = b"\xda" + n.to_bytes(2, "big")
    else:
        head = b"\xdb" + n.to_bytes(4, "big")
    return msgspec.Raw(head + data)


def _finish_batch(errors: str, dead: str, streams: str, written: str,
                  batch: list) -> tuple[list[str], bytes, bytes]:
    """`finish.lua`'s keys and its two msgpack arguments for a batch of (keys, args, ...): each
    key declared once (a cluster routes the call by them; they share the policy's slot), each
    distinct keys tuple (a job's) once as a key set of KEYS indices, each entry naming its key
    set; args (entry id, group, status, payload, dead-letter reason, item size, raw item) go as
    (entry id, group, status, payload, item size) plus (reason, raw item) for a dead letter."""
    keys, index, sets, set_index, entries = [errors, dead, streams, written], {}, [], {}, []
    for entry_keys, (entry_id, group, status, payload, reason, size, raw), *_ in batch:
        ref = set_index.get(entry_keys)
        if ref is None:
            refs = []
            for key in entry_keys:
                at = index.get(key)
                if at is None:
                    keys.append(key)
                    at = index[key] = len(keys)
                refs.append(at)
            sets.append(refs)
            ref = set_index[entry_keys] = len(sets)
        entries.append((ref, entry_id, group, status, payload, size, reason, raw) if reason
                       else (ref, entry_id, group, status, payload, size))
    return keys, _ENCODER.encode(entries), _ENCODER.encode(sets)


def _warn_unreplicated(wait_reply, wanted) -> None:
    """A result already written cannot be taken back: a failover that loses it puts its group
    back (the finish is lost with it) and the group is generated again; say so, and go on."""
    try:
        check_replicated(wait_reply, wanted)
    except NotReplicated as e:
        log.warning("results written but not replicated: %s", e)


_STATE_OF = {state.encode(): state for state in JobState}
_STATES = set(_STATE_OF)
_REPLIES = {reply.encode(): reply for reply in Reply}
"""finish.lua's replies as Redis sends them (bytes): a dict lookup, where `Reply(...)` cost ~1 us
of the worker's time per finished group (Enum's lookup by value)."""


def _job_state(value: bytes | None, job: str = "") -> JobState | None:
    """A job record's state; one rollq never writes (the trainer's own Redis user did) is
    skipped and logged: None, as for a job without a record."""
    if value is None:
        return None
    state = _STATE_OF.get(value)
    if state is None:
        members.skip(job, value, "not a job state")
    return state


def _text(value: bytes | str | None) -> str | None:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _entry(stream: str, entry_id: bytes, fields: dict | list | None, deliveries: int = 1,
           last_error: str = "") -> Claimed:
    if isinstance(fields, list):  # Lua replies carry fields as a flat list
        fields = dict(zip(fields[::2], fields[1::2]))
    if not fields:
        fields = {}
    group = fields.get(_GROUP)
    # ASCII digits only: str.isdigit() also takes digits int() refuses ('²').
    if isinstance(group, str):
        group = group.encode()
    return Claimed(stream, _text(entry_id), fields.get(_ITEM), _text(fields.get(_JOB)),
                   int(group) if group and group.isdigit() else None, deliveries, last_error)


class _Waiter:
    """One `finish_many` caller's replies, filled in as the batches holding its entries return."""

    __slots__ = ("future", "replies", "left")

    def __init__(self, future: asyncio.Future, replies: list):
        self.future, self.replies, self.left = future, replies, len(replies)


class WorkQueue:
    """One worker's view of a policy's work streams."""

    def __init__(self, redis: Redis, keys: Keys, consumer: str, *, job_ttl_s: int):
        self.redis = redis
        self.keys = keys
        self.consumer = consumer
        self.job_ttl_s = job_ttl_s
        self.scripts = Scripts(redis)
        self._rotation = 0
        self._reclaim_cursor: dict[str, str] = {}
        self._finishing: list[tuple[tuple, tuple, _Waiter, int]] = []
        self._by_stream: dict[str, tuple[str, str, str]] = {}
        self._by_job: dict[tuple[str, str], tuple[str, str]] = {}
        self._finisher: asyncio.Task | None = None
        self._next_prune = self._next_trainer_prune = self._next_results_sweep = 0.0
        self.stale = False
        """A stream it read is gone (pruned): the caller should ask `streams` again."""
        self._recent_jobs: list[str] = []
        """The jobs of the last claim: the next claim reads their state along (`claimed_states`)."""
        self._claim_states: dict[str, JobState | None] = {}
        """Job states read after every entry of the last claim was delivered."""

    async def streams(self) -> list[str]:
        """The streams to claim from: groups routed to this worker, then every trainer's own
        stream, then groups routed to a worker that is gone or serves another version now."""
        self.stale = False
        listed = await self.redis.smembers(self.keys.trainers)
        trainers = members.trainer_ids(self.keys.trainers, listed)
        if len(trainers) < len(listed):  # skipped (and logged); gone, so that no worker reads them again
            valid = {t.encode() for t in trainers}
            await self.redis.srem(self.keys.trainers, *(m for m in listed if m not in valid))
        if time.monotonic() >= self._next_trainer_prune:
            self._next_trainer_prune = time.monotonic() + PRUNE_EVERY_S
            gone = await prune_trainers(self.redis, self.scripts, self.keys, trainers)
            trainers = [t for t in trainers if t not in gone]
        if time.monotonic() >= self._next_results_sweep:
            self._next_results_sweep = time.monotonic() + RESULTS_SWEEP_S
            await expire_results(self.redis, self.scripts, self.keys, self.job_ttl_s)
        shared = [self.keys.work(t) for t in trainers]
        if len(self._by_stream) > 4 * len(trainers) + 1024:  # caches of trainers long gone
            self._by_stream.clear()
            self._reclaim_cursor = {s: c for s, c in self._reclaim_cursor.items() if s in shared}
        routed = await self.redis.hgetall(self.keys.routed)
        if not routed:
            return shared
        routes, malformed = members.routes(self.keys, routed)
        if malformed:  # skipped (and logged); gone, so that no worker reads them again
            await self.redis.hdel(self.keys.routed, *malformed)
        named = sorted({worker for _, worker, _, _ in routes.values()})
        beats = await self.redis.mget([self.keys.worker(w) for w in named]) if named else []
        serving = {w: msgspec.json.decode(b, type=WorkerState).version
                   for w, b in zip(named, beats) if b}
        mine, orphaned, idle = [], [], []
        for stream, (_, worker, version, at) in sorted(routes.items()):
            if worker == self.consumer:
                mine.append(stream)
            elif serving.get(worker) != version:
                orphaned.append(stream)
            if at < time.time() - ROUTE_IDLE_S:
                idle.append(stream)
        await self._prune(idle)
        return mine + shared + orphaned

    async def _prune(self, idle: list[str]) -> None:
        """Forget routed streams that were not used for ROUTE_IDLE_S and hold nothing."""
        if not idle or time.monotonic() < self._next_prune:
            return
        self._next_prune = time.monotonic() + ROUTE_IDLE_S / 2
        cutoff = time.time() - ROUTE_IDLE_S
        for stream in idle:
            await self.scripts.route_prune(keys=[self.keys.routed, stream], args=[stream, cutoff],
                                           client=self.redis)

    async def ensure_group(self, stream: str) -> None:
        """The workers' group on `stream`; a stream that is gone (pruned: nothing was queued
        there) stays gone, and the caller is told to list the streams again (`stale`)."""
        try:
            await self.redis.xgroup_create(stream, Group.WORKERS, id="0")
        except ResponseError as e:
            if "requires the key to exist" in str(e):
                self.stale = True
            elif "BUSYGROUP" not in str(e):
                raise

    async def claim(self, streams: list[str], free: int, block_ms: int = 0) -> list[Claimed]:
        """New entries for up to `free` slots, shared round-robin among the trainers.

        Each trainer gets an equal share (the remainder rotates), so one trainer's backlog cannot
        starve another's; a trainer is its base id with every id derived from it (its episodes,
        the gateway's completions for it: `keys.base_trainer`), so making more `Episodes` objects
        buys no more of a worker. Within a trainer's share its turns routed to this worker go
        first (their prefix cache is here), then its other streams in equal parts. Shares left
        unused by short streams go to the others. When nothing is waiting and `block_ms` is set,
        blocks until some stream has an entry; that read may return one entry per stream, so up
        to len(streams) - 1 more than `free`.
        """
        self._claim_states = {}
        got = await self._claim_shares(streams, free)
        if got or not block_ms or not streams:
            return got
        self._claim_states = {}  # read before the entries the blocking read may deliver
        try:
            reply = await self.redis.xreadgroup(
                Group.WORKERS, self.consumer, {s: ">" for s in streams}, count=1, block=block_ms
            )
        except ResponseError as e:
            # UNBLOCKED: the stream was deleted while we blocked on it (pruned, a wiped Redis).
            if not str(e).startswith(("NOGROUP", "UNBLOCKED")):
                raise
            for stream in streams:
                await self.ensure_group(stream)
            return []
        for stream, entries in reply or []:
            got.extend(_entry(_text(stream), eid, fields) for eid, fields in entries)
        return got

    def _family(self, stream: str) -> str:
        return base_trainer(self._trainer_keys(stream)[0])

    def _mine(self, stream: str) -> bool:
        route = self.keys.route_of(stream)
        return route is not None and route[1] == self.consumer

    def _asks(self, families: dict[str, list[str]], want: int) -> list[tuple[str, int]]:
        """(stream, count) for one round: `want` split equally among the trainers (rotating
        start), each trainer's part among its routed-to-me streams if it has some, else among
        its others."""
        order = list(families)
        start = self._rotation % len(order)
        self._rotation += 1
        order = order[start:] + order[:start]
        asks = []
        for i, family in enumerate(order):
            share = want // len(order) + (i < want % len(order))
            if not share:
                continue
            streams = [s for s in families[family] if self._mine(s)] or families[family]
            first = self._rotation % len(streams)
            streams = streams[first:] + streams[:first]
            asks += [(s, c) for j, s in enumerate(streams)
                     if (c := share // len(streams) + (j < share % len(streams)))]
        return asks

    async def _claim_shares(self, streams: list[str], free: int) -> list[Claimed]:
        """Up to `free` new entries, an equal share from each trainer (see `claim`)."""
        got: list[Claimed] = []
        families: dict[str, list[str]] = {}
        for stream in streams:
            families.setdefault(self._family(stream), []).append(stream)
        while families and len(got) < free:
            asks = self._asks(families, free - len(got))
            async with self.redis.pipeline(transaction=False) as pipe:
                for stream, count in asks:
                    pipe.xreadgroup(Group.WORKERS, self.consumer, {stream: ">"}, count=count)
                # After the reads: these states are as fresh as a read after the reply.
                for job in self._recent_jobs:
                    pipe.hget(job, JobField.STATE)
                replies = await pipe.execute(raise_on_error=False)
            replies, states = replies[:len(asks)], replies[len(asks):]
            # What does not parse is read again, and raises there as it always did.
            self._claim_states = {job: _job_state(state) for job, state in zip(self._recent_jobs, states)
                                  if state is None or state in _STATES}
            # Ends: a stream asked for more than it had leaves; when every stream asked had
            # its count, `free` is filled.
            for (stream, count), reply in zip(asks, replies):
                if isinstance(reply, ResponseError):
                    if "NOGROUP" not in str(reply):
                        raise reply
                    await self.ensure_group(stream)
                    entries = []
                else:
                    entries = reply[0][1] if reply else []
                got.extend(_entry(stream, eid, fields) for eid, fields in entries)
                if len(entries) < count:
                    family = families[self._family(stream)]
                    family.remove(stream)
                    if not family:
                        del families[self._family(stream)]
        return got

    async def reclaim(self, streams: list[str], lease_ms: int, count: int) -> list[Claimed]:
        """Take over up to `count` entries whose lease lapsed, with their delivery counts.

        Shared among the streams as `claim` shares new entries (equal shares, rotating start,
        unused shares passed on): groups that are handed back again and again (waiting for a
        version) must not keep another trainer's lapsed group out.
        """
        got: list[Claimed] = []
        if not streams:
            return got
        start = self._rotation % len(streams)
        self._rotation += 1
        candidates = streams[start:] + streams[:start]
        while candidates and len(got) < count:
            want = count - len(got)
            shares = [want // len(candidates) + (i < want % len(candidates))
                      for i in range(len(candidates))]
            more = []
            for stream, share in zip(candidates, shares):
                if share == 0:
                    more.append(stream)
                    continue
                entries = await self._reclaim_stream(stream, lease_ms, share)
                got.extend(entries)
                if len(entries) == share:  # may hold more: eligible for unused shares
                    more.append(stream)
            # Ends: a pass either fills `count` or drops a stream that came up short.
            candidates = more
        return got

    async def _reclaim_stream(self, stream: str, lease_ms: int, count: int) -> list[Claimed]:
        cursor = self._reclaim_cursor.get(stream, "0-0")
        try:
            next_cursor, entries = await self.scripts.reclaim(
                keys=[stream, self.keys.errors],
                args=[self.consumer, lease_ms, cursor, count],
                client=self.redis,
            )
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            await self.ensure_group(stream)
            return []
        self._reclaim_cursor[stream] = _text(next_cursor)
        return [_entry(stream, entry_id, fields, deliveries=int(deliveries), last_error=_text(error))
                for entry_id, fields, deliveries, error in entries]

    async def unheld(self, streams: list[str], held: set[tuple[str, str]], idle_ms: int,
                     limit: int = 1000) -> list[Claimed]:
        """Entries pending on this worker's name, idle for `idle_ms`, that it does not hold.

        They come from a read whose reply was lost: redis-py retried the XREADGROUP (or the
        reclaim), the retry returned other entries, and these were delivered to nobody.
        """
        if not streams:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream in streams:
                pipe.xpending_range(stream, Group.WORKERS, "-", "+", limit,
                                    consumername=self.consumer, idle=idle_ms)
            replies = await pipe.execute(raise_on_error=False)
        found = []
        for stream, reply in zip(streams, replies):
            if isinstance(reply, ResponseError):  # NOGROUP: nothing of ours there
                continue
            for p in reply:
                c = Claimed(stream, _text(p["message_id"]), None, None, None)
                if c.key not in held:
                    found.append(c)
        return found

    async def renew(self, held: list[Claimed]) -> list[Claimed]:
        """Extend the lease of every held entry; returns the ones this worker no longer owns."""
        by_stream: dict[str, list[Claimed]] = {}
        for c in held:
            by_stream.setdefault(c.stream, []).append(c)
        replies, _ = await pipelined(self.redis, [
            (self.scripts.renew, [stream], [self.consumer, *(c.entry_id for c in items)])
            for stream, items in by_stream.items()])
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        lost_ids = {(s, _text(i)) for s, reply in zip(by_stream, replies) for i in reply}
        return [c for c in held if c.key in lost_ids]

    async def finish(self, claimed: Claimed, status: str, payload: bytes, *,
                     dead_reason: str = "") -> Reply:
        """Append the group's result and ack its entry, if still ours: OK, DUP or LOST.

        Calls made while another batch is on the wire (or in the same event-loop turn) are sent
        together, as one script call: the script fences each entry exactly as if it were sent
        alone. Batching saves redis-py's per-command cost (packing, a reply to parse each), which
        dominated the worker's CPU time moving no-op groups (docs/benchmarks.md).
        """
        [reply] = await self.finish_many([(claimed, status, payload, dead_reason)])
        return reply

    async def finish_many(self, finishing: list[tuple[Claimed, str, bytes, str]]) -> list[Reply]:
        """`finish` for each (claimed, status, payload, dead_reason), from one caller: the same
        batch and fencing, without a task or a future per entry; raises the first entry's error."""
        if not finishing:
            return []
        waiter = _Waiter(asyncio.get_running_loop().create_future(), [None] * len(finishing))
        for c, *_ in finishing:
            c.settling = True
        self._finishing.extend((*self._finish_call(c, status, payload, dead_reason), waiter, i)
                               for i, (c, status, payload, dead_reason) in enumerate(finishing))
        if self._finisher is None or self._finisher.done():
            self._finisher = asyncio.create_task(self._send_finishes(), name="finish-batches")
        replies = await waiter.future
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        return [_REPLIES.get(reply) or Reply(_text(reply)) for reply in replies]

    def _finish_call(self, claimed: Claimed, status: str, payload: bytes,
                     dead_reason: str) -> tuple[tuple, tuple]:
        _, results, outstanding_bytes = self._trainer_keys(claimed.stream)
        job, done = self._job_keys(claimed.stream, claimed.job_id or "-")
        group = "" if claimed.group_index is None or not claimed.job_id else str(claimed.group_index)
        if claimed.score is not None and status == "ok":
            # A scored group --> its trainer's scoring stream. Not counted done yet: the scorer's
            # finish counts it (and drops a second copy, DUP), so the job ends when it is scored.
            results, group = self.keys.scoring(self._trainer_keys(claimed.stream)[0]), ""
            item = (claimed.data or b"") if claimed.score.resample is not None else b""
            payload = encode(ScoreItem(claimed.score, msgspec.Raw(payload), item))
        keys = (claimed.stream, results, job, done, outstanding_bytes)
        raw = claimed.data or b""
        # The item goes back to Redis only into a dead letter: the byte count needs its size.
        args = (claimed.entry_id, group, status, _lua_string(payload), dead_reason, len(raw),
                _lua_string(raw) if dead_reason else "")
        return keys, args

    def _trainer_keys(self, stream: str) -> tuple[str, str, str]:
        """A work stream's trainer, its result stream and byte counter (looked up per result)."""
        found = self._by_stream.get(stream)
        if found is None:
            trainer = self.keys.trainer_of(stream)
            found = self._by_stream[stream] = (trainer, self.keys.results(trainer),
                                               self.keys.outstanding_bytes(trainer))
        return found

    async def _send_finishes(self) -> None:
        await asyncio.sleep(0)  # let the other groups completing in this loop turn join the batch
        wanted = durability(self.redis)
        while self._finishing:
            batch, self._finishing = self._finishing[:FINISH_BATCH], self._finishing[FINISH_BATCH:]
            keys, entries, sets = _finish_batch(self.keys.errors, self.keys.dead,
                                                self.keys.result_streams, self.keys.results_written,
                                                batch)
            args = [self.consumer, self.job_ttl_s, entries, sets]
            try:
                # One WAIT covers the whole batch.
                [replies], acked = await pipelined(self.redis, [(self.scripts.finish, keys, args)],
                                                   durable_key=keys[2])
                if wanted.replicas:
                    _warn_unreplicated(acked, wanted)
                if isinstance(replies, Exception):
                    replies = [replies] * len(batch)
            except Exception as e:  # the connection failed: every caller decides whether to retry
                replies = [e] * len(batch)
            except BaseException:  # cancelled (shutdown): no caller may wait forever
                for _, _, waiter, _ in batch + self._finishing:
                    if not waiter.future.done():
                        waiter.future.set_exception(RedisConnectionError("finish batch cancelled"))
                self._finishing = []
                raise
            for (_, _, waiter, i), reply in zip(batch, replies):
                waiter.replies[i] = reply
                waiter.left -= 1
                # Done already: its caller was cancelled; the write itself is fenced.
                if not waiter.left and not waiter.future.done():
                    waiter.future.set_result(waiter.replies)

    async def release(self, items: list[Claimed], *, error: str = "", refund: bool = True) -> int:
        """Hand entries back so another worker takes them at once; `refund`: not a delivery."""
        released = 0
        by_stream: dict[str, list[str]] = {}
        for c in items:
            c.settling = True
            by_stream.setdefault(c.stream, []).append(c.entry_id)
        for stream, ids in by_stream.items():
            released += await self.scripts.release(
                keys=[stream, self.keys.errors],
                args=[self.consumer, error, int(refund), *ids],
                client=self.redis,
            )
        return released

    async def job_states(self, claimed: list[Claimed]) -> dict[tuple[str, str], JobState | None]:
        """The state of each entry's job by entry key; None for a job without a record (or an
        entry that names none). Read once per job: a batch holds many groups of few jobs."""
        return await self._job_states(self._jobs(claimed), {})

    async def claimed_states(self, claimed: list[Claimed]) -> dict[tuple[str, str], JobState | None]:
        """`job_states` of what the last `claim` (and reclaims before it) returned. The claim read
        the state of the previous claim's jobs in its own round trip, after its reads: a job's
        groups are claimed in a row, so most claims need no round trip of their own for this."""
        jobs = self._jobs(claimed)
        states = await self._job_states(jobs, self._claim_states)
        self._claim_states = {}
        self._recent_jobs = list(dict.fromkeys(jobs.values()))[-READ_AHEAD_JOBS:]
        return states

    async def _job_states(self, jobs: dict[tuple[str, str], str],
                          known: dict[str, JobState | None]) -> dict[tuple[str, str], JobState | None]:
        states = dict(known)
        distinct = [job for job in dict.fromkeys(jobs.values()) if job not in states]
        if distinct:
            async with self.redis.pipeline(transaction=False) as pipe:
                for job in distinct:
                    pipe.hget(job, JobField.STATE)
                states.update(zip(distinct, map(_job_state, await pipe.execute(), distinct)))
        return {key: states[job] for key, job in jobs.items()}

    def _jobs(self, claimed: list[Claimed]) -> dict[tuple[str, str], str]:
        """The job record of each entry that names a job, by entry key."""
        return {c.key: self._job_keys(c.stream, c.job_id)[0] for c in claimed if c.job_id}

    def _job_keys(self, stream: str, job_id: str) -> tuple[str, str]:
        """A job's record and done hash (looked up per group: cached for the recent jobs)."""
        found = self._by_job.get((stream, job_id))
        if found is None:
            if len(self._by_job) >= 64:
                self._by_job.clear()
            trainer = self._trainer_keys(stream)[0]
            found = self._by_job[stream, job_id] = (self.keys.job(trainer, job_id),
                                                    self.keys.done(trainer, job_id))
        return found
