"""Fixtures: a private real redis-server, clients, in-process workers and worker processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis as redis_sync

from rollq.client import RolloutClient
from rollq.engine.instant import InstantEngine
from rollq.harness.faults import RedisProcess, reserved_port  # noqa: F401 (tests import it from here)
from rollq.config import WorkerSettings
from rollq.queue.connection import connect
from rollq.worker.build import build_worker
from rollq.worker.loop import Worker
from rollq.children import stop_child
from vllm_servers import SHARED, SHARED_FIXTURES, ModuleGroups, module_seconds
from vllm_servers import (chat_engine, chat_model, chat_server, hermes_engine, hermes_server,  # noqa: F401
                          tool_model)


# --- the run's slowest tests and its total, printed last (after pytest's own summary line) -----

SLOWEST = 25
SLOWEST_MODULES = 15
_durations: dict[str, float] = {}
_session_began = time.monotonic()


def pytest_runtest_logreport(report):
    # setup + call + teardown: a module's fixture set-up is paid by its first test.
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_xdist_make_scheduler(config, log):
    """`make test` runs `--dist loadgroup`: each module's tests in one process, as `--dist loadfile`
    does, and the modules that share a session engine or vLLM server (`SHARED`) in the same one.
    (pytest-xdist 3.8's own loadgroup reads `xdist_group` marks through an item attribute that
    pytest 9 no longer uses: every test became a group of its own.)"""
    if config.getvalue("dist") == "loadgroup":
        return ModuleGroups(config, log)
    return None


def pytest_collection_modifyitems(items):
    """A module that uses a shared session engine or server must be in its `SHARED` group, or
    `make test` would start that engine or server again in the other process."""
    for item in items:
        module = item.nodeid.split("::")[0]
        defs = getattr(item, "_fixtureinfo", None)
        for fixture, group in SHARED_FIXTURES.items():
            used = defs is not None and fixture in defs.name2fixturedefs and \
                defs.name2fixturedefs[fixture][-1].func.__module__ == "vllm_servers"
            if used and SHARED.get(module) != group:
                raise pytest.UsageError(f"{module} uses the shared fixture {fixture}: add it to "
                                        f"SHARED[{module!r}] = {group!r} in tests/vllm_servers.py")


def pytest_unconfigure(config):
    """The drift shows at the very end of every log: pytest's `--durations` table comes before
    the failures and the summary line, where nobody scrolls to it. `make test` runs in two parts
    (the parallel one, then the tests that must run alone) and names one ROLLQ_TEST_DURATIONS
    file for both: the second part's table is the whole run's."""
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is None or not _durations or hasattr(config, "workerinput"):  # xdist: the controller prints
        return
    durations, began = dict(_durations), time.time() - (time.monotonic() - _session_began)
    if path := os.environ.get("ROLLQ_TEST_DURATIONS"):
        with contextlib.suppress(FileNotFoundError, ValueError):
            earlier = json.loads(Path(path).read_text())
            durations, began = earlier["durations"] | durations, min(began, earlier["began"])
        Path(path).write_text(json.dumps({"durations": durations, "began": began}))
    tr.write_sep("=", f"{min(SLOWEST, len(durations))} slowest tests (setup + call + teardown)")
    for nodeid, seconds in sorted(durations.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        tr.write_line(f"{seconds:8.1f} s  {nodeid}")
    modules = module_seconds(durations)
    tr.write_sep("=", f"{min(SLOWEST_MODULES, len(modules))} slowest modules (their tests' sum)")
    for module, seconds in list(modules.items())[:SLOWEST_MODULES]:
        tr.write_line(f"{seconds:8.1f} s  {module}")
    tr.write_line(f"total: {len(durations)} tests, {sum(durations.values()):.1f} s in tests, "
                  f"{time.time() - began:.1f} s in all")


if os.environ.get("ROLLQ_TEST_ENGINE_ENV", "1") != "0":
    # The tests' vLLM engines (in-process, in the worker processes they spawn, vLLM's reference
    # server), set here so that every child inherits them:
    # - vLLM's CPU build pins each engine's compute thread to core 0 and keeps core 1 for the
    #   front-ends ("auto" binding): a test with three engines ran them all on one core while the
    #   other idled. Unpinned and one thread each, the OS spreads them over both cores.
    # - torch.compile of the sampler's small kernels (a C++ build per engine start, ~6 s warm and
    #   far more on a cold cache) is an optimisation, not a behaviour: eager runs the same ops.
    # - One engine process, not two: with V1 multiprocessing off, vLLM's CPU build keeps the
    #   in-process ("uni") executor, so the model runs in the EngineCore process instead of a
    #   worker spawned from it. AsyncLLM still runs its engine core in a process of its own, so
    #   every engine is as separate from the test process as before; each start spares a second
    #   process's imports (~7 s of ~16 s) and its close a second exit. Binding needs "mp", and
    #   the tests do not bind.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
    # - Engine core processes forked from a fork server that imported torch and vLLM once
    #   (tests/vllm_forkserver.py): an engine starts in ~3 s instead of ~10.
    import vllm_forkserver

    vllm_forkserver.install()

LONG = os.environ.get("ROLLQ_LONG_TESTS", "") not in ("", "0")
"""`ROLLQ_LONG_TESTS=1 pytest ...`: the long variants at full length (10,000 hostile payloads);
CI runs them short. Each test says what its short variant still covers."""


def _wait_for_redis(url: str, timeout_s: float = 10) -> None:
    give_up = time.monotonic() + timeout_s
    while True:
        try:
            redis_sync.Redis.from_url(url).ping()
            return
        except redis_sync.ConnectionError:
            if time.monotonic() > give_up:
                raise RuntimeError(f"redis-server at {url} did not come up") from None
            time.sleep(0.05)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    """A private redis-server (no persistence) on a reserved loopback port;
    ROLLQ_TEST_REDIS_URL uses an existing one."""
    if url := os.environ.get("ROLLQ_TEST_REDIS_URL"):
        _wait_for_redis(url)
        yield url
        return
    try:
        server = RedisProcess(tmp_path_factory.mktemp("redis"), aof=False)
    except RuntimeError:
        pytest.exit("redis-server not found: run `make setup` (installs it) or set ROLLQ_TEST_REDIS_URL",
                    returncode=2)
    yield server.start().url
    server.stop()


@pytest.fixture
def policy() -> str:
    """A fresh policy name per test: its keys are its own namespace."""
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def redis(redis_url):
    r = connect(redis_url)
    yield r
    await r.aclose()


@pytest.fixture
async def make_client(redis_url, policy):
    made: list[RolloutClient] = []

    def create(trainer_id: str = "trainer", **kwargs) -> RolloutClient:
        kwargs.setdefault("policy", policy)
        c = RolloutClient(redis_url, trainer_id=trainer_id, **kwargs)
        made.append(c)
        return c

    yield create
    for c in made:
        await c.close()


@pytest.fixture
async def make_worker(redis_url, policy):
    """In-process worker (instant engine unless `engine=`), assembled as `rollq worker` does
    (`build_worker`): create(**settings) -> (worker, task). `settings`: WorkerSettings fields,
    plus `pinned` (to the engine's version) and `max_inflight_seqs` (an engine's sequence budget)."""
    made: list[tuple[Worker, asyncio.Task, object]] = []

    def create(worker_id: str | None = None, *, delay_s: float = 0.0, engine=None,
               follow: bool = True, base_schema=None, pinned: bool = False,
               max_inflight_seqs: int | None = None, **settings):
        """`follow`: swap as versions are published (unless pinned)."""
        engine = engine or InstantEngine(delay_s=delay_s)
        settings = {"policy": policy, "max_inflight": 8, "lease_s": 5.0, "max_deliveries": 3,
                    "grace_s": 1.0, "poll_s": 0.1, "job_ttl_s": 600} | settings
        s = WorkerSettings(worker_id=worker_id or f"w-{uuid.uuid4().hex[:6]}",
                           pin_version=engine.version if pinned else None, **settings).validate()
        r = connect(redis_url)
        w, follower = build_worker(s, r, engine, max_inflight_seqs=max_inflight_seqs,
                                   base_schema=base_schema, follow=follow)
        task = asyncio.create_task(w.run(follower))
        made.append((w, task, r))
        return w, task

    yield create
    for w, task, r in made:
        w.stop()
        w.stop()
        await asyncio.wait_for(task, 30)
        await r.aclose()


def cli_flags(flags: dict) -> list[str]:
    """{"max_num_seqs": 32, "enforce_eager": True} -> ["--max-num-seqs", "32", "--enforce-eager"]"""
    out = []
    for name, value in flags.items():
        flag = f"--{name.replace('_', '-')}"
        if value is True:
            out.append(flag)
        elif value is False:
            out.append(f"--no-{name.replace('_', '-')}")
        else:
            out += [flag, str(value)]
    return out


class WorkerProcess:
    """`rollq worker` in its own process, with its log kept for assertions."""

    def __init__(self, redis_url: str, policy: str, log_dir: Path, worker_id: str, **flags):
        self.worker_id = worker_id
        self.log_path = log_dir / f"{worker_id}.log"
        args = [sys.executable, "-m", "rollq", "worker", "--redis-url", redis_url,
                "--policy", policy, "--worker-id", worker_id]
        args += cli_flags(flags)
        env = os.environ | {"COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in close())
        # Own process group, so that close() also ends the engine processes it started.
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def report(self, lines: int = 60) -> str:
        """Its exit code and the tail of its log: what a failing test shows of it."""
        code = self.proc.poll()
        tail = self.log.splitlines()[-lines:]
        return "\n".join([f"worker {self.worker_id} (pid {self.proc.pid}): "
                          + ("running" if code is None else f"exited with code {code}"),
                          f"last {len(tail)} lines of {self.log_path}:", *tail])

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout_s: float = 30) -> int:
        return self.proc.wait(timeout_s)

    def close(self) -> None:
        stop_child(self.proc, 0)  # SIGKILL, its engine processes too
        self._log.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test shows the state and log tail of every worker process it spawned."""
    if (call.excinfo is not None and call.when in ("setup", "call")
            and not call.excinfo.errisinstance(pytest.skip.Exception)):
        for p in getattr(item, "spawned_workers", ()):
            item.add_report_section(call.when, f"worker {p.worker_id}", p.report())
    yield


