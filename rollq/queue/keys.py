"""Every Redis key rollq uses, spelled here and nowhere else.

All keys of one policy share the hash tag `{policy}`, so every Lua script touches one slot and
runs on Redis Cluster too.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollq.protocol import DERIVED_SEPARATOR, check_id

PREFIX = "rollq"


@dataclass(frozen=True)
class Keys:
    policy: str

    def __post_init__(self) -> None:
        check_id("policy", self.policy)

    @property
    def _p(self) -> str:
        return f"{PREFIX}:{{{self.policy}}}"

    def work(self, trainer: str) -> str:
        """Work stream of one trainer: one entry per prompt group."""
        return f"{self._p}:work:{trainer}"

    def results(self, trainer: str) -> str:
        """Result stream of one trainer: one entry per finished group."""
        return f"{self._p}:res:{trainer}"

    def job(self, trainer: str, job_id: str) -> str:
        """Hash: the job record with its counters. Job ids are the trainer's own: two trainers'
        `step-1` are two jobs (ids cannot contain ':', so trainer and id cannot run together)."""
        return f"{self._p}:job:{trainer}:{job_id}"

    def done(self, trainer: str, job_id: str) -> str:
        """Hash group_index -> status: the groups of a job that have their terminal result."""
        return f"{self._p}:done:{trainer}:{job_id}"

    def outstanding(self, trainer: str) -> str:
        """Counter: groups submitted by a trainer whose result it has not acknowledged. A
        trainer's counter also counts the groups of every id derived from it (its episodes, the
        gateway's completions for it: `base_trainer`): its quota and the operator's cap bound
        them all. A derived id's own counter counts its own."""
        return f"{self._p}:outstanding:{trainer}"

    def outstanding_bytes(self, trainer: str) -> str:
        """Counter: bytes of a trainer's encoded work items still in its work stream (queued or
        being generated); capped per submit, counted off by `finish`, reset by a submit that
        finds the stream empty (so drift cannot block a trainer for good)."""
        return f"{self._p}:outstanding-bytes:{trainer}"

    @property
    def trainers(self) -> str:
        """Set of trainers that have something queued on their work stream (or had, until the
        workers' next prune, `queue/prune.py`): the streams workers claim from. A trainer's next
        submit adds it again."""
        return f"{self._p}:trainers"

    @property
    def result_streams(self) -> str:
        """Sorted set result stream -> when a result was last written to it (unix s): results
        nobody read for `job_ttl_s` after the last one are dropped (`results_expire.lua`)."""
        return f"{self._p}:result-streams"

    @property
    def results_written(self) -> str:
        """Hash stream -> entries ever written to it by `finish.lua` (a result stream's results, a
        scoring stream's generated groups): the counters the gateway reads each second for live
        rates (`gateway/pool_view.py`). A field goes with its stream's entry in `result_streams`."""
        return f"{self._p}:results-written"

    def trainer_of_results(self, result_stream: str) -> str:
        return self._after("res", result_stream, "a result stream")

    def quota(self, trainer: str) -> str:
        """Server-side cap on a trainer's outstanding groups, its derived ids' included (optional,
        set by operators on the base trainer). One key per trainer, so a trainer's ACL can reach
        its own cap and no one else's."""
        return f"{self._p}:quota:{trainer}"

    @property
    def errors(self) -> str:
        """Hash work-entry id -> last error of a delivery that did not finish it."""
        return f"{self._p}:errors"

    @property
    def dead(self) -> str:
        """Stream of dead-lettered work items, with the reason."""
        return f"{self._p}:dead"

    @property
    def versions(self) -> str:
        """Hash version -> encoded VersionEntry: the weight registry."""
        return f"{self._p}:versions"

    @property
    def latest(self) -> str:
        """The newest registered version."""
        return f"{self._p}:latest"

    @property
    def version_events(self) -> str:
        """Stream announcing each newly registered version (workers block on it)."""
        return f"{self._p}:version-events"

    def pins(self, version: int) -> str:
        """Sorted set worker id -> lease expiry (ms, Redis clock): the workers verifying, draining
        toward, loading or serving `version`. Taken only while the version is registered and
        checked by retention in the same script, so a pinned version's files are never deleted."""
        return f"{self._p}:pins:{version}"

    def canary_refusals(self, version: int) -> str:
        """Hash worker id -> why it refused `version` (its canary's figures): written by each
        worker whose check refused the version, read to tell when every live worker has."""
        return f"{self._p}:canary-refusals:{version}"

    @property
    def refused_versions(self) -> str:
        """Hash version -> reason: versions every live worker's canary refused (the registry's
        mark). Groups that only such a version could serve fail with the reason instead of
        waiting; a worker that later accepts the version removes the mark."""
        return f"{self._p}:refused-versions"

    @property
    def bounded_jobs(self) -> str:
        """Sorted set job key -> its deadline (unix s; inf for none): the unfinished jobs with a
        max_version, whose versions retention keeps. A sorted set as `episodes` is: a trainer's
        Redis user may add to both (ZADD), and no command it may run gives either another type
        (a set before: a trainer's ZADD on it while absent failed every pinned submit,
        review-turn4). A set left by an older rollq is still read and added to until it empties."""
        return f"{self._p}:bounded-jobs"

    @property
    def pinned_versions(self) -> str:
        """Sorted set version -> when a pinned worker last served it: groups only a pinned
        worker can serve wait through its restart instead of failing."""
        return f"{self._p}:pinned-versions"

    @property
    def workers(self) -> str:
        """Sorted set of worker ids by time of their last heartbeat."""
        return f"{self._p}:workers"

    def worker(self, worker_id: str) -> str:
        """A worker's last heartbeat; expires when the worker stops beating."""
        return f"{self._p}:worker:{worker_id}"

    def scoring(self, trainer: str) -> str:
        """Stream of one trainer's generated groups of scored jobs, waiting for their reward
        (`rollq/scoring/`): one entry per group, claimed by scorers as work streams are by
        workers (the same consumer group name, `Group.WORKERS`, so the same scripts serve)."""
        return f"{self._p}:scoring:{trainer}"

    def trainer_of_scoring(self, scoring_stream: str) -> str:
        return self._after("scoring", scoring_stream, "a scoring stream")

    def picked(self, trainer: str, job_id: str) -> str:
        """Hash group index -> 1: the groups of an over-sampled job picked for delivery (at
        most its `deliver`); expires with the job."""
        return f"{self._p}:picked:{trainer}:{job_id}"

    @property
    def scoring_trainers(self) -> str:
        """Set of trainers that submitted scored jobs: whose scoring streams scorers read. Not
        pruned (a trainer's scoring stream is created by a worker after the submit)."""
        return f"{self._p}:scoring-trainers"

    @property
    def scorers(self) -> str:
        """Sorted set of scorer ids by time of their last heartbeat."""
        return f"{self._p}:scorers"

    def scorer(self, scorer_id: str) -> str:
        """A scorer's last heartbeat (the rewards it offers); expires when it stops beating."""
        return f"{self._p}:scorer:{scorer_id}"

    @property
    def score_tallies(self) -> str:
        """Stream (capped) of the scorers' tallies, one entry per scorer per second it scored
        anything: rewards per trainer and job, statuses, scoring time (`scoring/records.py`
        `Tally`); the gateway reads what is new each second (`gateway/scoring_view.py`)."""
        return f"{self._p}:score-tallies"

    def image(self, trainer: str, digest: str) -> str:
        """String: one image's encoded bytes, stored once per trainer and content (BLAKE3 hex
        `digest`) whatever the number of groups and jobs naming it; expires (`rollq/images.py`).
        `trainer`: a user's trainer id, never a derived one (`images.image_owner`). Per trainer,
        not per policy: a key two trainers share is a key one of them can shorten or overwrite
        (Redis ACLs grant commands, not their options), so no trainer holds another's images."""
        return f"{self._p}:image:{trainer}:{digest}"

    def image_holds(self, trainer: str) -> str:
        """Sorted set (digest followed by its bytes) -> expiry (unix s): the images a trainer
        stored or named and keeps alive; with `image_bytes`, its image budget (`rollq/images.py`)."""
        return f"{self._p}:image-holds:{trainer}"

    def image_bytes(self, trainer: str) -> str:
        """Counter: the bytes of the images in `image_holds(trainer)`."""
        return f"{self._p}:image-bytes:{trainer}"

    def routed_work(self, trainer: str, worker: str, version: int) -> str:
        """Work stream of one trainer's groups routed to one worker while it serves `version`
        (episode turns: that worker holds their prefix in its cache). Read by that worker, and by
        every worker once it is gone or serves another version (`WorkQueue.streams`)."""
        return f"{self._p}:work:{trainer}:{worker}:{version}"

    def route_of(self, stream: str) -> tuple[str, str, int] | None:
        """(trainer, worker, version) of a routed work stream; None for a trainer's own stream."""
        parts = self.trainer_stream_rest(stream).split(":")
        return (parts[0], parts[1], int(parts[2])) if len(parts) == 3 else None

    @property
    def routed(self) -> str:
        """Hash routed work stream -> when a group was last routed to it (unix s)."""
        return f"{self._p}:routed"

    def episode(self, trainer: str, episode_id: str) -> str:
        """Hash: one multi-turn episode (its token sequence, mask, logprobs, version, state;
        `names.EpisodeField`); expires `ttl_s` after its last turn began or ended."""
        return f"{self._p}:episode:{trainer}:{episode_id}"

    def conversation_holds(self, trainer: str) -> str:
        """Sorted set: the ids of a trainer's conversation records -> when each expires (unix s);
        with `conversation_bytes`, its conversation budget (`rollq/conversations.py`)."""
        return f"{self._p}:conversation-holds:{trainer}"

    def conversation_bytes(self, trainer: str) -> str:
        """Hash: each of a trainer's conversation records (its id) -> its bytes, and under
        `ConversationBytesField.TOTAL` (":total", not an id: ids have no colon) their sum."""
        return f"{self._p}:conversation-bytes:{trainer}"

    def conversation(self, trainer: str, conversation_id: str) -> str:
        """Hash: an agent conversation's exact trajectory (`names.ConversationField`), written by
        the gateway once per served chat turn that names it; expires an hour after its last turn."""
        return f"{self._p}:conversation:{trainer}:{conversation_id}"

    def episode_owner(self, submitter: str) -> str:
        """String with a PX expiry: the token of the one live `Episodes` object reading the
        results of `submitter` (a derived trainer `<trainer>~episodes~<owner>`)."""
        return f"{self._p}:episode-owner:{submitter}"

    def episode_running(self, submitter: str) -> str:
        """Sorted set episode key -> when its turn began (unix s): the records of `submitter`'s
        episodes a start or turn made running. A new holder of the owner reads it to free the
        turns its predecessor never queued (a trainer's Redis user may not list the policy's
        `episodes`, which names every trainer's); members no longer running are dropped lazily."""
        return f"{self._p}:episode-running:{submitter}"

    def gateway_episode_trainers(self, gateway_id: str) -> str:
        """Sorted set trainer -> when it last started or took a turn (unix s) through gateway
        `gateway_id`: whose episodes a gateway restarted with that id takes over. Not the
        `trainers` set: workers prune a trainer from it as soon as its work stream is empty, while
        its finished turns' results may still wait unapplied."""
        return f"{self._p}:gateway-episodes:{gateway_id}"

    @property
    def episodes(self) -> str:
        """Sorted set episode key -> expiry (unix s): the live episodes, whose versions retention
        keeps (entries of expired episodes are dropped by the retention that finds them gone)."""
        return f"{self._p}:episodes"

    def gap(self, trainer: str) -> str:
        """Hash `<version>:<worker>:<figure>` -> a running sum: the training-inference gap this
        trainer reported of the samples it trained on (`queue/gap.py`: tokens, sum of |Δ logprob|,
        of k3, tokens with |Δ| > 1, of the importance ratio and of its square). The trainer's
        own key, so its Redis user may write it (HINCRBY, HINCRBYFLOAT, HDEL); it keeps the newest
        `gap.GAP_VERSIONS` versions the trainer reported and expires `gap.GAP_TTL_S` after its
        last report."""
        return f"{self._p}:gap:{trainer}"

    @property
    def gap_trainers(self) -> str:
        """Set of trainers that reported a gap (`gap(trainer)`): whose records its readers sum
        (`rollq status`, the gateway). Not pruned: a member whose record expired reads as empty."""
        return f"{self._p}:gap-trainers"

    @property
    def every_key(self) -> str:
        """Glob pattern matching every key of the policy (ACL rules, scans)."""
        return f"{self._p}:*"

    def record_of(self, kind: str, key: str) -> tuple[str, str]:
        """(trainer, id) of a record's key (`kind`: "job", "episode"); ValueError for another key."""
        parts = self._after(kind, key, f"a {kind} record").split(":")
        if len(parts) != 2:
            raise ValueError(f"{key!r} is not a {kind} record of policy {self.policy!r}")
        return parts[0], parts[1]

    def trainer_stream_rest(self, work_stream: str) -> str:
        return self._after("work", work_stream, "a work stream")

    def _after(self, kind: str, key: str, what: str) -> str:
        """What follows `<policy prefix>:<kind>:` in `key` (the parsers of stream names)."""
        prefix = f"{self._p}:{kind}:"
        if not key.startswith(prefix):
            raise ValueError(f"{key!r} is not {what} of policy {self.policy!r}")
        return key[len(prefix):]

    def trainer_of(self, work_stream: str) -> str:
        """The trainer of a work stream, routed or not (ids cannot contain ':')."""
        return self.trainer_stream_rest(work_stream).split(":", 1)[0]


def base_trainer(trainer: str) -> str:
    """The trainer an id derived from it (`protocol.derived_trainer_id`: `trainer~purpose~owner`)
    submits for; a chosen id is its own base. Quota and fair share are the base trainer's."""
    return trainer.split(DERIVED_SEPARATOR, 1)[0]


class _EveryPolicy(Keys):
    """Keys whose policy is the glob `*`: patterns that match a key of every policy."""

    def __post_init__(self) -> None:
        pass


EVERY_POLICY = _EveryPolicy("*")
"""`EVERY_POLICY.trainers` is the glob of every policy's trainers set (for SCAN)."""


def policy_of(key: str) -> str:
    """The policy of one of rollq's keys (the text inside its hash tag)."""
    head = f"{PREFIX}:{{"
    end = key.find("}", len(head))
    if not key.startswith(head) or end < 0:
        raise ValueError(f"{key!r} is not a rollq key")
    return key[len(head):end]
