"""Settings, validated once at the edge (CLI flags, environment); narrow values go downward."""

from __future__ import annotations

import dataclasses
import os
import socket
import uuid
from pathlib import Path
from typing import Any, Literal

import msgspec

from rollq.canary import Tolerance
from rollq.engine.pushes import PUSH_TIMEOUT_S
from rollq.protocol import MAX_VERSION, InvalidInput, SwapMode, check_id
from rollq.queue.connection import DEFAULT_URL


def default_weight_store() -> str:
    """Where published weight copies go unless told: `ROLLQ_WEIGHT_STORE`, else the user's cache."""
    return os.environ.get("ROLLQ_WEIGHT_STORE", str(Path.home() / ".cache" / "rollq" / "weights"))


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


DEFAULT_MAX_INFLIGHT = 32
"""Groups in flight without `max_inflight` and without an engine's sequence budget."""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a settings class (the CLI's help texts)."""
    import ast
    import inspect

    body = ast.parse(inspect.getsource(cls)).body[0].body
    docs = {}
    for field, doc in zip(body, body[1:]):
        if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)):
            docs[field.target.id] = " ".join(doc.value.value.split())
    return docs


class WorkerSettings(msgspec.Struct, kw_only=True):
    redis_url: str = DEFAULT_URL
    """Redis to serve from (`redis://`, `rediss://` for TLS, user:password@ for ACL)."""
    policy: str = "default"
    """The policy whose queue this worker serves."""
    worker_id: str = msgspec.field(default_factory=default_worker_id)
    """Consumer name in the work streams; unique per process so leases are fenced."""
    engine: Literal["instant", "vllm"] = "instant"
    """`vllm` generates; `instant` returns deterministic tokens at once (load tests only)."""
    max_inflight: int | None = None
    """Groups running on the engine at once [default: 32; vllm: --max-num-seqs]."""
    lease_s: float = 30.0
    """A held group not renewed for this long may be taken over by another worker."""
    max_deliveries: int = 3
    """Deliveries of a group before it is dead-lettered with a `failed` result."""
    grace_s: float = 30.0
    """On SIGTERM: time for in-flight groups to finish before they are handed back."""
    poll_s: float = 1.0
    """Longest a blocked read waits before looking for new trainers."""
    job_ttl_s: int = 86_400
    """How long a finished job's record stays for `status` (and idempotent submit)."""
    instant_delay_s: float = 0.0
    """InstantEngine only: seconds each group takes."""
    swap_mode: SwapMode = "drain"
    """How to swap to a new version: finish running groups first, cut and continue them, or
    keep them with their KV cache (jobs that do not accept the mode are drained)."""
    pin_version: int | None = None
    """Serve this version only (e.g. to evaluate a checkpoint); never follow the registry."""
    base_version: int = 0
    """The version of the weights the engine starts with (the model directory's)."""
    metrics_port: int | None = None
    """Serve Prometheus `/metrics` on this port, bound before the engine starts (0: any free port,
    logged; None: no metrics server)."""
    require_durable: bool = False
    """Refuse to start on a Redis that may lose acknowledged work (no AOF, evicting policy)."""
    metrics_host: str = "127.0.0.1"
    """The address `/metrics` binds to."""
    canary_refusal: Literal["previous", "none"] = "previous"
    """After its canary refuses a version: serve the previous version on, or serve none (claim
    nothing, hand back what waits) until a later version is accepted."""
    canary_tolerance: str | None = None
    """Largest figures a version's canary may show and still serve: `MAX,MEAN,KL` (max and
    mean |Δ logprob|, k3 KL) [default: by dtype, float32 1e-4,1e-5,1e-9; bf16/fp16 0.1,0.01,1e-4;
    a publish may override it]."""
    push_timeout_s: float = PUSH_TIMEOUT_S
    """Longest a pushed version's bytes may take to be read and checked (engines started with a
    rollq weight-transfer backend): past it the push is refused, nothing loaded, and the worker
    loads the version's files instead."""

    def tolerance(self) -> Tolerance | None:
        """`canary_tolerance` parsed (None: the dtype's defaults)."""
        if self.canary_tolerance is None:
            return None
        parts = self.canary_tolerance.split(",")
        try:
            values = [float(p) for p in parts]
        except ValueError:
            values = []
        if len(values) != 3 or not all(0 <= v < float("inf") for v in values):
            raise InvalidInput("canary_tolerance", f"{self.canary_tolerance!r}: give three "
                               "finite numbers >= 0, MAX,MEAN,KL (e.g. 1e-4,1e-5,1e-9)")
        return Tolerance(*values)

    def validate(self) -> WorkerSettings:
        check_id("policy", self.policy)
        self.tolerance()
        check_id("worker_id", self.worker_id)
        limits = {
            "max_inflight": (self.max_inflight or 1, 1, 100_000),
            "lease_s": (self.lease_s, 0.5, 3600),
            "max_deliveries": (self.max_deliveries, 1, 1000),
            "grace_s": (self.grace_s, 0, 86_400),
            "poll_s": (self.poll_s, 0.01, 60),
            "job_ttl_s": (self.job_ttl_s, 1, 365 * 86_400),
            "instant_delay_s": (self.instant_delay_s, 0, 3600),
            "base_version": (self.base_version, 0, MAX_VERSION - 1),
            "pin_version": (0 if self.pin_version is None else self.pin_version, 0, MAX_VERSION - 1),
            "metrics_port": (0 if self.metrics_port is None else self.metrics_port, 0, 65_535),
            "push_timeout_s": (self.push_timeout_s, 0.01, 86_400),
        }
        for name, (value, lo, hi) in limits.items():
            if not lo <= value <= hi:
                raise InvalidInput(name, f"{name}={value} is out of range [{lo}, {hi}]")
        return self


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class VLLMSettings(msgspec.Struct, kw_only=True):
    """How a worker builds its vLLM engine (`AsyncEngineArgs`)."""

    model: str
    """Local directory of the policy's weights (config.json + safetensors). Never downloaded."""
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    """Sequences the engine runs at once; the worker admits groups until their n fill it."""
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    seed: int = 0
    enable_prefix_caching: bool = True
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """`processed`: logprobs of the distribution tokens were sampled from (after temperature,
    top-k/top-p), i.e. the behaviour policy; `raw`: of the model's unmodified logits."""
    enable_lora: bool = False
    """Serve adapter (LoRA) versions beside each other, without swaps (vLLM's `enable_lora`)."""
    max_loras: int = 3
    """Adapter versions the engine runs in one batch; the worker keeps this many loaded."""
    max_lora_rank: int = 16
    """The largest adapter rank served; an adapter version of a higher rank is refused."""
    enable_auto_tool_choice: bool = False
    """As `vllm serve --enable-auto-tool-choice`: chat tool calls parsed for tool_choice "auto"
    (and absent with tools); needs --tool-call-parser."""
    tool_call_parser: str | None = None
    """As `vllm serve --tool-call-parser NAME` (hermes, pythonic, llama3_json, ...): the vLLM
    parser that turns a chat sample's text into `tool_calls`, on the worker."""
    reasoning_parser: str | None = None
    """As `vllm serve --reasoning-parser NAME`: a chat sample's thinking goes to `reasoning`."""
    engine_args: dict[str, Any] = {}
    """Any other `AsyncEngineArgs` field, passed through."""

    def validate(self) -> VLLMSettings:
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise InvalidInput("model", f"{self.model!r} is not a model directory with config.json "
                                        "(rollq never downloads models)")
        if self.max_model_len is not None and not 1 <= self.max_model_len <= 10_000_000:
            raise InvalidInput("max_model_len", f"max_model_len={self.max_model_len} is out of range")
        if not 1 <= self.max_num_seqs <= 65_536:
            raise InvalidInput("max_num_seqs", f"max_num_seqs={self.max_num_seqs} is out of range [1, 65536]")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidInput("gpu_memory_utilization", "must be in (0, 1]")
        if not 1 <= self.tensor_parallel_size <= 1024:
            raise InvalidInput("tensor_parallel_size", "must be between 1 and 1024")
        if not 1 <= self.max_loras <= 256:
            raise InvalidInput("max_loras", f"max_loras={self.max_loras} is out of range [1, 256]")
        if self.max_lora_rank not in _LORA_RANKS:
            raise InvalidInput("max_lora_rank", f"max_lora_rank={self.max_lora_rank} must be one of "
                                                f"{_LORA_RANKS} (vLLM's choices)")
        self._validate_parsers()
        from vllm import AsyncEngineArgs

        known = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        for name in self.engine_args:
            if name not in known:
                raise InvalidInput(f"engine_args.{name}", "is not a field of vLLM's AsyncEngineArgs")
        return self

    def _validate_parsers(self) -> None:
        """vLLM's own startup checks of the parser flags, before the engine starts."""
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise InvalidInput("enable_auto_tool_choice", "--enable-auto-tool-choice needs "
                                                          "--tool-call-parser NAME (as vllm serve)")
        if self.tool_call_parser:
            from vllm.tool_parsers import ToolParserManager

            names = sorted(ToolParserManager.list_registered())
            if self.tool_call_parser not in names:
                raise InvalidInput("tool_call_parser", f"{self.tool_call_parser!r} is not one of "
                                                       f"vLLM's tool parsers: {', '.join(names)}")
        if self.reasoning_parser:
            from vllm.reasoning import ReasoningParserManager

            names = sorted(ReasoningParserManager.list_registered())
            if self.reasoning_parser not in names:
                raise InvalidInput("reasoning_parser", f"{self.reasoning_parser!r} is not one of "
                                                       f"vLLM's reasoning parsers: {', '.join(names)}")

    def engine_kwargs(self) -> dict[str, Any]:
        has_tokenizer = any(os.path.exists(os.path.join(self.model, f))
                            for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
        return dict(
            model=self.model, dtype=self.dtype, max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs, gpu_memory_utilization=self.gpu_memory_utilization,
            tensor_parallel_size=self.tensor_parallel_size, enforce_eager=self.enforce_eager,
            seed=self.seed, enable_prefix_caching=self.enable_prefix_caching,
            logprobs_mode=self.logprobs_mode, skip_tokenizer_init=not has_tokenizer,
        ) | (dict(reasoning_parser=self.reasoning_parser) if self.reasoning_parser else {}) \
          | (dict(enable_lora=True, max_loras=self.max_loras, max_lora_rank=self.max_lora_rank)
             if self.enable_lora else {}) | self.engine_args


class GatewaySettings(msgspec.Struct, kw_only=True):
    redis_url: str = DEFAULT_URL
    """Redis to serve from (`redis://`, `rediss://` for TLS, user:password@ for ACL)."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 8000
    """Port to listen on (0: any free one)."""
    tokens: str | None = None
    """JSON file of bearer tokens → (trainer, policies); see gateway/auth.py."""
    no_auth: bool = False
    """Every request is the trainer `anonymous` with every policy. Loopback use only."""
    public_observe: bool = False
    """Serve /metrics and the dashboard's data without a token (they name every trainer and show
    failure reasons; default: a token with the 'observe' scope)."""
    policies: list[str] = []
    """Show and serve only these policies (default: every policy found in Redis)."""
    gateway_id: str = "gateway"
    """Names this gateway's completions trainers; give each of several gateways its own."""
    weight_store: str = msgspec.field(default_factory=default_weight_store)
    weight_roots: list[Path] = []
    """Directories whose `<root>/<policy>/` subtree that policy may publish by path (default: the
    weight store, so `<store>/<policy>/`); another policy's store subtree is always refused."""
    tokenizer: str | None = None
    """A local tokenizer directory: text prompts are tokenized here and completions get text."""
    max_body_bytes: int = 64 * 1024 * 1024
    """A request body larger than this is refused (413)."""
    body_bytes_in_flight: int | None = None
    """Bytes of request bodies read and handled at once (default: 4 x max_body_bytes); others
    wait for room (a 503 after body_timeout_s). One 16 MiB submit costs ~140 MiB while decoded."""
    max_outstanding: int = 65_536
    """Quota of unfinished groups per trainer submitting through the gateway."""
    max_outstanding_bytes: int = 1024**3
    """Quota on the bytes of prompts (encoded work items) a trainer has waiting in Redis."""
    max_image_bytes: int = 1024**3
    """Budget on the bytes of the distinct images a trainer keeps stored in Redis (each until a
    week after the last submit naming it)."""
    max_conversation_bytes: int | None = None
    """Budget on the bytes of a trainer's agent-conversation records (X-Rollq-Conversation), each
    until an hour after its last turn (default: max_outstanding_bytes)."""
    require_durable: bool = False
    """Refuse to start on a Redis that may lose acknowledged work (no AOF, evicting policy)."""
    header_timeout_s: float = 15.0
    """A connection that has not sent a whole request head (or the next one, kept alive) by then
    is closed: a slow or silent client holds a socket for this long at most."""
    body_timeout_s: float = 60.0
    """Reading a request body longer than this ends in a 408."""
    max_connections: int = 1024
    """Connections beyond this are answered 503 and closed at once."""
    trust_request_chat_template: bool = False
    """Let chat requests bring their own Jinja `chat_template` (vLLM's flag of the same name): a
    template runs on the workers, and a slow one takes their CPU until vLLM's render timeout."""
    return_tokens_as_token_ids: bool = False
    """Name each token of a reply's logprobs `token_id:N` (vLLM's server flag of the same name):
    the default of chat and completion requests that leave `return_tokens_as_token_ids` out (a
    request's true or false wins), and on `/inference/v1/generate` a `token` of that form beside
    each `token_id` (verifiers' `renderers` client reads it there)."""
    max_reply_bytes: int = 16 * 1024 * 1024
    """A batch of results stops at this many bytes encoded (it has at least one result); the
    stream reads as few results at a time. One trainer's `count=1024` of big groups would
    otherwise be held in the gateway's memory at once."""

    def validate(self) -> GatewaySettings:
        if self.tokens is None and not self.no_auth:
            raise InvalidInput("tokens", "give a token file (--tokens FILE) or run with --no-auth")
        if self.tokens is not None and self.no_auth:
            raise InvalidInput("tokens", "--tokens and --no-auth exclude each other")
        for name in self.policies:
            check_id("policy", name)
        check_id("gateway_id", self.gateway_id)
        if not 0 <= self.port <= 65_535:
            raise InvalidInput("port", f"port={self.port} is out of range [0, 65535]")
        if not 1024 <= self.max_body_bytes <= 2**31:
            raise InvalidInput("max_body_bytes", f"{self.max_body_bytes} is out of range [1024, 2**31]")
        if self.max_conversation_bytes is None:
            self.max_conversation_bytes = self.max_outstanding_bytes
        for name, lo, hi in (("header_timeout_s", 0.1, 3600), ("body_timeout_s", 0.1, 3600),
                             ("max_connections", 1, 1_000_000), ("max_reply_bytes", 1024, 2**31),
                             ("max_image_bytes", 1024, 2**40),
                             ("max_conversation_bytes", 1024, 2**40)):
            if not lo <= getattr(self, name) <= hi:
                raise InvalidInput(name, f"{name}={getattr(self, name)} is out of range [{lo}, {hi}]")
        if self.body_bytes_in_flight is not None and not \
                self.max_body_bytes <= self.body_bytes_in_flight <= 2**40:
            raise InvalidInput("body_bytes_in_flight", f"{self.body_bytes_in_flight} is out of range "
                                                       f"[max_body_bytes={self.max_body_bytes}, 2**40]")
        self.weight_roots = [Path(p).resolve() for p in (self.weight_roots or [self.weight_store])]
        return self
