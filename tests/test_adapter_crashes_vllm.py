"""The fast adapter path (registered before its fsyncs, docs/architecture.md "Adapter versions
before they are durable"), killed at each step: the trainer (files written / renamed / registered
/ durable) and the worker (pinned / verified / added to the engine), each with SIGKILL in its own
process. Then a worker serves every version that was registered, each checked token for token
against transformers on its PEFT-merged model, and refuses the two whose bytes are torn (what a
machine crash before the fsyncs may leave: one file emptied, one whose tensor bytes read as
zeros, which only the digest check catches): no version served from bytes that were not
verified, none lost once published.

Every process that is killed, and the worker that serves at the end, is forked from one that
imported torch, PEFT, transformers and vLLM once (adapter_crash_steps.py): a kill costs what the
step costs, not ~9 s of imports."""

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
from models import greedy

from rollq.registry.adapters import CONFIG, WEIGHTS
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
        self.children: set[int] = set()
        self.tmpdirs: list[str] = []

    def _ask(self, request: dict) -> str:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        while True:
            answer = self.proc.stdout.readline()
            assert answer, f"adapter_crash_steps.py ended:\n{self.log.read_text()[-3000:]}"
            if answer != "ready\n":  # the first answer waits for the imports
                return answer.split()[1]

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
        """Kills what is left (the worker that served, the forks' own process): none of them
        holds anything the test still needs."""
        for pid in (*self.children, self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        self.proc.wait(30)
        self.proc.stdin.close()
        self.proc.stdout.close()
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


def zero_tensors(path: Path) -> None:
    """Zero a safetensors file's tensor bytes, its header and its size left as they were: blocks
    a machine crash left unwritten read as zeros. vLLM would load it (its adapter then changes
    nothing); only the registered digest tells it from the trainer's."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")  # the header's length, then the header
    assert len(data) > start
    data[start:] = bytes(len(data) - start)
    path.write_bytes(data)


def worker_flags(redis_url: str, policy: str, model: Path, worker_id: str) -> list[str]:
    return ["--redis-url", redis_url, "--policy", policy, "--worker-id", worker_id,
            "--engine", "vllm", "--model", str(model), "--dtype", "float32",
            "--max-model-len", "256", "--max-num-seqs", "8", "--enforce-eager", "--poll-s", "0.1",
            "--enable-lora", "--max-loras", "3", "--max-lora-rank", str(MAX_RANK)]


@pytest.mark.timeout(600)
async def test_killed_at_each_step_of_the_fast_adapter_path(make_client, redis_url, policy,
                                                            tiny_model, tmp_path):
    forks = Forks(tmp_path / "forks.log")  # imports on one core while this process goes on
    store = tmp_path / "store"
    client = make_client(weight_store=str(store))
    registry = Registry(client.redis, client.keys)
    try:
        # Version 1, published whole (the call returned: durable); the workers die around it.
        await client.publish_weights(1, peft_adapter(tiny_model, 1), adapter_on=0)
        expected = {version: greedy(peft_adapter(tiny_model, version).merge_and_unload().eval(),
                                    PROMPT, GREEDY["max_tokens"]) for version in range(1, 6)}

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
        # publishes them again), 4 registered but not yet durable, 5 durable, 6 and 7 as 4 but
        # their bytes torn afterwards, as a machine crash before the fsyncs may leave them. One
        # after the other: versions must increase.
        for version, step in zip((2, 3, 4, 5, 6, 7), (*TRAINER_STEPS, "registered", "registered"),
                                 strict=True):
            log = tmp_path / f"trainer-{version}-{step}.log"
            pid = forks.start(["trainer", step, redis_url, policy, str(store), str(tiny_model),
                               str(version), str(version)], log)
            await wait_until(pid, step, log, timeout_s=120)
            forks.kill(pid)
            entry = await registry.get(version)
            if step in ("written", "renamed"):
                assert entry is None, f"version {version} registered though killed at {step}"
                await client.publish_weights(version, peft_adapter(tiny_model, version), adapter_on=0)
            else:
                assert entry is not None and entry.kind == "adapter"
                files = Path(entry.path)
                assert all(digest_file(files / f.name) == f.digest for f in entry.files)  # complete
        torn = Path((await registry.get(6)).path)
        (torn / WEIGHTS).write_bytes(b"")  # ext4 may leave an unsynced new file empty
        assert (torn / CONFIG).exists()
        zero_tensors(Path((await registry.get(7)).path) / WEIGHTS)

        # A worker started now (the killed ones' engines are gone) serves what was published.
        log = tmp_path / "worker-after.log"
        pid = forks.start(["worker", "serves", *worker_flags(redis_url, policy, tiny_model, "w-after")],
                          log)
        results = {}
        for version in (6, 7, 1, 2, 3, 4, 5):  # one at a time: more adapters than --max-loras
            await client.submit([PROMPT], n=1, sampling=GREEDY, min_version=version,
                                max_version=version)
            got = await client.take(1, timeout_s=120, ack="manual")
            assert got, f"no result for version {version}:\n{log.read_text()[-3000:]}"
            await client.ack(got)
            [results[version]] = got
    finally:
        forks.close()
    for version in (6, 7):
        torn_result = results[version]
        assert torn_result.status == "failed", (version, torn_result.status, torn_result.samples)
        assert f"adapter version {version} refused" in torn_result.reason
        assert not torn_result.samples
    for version in range(1, 6):
        result = results[version]
        assert result.status == "ok", (version, result.reason)
        [sample] = result.samples
        assert sample.versions == [(version, 0)]
        assert sample.token_ids == expected[version], version
