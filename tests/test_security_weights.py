"""Issue 20: weights that try to escape the weight roots or attack the header validator, and ids
that try to escape the store. Real files, real redis-server (the registry), no mocks."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from rollq.protocol import InvalidInput, check_id
from rollq.registry.safetensors_check import MAX_HEADER_BYTES, WeightError, check_header
from rollq.registry.store import WeightStore, digest_dir, digest_file, verify

TENSORS = {"w": torch.arange(4, dtype=torch.float32)}


@pytest.fixture
def make_publisher(make_client, tmp_path):
    def create(trainer_id: str = "trainer"):
        return make_client(trainer_id, weight_store=str(tmp_path / "store"))

    return create


def forge(path: Path, header: bytes | dict, data: bytes = b"") -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def secret_outside(tmp_path: Path) -> Path:
    """A valid safetensors file outside every weight root: what a link points at."""
    secret = tmp_path / "secret"
    secret.mkdir()
    save_file({"w": torch.full((4,), 7.0)}, str(secret / "private.safetensors"))
    return secret / "private.safetensors"


# --- 1. symlinks and other non-regular files ------------------------------------------------

async def test_symlinked_weight_file_is_refused_by_copy_reference_and_verify(make_publisher, tmp_path):
    target = secret_outside(tmp_path)
    d = tmp_path / "weights"
    d.mkdir()
    (d / "model.safetensors").symlink_to(target)
    client = make_publisher()
    for copy in (True, False):
        with pytest.raises(WeightError, match=r"model\.safetensors: .*symbolic link"):
            await client.publish_weights(1, d, copy=copy)
    assert await client.latest_version() is None
    assert not list((tmp_path / "store").rglob("*.safetensors"))
    # A registered version whose file is later replaced by a link (sizes and sha256 those of
    # the target) is refused by the worker's check too.
    (d / "model.safetensors").unlink()
    save_file({"w": torch.full((4,), 7.0)}, str(d / "model.safetensors"))
    entry = await client.publish_weights(1, d, copy=False)
    (d / "model.safetensors").unlink()
    (d / "model.safetensors").symlink_to(target)
    assert entry.files[0].digest == digest_file(target)
    with pytest.raises(WeightError, match=r"model\.safetensors: .*symbolic link"):
        verify(entry.path, entry.files)


def test_other_symlinks_and_special_files_in_a_published_dir_are_refused(tmp_path):
    d = tmp_path / "weights"
    d.mkdir()
    save_file(TENSORS, str(d / "model.safetensors"))
    (d / "config.json").symlink_to("/etc/passwd")
    with pytest.raises(WeightError, match=r"config\.json: .*symbolic link"):
        digest_dir(d)
    with pytest.raises(WeightError, match=r"config\.json: .*symbolic link"):
        WeightStore(tmp_path / "store").copy_dir("p", 1, d)
    (d / "config.json").unlink()
    (d / "shard.safetensors").mkdir()
    with pytest.raises(WeightError, match=r"shard\.safetensors: .*not a regular file \(a directory\)"):
        digest_dir(d)


def _in_thread(fn, timeout_s: float = 10.0):
    """Run fn in a daemon thread; a hang becomes a test failure instead of a stuck session."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"still blocked after {timeout_s} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_fifo_named_safetensors_is_refused_at_once(tmp_path):
    d = tmp_path / "weights"
    d.mkdir()
    os.mkfifo(d / "model.safetensors")
    try:
        for check in (lambda: check_header(d / "model.safetensors"), lambda: digest_dir(d),
                      lambda: WeightStore(tmp_path / "store").copy_dir("p", 1, d)):
            with pytest.raises(WeightError, match=r"model\.safetensors: .*not a regular file \(a FIFO\)"):
                _in_thread(check)
    finally:  # a writer that opens and closes releases a reader blocked in open() (unfixed code)
        with contextlib.suppress(OSError):  # ENXIO: no reader is blocked
            os.close(os.open(d / "model.safetensors", os.O_WRONLY | os.O_NONBLOCK))


# --- 7. ids and the store's root -------------------------------------------------------------

@pytest.mark.parametrize("bad", ["a\n", ".", "..", "...", "a/b", "", "x" * 129])
def test_ids_refused(bad):
    with pytest.raises(InvalidInput, match="policy"):
        check_id("policy", bad)


@pytest.mark.parametrize("good", ["a", "a.b", "v1..2", ".hidden", "math-1.5b", "run_7"])
def test_ids_accepted(good):
    assert check_id("policy", good) == good


