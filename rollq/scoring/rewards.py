"""Reward functions as operators register them, and how a module of them is found and loaded.

A reward is found by the mark `reward(...)` leaves on it, in the module the operator names: the
scorer and each of its child processes load that module themselves, so nothing but the reward's
name and plain data crosses a pipe or the queue.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from rollq.protocol import check_id

MARK = "__rollq_reward__"


class Completion(msgspec.Struct, frozen=True):
    """What a reward sees of one sample."""

    text: str
    """The decoded completion (scored jobs ask for it; '' from an engine without a tokenizer)."""
    tokens: list[int]
    finish_reason: str
    index: int = 0
    """The sample's index in its group."""


class RewardSpec(msgspec.Struct, frozen=True):
    name: str
    version: str = "1"
    """Goes with every reward it computes: bump it when the function's meaning changes."""
    timeout_s: float = 30.0
    """Per call (per sample); a call past it gives that sample no reward."""
    memory_mb: int | None = 1024
    """Sync rewards: address space a call may add to its child process (RLIMIT_AS); None: no limit."""


def reward(name: str, *, version: str = "1", timeout_s: float = 30.0,
           memory_mb: int | None = 1024) -> Callable[[Callable], Callable]:
    """Register the decorated function (sync or async) as the reward `name`, called with
    (completion: Completion, inputs: the group's reward_inputs) and returning a number."""
    check_id("reward name", name)
    if not 0 < timeout_s <= 3600:
        raise ValueError(f"reward {name!r}: timeout_s={timeout_s} must be in (0, 3600]")
    if memory_mb is not None and memory_mb < 16:
        raise ValueError(f"reward {name!r}: memory_mb={memory_mb} must be at least 16 (or None)")
    spec = RewardSpec(name, str(version), float(timeout_s), memory_mb)

    def mark(fn: Callable) -> Callable:
        setattr(fn, MARK, spec)
        return fn
    return mark


class Reward(msgspec.Struct, frozen=True):
    spec: RewardSpec
    fn: Callable[..., Any]
    is_async: bool


def load_module(target: str):
    """`pkg.mod` or a path to a .py file: the operator's module, imported (its code runs)."""
    if target.endswith(".py") or "/" in target:
        path = Path(target).resolve()
        if not path.is_file():
            raise ValueError(f"--rewards {target!r}: no such file")
        name = f"rollq_rewards_{path.stem}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
    return importlib.import_module(target)


def find_rewards(target: str) -> dict[str, Reward]:
    """The rewards the module `target` registers, by name (ValueError: none, or a name twice)."""
    module = load_module(target)
    found: dict[str, Reward] = {}
    for value in vars(module).values():
        spec = getattr(value, MARK, None)
        if not isinstance(spec, RewardSpec) or not callable(value):
            continue
        if spec.name in found and found[spec.name].fn is not value:
            raise ValueError(f"--rewards {target!r}: two functions register the reward {spec.name!r}")
        found[spec.name] = Reward(spec, value, inspect.iscoroutinefunction(value))
    if not found:
        raise ValueError(f"--rewards {target!r} registers no reward (decorate functions with "
                         "rollq.scoring.reward)")
    return found


def as_reward(value: Any) -> float:
    """A reward function's answer as a finite float (a Python float: float64): TypeError for
    anything that is not a number, ValueError for NaN or an infinity, which no advantage can be
    computed from (and JSON has no word for). Sync and async rewards go through here alike, so
    either one's non-finite value is a reward error with this reason."""
    if not isinstance(value, numbers.Real):  # bool, int, float, numpy's (float32 included)
        raise TypeError(f"returned {type(value).__name__} {value!r:.80}, not a number")
    reward = float(value)  # OverflowError for an int beyond float64
    if not math.isfinite(reward):
        raise ValueError(f"returned {reward!r}: a reward must be a finite number")
    return reward
