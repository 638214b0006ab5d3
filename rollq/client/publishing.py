"""Publishing weights from a trainer (`RolloutClient.publish_weights`): the source made safe from
the trainer's next optimizer step (a state_dict packed into a staging buffer, a sharded model
gathered, a PEFT adapter extracted), then its files written into the weight store and hashed,
then the version committed (`registry/commit.py`, the step the gateway's publish shares), in the
order the publishes were made. A push commits first: its segment and fingerprints, then the
version registered with the offer, then its files written (`Publisher._push_first`)."""

from __future__ import annotations

import asyncio
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from rollq.canary import Canary, encode_canary, reference
from rollq.engine import pushes
from rollq.protocol import FileDigest, InvalidInput, PushOffer, TensorDigest, Version, VersionEntry, typed
from rollq.queue.keys import Keys
from rollq.registry.adapters import is_adapter_dir
from rollq.registry.commit import commit_files
from rollq.registry.retention import retain
from rollq.registry.sources import adapter_of, gathered, is_sharded, named_tensors
from rollq.registry.staging import Staging
from rollq.registry.store import WeightStore, adapter_files, digest_dir, image_digest
from rollq.registry.versions import Registry

log = logging.getLogger("rollq.client")


PUSH_HOLD_S = 60.0
"""How long a push's segment stays for workers to read (a later push removes it sooner): a
worker that comes later loads the version's files."""


def _log_failed_publish(task: asyncio.Task) -> None:
    """A background publish that failed is logged even if its caller never awaits its task."""
    if not task.cancelled() and (error := task.exception()) is not None:
        log.error("publish_weights (wait=False) failed: %s: %s", type(error).__name__, error)


