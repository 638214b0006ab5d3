"""One child process of a scorer's pool: loads the operator's reward module itself, then calls
its sync rewards one at a time, as its parent asks over stdin/stdout (one JSON line each way).

Run as `python -m rollq.scoring.child MODULE PARENT_PID`. Only names and plain data cross the pipe (JSON,
never pickle). Each call may add at most its reward's `memory_mb` of address space (RLIMIT_AS,
raised again after the call), so a memory-hungry reward raises MemoryError here, not in the
scorer; a call that hangs is the parent's to kill (it owns the timeout).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import sys
import traceback
from typing import Any

import msgspec

from rollq.scoring.rewards import Completion, as_reward, find_rewards


class Call(msgspec.Struct, frozen=True):
    name: str
    completion: Completion
    inputs: Any = None


class Answer(msgspec.Struct, frozen=True, omit_defaults=True):
    value: float | None = None
    error: str = ""


READY = b'"ready"\n'


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _limited(fn, completion: Completion, inputs: Any, memory_mb: int | None) -> float:
    if memory_mb is None:
        return as_reward(fn(completion, inputs))
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = _address_space() + memory_mb * 1024 * 1024
    limit = soft if hard == resource.RLIM_INFINITY else min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        return as_reward(fn(completion, inputs))
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


def _die_with(parent: int) -> None:
    """A scorer that is SIGKILLed takes its children along (Linux: PR_SET_PDEATHSIG), even one
    stuck in a reward call, which would not see its stdin close."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the line above
        os._exit(1)


def main(target: str, parent: int) -> None:
    _die_with(parent)
    # The protocol gets its own copy of stdout; what rewards print goes to stderr.
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    rewards = find_rewards(target)
    decoder, encoder = msgspec.json.Decoder(Call), msgspec.json.Encoder()
    replies.write(READY)
    for line in sys.stdin.buffer:
        call = decoder.decode(line)
        found = rewards.get(call.name)
        try:
            if found is None or found.is_async:
                raise LookupError(f"no sync reward named {call.name!r} in {target!r}")
            answer = Answer(value=_limited(found.fn, call.completion, call.inputs, found.spec.memory_mb))
        except MemoryError:
            answer = Answer(error=f"MemoryError: the call needed more than {found.spec.memory_mb} MB")
        except Exception as e:
            traceback.print_exc()
            answer = Answer(error=f"{type(e).__name__}: {e}"[:1000])
        replies.write(encoder.encode(answer) + b"\n")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
