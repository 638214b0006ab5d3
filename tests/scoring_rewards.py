"""Rewards the scoring tests run in real `rollq scorer` processes (`--rewards` this file's path).
Each is a plain function of the sample, so a test can call it directly for the expected value."""

import asyncio
import os
import time

from rollq.scoring import Completion, reward


@reward("count", version="7", timeout_s=30)
def count(completion: Completion, inputs) -> float:
    """A function of the tokens and the group's inputs (the instant engine gives no text)."""
    return (sum(completion.tokens) * 31 + int(inputs)) % 1009 / 1009


@reward("acount", version="3", timeout_s=30)
async def acount(completion: Completion, inputs) -> float:
    await asyncio.sleep(0)
    return count(completion, inputs)


@reward("slow", timeout_s=30)
def slow(completion: Completion, inputs) -> float:
    """Holds the scorer long enough to be killed mid-scoring; with ROLLQ_TEST_STARTED_DIR, leaves
    a file there as it starts (a test that must act while a reward runs waits for it)."""
    started = os.environ.get("ROLLQ_TEST_STARTED_DIR")
    if started:
        open(os.path.join(started, f"{os.getpid()}-{completion.index}"), "w").close()
    time.sleep(float(os.environ.get("ROLLQ_TEST_SLOW_S", "0.2")))
    return count(completion, inputs)


@reward("boom", timeout_s=30)
def boom(completion: Completion, inputs) -> float:
    if completion.index == 1:
        raise ValueError("no answer found in sample 1")
    return 1.0


@reward("hang", timeout_s=1)
def hang(completion: Completion, inputs) -> float:
    if completion.index == 0:
        time.sleep(3600)
    return 1.0


@reward("hog", timeout_s=30, memory_mb=64)
def hog(completion: Completion, inputs) -> float:
    if completion.index == 0:
        return float(len(bytearray(512 * 1024 * 1024)))
    return 1.0


@reward("same_if", timeout_s=30)
async def same_if(completion: Completion, inputs) -> float:
    """All equal for a group whose inputs say "same" (dynamic sampling filters it), else not."""
    return 1.0 if inputs == "same" else float(completion.index)


@reward("weight", timeout_s=30)
def weight(completion: Completion, inputs) -> float:
    """Sample 0 gets the group's inputs as a float (a trainer may send "nan", "inf", "1e308")."""
    return float(inputs) if completion.index == 0 else 0.5


@reward("aweight", timeout_s=30)
async def aweight(completion: Completion, inputs) -> float:
    return weight(completion, inputs)
