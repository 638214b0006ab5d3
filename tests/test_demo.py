"""A short `rollq demo` (a few steps) end to end: private Redis, vLLM workers, both runs."""

import json
import os
import subprocess
import sys

from rollq.faults import free_port


def test_short_demo_runs_and_keeps_staleness_within_bound(tmp_path):
    out = tmp_path / "demo"
    port = free_port()
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

