"""The tests' vLLM engine core processes, forked from a fork server instead of spawned.

vLLM's CPU build spawns each engine's core process, which imports torch and vLLM again: ~7 s of
CPU on every engine start, 10-15 s of wall on a loaded 2-core box, and the suite starts dozens.
Here they come from a `multiprocessing` fork server that imported those once: a clean
single-threaded process, so a child inherits no test's sockets, threads or locks (a fork of the
test process itself would hand it the listening sockets of the test's gateways). Each child takes
the environment of the process that started it, as a spawned one does; only what torch and vLLM
read once at import (e.g. TORCH_COMPILE_DISABLE) is the fork server's: a test that changes such a
variable starts its engine `spawned()`.

rollq's own processes (`rollq worker` in the pool and fault tests) still spawn theirs: the product
keeps vLLM's CPU default.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.context
import os

PRELOAD = ["torch", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor",
           "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner",
           "vllm.model_executor.models.llama", "vllm.lora.worker_manager", __name__]
"""What an engine core process imports before it serves (the fork server imports it once)."""


class EngineProcess(multiprocessing.context.ForkServerProcess):
    """A fork server's child that runs with its starter's environment, not the fork server's."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.environ = dict(os.environ)

    def run(self):
        os.environ.clear()
        os.environ.update(self.environ)
        super().run()


class ForkServerContext(multiprocessing.context.ForkServerContext):
    Process = EngineProcess


_FORKS = ForkServerContext()
_spawned = False


def _context():
    return multiprocessing.get_context("spawn") if _spawned else _FORKS


def install() -> None:
    """vLLM's engine core processes, from now on in this process: forked from the fork server
    (started at the first engine start)."""
    import vllm.v1.engine.utils as engine_utils

    multiprocessing.set_forkserver_preload(PRELOAD)
    engine_utils.get_mp_context = _context
    _tolerate_reaped_children()


def _tolerate_reaped_children() -> None:
    """A fork server reaps its child the moment it exits, where vLLM's own spawned child stays a
    zombie until vLLM joins it. So an engine core that exits between vLLM's `is_alive()` and its
    `kill_process_tree` is gone, not a zombie, and `psutil`'s `children()` raises NoSuchProcess
    out of vLLM's shutdown (CI, 2026-12-06, a test's engine close). Gone is what the kill wants."""
    import psutil
    import vllm.v1.utils as v1_utils

    kill_process_tree = v1_utils.kill_process_tree

    def kill_unless_gone(pid: int) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            kill_process_tree(pid)

    v1_utils.kill_process_tree = kill_unless_gone


@contextlib.contextmanager
def spawned():
    """Engines started inside spawn their core process, as vLLM's CPU build does: for a test
    that changes what torch or vLLM read at import."""
    global _spawned
    _spawned = True
    try:
        yield
    finally:
        _spawned = False


def fork_engine_cores() -> None:
    """vLLM's engine core processes started from now on in this process are forked from it (it
    has imported torch and vLLM already), as vLLM's GPU build does, not spawned: for a process
    that starts one engine and opened nothing a child must not inherit before it."""
    import vllm.v1.engine.utils as engine_utils

    engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")


def run_api_server(argv: list[str]) -> None:
    """vLLM's own OpenAI server (the tests' reference), its engine core process forked from the
    server's process, which has imported torch and vLLM already: as vLLM's GPU build does."""
    import runpy
    import sys

    fork_engine_cores()
    sys.argv = ["vllm.entrypoints.openai.api_server", *argv]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    import sys

    run_api_server(sys.argv[1:])
