"""vLLM engines shared between test modules.

A CPU engine takes 25-40 s to start on 2 cores, and a dozen modules each started one of the
same model and settings. Now a module borrows a named engine (module-scoped fixture), and hands
it back on its base version with the model's own weights; the next module starts from that
state, as a fresh engine would. An engine a module left dead, or that cannot be put back, is
closed and the next borrower gets a new one. After the last module of the run that names it
(known at collection), the engine is closed, so idle engines do not hold memory meanwhile.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

log = logging.getLogger("tests.engines")

STARTS: Counter = Counter()
"""Engines started per name in this run (printed after the slowest tests)."""

FIXTURES = {"swap_engine": "swap", "chat_engine": "chat", "grpo_engine": "chat"}
"""The module fixtures that borrow a shared engine, and its name."""

_engines: dict[str, object] = {}
_last_module: dict[str, str] = {}
"""Engine name -> the last module (path) of the run whose tests use it."""


def note_last_users(items) -> None:
    """At collection's end: remember the last module using each shared engine."""
    for item in items:
        for fixture in FIXTURES.keys() & set(getattr(item, "fixturenames", ())):
            _last_module[FIXTURES[fixture]] = str(item.path)


async def borrow(name: str, model: Path, *, version: int = 0, **settings):
    """The shared engine `name`, started (from `model`, at `version`) if there is none alive."""
    from conftest import engine_flags

    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    engine = _engines.get(name)
    if engine is not None and not engine.alive:
        await engine.close()
        engine = None
    if engine is None:
        flags = engine_flags(model) | settings
        engine = await VLLMEngine.start(VLLMSettings(**flags).validate(), version=version)
        _engines[name] = engine
        STARTS[name] += 1
    return engine


async def give_back(name: str, request, model: Path, *, version: int = 0) -> None:
    """Put `name` back on `version` with `model`'s weights (what the next borrower expects), or
    close it: when it cannot be put back, or when no later module of this run needs it."""
    engine = _engines.get(name)
    if engine is None:
        return
    last = _last_module.get(name, "") in ("", str(request.node.path))
    if not last and engine.alive and (engine.version != version or engine._weights_path != str(model)):
        try:
            await engine.swap(version, str(model))
        except Exception:  # a new engine serves the next module instead (counted in STARTS)
            log.exception("shared engine %s could not be put back on version %d", name, version)
    if last or not engine.alive or engine.version != version:
        del _engines[name]
        await engine.close()


async def close_all() -> None:
    while _engines:
        _, engine = _engines.popitem()
        await engine.close()

