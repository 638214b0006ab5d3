"""TRL's experimental AsyncGRPOTrainer (trl 1.16) on CPU: its rollout child generates through
rollq's gateway on a real vLLM (CPU) worker; its weight syncs publish registry versions."""

from __future__ import annotations

import asyncio
import math
import traceback
from pathlib import Path

import pytest
import torch
from models import make_chat_model, token_logprobs
from transformers import TrainerCallback

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


class SecondPolicy(TrainerCallback):
    """The step TRL cannot take on CPU, by hand, as training begins: new weights, then TRL's own
    sync (policy 2); then the rollout child's samples until 4 are tagged with policy 2."""

    def __init__(self, trainer):
        self.trainer, self.samples = trainer, []

    def on_train_begin(self, *_args, **_kwargs):
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in self.trainer.model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        self.trainer._sync_weight()
        while sum(s.model_version == 2 for s in self.samples) < 4:
            self.samples.append(self.trainer.rollout_queue.get(timeout=120))


def run(chat_model: Path, out: Path, gateway_url: str, token: str, publisher):
    """Build the trainer and train. Returns (trainer, the exception that ended training, the
    rollout child's samples until 4 were of policy 2)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo import async_grpo_trainer

    from rollq.integrations.trl import RollqVLLMClient, RollqWeightTransfer
    from rollq.integrations.trl_async import use_rollq_rollouts

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
    client = RollqVLLMClient(gateway_url, publisher=publisher, api_key=token)
    # The MFU metric's device lookup is torch.cuda.get_device_name: on CPU-only torch it raises.
    original = async_grpo_trainer.get_peak_flops_per_device
    async_grpo_trainer.get_peak_flops_per_device = lambda accelerator, dtype: None
    try:
        trainer = AsyncGRPOTrainer(model=str(chat_model), reward_funcs=even_tokens, args=args,
                                   train_dataset=dataset, processing_class=tokenizer,
                                   weight_transfer=RollqWeightTransfer(client))
    finally:
        async_grpo_trainer.get_peak_flops_per_device = original
    use_rollq_rollouts(trainer, client)
    probe = SecondPolicy(trainer)
    trainer.add_callback(probe)  # after TRL's own train-begin callback (first sync, child started)
    try:
        trainer.train()
        ended = None
    except Exception as e:  # what needs a GPU: asserted by the caller
        ended = e
    samples = probe.samples
    return trainer, ended, samples


@pytest.mark.timeout(600)  # usually under a minute; seen at 4 min on a loaded 2-core box
async def test_async_grpo_trainer_on_cpu_runs_up_to_its_flash_attention_3_forward(
        make_gateway, make_worker, engine, chat_model, redis_url, redis, policy, tmp_path, monkeypatch):
    """AsyncGRPOTrainer needs a GPU for two things: its MFU metric asks torch.cuda for the device
    name (patched out here), and its loss forward runs attention through `tree_fa3`, FlashAttention 3
    fetched by the `kernels` package from the Hugging Face Hub (a CUDA kernel; not installed here,
    and nothing may be downloaded). Everything else runs: weight syncs publish versions through
    rollq, and TRL's rollout child generates and scores groups through the gateway, each on the
    policy version TRL tags it with or a newer one."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # what trl.experimental warns of on import
    from rollq.client import SyncRolloutClient
    from rollq.queue.keys import Keys
    from rollq.registry.safetensors_check import dir_schema
    from rollq.registry.versions import Registry

    make_worker(engine=engine, base_schema=dir_schema(chat_model), max_inflight=32, max_inflight_seqs=32)
    gw = await make_gateway()
    publisher = await asyncio.to_thread(SyncRolloutClient, redis_url, policy=policy, trainer_id="async-grpo",
                                        weight_store=str(tmp_path / "store"))
    try:
        trainer, ended, samples = await asyncio.to_thread(run, chat_model, tmp_path / "out", gw.url,
                                                          gw.tokens["alice"], publisher)
    finally:
        await asyncio.to_thread(publisher.close)

    assert isinstance(ended, ModuleNotFoundError) and ended.name == "kernels"
    assert any(frame.name == "tree_attention" for frame in traceback.extract_tb(ended.__traceback__))
    # The train-begin sync and the one by hand published versions 1 and 2 (no NCCL, nothing paused).
    entries = await Registry(redis, Keys(policy)).entries()
    assert [(e.version, e.publisher) for e in entries] == [(1, "async-grpo"), (2, "async-grpo")]
    assert trainer.model_version == 2
    # The rollout child's samples: generated through rollq, rewarded, with behaviour logprobs; a
    # sample TRL tags with policy 2 was asked for min_version 2, so its logprobs are version 2's.
    v2 = _published(chat_model, entries[1].path)
    for sample in samples:
        mask = sample.completion_mask.astype(bool)
        start = int(mask.argmax())
        ids = sample.input_ids.tolist()
        assert 0 < mask.sum() <= 8 and mask[start:].all() and len(sample.old_log_probs) == len(ids)
        assert math.isfinite(sample.advantage)
        if sample.model_version == 2:
            expected = token_logprobs(v2, ids[:start], ids[start:])
            assert max(abs(a - b) for a, b in zip(sample.old_log_probs[start:], expected)) < 1e-3


def _published(chat_model: Path, path: str):
    """The model as a registry version holds it: the base config, the version's safetensors."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(chat_model), dtype=torch.float32)
    state = {k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()}
    model.load_state_dict(state)
    return model.eval()
