"""Fixtures of the vLLM swap tests: one float32 engine per test module (the tests swap it), the
weights of versions 1-3 with a transformers model of each, and greedy references per version."""

from bisect import bisect_right
from functools import cache
from itertools import groupby

import pytest
import torch
from conftest import engine_flags
from models import greedy
from transformers import LlamaForCausalLM

from rollq.registry.safetensors_check import dir_schema

GREEDY = {"temperature": 0.0, "max_tokens": 48}
PROMPTS = [[1, 7 + 13 * i, 3 + i] for i in range(25)]


def perturbed(base: dict, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in base.items()}


@pytest.fixture(scope="module")
def versions(tiny_model, reference):
    """Weights of v1 (the tiny model), v2 and v3 (perturbed), and a transformers model of each."""
    base = {k: v.clone() for k, v in reference.state_dict().items()}
    weights = {1: base, 2: perturbed(base, 2), 3: perturbed(base, 3)}
    models = {}
    for v, state in weights.items():
        model = LlamaForCausalLM(reference.config).eval()
        model.load_state_dict(state)
        models[v] = model
    return weights, models


@pytest.fixture(scope="module")
async def swap_engine(tiny_model):
    """A float32 engine of its own (these tests swap it); it starts as version 1."""
    from rollq.config import VLLMSettings
    from rollq.engine.vllm import VLLMEngine

    engine = await VLLMEngine.start(VLLMSettings(**engine_flags(tiny_model)).validate(), version=1)
    yield engine
    await engine.close()


async def start_with_hold(tiny_model, hold_dir, **settings):
    """A float32 engine (v1; `settings`: more `VLLMSettings`) whose processes run the tests'
    push hold hook (`pushes.HOLD_ENV` names `hold_dir` in their environment, ours at their start)."""
    import os

    from rollq.config import VLLMSettings
    from rollq.engine import pushes
    from rollq.engine.vllm import VLLMEngine

    os.environ[pushes.HOLD_ENV] = str(hold_dir)
    try:
        return await VLLMEngine.start(VLLMSettings(**engine_flags(tiny_model) | settings).validate(),
                                      version=1)
    finally:
        del os.environ[pushes.HOLD_ENV]


@pytest.fixture
async def engine_v1(swap_engine, tiny_model):
    """The module's engine, on version 1 (set before any worker of the test starts)."""
    if swap_engine.version != 1:
        await swap_engine.swap(1, str(tiny_model))
    return swap_engine


@pytest.fixture
def follower(make_worker, engine_v1, tiny_model):
    def create(**settings):
        settings = {"max_inflight": 32, "max_inflight_seqs": 32, "lease_s": 5.0} | settings
        return make_worker(engine=engine_v1, base_schema=dir_schema(tiny_model), **settings)[0]

    return create


@pytest.fixture
def publisher(make_client, tmp_path):
    return make_client(weight_store=str(tmp_path / "store"))


class Reference:
    """Greedy continuations under each version, cached (prompts repeat)."""

    def __init__(self, models):
        self.models = models
        self.greedy = cache(self._greedy)

    def _greedy(self, version: int, prefix: tuple[int, ...], count: int) -> tuple[int, ...]:
        return tuple(greedy(self.models[version], list(prefix), count)) if count else ()

    def check(self, prompt: list[int], sample) -> None:
        """Each version segment continues greedily, under its version, what came before it."""
        tokens = sample.token_ids
        bounds = [start for _, start in sample.versions[1:]] + [len(tokens)]
        for (version, start), end in zip(sample.versions, bounds):
            expected = self.greedy(version, tuple(prompt + tokens[:start]), end - start)
            assert tuple(tokens[start:end]) == expected, f"segment of version {version} at {start}"

    @torch.no_grad()
    def check_kept(self, prompt: list[int], sample) -> None:
        """What a `keep` swap promises, under transformers: every token is the greedy choice of
        the version its segment names, attending to KV that each position's own version computed.

        The step that samples token k runs its inputs through the weights of that moment: the
        prompt's KV comes from the version of token 0, and token k's KV (fed as input one step
        later) from the version of token k + 1. So across a swap the tokens before it keep the
        old version's KV, and a from-scratch continuation (`check`) would differ.
        """
        from transformers import DynamicCache

        tokens, starts = sample.token_ids, [start for _, start in sample.versions]

        def version_of(k: int) -> int:
            return sample.versions[bisect_right(starts, k) - 1][0]

        ids, p = prompt + tokens, len(prompt)
        by_position = [version_of(max(0, q - p + 1)) for q in range(len(ids) - 1)]
        cache, choices, q = DynamicCache(), [], 0
        for version, run in groupby(by_position):
            end = q + len(list(run))
            out = self.models[version](torch.tensor([ids[q:end]]), past_key_values=cache, use_cache=True)
            choices += out.logits[0].argmax(-1).tolist()
            q = end
        for k, token in enumerate(tokens):
            assert choices[p - 1 + k] == token, (
                f"token {k} (version {version_of(k)}): {token}, the kept-KV greedy choice is "
                f"{choices[p - 1 + k]}")
