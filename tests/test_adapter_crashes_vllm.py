"""The fast adapter path (registered before its fsyncs, docs/architecture.md "Adapter versions
before they are durable"), killed at each step: the trainer (files written / renamed / registered
/ durable) and the worker (pinned / verified / added to the engine), each with SIGKILL in its own
process. Then a worker serves every version that was registered, each checked token for token
against transformers on its PEFT-merged model, and refuses the one whose bytes are torn (what a
machine crash before the fsyncs may leave): no version served from bytes that were not verified,
none lost once published."""

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from adapter_crash_steps import TRAINER_STEPS, WORKER_STEPS, peft_adapter
from conftest import engine_flags
from helpers import collect
from models import greedy

from rollq.registry.adapters import CONFIG, WEIGHTS
from rollq.registry.safetensors_check import dir_schema
from rollq.registry.store import digest_file
from rollq.registry.versions import Registry

SCRIPT = Path(__file__).with_name("adapter_crash_steps.py")
ROOT = SCRIPT.parents[1]
"""This checkout: the scripts import its rollq, not the one the virtualenv was installed from."""
PROMPT = [1, 7, 3]
GREEDY = {"temperature": 0.0, "max_tokens": 16, "logprobs": 0}
MAX_RANK = 8


class Forks:
    """adapter_crash_steps.py: imports torch, PEFT, transformers and vLLM once, then forks each
    trainer and worker that is to be killed (each import was ~9 s of CPU per kill)."""

    def __init__(self, log: Path):
        env = os.environ | {"PYTHONUNBUFFERED": "1",
                            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen([sys.executable, str(SCRIPT)], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=out, text=True, env=env,
                                         start_new_session=True)
        self.ready = False
        self.children: set[int] = set()
        self.tmpdirs: list[str] = []

    def _ask(self, request: dict) -> str:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        while True:
            answer = self.proc.stdout.readline()
            assert answer, f"adapter_crash_steps.py ended:\n{self.log.read_text()[-3000:]}"
            if answer != "ready\n":
                return answer.split()[1]
            self.ready = True

    def start(self, args: list[str], log: Path) -> int:
        # Its own short TMPDIR: vLLM's IPC socket paths live there and may not pass 107 characters.
        self.tmpdirs.append(tempfile.mkdtemp(prefix="rq-crash-"))
        pid = int(self._ask({"run": args, "log": str(log), "tmpdir": self.tmpdirs[-1]}))
        self.children.add(pid)
        return pid

    def kill(self, pid: int) -> None:
        """SIGKILL to its process group (the engine process it started too); returns once reaped."""
        self._ask({"kill": pid})
        self.children.discard(pid)

    def close(self) -> None:
        for pid in self.children:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        finally:
            self.proc.stdout.close()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            for tmpdir in self.tmpdirs:
                shutil.rmtree(tmpdir, ignore_errors=True)


def ended(pid: int) -> bool:
    """Exited (a zombie until its parent reaps it) or gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


async def wait_until(pid: int, step: str, log: Path, timeout_s: float) -> None:
    give_up = time.monotonic() + timeout_s
    while f"AT {step}" not in log.read_text():
        assert not ended(pid), f"ended before {step}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < give_up, f"never reached {step}:\n{log.read_text()[-3000:]}"
        await asyncio.sleep(0.1)


def worker_flags(redis_url: str, policy: str, model: Path, worker_id: str) -> list[str]:
    return ["--redis-url", redis_url, "--policy", policy, "--worker-id", worker_id,
            "--engine", "vllm", "--model", str(model), "--dtype", "float32",
            "--max-model-len", "256", "--max-num-seqs", "8", "--enforce-eager", "--poll-s", "0.1",
            "--enable-lora", "--max-loras", "3", "--max-lora-rank", str(MAX_RANK)]


@pytest.mark.timeout(600)
async def test_killed_at_each_step_of_the_fast_adapter_path(make_client, make_worker, redis_url,
                                                            policy, tiny_model, tmp_path):
    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    forks = Forks(tmp_path / "forks.log")  # imports on one core while this process goes on
    store = tmp_path / "store"
    client = make_client(weight_store=str(store))
    registry = Registry(client.redis, client.keys)
    adapters = {version: peft_adapter(tiny_model, version) for version in (1, 2, 3, 4, 5)}
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(forks.close)
        # Version 1, published whole (the call returned: durable); the workers die around it.
        await client.publish_weights(1, adapters[1], adapter_on=0)
        # The engine of the worker that serves at the end. It holds nothing of the registry, so
        # starting it now (while the forks import) tests the same: the worker is built after
        # the kills, and the adapters it serves are loaded then.
        engine = await VLLMEngine.start(VLLMSettings(**engine_flags(tiny_model), enable_lora=True,
                                                     max_loras=3, max_lora_rank=MAX_RANK).validate())
        stack.push_async_callback(engine.close)

        # Each worker dies at its step, all at once: distinct ids, their pins and copies their own.
        workers = {}
        for step in WORKER_STEPS:
            log = tmp_path / f"worker-{step}.log"
            workers[step] = log, forks.start(
                ["worker", step, *worker_flags(redis_url, policy, tiny_model, f"w-{step}")], log)
        for step, (log, pid) in workers.items():
            await wait_until(pid, step, log, timeout_s=300)
        for _, pid in workers.values():
            forks.kill(pid)

        # The trainer dies at each step: 2 and 3 before they are registered (a restarted trainer
        # publishes them again), 4 registered but not yet durable, 5 durable, 6 as 4 but its
        # bytes torn afterwards, as a machine crash before the fsyncs may leave them. One after
        # the other: versions must increase.
        for version, step in zip((2, 3, 4, 5, 6), (*TRAINER_STEPS, "registered"), strict=True):
            log = tmp_path / f"trainer-{version}-{step}.log"
            pid = forks.start(["trainer", step, redis_url, policy, str(store), str(tiny_model),
                               str(version), str(version)], log)
            await wait_until(pid, step, log, timeout_s=120)
            forks.kill(pid)
            entry = await registry.get(version)
            if step in ("written", "renamed"):
                assert entry is None, f"version {version} registered though killed at {step}"
                await client.publish_weights(version, adapters[version], adapter_on=0)
            else:
                assert entry is not None and entry.kind == "adapter"
                files = Path(entry.path)
                assert all(digest_file(files / f.name) == f.digest for f in entry.files)  # complete
        torn = Path((await registry.get(6)).path)
        (torn / WEIGHTS).write_bytes(b"")  # ext4 may leave an unsynced new file empty
        assert (torn / CONFIG).exists()

        # A worker (in this process; the killed ones' engines are gone) serves what was published.
        worker, _ = make_worker(engine=engine, base_schema=dir_schema(tiny_model))
        results = {}
        for version in (6, 1, 2, 3, 4, 5):  # one at a time: more adapters than --max-loras
            await client.submit([PROMPT], n=1, sampling=GREEDY, min_version=version,
                                max_version=version)
            [results[version]] = await collect(client, 1, timeout_s=300)
    torn_result = results[6]
    assert torn_result.status == "failed" and "adapter version 6 refused" in torn_result.reason
    assert not torn_result.samples
    for version in range(1, 6):
        result = results[version]
        assert result.status == "ok", (version, result.reason)
        [sample] = result.samples
        assert sample.versions == [(version, 0)]
        reference = adapters[version].merge_and_unload().eval()
        assert sample.token_ids == greedy(reference, PROMPT, GREEDY["max_tokens"]), version
    assert 6 in worker.cannot_load
