"""vLLM's own OpenAI server (the reference the gateway is compared with) and the vLLM engines that
several modules share, one per (model, flags) and per test process.

A server or engine start costs 15-30 s of a loaded 2-core box, so the modules that use the same
model with the same flags share one: the session fixtures here (imported by conftest.py), and
`SHARED` puts those modules in one pytest-xdist process under `make test`'s `--dist loadgroup`
(every other module is a group of its own, as with `--dist loadfile`). None of these tests swaps
the weights of a shared engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from xdist.scheduler import LoadScopeScheduling

from rollq.harness.faults import free_port
from rollq.worker.pool import reap_group

SHARED = {
    "tests/test_chat_vllm.py": "chat-model",
    "tests/test_streaming_vllm.py": "chat-model",
    "tests/test_tokenize_vllm.py": "chat-model",
    "tests/test_trl_vllm_client.py": "chat-model",
    "tests/test_token_ids_flag_vllm.py": "chat-model",
    "tests/test_canary_vllm.py": "chat-model",
    "tests/test_tools_vllm.py": "tool-model-hermes",
    "tests/test_conversations_vllm.py": "tool-model-hermes",
    "tests/test_renderers_client_vllm.py": "tool-model-hermes",
}
"""Module -> the group of modules that run in one test process (`make test`)."""
SHARED_FIXTURES = {"chat_server": "chat-model", "chat_engine": "chat-model",
                   "hermes_engine": "tool-model-hermes", "hermes_server": "tool-model-hermes"}
"""The session fixtures below that start a vLLM server or engine -> the group that shares it."""
TOOL_MAX_MODEL_LEN = 2048
HERMES_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")
"""Each module's seconds (its tests' setup + call + teardown) in a recent full run: the scheduler
hands out the longest groups first. Refresh it from a run's durations file with
`python tests/vllm_servers.py .test-durations.json`; a module missing from it counts as short."""


class ModuleGroups(LoadScopeScheduling):
    """pytest-xdist's scheduler by scope, the scope being a test's module or its `SHARED` group,
    the longest scopes first (by `MODULE_SECONDS`): in collection order, a 150 s module collected
    last ran alone at the end while the other process idled."""

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return SHARED.get(module, module)

    def schedule(self) -> None:
        if self.collection is None:  # the first call fills the work queue, then hands it out
            self.config.option.loadscopereorder = False
            seconds = json.loads(MODULE_SECONDS.read_text()) if MODULE_SECONDS.exists() else {}
            self._order = {}
            for nodeid in next(iter(self.registered_collections.values()), []):
                module = nodeid.split("::", 1)[0]
                scope = self._split_scope(nodeid)
                self._order[scope] = self._order.get(scope, 0.0) + seconds.pop(module, 0.0)
        super().schedule()

    def _assign_work_unit(self, node) -> None:
        if getattr(self, "_order", None):
            for scope in sorted(self.workqueue, key=lambda s: -self._order.get(s, 0.0)):
                self.workqueue.move_to_end(scope)
            self._order = None  # sorted once; the queue keeps the order
        super()._assign_work_unit(node)


def module_seconds(durations: dict[str, float]) -> dict[str, float]:
    """Each test module's tests summed, longest first (the scheduler's order, the log's table)."""
    modules: dict[str, float] = {}
    for nodeid, seconds in durations.items():
        module = nodeid.split("::", 1)[0]
        modules[module] = modules.get(module, 0.0) + seconds
    return dict(sorted(modules.items(), key=lambda kv: -kv[1]))


def _write_module_seconds(durations_file: str) -> None:
    durations = json.loads(Path(durations_file).read_text())["durations"]
    rounded = {module: round(seconds, 1) for module, seconds in module_seconds(durations).items()}
    MODULE_SECONDS.write_text(json.dumps(rounded, indent=0) + "\n")


class VLLMServer:
    """vLLM's own OpenAI server (`vllm.entrypoints.openai.api_server`, through
    `vllm_forkserver.run_api_server`) on a free loopback port, in its own session."""

    def __init__(self, model: Path, log_path: Path, *args: str, max_model_len: int = 256):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("vllm_forkserver.py")), "--model", str(model),
             "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", str(max_model_len),
             "--enforce-eager", "--seed", "0", "--host", "127.0.0.1", "--port", str(self.port),
             # rollq's workers accept a request's chat_template; vLLM only with this flag.
             "--trust-request-chat-template", *args],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONUNBUFFERED": "1"})

    async def ready(self, timeout_s: float = 600) -> str:
        give_up = time.monotonic() + timeout_s
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < give_up:
                assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
                try:
                    async with http.get(f"{self.url}/health") as r:
                        if r.status == 200:
                            return self.url
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.5)
        raise AssertionError(f"vLLM's server did not come up in {timeout_s} s")

    def close(self) -> None:
        reap_group(self.proc.pid)
        self.proc.wait(30)
        self._log.close()


async def start_engine(model: Path, **settings):
    """rollq's vLLM engine on `model` with the tests' flags (`settings` on top)."""
    from conftest import engine_flags

    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    return await VLLMEngine.start(VLLMSettings(**engine_flags(model) | settings).validate())


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory) -> Path:
    from models import make_chat_model

    return make_chat_model(tmp_path_factory.mktemp("chat-model") / "m")


@pytest.fixture(scope="session")
def chat_server(chat_model, tmp_path_factory):
    """vLLM's server on the chat model, without parser flags (max_model_len 256)."""
    server = VLLMServer(chat_model, tmp_path_factory.mktemp("vllm-chat") / "server.log")
    yield server
    server.close()


@pytest.fixture(scope="session")
async def chat_engine(chat_model, chat_server):
    """The rollq side's engine on the chat model, started while vLLM's server starts (it depends
    on it for that)."""
    engine = await start_engine(chat_model)
    yield engine
    await engine.close()


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory) -> Path:
    from models import make_tool_model

    return make_tool_model(tmp_path_factory.mktemp("tool-model") / "m")


@pytest.fixture(scope="session")
def hermes_server(tool_model, tmp_path_factory):
    """vLLM's server on the tool model with its hermes tool parser (`HERMES_FLAGS`)."""
    server = VLLMServer(tool_model, tmp_path_factory.mktemp("vllm-tools") / "server.log", *HERMES_FLAGS,
                        max_model_len=TOOL_MAX_MODEL_LEN)
    yield server
    server.close()


@pytest.fixture(scope="session")
async def hermes_engine(tool_model):
    """The tool model's engine with vLLM's hermes tool parser (`--enable-auto-tool-choice
    --tool-call-parser hermes` on a worker)."""
    engine = await start_engine(tool_model, max_model_len=TOOL_MAX_MODEL_LEN,
                                 enable_auto_tool_choice=True, tool_call_parser="hermes")
    yield engine
    await engine.close()


if __name__ == "__main__":
    _write_module_seconds(sys.argv[1])
