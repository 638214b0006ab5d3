"""A vLLM general plugin (entry point `vllm.general_plugins`), run by vLLM in each of its
processes (engine core, model workers) before a model runs.

On x86 CPUs with AMX, vLLM's CPU attention takes its AMX kernels for bfloat16, but nothing in
vLLM asks Linux for the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM), which every process
must do before its first tile instruction: the model worker died of SIGILL (exit code -4) in
its warm-up on such a machine. PyTorch's `torch.cpu._init_amx` asks for it; calling it where
AMX is absent does nothing.
"""

from __future__ import annotations


def request_amx() -> None:
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()
