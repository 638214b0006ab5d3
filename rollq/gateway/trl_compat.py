"""The vLLM server endpoints TRL's `VLLMClient` calls beside the OpenAI ones, answered for a pool.

A vLLM server is one engine; a rollq policy is a queue served by any number of workers, each of
which swaps weights by itself when a version is published. So:

- `/get_world_size`: the policy's live workers (vLLM: tensor x data parallel ranks). TRL reads it
  only to size its NCCL group.
- `/reset_prefix_cache`: a no-op that says so: every worker resets its prefix cache when it swaps
  to a new version, which is the only time TRL asks for it.
- `/server_info`: the few parts of vLLM's `VllmConfig` that TRL reads (`weight_transfer_config`,
  `model_config.logprobs_mode`, `lora_config`, `parallel_config.data_parallel_size`), plus a
  `rollq` section (policy, newest version, workers).
- the NCCL weight-transfer endpoints, `/pause`, `/resume` and `/v1/load_lora_adapter`: a 400
  that says to publish through rollq's registry (`rollq.integrations.trl` does it for TRL). A
  pool shared by several trainers cannot be paused by one of them, and weights reach workers
  as registry versions, never as a broadcast from the trainer. (400 rather than 501: the
  gateway answers no request with a 5xx of its own making.)

Which policy: `?model=P`, else the token's one policy (or, without auth, the one policy in Redis).
"""

from __future__ import annotations

from aiohttp import web

from rollq.gateway.auth import allowed
from rollq.gateway.http import ApiError
from rollq.gateway.state import GATEWAY
from rollq.queue.keys import Keys
from rollq.registry.versions import Registry
from rollq.status import policies
from rollq.queue.workers import live_workers

WORKER_LOGPROBS_MODE = "processed_logprobs"
"""`rollq worker --logprobs-mode`'s default, reported as the pool's: workers do not report theirs."""

PUBLISH_INSTEAD = (
    "rollq's gateway takes no weights over NCCL and cannot pause a pool other trainers share: "
    "publish each new policy version through rollq's registry instead "
    "(RolloutClient.publish_weights(version, model), or POST /v1/policies/{policy}/versions with a "
    "directory under a weight root); every worker verifies and swaps to it by itself. With TRL's "
    "GRPOTrainer, rollq.integrations.trl does this for you (see the README, 'From TRL').")

NCCL_PATHS = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
              "/finish_weight_update", "/init_communicator", "/update_named_param", "/close_communicator",
              "/pause", "/resume", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
"""What TRL 1.16's `VLLMClient` (and its experimental async GRPO client) would call to push
weights or pause the server, and older TRLs' `trl vllm-serve` names."""


async def _policy(request: web.Request) -> str:
    return await policy_of(request, request.query.get("model"))


async def policy_of(request: web.Request, model: str | None) -> str:
    """`model` checked against the caller's token, else the one policy the token may use."""
    gw = request.app[GATEWAY]
    who = gw.tokens.principal(request)
    if model:
        return allowed(who, model)
    if "*" not in who.policies and len(who.policies) == 1:
        return allowed(who, who.policies[0])
    usable = [p for p in (gw.settings.policies or await policies(gw.redis)) if who.may_use(p)]
    if len(usable) != 1:
        raise ApiError(400, f"this token may use {len(usable)} policies here ({', '.join(usable[:8])}): "
                            "name one with ?model=POLICY (in a body: model)", "model")
    return usable[0]


async def world_size(request: web.Request) -> web.Response:
    policy = await _policy(request)
    workers = await live_workers(request.app[GATEWAY].redis, Keys(policy))
    return web.json_response({"world_size": len(workers)})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    await _policy(request)
    return web.json_response({"success": True, "message": (
        "nothing to do: each rollq worker resets its prefix cache whenever it swaps to a new "
        "policy version")})


async def server_info(request: web.Request) -> web.Response:
    policy = await _policy(request)
    gw = request.app[GATEWAY]
    keys = Keys(policy)
    workers = await live_workers(gw.redis, keys)
    latest = await Registry(gw.redis, keys).latest()
    config = {
        "model_config": {"model": policy, "served_model_name": policy,
                         "logprobs_mode": WORKER_LOGPROBS_MODE},
        "parallel_config": {"data_parallel_size": len(workers)},
        "weight_transfer_config": None,
        "lora_config": None,
    }
    pool = {"policy": policy, "latest_version": latest,
            "workers": [{"worker_id": w.worker_id, "version": w.version, "state": w.state} for w in workers],
            "weights": "publish versions through the registry; weight_transfer_config is null because "
                       "no NCCL endpoint is served",
            "logprobs_mode": "the rollq worker's default; workers do not report their own"}
    return web.json_response({"vllm_config": config, "rollq": pool})


async def publish_instead(request: web.Request) -> web.Response:
    raise ApiError(400, f"{request.path} is not served: {PUBLISH_INSTEAD}", "endpoint")