class Publisher:
    """One trainer's publishes of one policy (see `RolloutClient.publish_weights`)."""

    def __init__(self, redis: Redis, keys: Keys, registry: Registry, weight_store: str, trainer_id: str):
        self.redis, self.keys, self.registry = redis, keys, registry
        self.weight_store = weight_store
        self.trainer_id = trainer_id
        self._publishing: asyncio.Task | None = None
        """The last publish started: the next one registers after it (versions in order)."""
        self._staging = Staging()
        """Host buffers a published state_dict is copied into, kept for the next publishes."""
        self._segments: list[Path] = []
        """Pushes' shm segments still offered (the newest last)."""
        self._spare: Path | None = None
        """A segment no longer offered, which the next push writes over (`write_segment`)."""

    def drop_segments(self, keep: int = 0) -> None:
        """Offer no more than the newest `keep` push segments (a worker reading one keeps reading:
        its descriptor holds the file; one that comes later loads the version's files). The
        first one dropped is kept as the spare while pushes go on; `keep=0` removes all."""
        while len(self._segments) > keep:
            old = self._segments.pop(0)
            if keep and self._spare is None:
                self._spare = old
            else:
                old.unlink(missing_ok=True)
        if not keep and self._spare is not None:
            self._spare.unlink(missing_ok=True)
            self._spare = None

    async def settle(self) -> None:
        """Until the last publish started has finished (or failed)."""
        if self._publishing is not None:
            await asyncio.wait([self._publishing])

    async def publish(self, version: int, source: Any, *, copy: bool, keep: int | None, wait: bool,
                      adapter_on: int | None, push: str | None = None,
                      canary: Canary | bool | None = None):
        typed("version", version, Version)
        if canary not in (None, False) and adapter_on is not None:
            raise InvalidInput("canary", "adapter versions cannot carry a canary yet: vLLM 0.32 "
                                         "cannot score prompt logprobs under a LoRA adapter (its "
                                         "engine core dies: vllm#29955)")
        # Computed (or checked) first: of the weights as they are now, before anything returns.
        encoded = await self._canary(canary, source)
        if push is not None and (push not in pushes.TRANSPORTS or adapter_on is not None
                                 or isinstance(source, (str, os.PathLike))):
            raise InvalidInput("push", f"push={push!r}: a push takes one of {list(pushes.TRANSPORTS)}, "
                                       "and a full version's state_dict or model (not a directory, "
                                       "not an adapter)")
        if adapter_on is not None:
            await self._check_adapter_base(version, adapter_on, source)
            if not isinstance(source, (str, os.PathLike)):
                source = await asyncio.to_thread(adapter_of, source)
        elif isinstance(source, (str, os.PathLike)) and is_adapter_dir(Path(source)):
            raise InvalidInput("adapter_on", f"{source} is a LoRA adapter: publish it with "
                                             "adapter_on=<the full version it applies on>")
        elif not isinstance(source, (str, os.PathLike)):
            if is_sharded(source):
                source = await asyncio.to_thread(gathered, source)  # a collective: every rank
                if source is None:  # not rank 0: rank 0 publishes
                    return None
            # The one copy the trainer waits for: its tensors into a staging buffer, laid out
            # as the file; from here its optimizer may change them in place.
            source = await asyncio.to_thread(self._pack, source)
        task = asyncio.create_task(self._publish_in_turn(self._publishing, version, source, copy,
                                                         keep, adapter_on, push, encoded))
        self._publishing = task
        if wait:
            return await task
        task.add_done_callback(_log_failed_publish)
        return task

    @staticmethod
    async def _canary(canary: Canary | bool | None, source: Any) -> bytes:
        if canary is None or canary is False:
            return b""
        if isinstance(canary, Canary):
            return encode_canary(canary)
        if canary is not True:
            raise InvalidInput("canary", f"canary={canary!r}: give True (computed from the model) "
                                         "or a rollq.canary.Canary")
        if not callable(getattr(source, "forward", None)) or is_sharded(source):
            raise InvalidInput("canary", "canary=True computes the reference with the model itself: "
                                         "publish the (unsharded) model, or give a Canary made by "
                                         "rollq.canary.reference(model, ...)")
        return encode_canary(await asyncio.to_thread(reference, source))

    def _pack(self, source: Any):
        return self._staging.pack(named_tensors(source))  # (a PEFT model is merged first)

    async def _check_adapter_base(self, version: int, base: Any, source: Any) -> None:
        if not isinstance(base, int) or isinstance(base, bool) or not 0 <= base < version:
            raise InvalidInput("adapter_on", f"adapter_on={base!r} must be a full version below "
                                             f"{version} (0: the model workers start with)")
        if base > 0:
            entry = await self.registry.get(base)
            if entry is None or entry.kind != "full":
                raise InvalidInput("adapter_on", f"adapter_on={base}: no full version {base} is "
                                                 "registered (an adapter applies on full weights)")

    async def _publish_in_turn(self, previous: asyncio.Task | None, version: int, source: Any,
                               copy: bool, keep: int | None,
                               adapter_on: int | None = None, push: str | None = None,
                               canary: bytes = b"") -> VersionEntry:
        if previous is not None:
            await asyncio.wait([previous])  # its outcome is its own caller's to see
        store = WeightStore(self.weight_store, durable=False)
        entry = None
        if push is not None:
            entry = await self._push_first(store, version, source, canary)
        if entry is not None:
            path, owned = Path(entry.path), True
        else:
            # A copy in the store is registered before its fsyncs: workers copy and verify its
            # bytes from the page cache while it becomes durable (fsyncs on a shared disk wait
            # for every other writer's journal commits: the adapter's store step took up to
            # ~175 ms under load; a checkpoint's fsync writes all of it to disk); the call
            # returns once durable. What a crash leaves at each step: docs/architecture.md,
            # "Versions before they are durable".
            if adapter_on is None:
                path, files, owned = await asyncio.to_thread(self._write_weights, store, version,
                                                             source, copy)
            else:
                path, files = await asyncio.to_thread(self._write_adapter, store, version, source)
                owned = True
            entry = await commit_files(self.redis, self.keys, store, version, path, files, owned,
                                       publisher=self.trainer_id, keep=None, registry=self.registry,
                                       adapter_on=adapter_on, canary=canary)
        if owned:  # (by reference: the trainer's files, whose durability is the trainer's)
            await asyncio.to_thread(store.make_durable, path)
        if keep is not None:  # older versions go only once this one is durable
            await retain(self.redis, self.keys, store, keep)
        return entry

    def _write_weights(self, store: WeightStore, version: int, source: Any, copy: bool):
        policy = self.keys.policy
        if isinstance(source, (str, os.PathLike)):
            source = Path(source).resolve()
            if not source.is_dir():
                raise InvalidInput("source", f"{source} is not a directory of safetensors files")
            if not copy:
                return source, digest_dir(source), False
            return *store.copy_dir(policy, version, source), True
        try:  # a packed checkpoint (staging.Image)
            return *store.write_image(policy, version, source), True
        finally:
            self._staging.give(source.buffer)

    async def _push_first(self, store: WeightStore, version: int, image: Any,
                          canary: bytes) -> VersionEntry | None:
        """A push publish: the packed image written into a shm segment while other threads
        fingerprint each tensor and take its file's digest (`_offer`, all from memory), the
        version registered with the offer at once, and only then its file written into the
        store, at the directory the entry names. Workers that take the push never wait for the
        trainer's disk; those that miss it wait for the directory to appear (`worker/swap.py`).
        None: no segment could be written (logged); the caller publishes the files alone, the
        image still to write."""
        pushes.sweep_segments(PUSH_HOLD_S)  # (those of trainers that died)
        spare, self._spare = self._spare, None
        try:
            tensors, offer, digest = await asyncio.to_thread(
                _offer, image, f"{self.keys.policy}-{version}", spare)
        except OSError as e:
            log.warning("version %d: no push (its segment could not be written: %s); workers "
                        "load its files", version, e)
            return None
        except BaseException:
            self._staging.give(image.buffer)
            raise
        path = store.version_path(self.keys.policy, version)
        self._segments.append(Path(offer.address))
        try:  # the offer is part of the entry: registered first, it travels with the announcement
            entry = await commit_files(self.redis, self.keys, store, version, path, [digest], True,
                                       publisher=self.trainer_id, keep=None, registry=self.registry,
                                       tensors=tensors, push=offer, canary=canary)
        except BaseException:
            self._drop_segment(offer.address)  # never registered: nobody will read it
            self._staging.give(image.buffer)
            raise
        self.drop_segments(keep=1)
        asyncio.get_running_loop().call_later(PUSH_HOLD_S, self._drop_segment, offer.address)
        try:
            await asyncio.to_thread(self._write_image_at, store, version, image, path, digest)
        except BaseException as e:
            log.error("version %d is registered and pushed, but its files could not be written "
                      "(%s: %s): workers that missed the push load a later version", version,
                      type(e).__name__, e)
            raise
        return entry

    def _write_image_at(self, store: WeightStore, version: int, image: Any, path: Path,
                        digest: FileDigest) -> None:
        try:
            store.write_image(self.keys.policy, version, image, at=path, digest=digest)
        finally:
            self._staging.give(image.buffer)

    def _drop_segment(self, address: str) -> None:
        for path in [p for p in self._segments if str(p) == address]:
            self._segments.remove(path)
            path.unlink(missing_ok=True)

    def _write_adapter(self, store: WeightStore, version: int, source: Any):
        if isinstance(source, tuple):  # (tensors, config) of a PEFT model, copied already
            return store.write_adapter(self.keys.policy, version, *source)
        source = Path(source).resolve()
        if not source.is_dir():
            raise InvalidInput("source", f"{source} is not an adapter directory")
        return store.copy_dir(self.keys.policy, version, source, adapter_files)


def _offer(image: Any, label: str,
           spare: Path | None = None) -> tuple[list[TensorDigest], PushOffer, FileDigest]:
    """A packed image's tensors fingerprinted, their bytes written into a shm segment (over
    `spare` if given), and the digest of the file the image will be written as: three passes
    over the same bytes at once, in three threads (BLAKE3 and write release the GIL)."""
    view = image.view
    with ThreadPoolExecutor(2, thread_name_prefix="rollq-push") as pool:
        digest = pool.submit(image_digest, image)
        tensors = pool.submit(pushes.image_tensors, view)
        segment = pushes.write_segment(view[pushes.data_start(view):], label, spare)
        try:
            return tensors.result()[0], pushes.shm_offer(segment), digest.result()
        except BaseException:
            segment.unlink(missing_ok=True)
            raise