@pytest.fixture
def spawn_worker(request, redis_url, policy, tmp_path):
    made: list[WorkerProcess] = []
    request.node.spawned_workers = made

    def create(worker_id: str | None = None, **flags) -> WorkerProcess:
        flags = {"engine": "instant", "poll_s": 0.1} | flags
        p = WorkerProcess(redis_url, flags.pop("policy", policy), tmp_path,
                          worker_id or f"p-{uuid.uuid4().hex[:6]}", **flags)
        made.append(p)
        return p

    yield create
    for p in made:
        p.close()


# --- vLLM (CPU build): one tiny model and one engine per test session -------------------------

ENGINE_MAX_MODEL_LEN = 256
ENGINE_MAX_NUM_SEQS = 32


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from models import make_model

    return make_model(tmp_path_factory.mktemp("model") / "v1")


@pytest.fixture(scope="session")
def reference(tiny_model):
    """The Hugging Face transformers model the engine is checked against."""
    from models import load_reference

    return load_reference(tiny_model)


def engine_flags(model: Path, dtype: str = "float32") -> dict:
    return dict(model=str(model), dtype=dtype, max_model_len=ENGINE_MAX_MODEL_LEN,
                max_num_seqs=ENGINE_MAX_NUM_SEQS, enforce_eager=True, seed=0)


