"""The gate between held groups and the engine: closed while weights are swapped."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from rollq.protocol import WorkItem


class Admission:
    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.generating: dict[tuple[str, str], WorkItem] = {}
        """Groups past the gate: deciding on their version window, or generating."""
        self._changed = asyncio.Event()
        self._watchers = 0
        """Callers waiting for a change: without any, a group leaving notifies nobody."""

    def wake(self) -> None:
        """Groups waiting at the gate for a swap decide on their windows again, now."""
        self._notify()

    def _notify(self) -> None:
        if self._watchers:
            self._changed.set()
            self._changed = asyncio.Event()

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    def generation(self, key: tuple[str, str], item: WorkItem) -> _Inside:
        """`async with`: enter when the gate is open; a swap waits for the groups inside that it
        must drain."""
        return _Inside(self, key, item)

    async def close(self, blocking: Callable[[WorkItem], bool]) -> None:
        """Close the gate, then wait until no group inside is one that `blocking` selects."""
        self._open.clear()
        while any(blocking(item) for item in self.generating.values()):
            await self._watch(self._changed.wait())

    def reopen(self) -> None:
        """Open the gate again; groups waiting for a version re-check theirs."""
        self._open.set()
        self._notify()

    async def changed(self, timeout_s: float) -> None:
        """Until the gate reopens or a group leaves (at most `timeout_s`)."""
        with contextlib.suppress(TimeoutError):
            await self._watch(asyncio.wait_for(self._changed.wait(), timeout_s))

    async def _watch(self, change) -> None:
        self._watchers += 1
        try:
            await change
        finally:
            self._watchers -= 1


class _Inside:
    """One group past the gate. A class rather than a generator context manager: every group
    enters once, and the generator's machinery showed in the worker's per-group profile."""

    __slots__ = ("admission", "key", "item")

    def __init__(self, admission: Admission, key: tuple[str, str], item: WorkItem):
        self.admission, self.key, self.item = admission, key, item

    async def __aenter__(self) -> None:
        gate = self.admission
        while not gate._open.is_set():
            await gate._open.wait()
        # No await between the check and the registration: a closing gate sees this group.
        gate.generating[self.key] = self.item

    async def __aexit__(self, *exc) -> None:
        del self.admission.generating[self.key]
        self.admission._notify()
