"""The short CI variant of `rollq chaos --weights` (a longer run is in docs/reliability.md):
publish storms with keep=1, corrupted, rewritten and truncated by-reference versions against two
vLLM workers (drain and interrupt); every token checked against transformers under its label."""

import json
import os
import subprocess
import sys

import pytest

from rollq.harness.chaos.weights import FAULTS, PROMPTS


@pytest.mark.timeout(900)  # two engines start, then the faults: ~4 min alone, longer when loaded
def test_short_weight_chaos_run_loses_nothing_and_labels_every_token_right(tmp_path):
    out = tmp_path / "chaos.json"
    env = os.environ | {"COLUMNS": "200"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # 12 s of faults (about two decks of the four; they go on until every kind has been dealt):
    # with the engine loading the published files instead of its checked copy (issue 21's bug),
    # 12 s found 85 mislabeled segments; 6 s (one `rewritten`, lost the race) found none.
    proc = subprocess.run(
        [sys.executable, "-m", "rollq", "chaos", "--weights", "--minutes", "0.2", "--seed", "7",
         "--json", str(out)], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())
    assert s["lost"] == 0 and s["duplicated"] == 0 and s["delivered"] == s["submitted_groups"] > 50
    assert s["statuses"] == {"ok": s["delivered"]}
    assert s["mislabeled"] == 0 and s["nonfinite_logprobs"] == 0 and s["evidence"] == []
    assert s["samples"] == s["delivered"] and s["segments"] >= s["samples"]
    # The check can see a mislabel: the weight sets continue the prompts differently.
    assert s["distinguishable_prompts"] >= len(PROMPTS) - 2
    # Every kind of fault happened, and they bit: damaged versions were refused, the others
    # served (both workers swapped many times), and the followers still reached the last one.
    # Each kind dealt at least once publishes: storm 3, the six others 1 each; then the final
    # version. (This short run may deal each only once: exactly 10.)
    # Pushes and canaries (issues 40, 41): pushed 1, push_cut 1, canary_wrong 1 more.
    assert set(FAULTS) <= set(s["faults"]) and s["versions_published"] >= 3 + 1 + 1 + 1 + 3 + 1
    assert sum(s["refusals"].values()) >= 1
    # Every worker took the pushed version by its push, and refused the wrong canary's version.
    assert all(n >= 1 for n in s["pushes"].values()) and len(s["pushes"]) == 2, s["pushes"]
    assert all(n >= 1 for n in s["canary_refusals"].values()), s["canary_refusals"]
    # What every worker must have served, however the races fell: the storm's last version (the
    # faults are paced, so no worker skips it) and the final one. Refused damage, a rewrite a
    # worker copied too late and a racing corruption may each add a refusal instead of a swap.
    assert all(swaps >= 2 for swaps in s["swaps"].values()) and len(s["swaps"]) == 2
    assert s["final_version_reached"] and s["workers_alive"] == 2 and s["exit_codes"] == [0, 0]
