"""A short `rollq demo` (a few steps) end to end: private Redis, vLLM workers, both runs."""

import json
import os
import random
import re
import socket
import subprocess
import sys

from rollq.harness import demo_rewards
from rollq.harness.demo import _port, load_example
from rollq.harness.faults import reserved_port


def test_the_scorers_reward_is_the_examples():
    """The scorer's `even` (rollq/harness/demo_rewards.py) is the reward the example's trainer
    computes itself; its long-tailed twin waits 0-2 s, as long for the same tokens."""
    example, rng = load_example(), random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(example.VOCAB) for _ in range(rng.randrange(0, 40))]
        assert demo_rewards.even_share(tokens) == example.reward([], tokens)
        assert 0 <= demo_rewards.tail_s(tokens) == demo_rewards.tail_s(list(tokens)) <= demo_rewards.TAIL_S


def test_gateway_port_probe_takes_a_reserved_port_and_skips_a_listening_one():
    # A reserved port sits in TIME_WAIT: a probe without SO_REUSEADDR would call it taken.
    port = reserved_port()
    assert _port(port) == port
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        taken = listener.getsockname()[1]
        assert _port(taken) not in (taken, 0)


def test_short_demo_runs_and_keeps_staleness_within_bound(tmp_path):
    out = tmp_path / "demo"
    # Reserved: the demo's gateway binds it only after the demo's imports and its redis-server.
    port = reserved_port()
    proc = subprocess.run(
        [sys.executable, "-m", "rollq", "demo", "--steps", "3", "--groups", "4", "--n", "4",
         "--staleness", "2", "--out", str(out), "--port", str(port)],
        capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if k != "REDIS_URL"} | {"COLUMNS": "160"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "wall time of 3 steps, async / sync" in proc.stdout
    for mode in ("sync", "async"):  # rewards by each run's `rollq scorer`, none by the trainer
        assert f"{mode} rewards: computed by its `rollq scorer`" in proc.stdout
        assert "offers even (v1)" in (out / f"scorer-{mode}.log").read_text()
    assert f"dashboard (live during the runs): http://127.0.0.1:{port}/" in proc.stdout
    assert "gateway on http://127.0.0.1" in (out / "gateway.log").read_text()
    runs = json.loads((out / "runs.json").read_text())
    assert [len(runs[m]) for m in ("sync", "async")] == [3, 3]
    for mode, bound in (("sync", 0), ("async", 2)):
        for step in runs[mode]:
            assert max(int(s) for s in step["staleness"]) <= bound, (mode, step)
            assert 0.0 <= step["reward"] <= 1.0
            assert step["reward_s"] == 0.0
    # Asynchronous for real: a batch submitted before an update is trained on after it.
    assert any(int(k) >= 1 for step in runs["async"] for k in step["staleness"]), runs["async"]
    assert (out / "reward.png").stat().st_size > 0
    # The bars' clocks and the table agree on each run's wall time: a bar's clock runs while its
    # trainer trains (not while its worker starts) and shows whole seconds.
    bars = {m: int(h) * 3600 + int(mi) * 60 + int(sec) for m, h, mi, sec in re.findall(
        r"^(sync|async) +step .* (\d+):(\d\d):(\d\d)\s*$", proc.stdout, re.MULTILINE)}
    table = dict(re.findall(r"^. (sync|async) +. [^\n]*?. ([\d.]+) s ", proc.stdout, re.MULTILINE))
    assert bars.keys() == table.keys() == {"sync", "async"}, proc.stdout[-3000:]
    for mode in ("sync", "async"):
        assert 0 <= float(table[mode]) - bars[mode] < 1.5, (mode, bars, table, proc.stdout[-3000:])

