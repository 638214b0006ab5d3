"""The fast adapter path (registered before its fsyncs, docs/architecture.md "Adapter versions
before they are durable"), killed at each step: the trainer (files written / renamed / registered
/ durable) and the worker (pinned / verified / added to the engine), each with SIGKILL in its own
process. Then a worker serves every version that was registered, each checked token for token
against transformers on its PEFT-merged model, and refuses the one whose bytes are torn (what a
machine crash before the fsyncs may leave): no version served from bytes that were not verified,
none lost once published."""

import contextlib
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


def run_until(args: list[str], step: str, log: Path, timeout_s: float = 900) -> None:
    """Start `adapter_crash_steps.py ARGS`, wait for it to reach `step`, SIGKILL it (and the
    engine processes it started: its own process group). Its TMPDIR is its own, short (vLLM's
    IPC socket paths live there and may not pass 107 characters)."""
    tmpdir = tempfile.mkdtemp(prefix="rq-crash-")
    env = os.environ | {"PYTHONUNBUFFERED": "1", "TMPDIR": tmpdir,
                        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
    give_up = time.monotonic() + timeout_s
    try:
        while f"AT {step}" not in log.read_text():
            assert proc.poll() is None, f"ended before {step}:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < give_up, f"never reached {step}:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        shutil.rmtree(tmpdir, ignore_errors=True)


def worker_flags(redis_url: str, policy: str, model: Path, worker_id: str) -> list[str]:
    return ["--redis-url", redis_url, "--policy", policy, "--worker-id", worker_id,
            "--engine", "vllm", "--model", str(model), "--dtype", "float32",
            "--max-model-len", "256", "--max-num-seqs", "8", "--enforce-eager", "--poll-s", "0.1",
            "--enable-lora", "--max-loras", "3", "--max-lora-rank", str(MAX_RANK)]


@pytest.mark.timeout(2400)
async def test_killed_at_each_step_of_the_fast_adapter_path(make_client, make_worker, redis_url,
                                                            policy, tiny_model, tmp_path):
    store = tmp_path / "store"
    client = make_client(weight_store=str(store))
    registry = Registry(client.redis, client.keys)
    # Version 1, published whole (the call returned: durable); the workers die around it.
    await client.publish_weights(1, peft_adapter(tiny_model, 1), adapter_on=0)
    for step in WORKER_STEPS:
        where = tmp_path / f"worker-{step}"
        where.mkdir()
        run_until(["worker", step, "--", *worker_flags(redis_url, policy, tiny_model, f"w-{step}")],
                  step, where / "log")

    # The trainer dies at each step: 2 and 3 before they are registered (a restarted trainer
    # publishes them again), 4 registered but not yet durable, 5 durable, 6 as 4 but its bytes
    # torn afterwards, as a machine crash before the fsyncs may leave them.
    for version, step in zip((2, 3, 4, 5, 6), (*TRAINER_STEPS, "registered"), strict=True):
        where = tmp_path / f"trainer-{version}-{step}"
        where.mkdir()
        run_until(["trainer", step, redis_url, policy, str(store), str(tiny_model), str(version),
                   str(version)], step, where / "log", timeout_s=300)
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

    # A worker (in this process; the killed ones' engines are gone) serves what was published.
    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    engine = await VLLMEngine.start(VLLMSettings(**engine_flags(tiny_model), enable_lora=True,
                                                 max_loras=3, max_lora_rank=MAX_RANK).validate())
    try:
        worker, _ = make_worker(engine=engine, base_schema=dir_schema(tiny_model))
        results = {}
        for version in (6, 1, 2, 3, 4, 5):  # one at a time: more adapters than --max-loras
            await client.submit([PROMPT], n=1, sampling=GREEDY, min_version=version,
                                max_version=version)
            [results[version]] = await collect(client, 1, timeout_s=300)
    finally:
        await engine.close()
    torn_result = results[6]
    assert torn_result.status == "failed" and "adapter version 6 refused" in torn_result.reason
    assert not torn_result.samples
    for version in range(1, 6):
        result = results[version]
        assert result.status == "ok", (version, result.reason)
        [sample] = result.samples
        assert sample.versions == [(version, 0)]
        reference = peft_adapter(tiny_model, version).merge_and_unload().eval()
        assert sample.token_ids == greedy(reference, PROMPT, GREEDY["max_tokens"]), version
    assert 6 in worker.cannot_load
