"""The weight store cleans its own leftovers (issue 43, item 7a): a `.tmp-*` of a publisher
killed inside its write (a taken spare included) and a `.trash-*` of one killed inside
retention's delete go with the next write, or after a failed one; never while their writer lives."""

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rollq.registry import store as store_module
from rollq.registry.staging import Staging
from rollq.registry.store import WeightStore

STALLED = """
import sys, time
from pathlib import Path
from rollq.registry import store
root, what, path = sys.argv[1:]

def stall(*args, **kwargs):
    print("stalled", flush=True)
    time.sleep(60)

if what == "write":  # killed inside the store's write, its file half copied
    store.copy_fd = stall
    store.WeightStore(root).copy_dir("p", 9, Path(path))
else:  # killed inside retention's delete, the version renamed to its trash
    store.shutil.rmtree = stall
    store.WeightStore(root).delete(path)
"""


def _stalled(root: Path, what: str, path: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", STALLED, str(root), what, str(path)],
                             stdout=subprocess.PIPE, text=True, env=env)
    assert child.stdout.readline() == "stalled\n"
    return child


def _leftovers(policy_dir: Path) -> list[str]:
    return sorted(p.name.split("-")[0] for p in policy_dir.iterdir()
                  if p.name.startswith((".tmp-", ".trash-")))


def _state(seed: int) -> dict:
    return {"w": torch.randn(1 << 10, 1 << 8, generator=torch.Generator().manual_seed(seed))}


def test_a_killed_writers_leftovers_go_with_the_next_write_never_a_live_ones(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(store_module, "SPARE_FROM", 1 << 20)  # 1 MiB: this test's versions
    store = WeightStore(tmp_path / "store")
    staging = Staging()
    policy_dir = tmp_path / "store" / "p"
    source = tmp_path / "source"
    source.mkdir()
    save_file(_state(0), source / "model.safetensors")
    v1, _ = store.write_image("p", 1, staging.pack(_state(1)))
    store.delete(v1)  # the spare, which the stalled writer takes
    v2, _ = store.write_image("p", 2, staging.pack(_state(2)))
    v3, _ = store.write_image("p", 3, staging.pack(_state(3)))
    writer = _stalled(tmp_path / "store", "write", source)
    deleter = _stalled(tmp_path / "store", "delete", v3)
    try:
        assert not list(policy_dir.glob(".spare-*"))  # taken by the writer
        assert _leftovers(policy_dir) == [".tmp", ".trash"]
        store.write_image("p", 4, staging.pack(_state(4)))  # both writers live: nothing removed
        store.delete(v2)
        assert _leftovers(policy_dir) == [".tmp", ".trash"]
    finally:
        for child in (writer, deleter):
            child.send_signal(signal.SIGKILL)
            child.wait()
            child.stdout.close()
    with caplog.at_level(logging.WARNING, "rollq.registry"):
        store.write_image("p", 5, staging.pack(_state(5)))
    assert _leftovers(policy_dir) == []
    assert "left by a writer that was killed" in caplog.text
    assert sorted(p.name[:11] for p in policy_dir.iterdir() if not p.name.startswith(".spare-")) == [
        "v0000000004", "v0000000005"]


def test_a_failed_write_removes_its_own_and_earlier_leftovers(tmp_path):
    store = WeightStore(tmp_path / "store")
    policy_dir = tmp_path / "store" / "p"
    store.write_image("p", 1, Staging().pack(_state(1)))

    def fill(tmp: Path):
        (tmp / "model.safetensors").write_bytes(b"half")
        (policy_dir / ".trash-v0000000000-dead").mkdir()  # a deleter killed meanwhile
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store._write("p", 2, fill)
    assert _leftovers(policy_dir) == []
