"""`rollq demo --task tools`: GRPO over multi-turn tool-use episodes (`examples/tool_agent.py`) on
a tiny model made here, with a private redis-server and one vLLM worker (nothing is downloaded).

Prints each step's reward and the version that served its episodes, and writes
`<out>/tools.json`. The CLI flag is wired in `rollq/cli.py` (`demo --task tools`); this module
runs it: `python -m rollq.harness.demo_tools [--steps 16] [--out demo-output]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

from rollq.harness.demo import private_redis, wait_for_worker, worker_process

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tool_agent.py"


def load_example():
    if not EXAMPLE.exists():
        raise SystemExit(f"{EXAMPLE} not found: run `rollq demo --task tools` from a checkout of rollq")
    sys.path.insert(0, str(EXAMPLE.parent))  # it imports async_grpo, its neighbour
    spec = importlib.util.spec_from_file_location("tool_agent", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


async def tools_demo(steps: int = 16, out_dir: str = "demo-output", redis_url: str | None = None,
                     groups: int = 8, n: int = 8) -> list[dict]:
    import torch

    from rollq import RolloutClient

    example = load_example()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    policy = f"tools-{int(time.time())}"
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        url = redis_url or stack.enter_context(private_redis(work))
        model = example.make_model(work / "model")
        # The worker on core 0 (as `rollq demo`), the trainer wherever the OS puts it.
        proc = stack.enter_context(worker_process(url, policy, model, out / "tools-worker.log", "0"))
        print(f"starting a vLLM worker (log: {out / 'tools-worker.log'}) ...", flush=True)
        await wait_for_worker(url, policy, proc, 600, out / "tools-worker.log")
        async with RolloutClient(url, policy=policy, trainer_id="tool-agent",
                                 weight_store=str(work / "store")) as client:
            stats = await example.train(
                client, example.EpisodeTrainer(model), steps=steps, groups=groups, n=n,
                on_step=lambda s: print(f"step {s.step:3d}: reward {s.reward:.3f}, episodes served "
                                        f"by version {sorted(s.versions)}, {s.wall_s:.1f} s", flush=True))
    rows = [{"step": s.step, "reward": s.reward, "wall_s": s.wall_s, "versions": sorted(s.versions)}
            for s in stats]
    (out / "tools.json").write_text(json.dumps(rows, indent=1))
    print(f"reward {rows[0]['reward']:.3f} -> {rows[-1]['reward']:.3f} in {rows[-1]['wall_s']:.0f} s "
          f"({groups} groups of {n} episodes per step); {out / 'tools.json'}")
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", default="demo-output")
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()
    asyncio.run(tools_demo(args.steps, args.out, args.redis_url))
