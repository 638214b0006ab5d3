"""Version gating: may this worker, with the version it has loaded, start this group now?"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from rollq.engine.base import Engine
from rollq.protocol import SwapMode, WorkItem


class Decision(enum.Enum):
    SERVE = "serve"
    """The loaded version is in the group's window."""
    WAIT_SWAP = "wait-swap"
    """This worker is about to load a version in the window: hold the group until then."""
    PASS = "pass"
    """Another worker (or a version not yet published) can serve it: hand it back."""
    FAIL = "fail"
    """No worker can ever serve it."""


@dataclass(frozen=True)
class Verdict:
    decision: Decision
    reason: str = ""
    version: int | None = None
    """SERVE with this adapter version (None: with the loaded full version)."""


def in_window(item: WorkItem, version: int, newest: int) -> bool:
    if version < item.min_version:
        return False
    if item.max_version is not None and version > item.max_version:
        return False
    return item.max_staleness is None or version >= newest - item.max_staleness


def decide(item: WorkItem, *, loaded: int, pinned: bool, newest: int | None,
           pinned_elsewhere: set[int], cannot_load: set[int], target: int | None = None,
           refused_everywhere: dict[int, str] | None = None) -> Verdict:
    """`newest`: the newest registered version (None: none yet, the base weights serve).
    `target`: the version this worker is verifying, draining toward or loading, if any.
    `pinned_elsewhere`: versions other live workers are pinned to or about to load.
    `refused_everywhere`: versions every live worker's canary refused -> why (a group whose
    window starts at such a newest version fails with that reason instead of waiting).

    Workers that follow the registry serve the newest version and every later one, and on the
    way the version they are already swapping to (they pinned it: it cannot be retired); pinned
    workers serve their version forever.
    """
    newest = loaded if newest is None else max(newest, loaded)
    if in_window(item, loaded, newest):
        return Verdict(Decision.SERVE)
    if target is not None and target > loaded and target not in cannot_load \
            and in_window(item, target, newest):
        return Verdict(Decision.WAIT_SWAP)
    if not pinned and loaded < newest and newest not in cannot_load and in_window(item, newest, newest):
        return Verdict(Decision.WAIT_SWAP)
    followers_can = item.max_version is None or item.max_version >= max(item.min_version, newest)
    elsewhere = any(in_window(item, v, newest) for v in pinned_elsewhere)
    refused = (refused_everywhere or {}).get(newest)
    if refused and item.min_version >= newest and in_window(item, newest, newest) and not elsewhere:
        return Verdict(Decision.FAIL, refused)
    if followers_can or elsewhere:
        return Verdict(Decision.PASS)
    window = f"[{item.min_version}, {item.max_version}]"
    return Verdict(Decision.FAIL, f"version window {window} can never be served: the newest version "
                                  f"is {newest} and no live worker is pinned to a version in it")


def interruptible(item: WorkItem, version: int, engine: Engine) -> bool:
    """May a running group be interrupted and continued under `version`?

    Not when the job declines it (`sampling.swap_modes`), the window excludes `version`, nor
    when the engine cannot continue its samples token-exactly from "prompt + tokens so far"
    (`Engine.continues_exactly`: a seed, a regex, penalties, images on vLLM).
    """
    if item.max_version is not None and item.max_version < version:
        return False
    return "interrupt" in item.sampling.swap_modes and engine.continues_exactly(item)


def keepable(item: WorkItem, version: int) -> bool:
    """May a running group be paused and resumed with its KV cache under `version` (a `keep`
    swap)? Only when its job accepts that its later tokens attend to KV computed by an older
    version (`sampling.swap_modes`), and its window admits `version`. Sampling settings need no
    check: the request itself goes on (its seed's generator, regex automaton and penalty counts
    with it)."""
    return "keep" in item.sampling.swap_modes and (item.max_version is None
                                                   or item.max_version >= version)


def crossing(mode: SwapMode, engine: Engine) -> Callable[[WorkItem, int], bool]:
    """For a swap in `mode`: may a running group (item) go on across the swap to a version?"""
    if mode == "interrupt":
        return lambda item, version: interruptible(item, version, engine)
    if mode == "keep":
        return keepable
    return lambda item, version: False
