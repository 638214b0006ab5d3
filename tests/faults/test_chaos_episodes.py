"""The short CI variant of `rollq chaos --episodes` (the 3-minute run is in docs/reliability.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path


def test_short_episode_chaos_run_loses_doubles_and_strands_no_turn(tmp_path):
    out, workdir = tmp_path / "chaos.json", tmp_path / "run"
    # One round of the six faults, each once: a round (its 15 s Redis outage included) outlasts
    # 18 s, and the run finishes the round it is in.
    proc = subprocess.run(
        [sys.executable, "-m", "rollq", "chaos", "--episodes", "--minutes", "0.3", "--seed", "7",
         "--json", str(out), "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=600, env=os.environ | {"COLUMNS": "200"})
    summary = json.loads(out.read_text())
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:] + _warnings(workdir)
    for count in ("lost", "doubled", "mismatched", "phantom", "changed_after_end", "stuck", "hung"):
        assert summary[count] == 0, (count, summary["evidence"])
    # Every kind of fault happened, and turns were served through the client and the gateway.
    assert set(summary["faults"]) == {"trainer_sigkill", "gateway_sigkill", "worker_sigkill",
                                      "redis_restart", "redis_outage", "client_kill"}
    assert summary["trainer_exits"] == 0
    assert set(summary["turns_by_trainer"]) == {"t0", "t1", "anonymous"}
    assert summary["turns_served"] > 100 and summary["turns_by_trainer"]["anonymous"] > 10


def _warnings(workdir: Path) -> str:
    """The gateways' and trainers' warnings and errors: a failing CI run's only trace of why."""
    logs = sorted(workdir.glob("trainer*.log")) + sorted(workdir.glob("gateway-*.log"))
    lines = [f"{log.name}: {line.strip()[:300]}" for log in logs
             for line in log.read_text(errors="replace").splitlines()
             if "WARNING" in line or "ERROR" in line]
    return "\n" + "\n".join(lines[-60:])
