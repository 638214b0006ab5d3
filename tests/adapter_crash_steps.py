"""A trainer or a worker that stops at one step of the fast adapter path, says so, and waits to
be killed (tests/test_adapter_crashes_vllm.py kills it there with SIGKILL).

    python tests/adapter_crash_steps.py trainer STEP REDIS_URL POLICY STORE BASE VERSION SEED
    python tests/adapter_crash_steps.py worker STEP -- <rollq worker flags>

It prints `AT <step>` (flushed) once the step is reached, then sleeps. The hooks wrap the real
functions and change nothing else: the bytes, the files and the registry are the real ones.
"""

from __future__ import annotations

import asyncio
import sys
import time
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
    from rollq.cli import main
    from rollq.engine.vllm import VLLMEngine
    from rollq.worker import resident

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
    sys.argv = ["rollq", "worker", *flags]
    main()


if __name__ == "__main__":
    role, step = sys.argv[1], sys.argv[2]
    if role == "trainer":
        url, policy, store, base, version, seed = sys.argv[3:9]
        asyncio.run(trainer(step, url, policy, store, base, int(version), int(seed)))
    else:
        worker(step, sys.argv[sys.argv.index("--") + 1:])
