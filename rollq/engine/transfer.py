"""rollq's weight-transfer engines inside vLLM: registered in vLLM's `WeightTransferEngineFactory`
in every vLLM process (`engine/vllm_plugin.py`), created by vLLM on each model rank of an engine
started with `weight_transfer_config={"backend": "rollq_shm"}`, and driven through vLLM's own
API (`AsyncLLM.start_weight_update`, `update_weights`, `finish_weight_update`), as vLLM's `ipc`
and `nccl` engines are.

`rollq_shm`: each rank reads the whole segment (`engine/pushes.py: read_checked`) into tensors of
its own and checks every fingerprint before anything reaches the model; the ranks then agree
(`_refused_anywhere`: one refusal refuses it on every rank), and only then does each begin
vLLM's layerwise reload (as vLLM's IPC engine does, with `model.load_weights`, which shards each
full tensor for its rank). So a refused push has touched no weight on any rank: the engine still
holds the version it served. A load that fails after that (vLLM itself) leaves layers half loaded, and the
engine loads its last verified files back (`VLLMEngine._load_or_restore`).

A read is bounded (`timeout_s`, the worker's `--push-timeout-s`): it runs in a daemon thread of
its own (`_Reading`), and whoever waits for it (the paused `update_weights`) stops waiting at its
deadline and refuses the push, nothing loaded. The thread is abandoned, told to stop at its next
tensor; a later push reads in a new thread, so one stuck read (a FIFO opened without O_NONBLOCK
blocked for ever) wedges neither the engine core nor later pushes.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch
from vllm.distributed.weight_transfer.base import (WeightTransferEngine, WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from rollq.engine.pushes import BACKENDS, PUSH_TIMEOUT_S, PushRefused, read_checked
from rollq.protocol import TensorDigest


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to agree on beforehand (each update names its segment); `stage`: an update's
    payload to receive and check now, in a thread of this process, while the engine still serves
    (`VLLMEngine.stage_push`); the `update_weights` of the same segment then loads what was
    staged, so the engine's pause holds only the load."""

    stage: dict | None = None


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    address: str
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    digests: list[str] = field(default_factory=list)
    finite: bool = False
    """Refuse NaN/inf weights too (a keep swap's frozen requests would sample on them)."""
    timeout_s: float = PUSH_TIMEOUT_S
    """The read and check are given up this long after they began (the push refused)."""

    def __post_init__(self):
        if not 0 < self.timeout_s < float("inf"):
            raise ValueError(f"update_info: timeout_s={self.timeout_s} must be a finite number > 0")
        if not len(self.names) == len(self.dtype_names) == len(self.shapes) == len(self.digests):
            raise ValueError("update_info: names, dtype_names, shapes and digests must have one "
                             f"entry per tensor (got {len(self.names)}, {len(self.dtype_names)}, "
                             f"{len(self.shapes)}, {len(self.digests)})")

    def tensors(self) -> list[TensorDigest]:
        return [TensorDigest(n, d, list(s), f) for n, d, s, f in
                zip(self.names, self.dtype_names, self.shapes, self.digests)]


def _empty(t: TensorDigest):
    tensor = torch.empty(t.shape, dtype=getattr(torch, t.dtype))
    return tensor, memoryview(tensor.view(-1).view(torch.uint8).numpy()).cast("B")


def _receive(info: ShmUpdateInfo, given_up) -> list[tuple[str, torch.Tensor]]:
    """The segment's tensors in memory of this process, every fingerprint checked."""
    weights = read_checked(info.address, info.tensors(), _empty, given_up)
    if info.finite:
        for name, t in weights:
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise PushRefused(f"tensor {name} holds NaN or inf")
    return weights


class _Reading:
    """One segment read and checked in a daemon thread of its own (a stuck one must not keep
    the process from exiting, as a pool's thread would), waited for until its deadline."""

    def __init__(self, info: ShmUpdateInfo):
        self.address, self.timeout_s = info.address, info.timeout_s
        self.deadline = time.monotonic() + info.timeout_s
        self.abandoned = threading.Event()
        self.future: Future = Future()
        threading.Thread(target=self._run, args=(info,), name="rollq-push-read", daemon=True).start()

    def _run(self, info: ShmUpdateInfo) -> None:
        try:  # (pread and BLAKE3 release the GIL: generation goes on beside a staged read)
            self.future.set_result(_receive(info, self.abandoned.is_set))
        except BaseException as e:  # noqa: BLE001 (handed to the waiter, which raises it)
            self.future.set_exception(e)

    def result(self) -> list[tuple[str, torch.Tensor]]:
        try:
            return self.future.result(timeout=max(0.0, self.deadline - time.monotonic()))
        except TimeoutError:
            self.abandon()
            raise PushRefused(f"push segment {self.address}: not read and checked within "
                              f"{self.timeout_s:g} s (the worker's --push-timeout-s)") from None

    def abandon(self) -> None:
        self.abandoned.set()


def _refused_anywhere(refused: bool) -> bool:
    """Every rank's verdict on its read, agreed before any rank loads: one MAX all-reduce over
    the tensor-parallel group, then the pipeline-parallel one, on their CPU (gloo) groups. Each
    rank reads and checks the segment on its own and may refuse alone (its deadline, a segment
    cut between two reads); had the others loaded, the engine would hold two versions' shards
    under one label. (One rank: nothing to agree.)"""
    from vllm.distributed.parallel_state import (get_pp_group, get_tp_group,
                                                 model_parallel_is_initialized)

    if not model_parallel_is_initialized():
        return refused
    flag = torch.tensor([int(refused)], dtype=torch.int32)
    for group in (get_tp_group(), get_pp_group()):
        if group.world_size > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group.cpu_group)
    return bool(flag.item())


class ShmTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._reloading = False
        self._staged: _Reading | None = None
        """A segment being read and checked while the engine serves."""

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        if init_info.stage is None:
            return
        self._drop_staged()
        self._staged = _Reading(ShmUpdateInfo(**init_info.stage))

    def _drop_staged(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.abandon()

    def start_weight_update(self) -> None:
        # The layerwise reload begins with the first checked chunk (receive_weights), so a push
        # refused before it leaves every layer as it was.
        self._reloading = False

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        staged = self._staged
        if staged is None or staged.address != update_info.address:
            self._drop_staged()
            staged = _Reading(update_info)
        self._staged = None
        refusal = None
        try:
            weights = staged.result()  # (a refusal or the timeout is raised here, nothing loaded yet)
        except PushRefused as e:
            refusal = e
        except Exception as e:  # noqa: BLE001 (read, not loaded: refused all the same)
            refusal = PushRefused(f"push segment {update_info.address}: {type(e).__name__}: {e}")
        if _refused_anywhere(refusal is not None):
            raise refusal or PushRefused("another rank of this engine refused the push; none loads it")
        if not self._reloading:
            initialize_layerwise_reload(self.model)
            self._reloading = True
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._drop_staged()
        if self._reloading:
            finalize_layerwise_reload(self.model, self.model_config)
            self._reloading = False

    def shutdown(self) -> None:
        self._drop_staged()


def register() -> None:
    """rollq's engines in vLLM's factory (once per process; vLLM may run its plugins again)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if BACKENDS["shm"] not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKENDS["shm"], ShmTransferEngine)
