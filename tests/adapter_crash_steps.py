"""A trainer or a worker that stops at one step of the fast adapter path, says so, and waits to
be killed (tests/test_adapter_crashes_vllm.py kills it there with SIGKILL).

    python tests/adapter_crash_steps.py

imports what both need (torch, PEFT, transformers, vLLM, rollq: ~9 s of CPU), then forks one
process per line on its standard input and answers each on its standard output:

    {"run": ["trainer", STEP, REDIS_URL, POLICY, STORE, BASE, VERSION, SEED], "log": .., "tmpdir": ..}
    {"run": ["worker", STEP or "serves", <rollq worker flags>], "log": .., "tmpdir": ..}  ->  pid N
    {"kill": N}  ->  killed N  (SIGKILL to its process group, vLLM's engine process too; reaped)

A child prints `AT <step>` (flushed) to its log once the step is reached, then sleeps. The hooks
wrap the real functions and change nothing else: the bytes, the files and the registry are the
real ones, and a worker is `rollq worker`'s own `main()`, which starts its own vLLM engine.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import peft  # noqa: F401  (before vLLM: importing it after vLLM's tokenizers is circular)

TRAINER_STEPS = ("written", "renamed", "registered", "durable")
"""Files written in the temp directory (not renamed) / renamed into place, not registered /
registered, not yet fsynced / fsynced: `publish_weights` returned."""
WORKER_STEPS = ("pinned", "verified", "loaded")
"""Pinned, before its private copy / copied and verified, before `add_lora` / added to the
engine, before it is marked servable."""


def stop_here(step: str) -> None:
    print(f"AT {step}", flush=True)
    time.sleep(3600)


def peft_adapter(base: Path, seed: int):
    """The rank-8 PEFT adapter `seed` of `base`, as a trainer holds it (lora_B non-zero)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base, torch_dtype=torch.float32).eval(),
                           LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    return model


def _after(fn, step: str):
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs)
        stop_here(step)
        return out
    return wrapped


def _before(fn, step: str):
    def wrapped(*args, **kwargs):
        stop_here(step)
        return fn(*args, **kwargs)
    return wrapped


async def trainer(step: str, redis_url: str, policy: str, store: str, base: str, version: int,
                  seed: int) -> None:
    from rollq.client import RolloutClient
    from rollq.registry import store as store_module
    from rollq.registry.versions import Registry

    if step == "written":  # files written and checked in the temp directory, not renamed
        store_module._checked = _after(store_module._checked, step)
    elif step == "renamed":
        original = Registry.register

        async def register(self, entry):
            stop_here(step)
            return await original(self, entry)
        Registry.register = register
    elif step == "registered":
        store_module.WeightStore.make_durable = _before(store_module.WeightStore.make_durable, step)
    model = peft_adapter(Path(base), seed)
    async with RolloutClient(redis_url, policy=policy, trainer_id=f"crash-{step}",
                             weight_store=store) as client:
        await client.publish_weights(version, model, adapter_on=0)
    stop_here(step)  # "durable": publish_weights returned


def worker(step: str, flags: list[str]) -> None:
    from vllm_forkserver import fork_engine_cores

    from rollq.cli import main
    from rollq.engine.vllm import VLLMEngine
    from rollq.worker import resident

    # vLLM's CPU platform spawns its engine process, which imports torch and vLLM again (~7 s of
    # CPU per worker); forked, it has them from `preload`, as vLLM's GPU build forks by default.
    # How that process starts is not what this test is about: what a kill leaves is.
    fork_engine_cores()

    if step == "pinned":
        resident.check_adapter_version = _before(resident.check_adapter_version, step)
    elif step == "verified":
        resident.check_adapter_version = _after(resident.check_adapter_version, step)
    elif step == "loaded":
        original = VLLMEngine.add_adapter

        async def add_adapter(self, adapter):
            await original(self, adapter)
            stop_here(step)
        VLLMEngine.add_adapter = add_adapter
    elif step != "serves":  # the worker that is not killed
        raise ValueError(f"no worker step {step!r}")
    sys.argv = ["rollq", "worker", *flags]
    main()


def run(args: list[str]) -> None:
    role, step = args[0], args[1]
    if role == "trainer":
        url, policy, store, base, version, seed = args[2:8]
        asyncio.run(trainer(step, url, policy, store, base, int(version), int(seed)))
    else:
        worker(step, args[2:])


def preload() -> None:
    """What the children would each import again: the trainer's torch, PEFT and transformers,
    the worker's rollq and vLLM, and the modules vLLM's engine process imports after its fork.
    Nothing here starts a thread or runs a torch op, so forking afterwards is safe."""
    import transformers  # noqa: F401
    import vllm.lora.worker_manager  # noqa: F401
    import vllm.model_executor.models.llama  # noqa: F401
    import vllm.v1.engine.async_llm  # noqa: F401
    import vllm.v1.engine.core  # noqa: F401
    import vllm.v1.executor.uniproc_executor  # noqa: F401
    import vllm.v1.worker.cpu_model_runner  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401

    import rollq.cli  # noqa: F401
    import rollq.client  # noqa: F401
    import rollq.engine.vllm  # noqa: F401
    import rollq.worker.resident  # noqa: F401


def fork_child(args: list[str], log: str, tmpdir: str) -> int:
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)  # there once it is asked for
    sys.stdout.flush()
    pid = os.fork()
    if pid:
        os.close(out)
        return pid
    try:
        os.setsid()  # its own process group: the kill reaches the engine process it forks
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests are the parent's
        # vLLM's IPC socket paths live in TMPDIR and may not pass 107 characters.
        os.environ["TMPDIR"] = tmpdir
        tempfile.tempdir = None
        run(args)
    except BaseException:  # noqa: BLE001 (a child never returns into the parent's loop)
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def serve_forks() -> None:
    preload()
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        if "run" in request:
            print(f"pid {fork_child(request['run'], request['log'], request['tmpdir'])}", flush=True)
        else:
            pid = request["kill"]
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            print(f"killed {pid}", flush=True)


if __name__ == "__main__":
    serve_forks()
