"""TRL's experimental AsyncGRPOTrainer (trl 1.16) on CPU: its rollout child generates through
rollq's gateway on a real vLLM (CPU) worker; its weight syncs publish registry versions."""

from __future__ import annotations

import asyncio
import contextlib
import math
import queue
import traceback
from pathlib import Path

import pytest
from models import load_reference, make_chat_model, token_logprobs

pytest.importorskip("trl")

STEPS = 3


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("async-grpo-model") / "m")


@pytest.fixture(scope="module")
async def engine(chat_model):
    from conftest import engine_flags

    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    engine = await VLLMEngine.start(VLLMSettings(**engine_flags(chat_model)).validate())
    yield engine
    await engine.close()


def even_tokens(completions, completion_ids, **_) -> list[float]:
    """The reward (module level: TRL pickles it into its rollout child)."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def run(chat_model: Path, out: Path, gateway_url: str, policy: str, publisher):
    """Build the trainer and train; returns (trainer, the exception that ended training, samples the
    rollout child had queued)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer

    from rollq.integrations.trl import RollqVLLMClient, RollqWeightTransfer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.pad_token = "<unk>"
    # The rollout child parses each reply with the tokenizer's response template (tool calls), known
    # to TRL for popular models only: the tiny model's own.
    tokenizer.response_template = {"defaults": {"role": "assistant"}, "start_anchor": "<|assistant|>",
                                   "fields": {"content": {"close_pattern": r"</s>\s*|$", "content": "text"}}}
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"w{20 + i} w{40 + i}"}]
                                            for i in range(16)]})
    args = AsyncGRPOConfig(
        output_dir=str(out), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, learning_rate=5e-2, logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, seed=0, vllm_server_base_url=gateway_url, token_budget=256, max_staleness=2,
        dtype="float32")
    client = RollqVLLMClient(gateway_url, publisher=publisher)
    # The MFU metric's device lookup is torch.cuda.get_device_name: on CPU-only torch it raises.
    original = async_grpo_trainer.get_peak_flops_per_device
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
    try:
        trainer = AsyncGRPOTrainer(model=str(chat_model), reward_funcs=even_tokens, args=args,
                                   train_dataset=dataset, processing_class=tokenizer,
                                   weight_transfer=RollqWeightTransfer(client))
    finally:
        async_grpo_trainer.get_peak_flops_per_device = original
    # The rollout child names the model by its config's path: make it the policy the gateway serves.
    trainer.rollout_worker._loop_kwargs["model_name"] = policy
    try:
        trainer.train()
        ended = None
    except Exception as e:  # what needs a GPU: asserted by the caller
        ended = e
    finally:
        samples = [trainer.rollout_queue.get(timeout=120)]  # at least one: the child works on
        trainer.rollout_worker.stop()
    with contextlib.suppress(queue.Empty):
        while len(samples) < 64:
            samples.append(trainer.rollout_queue.get(timeout=1))
    return trainer, ended, samples


async def test_async_grpo_trainer_on_cpu_runs_up_to_its_flash_attention_3_forward(
        make_gateway, make_worker, engine, chat_model, redis_url, redis, policy, tmp_path, monkeypatch):
    """AsyncGRPOTrainer needs a GPU for two things: its MFU metric asks torch.cuda for the device
    name (patched out here), and its loss forward runs attention through `tree_fa3`, FlashAttention 3
    fetched by the `kernels` package from the Hugging Face Hub (a CUDA kernel; not installed here,
    and nothing may be downloaded). Everything before that forward runs: the first weight sync
    publishes version 1 through rollq, and TRL's rollout child generates and scores groups
    through the gateway on the rollq worker."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # what trl.experimental warns of on import
    from rollq.client import SyncRolloutClient
    from rollq.queue.keys import Keys
    from rollq.registry.safetensors_check import dir_schema
    from rollq.registry.versions import Registry

    make_worker(engine=engine, base_schema=dir_schema(chat_model), max_inflight=32, max_inflight_seqs=32)
    gw = await make_gateway(no_auth=True, tokens=None, policies=[policy])
    publisher = await asyncio.to_thread(SyncRolloutClient, redis_url, policy=policy, trainer_id="async-grpo",
                                        weight_store=str(tmp_path / "store"))
    try:
        trainer, ended, samples = await asyncio.to_thread(run, chat_model, tmp_path / "out", gw.url, policy,
                                                          publisher)
    finally:
        await asyncio.to_thread(publisher.close)

    assert isinstance(ended, ModuleNotFoundError) and ended.name == "kernels"
    assert any(frame.name == "tree_attention" for frame in traceback.extract_tb(ended.__traceback__))
    # The train-begin sync published the trainer's weights as version 1 (no NCCL, nothing paused).
    [entry] = await Registry(redis, Keys(policy)).entries()
    assert (entry.version, entry.publisher) == (1, "async-grpo") and trainer.model_version == 1
    # The rollout child's samples: generated through rollq by the worker (version 1 holds the
    # initial weights, so the behaviour logprobs are transformers' of the model made here), rewarded.
    reference = load_reference(chat_model)
    assert samples
    for sample in samples:
        mask = sample.completion_mask.astype(bool)
        start = int(mask.argmax())
        ids = sample.input_ids.tolist()
        assert 0 < mask.sum() <= 8 and mask[start:].all() and len(sample.old_log_probs) == len(ids)
        expected = token_logprobs(reference, ids[:start], ids[start:])
        assert max(abs(a - b) for a, b in zip(sample.old_log_probs[start:], expected)) < 1e-3
        assert sample.model_version == 1 and math.isfinite(sample.advantage)
