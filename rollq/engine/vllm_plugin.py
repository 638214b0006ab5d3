"""A vLLM general plugin (entry point `vllm.general_plugins`), run by vLLM in each of its
processes (engine core, model workers) before a model runs: `prepare_process`.

1. On x86 CPUs with AMX, vLLM's CPU attention takes its AMX kernels for bfloat16, but nothing in
vLLM asks Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM), which every process
must do before its first tile instruction: the model worker died of SIGILL (exit code -4) in
its warm-up on such a machine. PyTorch's `torch.cpu._init_amx` asks for it; calling it where
AMX is absent does nothing.

2. rollq's weight-transfer engines (`engine/transfer.py`) registered in vLLM's factory: vLLM
creates an engine's transfer engine on each model rank, in that rank's process (a tensor-parallel
worker's ranks are processes of their own), so each process must know the name.
"""

from __future__ import annotations


def prepare_process() -> None:
    _request_amx()
    from rollq.engine.transfer import register

    register()


request_amx = prepare_process
"""The entry point's name in installs made before the transfer engines (until reinstalled)."""


def _request_amx() -> None:
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
