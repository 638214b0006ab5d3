"""TRL's trainers generating through a rollq pool: `pip install rollq[trl]` (tested: trl 1.16.0).

TRL's `GRPOTrainer(use_vllm=True, vllm_mode="server")` talks to a vLLM server through TRL's
`VLLMClient`: OpenAI routes for generation, which rollq's gateway serves, and NCCL for weights,
which a shared pool cannot take. `RollqVLLMClient` is TRL's client with the weight path replaced:

- `init_communicator`: no NCCL group; reads the policy's newest version from `/server_info`.
- `update_named_params` (what `sync_weights` calls, once per optimizer step that generates):
  the tensors are published as the next version with rollq's `publish_weights`; every worker of
  the pool verifies and swaps to it by itself.
- `generate` / `chat`: the request carries `exact_version` = the version last published (unless
  `generation_kwargs` name a window of their own), so every token TRL trains on comes from the
  weights it synced; each call's per-sample version segments are kept (`policy_versions`,
  `generations`) since TRL has no place for them.
- scored rollouts: `generation_kwargs={"reward": name}` (GRPOConfig's, or per call, with
  `reward_inputs` and `reward_errors` as `RolloutClient.submit` takes them) has the pool's
  `rollq scorer`s score every completion with the operator's reward `name`; `rollq_rewards(client)`
  is a TRL reward function that gives each completion that reward.
- the training-inference gap: `RollqGRPOTrainer` reports TRL's recomputed logprobs of each
  batch (`old_per_token_logps`) against the served ones, per version and worker, to the
  gateway's `POST /v1/policies/{p}/gap` (`report_gap`; rollq's `queue/gap.py` sums them).
- `_format_sequence_logprobs`: tokens outside the top N carry rank null in `prompt_logprobs`
  from workers older than `Sample.token_ranks`; they are ordered after the ranked ones.

Everything else (`generate`'s payload, logprob parsing, `reset_prefix_cache`) is TRL's own code.
`serve_from_rollq` makes TRL build this client instead of its own; `RollqGRPOTrainer` is
`GRPOTrainer` built inside it:

    publisher = SyncRolloutClient(redis_url, policy="demo", trainer_id="grpo-1")
    args = GRPOConfig(..., use_vllm=True, vllm_mode="server", vllm_server_base_url=gateway_url)
    trainer = RollqGRPOTrainer(model, reward_funcs, args=args, train_dataset=ds, publisher=publisher)
    trainer.train()
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import requests
import torch
from trl import GRPOTrainer
from trl.generation import vllm_generation
from trl.generation.vllm_client import VLLMClient

logger = logging.getLogger("rollq.integrations.trl")
WINDOW_FIELDS = ("exact_version", "min_version", "max_version", "max_staleness")


def host_copies(named_params: Iterator[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    # Convert TRL's stream of (vLLM name, tensor) --> one state_dict: one registry version.
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in named_params}


@dataclass
class Generation:
    """One `generate` or `chat` call as served: the version asked for and, per completion, its
    prompt ids, version segments `[(version, first token), ...]`, token ids, sampled-token
    logprobs and, for a call that asked for a reward, the reward rollq's scorers gave it."""

    version: int | None
    prompt_ids: list[list[int]] = field(default_factory=list)
    policy_versions: list[list[tuple[int, int]]] = field(default_factory=list)
    completion_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[float]] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)
    worker_ids: list[str] = field(default_factory=list)

    def add(self, choice: dict, prompt_ids: list[int] | None) -> None:
        self.prompt_ids.append(choice.get("prompt_token_ids") or prompt_ids or [])
        self.policy_versions.append([tuple(s) for s in choice.get("policy_versions", [])])
        self.completion_ids.append(choice.get("token_ids") or [])
        lp = choice.get("logprobs") or {}
        self.logprobs.append([e["logprob"] for e in lp["content"]] if "content" in lp
                             else lp.get("token_logprobs", []))
        self.rewards.append(choice.get("reward"))
        self.worker_ids.append(choice.get("worker_id") or "")


