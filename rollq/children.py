"""Stopping the processes rollq starts (workers, gateways, redis-servers) for the pool, the demo,
chaos runs, benchmarks and tests: one way, so that none leaves an engine process behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Iterable


def reap_group(pgid: int) -> None:
    """Kill what a dead child leaves behind in its process group (a worker's engine-core processes).

    vLLM's engine core outlives a SIGKILLed parent, holding its memory (and, on a GPU, the
    device): a restarted worker would find the device full.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def stop_children(procs: Iterable[subprocess.Popen], grace_s: float, *, group: bool = True) -> list[int]:
    """Stop `procs` together: SIGCONT (a frozen child cannot act on SIGTERM), SIGTERM to each,
    then wait up to `grace_s` for each and SIGKILL it if still running (`grace_s` 0: SIGKILL at
    once). `group`: they were started with `start_new_session`, and whatever is left in their
    process groups is killed too. Returns their exit codes."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                if grace_s > 0:
                    proc.terminate()
    codes = []
    for proc in procs:
        if grace_s > 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if group:
            reap_group(proc.pid)
        codes.append(proc.returncode)
    return codes


def stop_child(proc: subprocess.Popen, grace_s: float, *, group: bool = True) -> int:
    """`stop_children` for one process; its exit code."""
    return stop_children([proc], grace_s, group=group)[0]
