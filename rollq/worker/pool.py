"""The worker pool of one host: N `rollq worker` processes, restarted when they die.

Each worker is its own process with its own engine, so one crash takes down one engine. On a
GPU host each worker gets its own devices (`CUDA_VISIBLE_DEVICES`) and a matching tensor-parallel
size; that path follows vLLM's documented device selection and is untested here (no GPU).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time

from rollq.children import reap_group

log = logging.getLogger("rollq.pool")

__all__ = ["Pool", "describe_exit", "reap_group"]

HEALTHY_UPTIME_S = 60.0
"""A worker that ran this long before dying is restarted at once (backoff reset)."""


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return "exited cleanly" if code == 0 else f"exited with code {code}"


class Pool:
    def __init__(
        self,
        count: int,
        worker_args: list[str],
        *,
        gpus_per_worker: int = 0,
        grace_s: float = 30.0,
        max_backoff_s: float = 60.0,
    ):
        self.count = count
        self.worker_args = worker_args
        self.gpus_per_worker = gpus_per_worker
        self.grace_s = grace_s
        self.max_backoff_s = max_backoff_s
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.restarts = 0
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> int:
        log.info("pool: starting %d workers", self.count)
        slots = [asyncio.create_task(self._keep_alive(i)) for i in range(self.count)]
        await self._stopping.wait()
        await self._stop_all()
        await asyncio.gather(*slots)
        log.info("pool: all workers stopped")
        return 0

    def _command(self, slot: int) -> tuple[list[str], dict[str, str]]:
        args = [sys.executable, "-m", "rollq", "worker", *_metrics_port_of(self.worker_args, slot)]
        env = dict(os.environ)
        if self.gpus_per_worker:
            first = slot * self.gpus_per_worker
            devices = range(first, first + self.gpus_per_worker)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices))
            args += ["--tensor-parallel-size", str(self.gpus_per_worker)]
        return args, env

    async def _keep_alive(self, slot: int) -> None:
        backoff = 1.0
        while not self._stopping.is_set():
            args, env = self._command(slot)
            # Own session: a Ctrl-C on the pool's terminal reaches the pool only, which then
            # stops the workers in stages (a worker that saw SIGINT too would skip its grace).
            proc = await asyncio.create_subprocess_exec(*args, env=env, start_new_session=True)
            self.procs[slot] = proc
            started = time.monotonic()
            log.info("pool: worker %d started (pid %d)", slot, proc.pid)
            code = await proc.wait()
            reap_group(proc.pid)
            if self._stopping.is_set():
                log.info("pool: worker %d (pid %d) %s", slot, proc.pid, describe_exit(code))
                return
            uptime = time.monotonic() - started
            if uptime >= HEALTHY_UPTIME_S:
                backoff = 1.0
            log.error("pool: worker %d (pid %d) %s after %.1f s; restarting in %.1f s",
                      slot, proc.pid, describe_exit(code), uptime, backoff)
            self.restarts += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), backoff)
            backoff = min(backoff * 2, self.max_backoff_s)

    async def _stop_all(self) -> None:
        """SIGTERM every worker (each finishes or hands back its groups), SIGKILL after grace."""
        running = [p for p in self.procs.values() if p.returncode is None]
        for p in running:
            p.send_signal(signal.SIGTERM)
        hard_deadline = self.grace_s + 15.0  # their grace, then time to hand back and exit
        waits = [asyncio.create_task(p.wait()) for p in running]
        if not waits:
            return
        await asyncio.wait(waits, timeout=hard_deadline)
        for p in running:
            if p.returncode is None:
                log.error("pool: worker pid %d did not stop in %.0f s; killing it", p.pid,
                          hard_deadline)
                p.kill()
        await asyncio.gather(*waits)


def _metrics_port_of(args: list[str], slot: int) -> list[str]:
    """`--metrics-port P` given to the pool: worker `slot` serves on P + slot (one port each);
    `--metrics-port 0` stays 0 (each worker binds any free port and logs it)."""
    def port(value: str) -> str:
        return str(int(value) + slot) if int(value) else value

    out = list(args)
    for i, arg in enumerate(out):
        if arg == "--metrics-port" and i + 1 < len(out):
            out[i + 1] = port(out[i + 1])
        elif arg.startswith("--metrics-port="):
            out[i] = f"--metrics-port={port(arg.split('=', 1)[1])}"
    return out
