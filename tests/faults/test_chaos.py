"""The short CI variant of `rollq chaos` (the 3-minute run is in docs/reliability.md)."""

import json
import os
import subprocess
import sys


def test_short_chaos_run_loses_and_doubles_nothing(tmp_path):
    out = tmp_path / "chaos.json"
    # 24 s: the faults run until every kind has been dealt once (seed 7: ~25 s), the publisher
    # for 24 s (a version every 5 s: 4, the asserts need 3).
    proc = subprocess.run(
        [sys.executable, "-m", "rollq", "chaos", "--minutes", "0.4", "--seed", "7", "--json", str(out)],
        capture_output=True, text=True, timeout=420, env=os.environ | {"COLUMNS": "200"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["lost"] == 0 and summary["duplicated"] == 0 and summary["quota_drift"] == 0
    # Every kind of fault happened, the trainer's included (killed; broke out of results()).
    assert set(summary["faults"]) == {"worker_sigkill", "worker_sigstop", "scorer_sigkill", "scorer_sigstop",
                                      "redis_restart", "client_kill", "trainer_sigkill", "results_break"}
    assert summary["trainer_exits"] == 0
    assert summary["delivered"] == summary["submitted_groups"] > 200
    assert sum(summary["faults"].values()) >= 5 and summary["versions_published"] >= 3
    # Scored jobs (issue 30) through killed and frozen scorers: each scored group once (counted
    # above with the rest), each `ok` one with exactly the rewards recomputed from its samples.
    assert summary["scored_delivered"] == summary["scored_groups"] > 20
    assert summary["rewards_wrong"] == 0 and summary["rewards_unchecked"] == 0
    assert summary["rewards_right"] > 20 and summary["faults"]["scorer_sigkill"] >= 1
    # Dynamic sampling (regenerated, then filtered: the requeue a renewal once took for a
    # take-over, which ended the scorer) and over-sampling (at most k ok, the job done) under
    # the same faults; no scorer ended by itself (issue 43).
    assert summary["filtered"] > 5 and summary["resampled"] > summary["filtered"]
    assert summary["oversampled_jobs"] > 2 and summary["oversampled_wrong"] == 0
    assert summary["scorer_exits"] == 0
