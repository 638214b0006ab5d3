"""The openai-SDK agent example (examples/openai_agent_grpo.py) learns, in a short run on real vLLM
(CPU) through a real gateway: an unchanged OpenAI tool loop whose conversations are named with
`X-Rollq-Conversation`, trained with GRPO on the exact trajectories rollq kept. The reward rises;
every token the loss trained on (mask 1) is one the engine sampled (the completions' `token_ids`,
turn by turn); every sampled token's version is its step's version (each request `exact_version`).
The run is seeded (the questions and every request's `seed`), so its rewards are the same run to run."""

import statistics
import sys
from pathlib import Path

from conftest import LONG, engine_flags

from rollq.registry.safetensors_check import dir_schema

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

STEPS, GROUPS, N, SEED = 12 if LONG else 8, 6, 8, 0
"""CI runs 8 steps (the reward is up by the fifth: see the bounds below); ROLLQ_LONG_TESTS=1 runs the
example's 12."""


async def test_the_openai_agent_learns_from_its_exact_trajectories(make_worker, make_client, make_gateway,
                                                                   policy, tmp_path):
    from openai_agent_grpo import LR, EpisodeTrainer, make_agent_model, train

    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    model = make_agent_model(tmp_path / "model")
    settings = VLLMSettings(**engine_flags(model) | dict(max_model_len=512), enable_auto_tool_choice=True,
                            tool_call_parser="hermes").validate()
    engine = await VLLMEngine.start(settings)
    try:
        worker, task = make_worker(engine=engine, base_schema=dir_schema(model), max_inflight=32,
                                   max_inflight_seqs=32)
        gw = await make_gateway()
        client = make_client("alice", weight_store=str(tmp_path / "store"))
        stats = await train(gw.url, gw.tokens["alice"], client, EpisodeTrainer(model, lr=LR), model=policy,
                            steps=STEPS, groups=GROUPS, n=N, seed=SEED,
                            on_step=lambda s: print(f"step {s.step}: reward {s.reward:.3f} "
                                                    f"({s.wall_s:.1f} s)"))
        worker.stop()
        await task
    finally:
        await engine.close()
    rewards = [round(s.reward, 3) for s in stats]
    for s in stats:
        assert len(s.conversations) == GROUPS * N
        for _messages, completions, trajectory in s.conversations:
            assert trajectory.segments == [0] and len(trajectory.turns) == len(completions)
            sampled = []
            for completion, turn in zip(completions, trajectory.turns):
                [choice] = completion.choices
                ids = choice.model_extra["token_ids"]
                assert trajectory.tokens[turn.sample_start:turn.end] == ids
                assert trajectory.tokens[turn.prompt_start:turn.sample_start] == \
                    completion.model_extra["prompt_token_ids"]
                sampled += ids
            # The tokens the loss trains on (mask 1) are exactly the engine's samples, in order.
            assert [t for t, m in zip(trajectory.tokens, trajectory.mask) if m] == sampled
            assert {v for v, m in zip(trajectory.token_versions, trajectory.mask) if m} == {s.version}
            assert all(v == -1 for v, m in zip(trajectory.token_versions, trajectory.mask) if not m)
    assert [s.version for s in stats] == list(range(STEPS))
    # Seed 0, three 8-step runs: 0.333 0.438 0.646 0.708 0.917 0.938 0.979 1.0 each time (the same
    # tokens: vLLM samples each request from its own seeded generator, whatever it is batched with,
    # and the trainer's rows are in group order), so first 0.385 and last 0.972. The margins are for
    # a change of vLLM, torch or CPU, which changes the floats and so the samples, as a change of
    # seed does: seeds 2 and 3 end at 0.93 and 1.0 (seed 2 dips to 0.312 at step 4); seed 1 fails,
    # the policy collapsing after step 3 (0.917, then 0.021, 0.0: one update undid the task, which no
    # bound can cover: the training itself is unstable there).
    first, last = statistics.mean(rewards[:2]), statistics.mean(rewards[-3:])
    assert last > first + 0.3 and last >= 0.85, rewards
