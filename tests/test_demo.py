"""A short `rollq demo` (a few steps) end to end: private Redis, vLLM workers, both runs."""

import json
import os
import re
import socket
import subprocess
import sys

from rollq.harness.demo import _port
from rollq.harness.faults import reserved_port


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
        [sys.executable, "-m", "rollq", "demo", "--steps", "4", "--groups", "6", "--n", "4",
         "--staleness", "2", "--out", str(out), "--port", str(port)],
        capture_output=True, text=True, timeout=600,
        env={k: v for k, v in os.environ.items() if k != "REDIS_URL"} | {"COLUMNS": "160"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "wall time of 4 steps, async / sync" in proc.stdout
    assert f"dashboard (live during the runs): http://127.0.0.1:{port}/" in proc.stdout
    assert "gateway on http://127.0.0.1" in (out / "gateway.log").read_text()
    runs = json.loads((out / "runs.json").read_text())
    assert [len(runs[m]) for m in ("sync", "async")] == [4, 4]
    for mode, bound in (("sync", 0), ("async", 2)):
        for step in runs[mode]:
            assert max(int(s) for s in step["staleness"]) <= bound, (mode, step)
            assert 0.0 <= step["reward"] <= 1.0
    assert (out / "reward.png").stat().st_size > 0
    # The bars' clocks and the table agree on each run's wall time: a bar's clock runs while its
    # trainer trains (not while its worker starts) and shows whole seconds.
    bars = {m: int(h) * 3600 + int(mi) * 60 + int(sec) for m, h, mi, sec in re.findall(
        r"^(sync|async) +step .* (\d+):(\d\d):(\d\d)\s*$", proc.stdout, re.MULTILINE)}
    table = dict(re.findall(r"^. (sync|async) +. [^\n]*?. ([\d.]+) s ", proc.stdout, re.MULTILINE))
    assert bars.keys() == table.keys() == {"sync", "async"}, proc.stdout[-3000:]
    for mode in ("sync", "async"):
        assert 0 <= float(table[mode]) - bars[mode] < 1.5, (mode, bars, table, proc.stdout[-3000:])

