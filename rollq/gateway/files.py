"""The publish route's file work, in helper processes: header checks, copies and digests.

Checking a safetensors header is CPU work under the GIL (a 16 MiB forged header of
4,300-digit integers holds it for ~0.5 s in msgspec's decode), so in a thread of the gateway it
stalls the event loop and every request with it. Here it runs in a small pool of spawned
processes at a lower priority, created on the first publish. Only plain values cross: the
gateway sends a path it has already checked against the weight roots, the policy, the version
and the copy flag; the process sends back strings and ints, or the refusal's message.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

from rollq.protocol import FileDigest
from rollq.registry.safetensors_check import WeightError
from rollq.registry.store import WeightStore, digest_dir

NICE = 10
"""Added to the helpers' niceness: on a busy box the gateway's own loop runs first."""

Files = list[tuple[str, str, int, str]]
"""(name, digest, bytes, algorithm) per file: FileDigest as plain values."""


def _lower_priority() -> None:
    os.nice(NICE)


def prepare_files(store_root: str, policy: str, version: int, source: str, copy: bool
                  ) -> tuple[str, str, Files]:
    """In a helper process: `source` checked and hashed in place, or copied into the store.

    Returns ("", path, files), or (message, "", []) for weights refused (WeightError's text)."""
    src = Path(source)
    try:
        if not src.is_dir():
            raise WeightError(f"{src} is not a directory of safetensors files")
        if copy:
            path, digests = WeightStore(store_root).copy_dir(policy, version, src)
        else:
            path, digests = src, digest_dir(src)
    except WeightError as e:
        return str(e), "", []
    return "", str(path), [(d.name, d.digest, d.bytes, d.algorithm) for d in digests]


class FileWorkers:
    """A lazily started pool of `processes` helper processes; `close()` when the gateway stops."""

    def __init__(self, processes: int):
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def _submit(self, *args: object) -> tuple[ProcessPoolExecutor, Future]:
        """Called in a thread: starting the helpers (their queues' resource tracker, fork and
        exec of each) took ~0.2 s on the event loop. A pool broken by a helper's death (killed,
        out of memory) is replaced."""
        with self._lock:
            for _ in range(2):
                if self._pool is None:
                    # spawn: a fresh interpreter, nothing of the gateway's state (sockets, threads).
                    self._pool = ProcessPoolExecutor(
                        self.processes, multiprocessing.get_context("spawn"), initializer=_lower_priority)
                try:
                    return self._pool, self._pool.submit(prepare_files, *args)
                except BrokenProcessPool:
                    self._pool = None
            raise BrokenProcessPool("the publish helpers could not be started")

    async def prepare(self, store_root: Path, policy: str, version: int, source: Path,
                      copy: bool) -> tuple[Path, list[FileDigest]]:
        """The version's directory and digests; WeightError with the files' problem."""
        pool, future = await asyncio.to_thread(self._submit, str(store_root), policy, version,
                                               str(source), copy)
        done = asyncio.wrap_future(future)
        try:
            refused, path, files = await asyncio.shield(done)
        except asyncio.CancelledError:
            # The helper runs on regardless: the caller keeps its turn until it is done, so
            # publishes whose clients hang up cannot pile work up behind the pool.
            await asyncio.wait([done])
            raise
        except BrokenProcessPool:
            with self._lock:
                if self._pool is pool:  # not one another caller started since
                    self._pool = None
            raise
        if refused:
            raise WeightError(refused)
        return Path(path), [FileDigest(*f) for f in files]

    def close(self) -> None:
        """Queued work is dropped; a helper busy with a file finishes it, then exits."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None
