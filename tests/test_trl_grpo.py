"""TRL's GRPOTrainer (trl 1.16, vLLM server mode) training a tiny model on CPU, generation served
by a real vLLM (CPU) worker through rollq's gateway, weights synced as registry versions, the
trainer's recomputed logprobs reported as the training-inference gap."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from models import make_chat_model, token_logprobs

pytest.importorskip("trl")

LOGPROB_TOLERANCE = 1e-3
STEPS = 3


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("grpo-model") / "m")


@pytest.fixture(scope="module")
async def grpo_engine(chat_model):
    """An engine of its own: the trainer's versions replace its weights."""
    from conftest import engine_flags

    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    engine = await VLLMEngine.start(VLLMSettings(**engine_flags(chat_model)).validate())
    yield engine
    await engine.close()


def even_tokens(completions, completion_ids, **_) -> list[float]:
    """The reward: the share of even token ids in the completion."""
    return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def grpo_run(chat_model: Path, out: Path, gateway_url: str, token: str, publisher):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from rollq.integrations.trl import RollqGRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.pad_token = "<unk>"
    model = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32)
    dataset = Dataset.from_dict({"prompt": [f"w{20 + i} w{40 + i} w{60 + i}" for i in range(16)]})
    args = GRPOConfig(
        output_dir=str(out), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=4,
        num_generations=2, max_completion_length=8, learning_rate=5e-2, beta=0.0, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=gateway_url, vllm_server_timeout=30)
    trainer = RollqGRPOTrainer(model=model, reward_funcs=even_tokens, args=args, train_dataset=dataset,
                               processing_class=tokenizer, publisher=publisher, api_key=token)
    trainer.train()
    return trainer


async def test_grpo_trainer_generates_through_rollq_and_publishes_a_version_per_step(
        make_gateway, make_worker, grpo_engine, chat_model, redis_url, redis, policy, tmp_path):
    from rollq.client import SyncRolloutClient
    from rollq.queue import gap
    from rollq.queue.keys import Keys
    from rollq.queue.workers import live_workers
    from rollq.registry.safetensors_check import dir_schema
    from rollq.registry.versions import Registry

    make_worker(engine=grpo_engine, base_schema=dir_schema(chat_model), max_inflight=32, max_inflight_seqs=32)
    gw = await make_gateway()
    publisher = await asyncio.to_thread(SyncRolloutClient, redis_url, policy=policy, trainer_id="grpo",
                                        weight_store=str(tmp_path / "store"))
    try:
        trainer = await asyncio.to_thread(grpo_run, chat_model, tmp_path / "out", gw.url, gw.tokens["alice"],
                                          publisher)
    finally:
        await asyncio.to_thread(publisher.close)

    # One version per optimizer step that generated: step k syncs version k + 1 and generates on it.
    entries = await Registry(redis, Keys(policy)).entries()
    assert [e.version for e in entries] == [1, 2, 3] and {e.publisher for e in entries} == {"grpo"}
    generations = list(trainer.rollq_client.generations)
    assert [g.version for g in generations] == [1, 2, 3]
    for step, generation in enumerate(generations):
        assert len(generation.completion_ids) == 4  # 2 prompts x num_generations 2
        assert generation.policy_versions == [[(step + 1, 0)]] * 4
        # The tokens are those version's: its published weights give the logprobs vLLM reported.
        model = _published(chat_model, entries[step].path)
        for prompt, ids, logprobs in zip(generation.prompt_ids, generation.completion_ids,
                                         generation.logprobs):
            expected = token_logprobs(model, prompt, ids)
            assert max(abs(a - b) for a, b in zip(logprobs, expected)) < LOGPROB_TOLERANCE

    # TRL's recomputed logprobs of every batch were reported (RollqGRPOTrainer.report_gap): each
    # version's tokens, all on the one worker, float32 on both sides. Measured here: mean |Δ|
    # 1.1e-3, 2.1e-3, 2.5e-3 and k3 1e-6 to 7e-6 for versions 1-3 (TRL's padded batch forward
    # against vLLM's CPU float32, growing as training sharpens the logits).
    view = await gap.read(redis, Keys(policy))
    [worker] = await live_workers(redis, Keys(policy))
    assert [v.version for v in view.versions] == [1, 2, 3]
    assert [v.tokens for v in view.versions] == [sum(map(len, g.completion_ids)) for g in generations]
    assert {(w.version, w.worker) for w in view.workers} == {(v, worker.worker_id) for v in (1, 2, 3)}
    assert all(0 < v.mean_abs < 1e-2 and v.kl < 1e-4 and v.over_1 == 0 for v in view.versions), view

    # The trainer learned: each version's weights differ from the one before, and the loss is finite.
    assert len({e.files[0].digest for e in entries}) == 3
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert trainer.state.global_step == STEPS


def _published(chat_model: Path, path: str):
    """The model as a registry version holds it: the base config, the version's safetensors."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(chat_model), dtype=torch.float32)
    state = {k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()}
    model.load_state_dict(state)
    return model.eval()
