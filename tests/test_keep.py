"""Swap mode `keep` without an engine: which running groups may cross which swap, the job's
`swap_modes` on the wire and through the gateway, and the finite-weights check of keep swaps
(the swaps themselves run on vLLM in test_swaps_vllm.py)."""

import msgspec
import pytest
import torch
from safetensors.torch import save_file

from rollq.gateway.completions import CompletionRequest, sampling_of
from rollq.protocol import InvalidInput, Sampling, WorkItem, decode_item, encode, sampling_from_dict
from rollq.registry.safetensors_check import WeightError
from rollq.registry.snapshots import check_finite
from rollq.engine.vllm import VLLMEngine
from rollq.worker.windows import interruptible, keepable


def _item(max_version=None, **sampling) -> WorkItem:
    return WorkItem("job", 0, b"\x01\x00\x00\x00", 1, Sampling(**sampling), 0.0, max_version=max_version)


def test_a_job_crosses_only_the_swaps_it_accepts():
    default = _item()
    assert Sampling().swap_modes == ("drain", "interrupt")  # exact unless the job says otherwise
    assert interruptible(default, 2, VLLMEngine) and not keepable(default, 2)
    keeps = _item(swap_modes=("keep",))
    assert keepable(keeps, 2) and not interruptible(keeps, 2, VLLMEngine)
    assert not keepable(_item(swap_modes=("keep",), max_version=1), 2)  # window first
    # A seed, a regex or penalties cannot be continued exactly, but a kept request is not cut.
    assert keepable(_item(swap_modes=("keep",), seed=3, regex="a+"), 2)
    only_drain = _item(swap_modes=("drain",))
    assert not interruptible(only_drain, 2, VLLMEngine) and not keepable(only_drain, 2)


def test_swap_modes_travel_and_bad_ones_are_named():
    item = _item(swap_modes=("interrupt", "keep"))
    assert decode_item(encode(item)).sampling.swap_modes == ("interrupt", "keep")
    assert decode_item(encode(_item())).sampling.swap_modes == ("drain", "interrupt")
    with pytest.raises(InvalidInput, match=r"sampling\.swap_modes"):
        sampling_from_dict({"swap_modes": ["kept"]})
    raw = msgspec.msgpack.decode(encode(item))
    raw[4][Sampling.__struct_fields__.index("swap_modes")] = ["sometimes"]  # on the wire
    with pytest.raises(InvalidInput, match=r"swap_modes"):
        decode_item(msgspec.msgpack.encode(raw))
    # The gateway's OpenAI routes pass it on.
    req = msgspec.json.decode(b'{"model": "p", "prompt": "x", "swap_modes": ["keep"]}',
                              type=CompletionRequest)
    assert sampling_of(req).swap_modes == ("keep",)
    with pytest.raises(msgspec.ValidationError, match="swap_modes"):
        msgspec.json.decode(b'{"model": "p", "prompt": "x", "swap_modes": ["all"]}', type=CompletionRequest)


def test_keep_swaps_refuse_non_finite_weights(tmp_path):
    save_file({"a": torch.ones(3), "b": torch.tensor([1.0, float("nan")]),
               "i": torch.ones(2, dtype=torch.int64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightError, match="'b' holds NaN"):
        check_finite(tmp_path)
    save_file({"a": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    check_finite(tmp_path)