@pytest.mark.parametrize("policy", ["..", ".", "../escape", "a/../../b", "<absolute>"])
def test_store_never_writes_outside_its_root(tmp_path, policy):
    if policy == "<absolute>":  # under tmp_path: the unfixed store wrote wherever it was told
        policy = str(tmp_path / "abs")
    source = tmp_path / "source"
    source.mkdir()
    save_file(TENSORS, str(source / "model.safetensors"))
    store = WeightStore(tmp_path / "root" / "store")
    with pytest.raises((WeightError, InvalidInput), match="policy"):
        store.write_tensors(policy, 1, TENSORS)
    with pytest.raises((WeightError, InvalidInput), match="policy"):
        store.copy_dir(policy, 1, source)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [source / "model.safetensors"]


def test_store_refuses_a_policy_dir_linked_out_of_the_store(tmp_path):
    store = WeightStore(tmp_path / "store")
    (tmp_path / "store").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "store" / "p").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(WeightError, match="policy 'p': .* is not a directory of the store"):
        store.write_tensors("p", 1, TENSORS)
    assert list((tmp_path / "elsewhere").iterdir()) == []


# --- 3. the header validator -----------------------------------------------------------------

def _deep(depth: int) -> bytes:
    return b'{"w":' + b"[" * depth + b"]" * depth + b"}"


HOSTILE = {
    "100,000-deep nesting": (_deep(100_000), "header"),
    "5,000-digit integer": (b'{"w":{"dtype":"F32","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}',
                            "shape"),
    "4,300-digit shape": (b'{"w":{"dtype":"F32","shape":[' + b",".join([b"9" * 4300] * 40)
                          + b'],"data_offsets":[0,4]}}', "shape"),
    "huge product of small dims": ({"w": {"dtype": "F32", "shape": [2**31] * 30, "data_offsets": [0, 4]}},
                                   "shape"),
    "duplicate names": (b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                        b'"w":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}', "repeats the key 'w'"),
    "duplicate field": (b'{"w":{"dtype":"I32","dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
                        "repeats the key 'dtype'"),
    "bool dim": ({"w": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, "shape"),
    "bool offset": ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [False, 4]}}, "data_offsets"),
    "negative dim": ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, "shape"),
    "too many dims": ({"w": {"dtype": "F32", "shape": [1] * 33, "data_offsets": [0, 4]}}, "dims"),
    "unknown field": ({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "x": 1}}, "x"),
    "metadata not strings": ({"__metadata__": {"a": 1}, "w": {"dtype": "F32", "shape": [1],
                                                              "data_offsets": [0, 4]}}, "__metadata__"),
    "not an object": (b"[1, 2]", "header"),
    "NaN dim": (b'{"w":{"dtype":"F32","shape":[NaN],"data_offsets":[0,4]}}', "header"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_headers_end_in_weight_error(tmp_path, case):
    header, field = HOSTILE[case]
    f = forge(tmp_path / "model.safetensors", header, b"\0" * 4)
    with pytest.raises(WeightError, match=field) as raised:
        _in_thread(lambda: check_header(f), timeout_s=5)
    assert raised.value.args[0].startswith("model.safetensors: ")


def test_header_over_the_cap_is_refused_before_reading(tmp_path):
    assert MAX_HEADER_BYTES == 16 * 1024 * 1024
    f = forge(tmp_path / "model.safetensors", b"{" + b" " * MAX_HEADER_BYTES + b"}")
    with pytest.raises(WeightError, match=f"header of {MAX_HEADER_BYTES + 2} bytes; the limit is"):
        check_header(f)


def test_a_real_file_still_passes(tmp_path):
    f = tmp_path / "model.safetensors"
    save_file({"a": torch.zeros(3, 4), "b": torch.ones(5, dtype=torch.bfloat16),
               "empty": torch.zeros(0, 7)}, str(f), metadata={"format": "pt"})
    assert check_header(f) == {"a": ("F32", (3, 4)), "b": ("BF16", (5,)), "empty": ("F32", (0, 7))}


async def test_verify_checks_size_and_sha256_before_parsing(make_publisher, tmp_path):
    """A header bomb in place of a registered file is caught by its checksum, never parsed."""
    d = tmp_path / "weights"
    d.mkdir()
    save_file(TENSORS, str(d / "model.safetensors"))
    entry = await make_publisher().publish_weights(1, d, copy=False)
    size = entry.files[0].bytes
    bomb = _deep(size)[: size - 8]
    forge(d / "model.safetensors", bomb + b" " * (size - 8 - len(bomb)))
    assert (d / "model.safetensors").stat().st_size == size
    with pytest.raises(WeightError, match=r"blake3 .* does not match"):
        verify(entry.path, entry.files)

