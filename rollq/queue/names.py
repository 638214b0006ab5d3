"""Every name inside rollq's Redis values, spelled here and nowhere else: consumer groups, stream
entry fields, job-record fields, job states and the words the Lua scripts answer with.

Key names are `keys.py`'s. The Lua scripts never spell a name: `scripts.py` prepends
`lua_preamble()`, one `local PREFIX_MEMBER = 'value'` per member of the enums below, so a script
writes `JOB_STATE` where Python writes `JobField.STATE`. tests/test_data_model.py fails when a
script uses a name not defined here, or spells a lowercase word of its own.
"""

from __future__ import annotations

from enum import StrEnum
from typing import get_args

from rollq.protocol import Status


class Group(StrEnum):
    """Consumer groups and the one pseudo-consumer."""

    WORKERS = "workers"
    """Consumer group of every work stream."""
    TRAINER = "trainer"
    """Consumer group of every result stream."""
    RELEASED = "_released"
    """Owner of work entries handed back by a worker; anyone may reclaim them at once."""


class WorkField(StrEnum):
    """Fields of a work-stream entry. `JOB` and `GROUP` repeat the payload's job id and group
    index, so that an entry whose payload does not decode can still be named."""

    JOB = "j"
    GROUP = "g"
    ITEM = "d"
    """The encoded WorkItem."""


class ResultField(StrEnum):
    """Fields of a result-stream entry."""

    RESULT = "d"
    """The encoded GroupResult."""


class DeadField(StrEnum):
    """Fields of a dead letter."""

    STREAM = "stream"
    ID = "id"
    REASON = "reason"
    ITEM = "item"
    """The raw work item, as it was queued."""


class EventField(StrEnum):
    """Fields of a version announcement (the version-events stream)."""

    VERSION = "v"


class TallyField(StrEnum):
    """Fields of a scorer's tally (the score-tallies stream)."""

    TALLY = "d"
    """The encoded `scoring.records.Tally`."""


class DoneField(StrEnum):
    """A job's done hash holds group index -> status; a job of many groups also `ENCODING`."""

    ENCODING = "encoding"
    """Its value, `TABLE`, is longer than a listpack's values may be (`finish.lua`): the hash is a
    hash table from its first marker, where a listpack's lookups cost O(groups) per marker."""
    TABLE = "a_hash_table_from_the_first_marker_where_a_listpack_costs_o_of_groups_per_marker"


class JobState(StrEnum):
    """The `state` field of a job record."""

    PENDING = "pending"
    DONE = "done"
    """Every group has its terminal result."""
    CANCELLED = "cancelled"
    """Cancelled by the trainer: groups without a result end `cancelled`."""


class JobField(StrEnum):
    """Fields of a job record (a hash). The four result counters are named by the result's
    status (`finish.lua` increments the field its status names), so they are the `Status` words."""

    TRAINER = "trainer"
    GROUPS = "groups"
    DONE = "done"
    """Groups with a terminal result."""
    OK = "ok"
    FAILED = "failed"
    EXPIRED = "expired"
    CANCELLED = "cancelled"
    FILTERED = "filtered"
    """Groups of a scored job with dynamic sampling whose rewards stayed all equal."""
    RESAMPLED = "resampled"
    """Times its groups were generated again because their rewards were all equal."""
    CREATED_AT = "created_at"
    DEADLINE = "deadline"
    META = "meta"
    STATE = "state"
    """A JobState."""
    MIN_VERSION = "min_version"
    MAX_VERSION = "max_version"
    """Only when the job has an upper bound."""
    FINISHED_AT = "finished_at"
    """Set when the last group gets its result."""
    CUT = "cut"
    """Over-sampling: set by the pick that filled the job's `deliver` groups, which cancels it
    (its other groups end `cancelled`); a job so cut ends `done` with its last group's result."""


class EpisodeState(StrEnum):
    """The `state` field of an episode record."""

    IDLE = "idle"
    """Waiting for its next turn."""
    RUNNING = "running"
    """A turn is queued or being generated (`turn_job` names it)."""
    ENDED = "ended"
    """Ended by its owner: no more turns; the record stays until it expires."""


class EpisodeField(StrEnum):
    """Fields of an episode record (a hash; `rollq/client/episodes.py`)."""

    TRAINER = "trainer"
    STATE = "state"
    """An EpisodeState."""
    SAMPLING = "sampling"
    """The encoded Sampling of every turn."""
    MIN_VERSION = "min_version"
    MAX_VERSION = "max_version"
    """'' for none."""
    MAX_STALENESS = "max_staleness"
    """'' for none; bounds the first turn (and every turn of an episode allowed to move)."""
    MOVE = "move"
    """'1': later turns may be served by a newer version in the window; '0': by the first
    turn's version only."""
    VERSION = "version"
    """The version that served the last turn ('' before the first turn)."""
    TOKENS = "tokens"
    """int32 token ids of the whole episode so far: prompt, then each turn's new and sampled tokens."""
    MASK = "mask"
    """One byte per token: 1 where the policy sampled it, 0 for prompt and new tokens."""
    LOGPROBS = "logprobs"
    """float32 per token: its logprob where sampled, NaN elsewhere."""
    TOKEN_VERSIONS = "token_versions"
    """int32 per token: the version that sampled it, -1 where not sampled."""
    TURNS = "turns"
    """Turns served."""
    TURN_JOB = "turn_job"
    """The job id of the running turn ('' when idle)."""
    WORKER = "worker"
    """The worker that served the last turn (its prefix cache holds the episode)."""
    TTL = "ttl"
    """Seconds the record lives after each turn begins or ends."""
    CREATED_AT = "created_at"
    REASON = "reason"
    """Why the last turn did not extend the episode ('' when it did)."""
    LAST_TURN_JOB = "last_turn_job"
    """The job id of the last turn served: a turn sent again with its `turn_id` is answered
    from `last_turn` instead of being appended twice."""
    LAST_TURN = "last_turn"
    """msgpack (new tokens, Sample, worker, version) of that turn."""
    SUBMITTER = "submitter"
    """The (derived) trainer that queued the running turn: whose job record says it was queued."""


