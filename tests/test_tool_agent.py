"""The agentic example (examples/tool_agent.py) learns, in a short run on real vLLM (CPU): GRPO
over groups of two-turn tool-use episodes, the tool's output masked out of the loss, a version
published per step and every episode of a step served by that step's version."""

import statistics
import sys
from pathlib import Path

from conftest import engine_flags

from rollq.registry.safetensors_check import dir_schema

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

STEPS = 16


async def test_the_tool_agent_learns(make_worker, make_client, tmp_path):
    from tool_agent import EpisodeTrainer, make_model, train

    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    model = make_model(tmp_path / "model")
    engine = await VLLMEngine.start(VLLMSettings(**engine_flags(model)).validate())
    try:
        worker, task = make_worker(engine=engine, base_schema=dir_schema(model), max_inflight=32,
                                   max_inflight_seqs=32)
        client = make_client(weight_store=str(tmp_path / "store"))
        stats = await train(client, EpisodeTrainer(model), steps=STEPS, groups=8, n=8,
                            on_step=lambda s: print(f"step {s.step}: reward {s.reward:.3f}"))
        worker.stop()
        await task
    finally:
        await engine.close()
    assert [s.versions for s in stats] == [{k} for k in range(STEPS)]
    first = statistics.mean(s.reward for s in stats[:3])
    last = statistics.mean(s.reward for s in stats[-3:])
    assert last > first + 0.1, [round(s.reward, 3) for s in stats]
