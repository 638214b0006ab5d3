"""bench/gpu_check.py on a machine without a GPU (this one, and CI): it must fail loudly, exit 2 and
say so, before any heavy work. Its GPU part never runs here: CUDA_VISIBLE_DEVICES is emptied, so
even a CI box that had a GPU would take the no-GPU path."""

import os
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"


def test_without_a_gpu_it_exits_2_and_says_so_before_any_heavy_work(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    began = time.monotonic()
    # The default size (4 GiB): the GPU check comes before any of it is allocated or written.
    args = ["--dir", str(tmp_path), "--json", str(tmp_path / "r.json")]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True,
                          timeout=60)
    took = time.monotonic() - began
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "no CUDA GPU" in proc.stderr and "torch.cuda.is_available() is False" in proc.stderr
    assert "nothing was measured" in proc.stderr
    assert proc.stdout == ""  # no table: nothing measured must not look like a result
    assert list(tmp_path.iterdir()) == []  # no checkpoint file, no JSON
    print(f"gpu_check without a GPU: exit 2 in {took:.1f} s")