class ConversationField(StrEnum):
    """Fields of an agent conversation's record (a hash; `rollq/conversations.py`)."""

    TOKENS = "tokens"
    """int32 token ids of every turn: its prompt as the engine saw it (only what the conversation
    did not hold yet, when the turn continued it), then the sampled tokens."""
    MASK = "mask"
    """One byte per token: 1 where the policy sampled it."""
    LOGPROBS = "logprobs"
    """float32 per token: its behaviour logprob where sampled, NaN elsewhere."""
    TOKEN_VERSIONS = "token_versions"
    """int32 per token: the version that sampled it, -1 where not sampled."""
    SEGMENT_START = "segment_start"
    """The index in `tokens` where the last rendered segment starts: the exact prefix of the next
    turn is `tokens[segment_start:]`."""
    MESSAGES = "messages"
    """msgpack: the last turn's messages and the assistant message it was answered with."""
    TURNS = "turns"
    """Per turn: '1' (it continued the last segment), '0' (it began a segment: rendered whole) or
    '2' (it began one: the segment it continued had grown meanwhile), then a 4-byte length and
    the msgpack of the turn as `rollq.conversations.Turn`."""
    JOBS = "jobs"
    """The job id of every turn appended, each between spaces: a turn sent again is not appended."""
    DRIFT = "drift"
    """Turns whose prompt, rendered from the text, would have differed from the exact one."""
    REQUEST = "request"
    """The key of the last turn's request (`conversations.request_key`)..."""
    REPLY = "reply"
    """...and the reply it was answered with (JSON): what a retry of it is answered with."""



class ConversationBytesField(StrEnum):
    """Fields of a trainer's conversation-record bytes (a hash: conversation id -> its record's
    bytes; `keys.conversation_bytes`) that are not ids."""

    TOTAL = ":total"
    """The sum of the records' bytes (not an id: ids have no colon)."""

STATUS_COUNTERS = tuple(JobField(s) for s in get_args(Status))
"""The job-record counter of each result status (a Status the record has no field for fails here,
at import)."""


class Reply(StrEnum):
    """Words the Lua scripts answer with (each script's header says which it uses)."""

    OK = "ok"
    DUP = "dup"
    """enqueue: the job id exists (idempotent submit); finish: the group had its result."""
    LOST = "lost"
    """finish: the caller no longer owns the entry (fencing)."""
    FULL = "full"
    BYTES = "bytes"
    STALE = "stale"
    NEWEST = "newest"
    PINNED = "pinned"
    GONE = "gone"
    BUSY = "busy"
    """episode: a turn is already running."""
    ENDED = "ended"
    """episode: it was ended."""


class GapField(StrEnum):
    """The figures of one (version, worker) in a trainer's gap record (`Keys.gap`), each a
    running sum; a field is `<version>:<worker>:<figure>`. Not used by any script."""

    TOKENS = "n"
    ABS = "abs"
    """Sum of |Δ logprob|, Δ = trainer - behaviour."""
    K3 = "k3"
    """Sum of Schulman's k3, r - 1 - log r, r = exp(Δ)."""
    OVER = "over1"
    """Tokens with |Δ| > 1."""
    RATIO = "r"
    """Sum of the importance ratio r = exp(Δ)..."""
    RATIO_SQ = "r2"
    """...and of its square (the ratio's spread)."""


LUA_PREFIXES: dict[str, type[StrEnum]] = {
    "GROUP": Group, "WORK": WorkField, "RESULT": ResultField, "DEAD": DeadField, "EVENT": EventField,
    "STATE": JobState, "JOB": JobField, "REPLY": Reply, "EPISODE": EpisodeField,
    "EPISODE_IS": EpisodeState, "CONVERSATION": ConversationField, "DONE": DoneField,
    "CONVERSATION_BYTES": ConversationBytesField,
}
"""Lua name of a member: `<prefix>_<member>`, e.g. `JOB_STATE`, `STATE_PENDING`, `GROUP_WORKERS`."""


def lua_names() -> dict[str, str]:
    """Every name a script may use, by its Lua constant."""
    return {f"{prefix}_{member.name}": member.value
            for prefix, enum in LUA_PREFIXES.items() for member in enum}


def lua_preamble() -> str:
    return "".join(f"local {name} = '{value}'\n" for name, value in lua_names().items())