class RollqVLLMClient(VLLMClient):
    """TRL's `VLLMClient` against rollq's gateway, publishing weights through rollq's registry.

    `publisher`: a `SyncRolloutClient` of the gateway's policy (weights go to Redis and the weight
    store directly, not through the gateway). `api_key`: the gateway token (TRL sends none).
    `keep`: retention passed to each publish. `history`: how many calls `generations` keeps.
    """

    def __init__(self, base_url: str | None = None, *, publisher: Any, api_key: str | None = None,
                 keep: int | None = None, history: int = 16, **trl_kwargs: Any):
        self.auth_headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.publisher, self.keep = publisher, keep
        self.version: int | None = None
        """The version last published by this client (None: none yet, any version serves)."""
        self.generations: deque[Generation] = deque(maxlen=history)
        """The last `history` generate / chat calls, as served (TRL keeps no provenance)."""
        self._lock = threading.Lock()
        self._serving: Generation | None = None
        super().__init__(base_url=base_url, **trl_kwargs)

    # TRL builds its requests.Session inside __init__: the token goes on it as it is assigned.
    @property
    def session(self) -> requests.Session:
        return self._session

    @session.setter
    def session(self, session: requests.Session) -> None:
        session.headers.update(self.auth_headers)
        self._session = session

    @property
    def policy_versions(self) -> list[list[tuple[int, int]]]:
        """Version segments `[(version, first token), ...]` of each completion of the last call."""
        return self.generations[-1].policy_versions if self.generations else []

    def latest_version(self) -> int | None:
        """The policy's newest registered version, as the gateway reports it."""
        info = self._get(f"{self.base_url}/server_info", params={"model": self.model})
        return info["rollq"]["latest_version"]

    # --- weights: a registry version per sync, no NCCL --------------------------------------

    def init_communicator(self, device: torch.device | str | int = 0) -> None:
        self.version = None  # generation accepts any version until the first sync publishes one

    def close_communicator(self) -> None:
        pass

    @contextmanager
    def weight_update(self) -> Iterator[None]:
        yield  # each update_named_params call is one whole version already

    def update_named_params(self, metadata: list[tuple[str, str, list[int]]],
                            named_params: Iterator[tuple[str, torch.Tensor]]) -> None:
        tensors = host_copies(named_params)
        if sorted(tensors) != sorted(name for name, _, _ in metadata):
            raise ValueError(f"TRL announced {len(metadata)} tensors and streamed {len(tensors)}")
        self.publish(tensors)

    def publish(self, tensors: dict[str, torch.Tensor]) -> int:
        """Register `tensors` as the policy's next version (waits until registered); returns it."""
        if self.publisher is None:
            raise RuntimeError("this RollqVLLMClient has no publisher: give it a SyncRolloutClient of the "
                               "policy to sync weights")
        latest = self.latest_version()
        version = 1 if latest is None else latest + 1
        self.publisher.publish_weights(version, tensors, keep=self.keep)
        if (self.latest_version() or -1) < version:
            raise RuntimeError(
                f"published version {version}, but the gateway's policy {self.model!r} does not list it: "
                "the publisher (SyncRolloutClient) must be of the same policy and Redis as the gateway")
        self.version = version
        return version

    def update_named_param(self, name: str, weights: torch.Tensor) -> None:
        raise NotImplementedError("a rollq version is a whole model: publish all tensors at once "
                                  "(update_named_params / update_model_params)")

    # --- generation: on the version last published, provenance kept ------------------------

    def _window(self, generation_kwargs: dict | None) -> dict:
        kwargs = dict(generation_kwargs or {})
        if self.version is not None and not any(k in kwargs for k in WINDOW_FIELDS):
            kwargs["exact_version"] = self.version
        return kwargs

    def generate(self, prompts, features=None, *args, generation_kwargs: dict | None = None, **kwargs):
        return self._recorded(super().generate, prompts, features, *args,
                              generation_kwargs=self._window(generation_kwargs), **kwargs)

    def chat(self, messages, *args, generation_kwargs: dict | None = None, **kwargs):
        # Conversations go out concurrently, one request each: their versions are kept in the
        # order the replies come, not per conversation.
        return self._recorded(super().chat, messages, *args,
                              generation_kwargs=self._window(generation_kwargs), **kwargs)

    def _recorded(self, call, *args, **kwargs):
        self._serving = Generation(self.version)
        try:
            out = call(*args, **kwargs)
            self.generations.append(self._serving)
        finally:
            self._serving = None
        return out

    def _post(self, url: str, **kwargs) -> dict:
        reply = super()._post(url, **kwargs)
        serving = self._serving
        if serving is not None and url.endswith(("/v1/completions", "/v1/chat/completions")):
            with self._lock:
                for choice in reply.get("choices", []):
                    serving.add(choice, reply.get("prompt_token_ids"))  # chat: one per reply
        return reply

    # --- the training-inference gap -------------------------------------------------------------

    def report_gap(self, completion_ids: list[list[int]], trainer_logprobs: list[list[float]]) -> int:
        """Report the trainer's logprobs of completions this client generated (matched by token
        ids among its recent calls, as `rollq_rewards` does) to the gateway's `.../gap`, with each
        one's worker, version segments and served logprobs; returns the samples reported. A
        completion not found (or of another length) is left out. A failed report is logged, not
        raised: the gap is a figure to watch, never a reason to stop training."""
        served: dict[tuple[int, ...], list[tuple[str, list, list[float]]]] = {}
        for g in reversed(list(self.generations)):  # the newest call's first
            for ids, worker, versions, logprobs in zip(g.completion_ids, g.worker_ids, g.policy_versions,
                                                      g.logprobs):
                served.setdefault(tuple(ids), []).append((worker, versions, logprobs))
        samples = []
        for ids, theirs in zip(completion_ids, trainer_logprobs):
            found = served.get(tuple(ids))
            if not found or not ids:
                continue
            worker, versions, logprobs = found.pop(0)
            if len(logprobs) == len(theirs) and versions:
                samples.append(dict(worker_id=worker, policy_versions=[list(v) for v in versions],
                                    rollout_logprobs=logprobs, trainer_logprobs=theirs))
        if not samples:
            return 0
        try:
            r = self.session.post(f"{self.base_url}/v1/policies/{self.model}/gap", json=dict(samples=samples))
            r.raise_for_status()
        except requests.RequestException as e:
            logger.warning("rollq: the gap report of %d samples failed: %s", len(samples), e)
            return 0
        return len(samples)

    @staticmethod
    def _format_sequence_logprobs(choice: dict, sequence: list[int], prompt_length: int, top_logprobs: int):
        unranked = 1 << 62  # rank null: outside the top N, after every ranked entry
        ranked = [None if p is None else {t: {**e, "rank": unranked if e["rank"] is None else e["rank"]}
                                          for t, e in p.items()}
                  for p in choice["prompt_logprobs"]]
        return VLLMClient._format_sequence_logprobs({**choice, "prompt_logprobs": ranked}, sequence,
                                                    prompt_length, top_logprobs)


