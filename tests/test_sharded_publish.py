"""Publishing from a sharded trainer (issue 16): an FSDP2 model on two gloo ranks (CPU), every
rank calls `publish_weights` as it would call any collective, with no gather code of its own;
rank 0 publishes the full tensors and the other rank gets None."""

import asyncio
import json
import multiprocessing
import os
import socket
from pathlib import Path

import torch
from safetensors.torch import load_file

from rollq import RolloutClient

WORLD = 2


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def step(model) -> None:
    """One optimizer step, so that version 2 differs from version 1."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.arange(8).unsqueeze(0), labels=torch.arange(8).unsqueeze(0)).loss.backward()
    optimizer.step()


def rank_main(rank: int, port: int, redis_url: str, policy: str, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = tiny_llama()
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    async def publish() -> list:
        client = RolloutClient(redis_url, trainer_id=f"rank{rank}", policy=policy, weight_store=store)
        try:
            first = await client.publish_weights(1, model)
            step(model)
            second = await client.publish_weights(2, model, wait=False)
            if second is not None:
                second = await second
            return [None if e is None else e.path for e in (first, second)]
        finally:
            await client.close()

    paths = asyncio.run(publish())
    Path(out, f"rank{rank}.json").write_text(json.dumps(paths))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp2_ranks_publish_one_full_version(redis_url, policy, tmp_path):
    spawn = multiprocessing.get_context("spawn")
    port, store = free_port(), str(tmp_path / "store")
    ranks = [spawn.Process(target=rank_main, args=(r, port, redis_url, policy, store, str(tmp_path)))
             for r in range(WORLD)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(180)
        assert p.exitcode == 0, f"rank exited {p.exitcode}"
    paths = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert paths[1] == [None, None] and None not in paths[0]

    reference = tiny_llama()  # the same weights, unsharded
    expected = {1: {k: v.clone() for k, v in reference.state_dict().items()}}
    step(reference)  # the same step on the full model
    expected[2] = reference.state_dict()
    for version, path in zip((1, 2), paths[0]):
        stored = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            stored |= load_file(str(f))
        assert set(stored) == set(expected[version]), f"version {version}: names"
        for name, tensor in expected[version].items():
            torch.testing.assert_close(stored[name], tensor, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name, v=version: f"version {v} {n}: {m}")
