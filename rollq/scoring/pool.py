"""The scorer's child processes for sync rewards: a call per idle child, a timeout per call.

A call past its timeout kills its child (a thread or a process-pool task cannot be stopped), so
a hanging reward costs one fresh child, never a stuck pool; a child that dies (killed by the OS,
a crash in native code) ends only its own call, with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from typing import Any

import msgspec

from rollq.scoring.child import READY, Answer, Call
from rollq.scoring.rewards import Completion

log = logging.getLogger("rollq.scorer")

START_TIMEOUT_S = 300.0
"""A child loading the reward module (math-verify imports sympy) may take this long."""


class RewardError(Exception):
    """A reward call that gave no value: the reason goes with the sample."""


class ChildPool:
    def __init__(self, target: str, size: int):
        self.target, self.size = target, size
        self._idle: list[asyncio.subprocess.Process] = []
        self._slots = asyncio.Semaphore(size)
        self._encoder, self._decoder = msgspec.json.Encoder(), msgspec.json.Decoder(Answer)
        self.restarts = 0
        """Children killed (timeouts) or found dead, and replaced."""

    async def _spawn(self) -> asyncio.subprocess.Process:
        child = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "rollq.scoring.child", self.target, str(os.getpid()),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        try:
            ready = await asyncio.wait_for(child.stdout.readline(), START_TIMEOUT_S)
        except BaseException:
            await _kill(child)
            raise
        if ready != READY:
            code = await child.wait()
            raise RuntimeError(f"reward child process for {self.target!r} did not start (exit code {code}; "
                               "see its stderr)")
        return child

    async def start(self) -> None:
        """One child at once: a reward module that does not load fails the scorer's start."""
        self._idle.append(await self._spawn())

    async def call(self, name: str, completion: Completion, inputs: Any, timeout_s: float) -> float:
        async with self._slots:
            child = self._idle.pop() if self._idle else await self._spawn()
            try:
                child.stdin.write(self._encoder.encode(Call(name, completion, inputs)) + b"\n")
                async with asyncio.timeout(timeout_s):
                    await child.stdin.drain()
                    line = await child.stdout.readline()
            except TimeoutError:
                await self._replace(child)
                raise RewardError(f"timed out after {timeout_s:g} s") from None
            except BaseException:  # cancelled mid-call (a lost lease, shutdown): the child is busy
                await self._replace(child)
                raise
            if not line:
                code = await child.wait()
                self.restarts += 1
                raise RewardError(f"the reward's process died (exit code {code})")
            self._idle.append(child)
        answer = self._decoder.decode(line)
        if answer.error:
            raise RewardError(answer.error)
        if answer.value is None:  # the child checks its value (`as_reward`); JSON writes NaN as null
            raise RewardError("the reward's process answered no value")
        return answer.value

    async def _replace(self, child: asyncio.subprocess.Process) -> None:
        self.restarts += 1
        await _kill(child)

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        for child in idle:
            await _kill(child)


async def _kill(child: asyncio.subprocess.Process) -> None:
    if child.returncode is None:
        child.kill()
    await child.wait()