def rollq_rewards(client: RollqVLLMClient | Callable[[], RollqVLLMClient], name: str = "rollq_reward"):
    """A TRL reward function: each completion's reward as rollq's scorers gave it, for generations
    that asked for one (`generation_kwargs={"reward": ...}`); None (TRL: NaN, ignored) for a
    completion the client did not generate with a reward. `client`, or a function that returns
    it (the trainer makes its client after its reward functions):

        trainer = RollqGRPOTrainer(..., reward_funcs=[rollq_rewards(lambda: trainer.rollq_client)])

    Completions are matched by their token ids among the client's recent calls (`history`), so it
    holds where the client generates: TRL's main process."""
    get = client if callable(client) else lambda: client

    def reward(prompts=None, completions=None, completion_ids=None, **kwargs) -> list[float | None]:
        if completion_ids is None:
            raise ValueError("rollq_rewards needs TRL's `completion_ids` (TRL >= 0.20 passes them)")
        given: dict[tuple[int, ...], list[float | None]] = {}
        for g in reversed(list(get().generations)):  # the newest call's first
            for ids, value in zip(g.completion_ids, g.rewards):
                given.setdefault(tuple(ids), []).append(value)
        out = []
        for ids in completion_ids:
            values = given.get(tuple(ids))
            out.append(values.pop(0) if values else None)  # equal completions: in the order served
        return out

    reward.__name__ = name
    return reward


@contextmanager
def serve_from_rollq(publisher: Any, *, api_key: str | None = None,
                     keep: int | None = None) -> Iterator[None]:
    """Within it, TRL's vLLM server mode builds a `RollqVLLMClient` (TRL looks its client class up
    in `trl.generation.vllm_generation` when a trainer is constructed; nothing else changes)."""
    original = vllm_generation.VLLMClient
    vllm_generation.VLLMClient = partial(RollqVLLMClient, publisher=publisher, api_key=api_key, keep=keep)
    try:
        yield
    finally:
        vllm_generation.VLLMClient = original


class RollqGRPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer`, generating through a rollq gateway and publishing a version per sync.

    Takes GRPOTrainer's arguments plus `publisher` (a `SyncRolloutClient` of the policy),
    `api_key` (the gateway token) and `keep` (versions retained); `args` must say
    `use_vllm=True, vllm_mode="server", vllm_server_base_url=<gateway>`."""

    def __init__(self, *args: Any, publisher: Any, api_key: str | None = None, keep: int | None = None,
                 report_gap: bool = True, **kwargs: Any):
        with serve_from_rollq(publisher, api_key=api_key, keep=keep):
            super().__init__(*args, **kwargs)
        self.report_gap = report_gap
        """Report the trainer's recomputed logprobs of each batch (`old_per_token_logps`, which TRL
        computes with `vllm_importance_sampling_correction`, its default) to rollq's gap."""

    def _generate_and_score_completions(self, inputs: Any) -> dict:
        # TRL holds its own recomputed logprobs and the served completions together only here.
        output = super()._generate_and_score_completions(inputs)
        old = output.get("old_per_token_logps")
        client = getattr(getattr(self, "vllm_generation", None), "vllm_client", None)
        if self.report_gap and old is not None and isinstance(client, RollqVLLMClient):
            mask = output["completion_mask"].bool()
            ids = [row[m].tolist() for row, m in zip(output["completion_ids"], mask)]
            client.report_gap(ids, [row[m].float().tolist()
                                    for row, m in zip(old.detach().cpu(), mask.cpu())])
        return output

    @property
    def rollq_client(self) -> RollqVLLMClient:
        """The main process's client: its `generations` hold every sample's version segments."""
        return self.vllm_generation.vllm_client


class RollqWeightTransfer:
    """`weight_transfer` for TRL's experimental `AsyncGRPOTrainer`: each sync publishes the next
    registry version through `client` (a `RollqVLLMClient`); nothing is paused, since other
    trainers share the pool and each worker swaps by its own `--swap-mode`."""

    def __init__(self, client: RollqVLLMClient):
        self.client = client

    def init_weight_transfer(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.client.publish(host_copies(iterator))

    def resume(self) -> None:
        pass

    def destroy(self) -> None:
        pass