@pytest.fixture(scope="session")
async def vllm_engine(tiny_model):
    """A float32 engine: matches the float32 reference exactly, so failures are real."""
    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    engine = await VLLMEngine.start(VLLMSettings(**engine_flags(tiny_model)).validate())
    yield engine
    await engine.close()


@pytest.fixture
def make_vllm_worker(make_worker, vllm_engine):
    def create(worker_id: str | None = None, **settings):
        settings = {"max_inflight": ENGINE_MAX_NUM_SEQS,
                    "max_inflight_seqs": ENGINE_MAX_NUM_SEQS} | settings
        return make_worker(worker_id, engine=vllm_engine, **settings)

    return create


# --- the HTTP gateway ------------------------------------------------------------------------

@pytest.fixture
async def make_gateway(redis_url, policy, tmp_path):
    """create(**settings) -> RunningGateway: `rollq gateway` in-process on a free loopback port."""
    from gateway_fixtures import RunningGateway, write_tokens

    from rollq.gateway.app import start_gateway
    from rollq.config import GatewaySettings

    runners = []

    async def create(tokenizer=None, **settings) -> RunningGateway:
        tokens = write_tokens(tmp_path / "tokens.json", policy)
        root = tmp_path / "weights"
        root.mkdir(exist_ok=True)
        settings = dict(redis_url=redis_url, port=0, tokens=str(tmp_path / "tokens.json"),
                        weight_store=str(root), gateway_id=f"gw{uuid.uuid4().hex[:6]}") | settings
        runner, port = await start_gateway(GatewaySettings(**settings).validate(), tokenizer=tokenizer)
        runners.append(runner)
        return RunningGateway(f"http://127.0.0.1:{port}", tokens, root)

    yield create
    for runner in runners:
        await runner.cleanup()
