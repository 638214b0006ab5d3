# ruff: noqa: F811 (fixtures imported from swap_fixtures are test arguments by design)
"""A request that passed the engine's swap gate just before a swap began, and whose add reaches
vLLM only after the swap paused it (issue 21; a weight-fault chaos run in CI caught 11 segments
labelled with the old version whose tokens were the new weights').

vLLM queues every add that arrives while it is paused and runs it as soon as generation resumes,
and the swap resumes generation once for its probe token: such a request ran on the weights just
loaded, or on weights that failed their probe. The add is made slow here (vLLM's input
processing awaits between the gate and the add) so that it arrives inside the swap."""

import asyncio
import contextlib
import math
import time

import pytest
import torch
from safetensors.torch import save_file
from swap_fixtures import (PROMPTS, Reference, engine_v1, swap_engine,  # noqa: F401
                           versions)

from rollq.protocol import Sampling, WorkItem, pack_tokens

TOKENS = 24


def saved(state: dict, directory) -> str:
    directory.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    return str(directory)


class SlowAdd:
    """Holds the engine's first add until the swap has paused vLLM (at most `hold_s`: a swap
    that waits for adds in progress before it pauses never pauses while one is held), and the
    swap's weight load until that add was sent, so the add lands in vLLM's paused queue."""

    def __init__(self, llm, hold_s: float = 3.0):
        self.llm, self.hold_s = llm, hold_s
        self.entered, self.paused, self.added = asyncio.Event(), asyncio.Event(), asyncio.Event()
        # vLLM's own pause, under whichever call the engine makes (rollq's skips
        # `pause_generation`'s closing sleep): the engine core's pause is what the add must follow.
        self.core = llm.engine_core
        self.add, self.pause, self.rpc = llm.add_request, self.core.pause_scheduler_async, llm.collective_rpc
        self.order: list[str] = []

    async def _add(self, *args, **kwargs):
        self.entered.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.paused.wait(), self.hold_s)
        try:
            return await self.add(*args, **kwargs)
        finally:
            self.order.append("added")
            self.added.set()

    async def _pause(self, *args, **kwargs):
        await self.pause(*args, **kwargs)
        self.order.append("paused")
        self.paused.set()

    async def _rpc(self, method, *args, **kwargs):
        if method == "reload_weights":
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.added.wait(), self.hold_s)
        return await self.rpc(method, *args, **kwargs)

    def __enter__(self):
        self.llm.add_request, self.core.pause_scheduler_async = self._add, self._pause
        self.llm.collective_rpc = self._rpc
        return self

    def __exit__(self, *exc):
        del self.llm.add_request, self.core.pause_scheduler_async, self.llm.collective_rpc


def greedy_item(prompt: list[int]) -> WorkItem:
    return WorkItem(f"slow-{time.monotonic_ns()}", 0, pack_tokens(prompt), 1,
                    Sampling(temperature=0.0, max_tokens=TOKENS, logprobs=0), time.time())


async def swap_under_a_slow_add(engine, version: int, path: str, interrupt: bool, prompt):
    """Start a group whose add is slow, swap while it is held; the group's sample and the
    swap's error (None if it loaded)."""
    with SlowAdd(engine.llm) as slow:
        group = asyncio.create_task(engine.generate_group(greedy_item(prompt)))
        await asyncio.wait_for(slow.entered.wait(), 30)  # past the gate, inside vLLM's add
        try:
            await engine.swap(version, path, interrupt=interrupt)
            error = None
        except Exception as e:  # noqa: BLE001 (the test asserts on it)
            error = e
        generated = await asyncio.wait_for(group, 120)
    print(f"order of events: {slow.order}")
    return generated.samples[0], error


@pytest.mark.parametrize("interrupt", [False, True], ids=["drain", "interrupt"])
async def test_an_add_that_reaches_vllm_inside_a_swap_is_labelled_with_the_weights_that_ran_it(
        engine_v1, versions, tmp_path, interrupt):
    weights, models = versions
    reference, prompt = Reference(models), PROMPTS[3]
    sample, error = await swap_under_a_slow_add(engine_v1, 2, saved(weights[2], tmp_path / "v2"),
                                                interrupt, prompt)
    assert error is None and engine_v1.version == 2
    print(f"versions {sample.versions}")
    reference.check(prompt, sample)  # each segment's tokens are its version's greedy tokens
    assert sample.versions[-1][0] in (1, 2) and len(sample.token_ids) == TOKENS


@pytest.mark.parametrize("interrupt", [False, True], ids=["drain", "interrupt"])
async def test_an_add_that_reaches_vllm_inside_a_failed_swap_never_runs_on_the_failed_weights(
        engine_v1, versions, tmp_path, interrupt):
    """The load of a version whose weights give a non-finite logprob fails at the probe and the
    old weights come back: the held request must not have run on the failed weights."""
    weights, models = versions
    broken = dict(weights[2])
    name = next(k for k in broken if k.endswith("layers.0.mlp.down_proj.weight"))
    broken[name] = torch.full_like(broken[name], math.nan)
    prompt = PROMPTS[4]
    sample, error = await swap_under_a_slow_add(engine_v1, 2, saved(broken, tmp_path / "v2"),
                                                interrupt, prompt)
    assert isinstance(error, RuntimeError) and engine_v1.version == 1 and engine_v1.alive, error
    print(f"versions {sample.versions}")
    assert sample.versions == [(1, 0)]
    assert all(math.isfinite(lp) for lp in sample.token_logprobs)
    Reference(models).check(prompt, sample)


class BusyCore:
    """Keeps vLLM's engine core busy (reloading the weights it serves) while the engine's first
    add and the swap's pause reach it, so that it takes both from one input batch, before a step
    could schedule the request: under CPU load that happened by chance (a flaky EngineDead)."""

    def __init__(self, llm, weights_path: str):
        self.llm, self.weights_path, self.busy = llm, weights_path, None
        self.add = llm.add_request

    async def _add(self, *args, **kwargs):
        if self.busy is None:
            self.busy = asyncio.create_task(self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_path": self.weights_path}))
            await asyncio.sleep(0.002)  # its message is sent first
        return await self.add(*args, **kwargs)

    def __enter__(self):
        self.llm.add_request = self._add
        return self

    def __exit__(self, *exc):
        del self.llm.add_request


async def test_an_add_taken_with_the_pause_in_one_batch_never_runs_on_failed_weights(
        engine_v1, versions, tmp_path):
    """vLLM's wait pause drains only the requests it has scheduled: one it took from the same
    input batch as the pause stayed queued and ran beside the probe of weights giving NaN, which
    filled its KV block with NaN, and the restored weights' probe read that block (EngineDead)."""
    weights, models = versions
    broken = dict(weights[2])
    name = next(k for k in broken if k.endswith("layers.0.mlp.down_proj.weight"))
    broken[name] = torch.full_like(broken[name], math.nan)
    path, prompt = saved(broken, tmp_path / "v2"), PROMPTS[5]
    with BusyCore(engine_v1.llm, engine_v1._weights_path) as core:
        group = asyncio.create_task(engine_v1.generate_group(greedy_item(prompt)))
        while core.busy is None:
            await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="logprob of nan"):
            await engine_v1.swap(2, path)
        sample = (await asyncio.wait_for(group, 120)).samples[0]
        await core.busy
    assert engine_v1.version == 1 and engine_v1.alive
    assert sample.versions == [(1, 0)]
    assert all(math.isfinite(lp) for lp in sample.token_logprobs)
    Reference(models).check(prompt, sample)
