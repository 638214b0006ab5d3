"""TRL's experimental `AsyncGRPOTrainer` (trl 1.16) with a rollq pool: weights through the
registry (`RollqWeightTransfer`), rollouts through the gateway with a token and a version window.

Its own module because importing `trl.experimental` warns, and TRL's rollout child unpickles the
loop class by reference (it must be importable). On a CPU-only machine the trainer cannot take a
step: its loss forward needs FlashAttention 3 (docs/architecture.md, TRL).

    client = RollqVLLMClient(gateway_url, publisher=publisher, api_key=token)
    trainer = AsyncGRPOTrainer(model_path, reward, args=args, train_dataset=ds,
                               weight_transfer=RollqWeightTransfer(client))
    use_rollq_rollouts(trainer, client)
    trainer.train()
"""

from __future__ import annotations

from typing import Any

import aiohttp
from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

from rollq.integrations.trl import RollqVLLMClient


class RollqRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop whose requests carry the gateway token and `min_version`: the rollq
    version of the trainer's current policy, so a sample TRL tags with policy k comes from k or a
    newer version, and TRL's `max_staleness` check never underestimates."""

    def __init__(self, *, rollq_version_base: int, rollq_headers: dict[str, str], **trl_kwargs: Any):
        super().__init__(**trl_kwargs)
        self._rollq_base = rollq_version_base
        self._rollq_headers = rollq_headers

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        if path == "/v1/completions" and self.model_version > 0:
            # TRL counts its syncs from 1; rollq's versions go on from the newest before the first.
            payload = {**payload, "min_version": self._rollq_base + self.model_version}

        async def post() -> dict:
            async with self.session.post(f"{self.vllm_server_url}{path}", json=payload,
                                         headers=self._rollq_headers,
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                response.raise_for_status()
                return await response.json() or {}

        return await self._retry(post, label=f"POST {path}", max_attempts=max_retries)


def use_rollq_rollouts(trainer: Any, client: RollqVLLMClient) -> None:
    """Before `trainer.train()`: its rollout child requests `client`'s policy with its token and a
    version window. Call it before anything else publishes to the policy: TRL's first sync is
    taken to be the newest version now + 1."""
    worker = trainer.rollout_worker
    if worker is None:  # not the main process
        return
    if worker._process is not None:
        raise RuntimeError("call use_rollq_rollouts before trainer.train(): the rollout child has started")
    worker._loop_cls = RollqRolloutLoop
    worker._loop_kwargs.update(model_name=client.model, rollq_version_base=client.latest_version() or 0,
                               rollq_headers=dict(client.auth_headers))
