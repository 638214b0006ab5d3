"""The weight store: safetensors files on a filesystem every worker sees, written atomically.

A version is written into a private temp directory, every file hashed (BLAKE3), a `COMMITTED`
manifest written last, all of them and the directory fsynced together, then the directory renamed
into place and its parent fsynced: a reader never sees a half-written version. Directory names
are unique per write, so two concurrent publishers of one version never collide; the registry's
compare-and-set picks one. What a killed writer or deleter leaves (`.tmp-*`, `.trash-*`) is
removed by the next write once no writer of the policy is live (`_writing`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import mmap
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import blake3

from rollq.protocol import FileDigest, check_id
from rollq.registry import adapters, staging
from rollq.registry.safetensors_check import WeightError, check_header_of, not_regular, open_regular

COMMIT_MARKER = "COMMITTED"
UNSAFE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".npy", ".npz")
"""Formats that unpickle (or may) on load: never registered, never loaded."""
_CHUNK = 8 * 1024 * 1024

log = logging.getLogger("rollq.registry")


DIGEST = "blake3"
"""The digest of new versions: BLAKE3, multithreaded, ~2.5× sha256 on one core here (see
docs/benchmarks.md). Older entries say `sha256` and are verified with it."""


def digest_file(path: Path, algorithm: str = DIGEST) -> str:
    with open(path, "rb") as f:
        return _digest_of(f, algorithm)


_THREADED_FROM = 16 << 20
"""Bytes from which BLAKE3 hashes on all cores. Below (an adapter, a config) one thread does it
in place: BLAKE3's threads are a pool the call hands its work to and waits on, and on busy cores
that hand-off cost more than the hash (a 3.7 MB adapter: ~1 ms on one thread; with the pool,
its store step took 40-120 ms beside three busy loops on the 2 cores here, 7 ms quiet)."""


def _hasher(algorithm: str, size: int):
    """A hasher for `size` bytes (BLAKE3 on all cores from `_THREADED_FROM` on)."""
    if algorithm == "blake3":  # releases the GIL as it hashes
        return blake3.blake3(max_threads=blake3.blake3.AUTO if size >= _THREADED_FROM else 1)
    if algorithm == "sha256":
        return hashlib.sha256()
    raise WeightError(f"unknown digest algorithm {algorithm!r} (blake3 or sha256)")


def _digest_of(f, algorithm: str) -> str:
    """Hash an open file from its start, through one reused buffer (no chunk copies)."""
    size = os.fstat(f.fileno()).st_size
    digest = _hasher(algorithm, size)
    f.seek(0)
    buffer = bytearray(min(_CHUNK, size + 1))  # (a config's: not 8 MiB zeroed for 1 kB)
    view = memoryview(buffer)
    while n := f.readinto(buffer):
        digest.update(view[:n])
    return digest.hexdigest()


def check_digest(f, expected: FileDigest) -> None:
    """The open file `f` hashes to its registered digest, or WeightError."""
    _compare(_digest_of(f, expected.algorithm), expected)


def check_digest_of(data: memoryview, expected: FileDigest) -> None:
    """Bytes in memory hash to the registered digest, or WeightError."""
    digest = _hasher(expected.algorithm, len(data))
    digest.update(data)
    _compare(digest.hexdigest(), expected)


def _compare(actual: str, expected: FileDigest) -> None:
    if actual != expected.digest:
        raise WeightError(f"{expected.name}: {expected.algorithm} {actual[:12]}… does not match "
                          f"the registered {expected.digest[:12]}… (corrupted or replaced)")


@contextlib.contextmanager
def mapped(path: Path) -> Iterator[memoryview]:
    """The bytes of a file only its reader writes (a worker's private snapshot, the store's own
    copy in its temp directory), through a memory map: hashed with no copy out of the page
    cache, 0.04 s for 445 MB here against 0.11 s read through a buffer (docs/benchmarks.md).
    Only for such files: a file truncated while mapped faults its reader (SIGBUS)."""
    with os.fdopen(open_regular(path), "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:  # (an empty file cannot be mapped)
            yield memoryview(b"")
            return
        with (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view,
              memoryview(view) as data):
            yield data


def _digest_bytes(data: memoryview) -> str:
    digest = _hasher(DIGEST, len(data))
    digest.update(data)
    return digest.hexdigest()


IMAGE_FILE = "model.safetensors"
"""The one file a packed checkpoint is written as."""


def image_digest(image: staging.Image) -> FileDigest:
    """The digest `write_image` gives the file of `image`, from its bytes in memory."""
    return FileDigest(IMAGE_FILE, _digest_bytes(image.view), image.size, DIGEST)


def _write_hashed(target: Path, data: memoryview) -> FileDigest:
    """Write `data` to a new file while another thread hashes it (BLAKE3 releases the GIL);
    small data is hashed first in this thread (a thread hand-off costs more than its hash)."""
    if len(data) < _THREADED_FROM:
        digest = _digest_bytes(data)
        _write_new(target, data)
        return FileDigest(target.name, digest, len(data), DIGEST)
    with ThreadPoolExecutor(1) as pool:
        hashing = pool.submit(_digest_bytes, data)
        _write_new(target, data)
        return FileDigest(target.name, hashing.result(), len(data), DIGEST)


def _write_new(target: Path, data: memoryview) -> None:
    fd = _open_over(target)
    with open(fd, "wb", buffering=0) as f:
        written = 0
        while written < len(data):  # a raw write may take less than it was given
            written += f.write(data[written:written + _CHUNK])
        f.truncate(written)


def _open_over(path: Path, mode: int = 0o666) -> int:
    """A file to write: new, or a spare's file of that name written over in place (its blocks
    and cached pages reused; the writer truncates it to what it wrote). Never through a link."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, mode)


def copy_over(src: int, target: Path, size: int, mode: int = 0o666) -> None:
    """Copy `size` bytes of descriptor `src` into `target` (`_open_over`: new or written over),
    cut to what was copied: a spare's longer tail goes, and a source that shrank under the copy
    leaves a short file, which the caller's size or digest check refuses."""
    fd = _open_over(target, mode)
    try:
        os.ftruncate(fd, copy_fd(src, fd, size))
    finally:
        os.close(fd)


def open_version_file(path: Path) -> int:
    """A descriptor of a published file to read whole (a copy, a hash), with a shared lock held
    until it is closed: a store writer writes a spare's file over in place only once it holds
    that file's exclusive lock (`_take_spare`), so a file locked here never changes under its
    reader. Taken, then the file checked to be still at `path`: one opened just before its
    version was retired (renamed to the spare, maybe written over since) is refused, never read.
    A file another holds exclusively (a spare being written over) is refused at once, not waited
    for. Where the filesystem has no locks, no writer can lock either and spares are never
    written over there."""
    fd = open_regular(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise WeightError(f"{path.name}: locked by a writer (a file being written over: in the store, "
                              "a retired version's, reused by the next); read it once written") from None
        except OSError:  # no locks here (see above)
            pass
        now = os.stat(path, follow_symlinks=False)
        held = os.fstat(fd)
        if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            raise WeightError(f"{path.name}: replaced while it was opened")
    except FileNotFoundError:
        os.close(fd)
        raise WeightError(f"{path.name}: its version was retired while it was opened") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _checked(files: list[Path], digests: list[FileDigest]) -> list[FileDigest]:
    """Digests a writer took from its own bytes: each file must have that size, and a weight
    file a valid header (an adapter's config was parsed from those bytes)."""
    by_name = {d.name: d for d in digests}
    if sorted(by_name) != sorted(f.name for f in files):
        raise WeightError(f"written {sorted(f.name for f in files)}, hashed {sorted(by_name)}")
    for f in files:
        with os.fdopen(open_regular(f), "rb") as fh:
            if os.fstat(fh.fileno()).st_size != by_name[f.name].bytes:
                raise WeightError(f"{f.name}: written size differs from the hashed bytes")
            if f.suffix == ".safetensors":
                check_header_of(fh, f.name)
    return [by_name[f.name] for f in files]


def copy_fd(src: int, dst: int, size: int) -> int:
    """Copy `size` bytes between descriptors in the kernel (sendfile), as shutil.copyfile does
    for paths; returns the bytes copied. A file that shrank meanwhile ends the copy short:
    callers compare sizes or digests after it."""
    offset = 0
    while offset < size:
        sent = os.sendfile(dst, src, offset, min(size - offset, 1 << 30))
        if sent == 0:
            break
        offset += sent
    return offset


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_together(files: list[Path], directory: Path) -> None:
    """fsync the files and their directory at once: concurrent fsyncs share the filesystem's
    journal commits (one round instead of one per file, ~3 ms each here, far more on a busy
    disk). The order among them does not matter: the rename that follows is what commits a
    version, and it runs only once they all returned."""
    with ThreadPoolExecutor(len(files) + 1) as pool:
        waits = [pool.submit(_fsync_file, f) for f in files] + [pool.submit(_fsync_dir, directory)]
        for w in waits:
            w.result()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def refuse_unsafe(path: Path) -> None:
    for f in path.iterdir():
        if f.suffix in UNSAFE_SUFFIXES:
            raise WeightError(f"{f.name}: pickle-based weight files are refused; use safetensors")


def refuse_links(path: Path) -> None:
    """Every entry must be a regular file or a directory (which is not read): a link could point
    outside every weight root, a FIFO or device would block or feed endless bytes to a reader.
    lstat only: nothing is opened here."""
    with os.scandir(path) as entries:
        for entry in entries:
            mode = entry.stat(follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode) and not entry.name.endswith(".safetensors"):
                continue
            if not stat.S_ISREG(mode):
                raise not_regular(entry.name, mode)


def weight_files(path: Path) -> list[Path]:
    refuse_unsafe(path)
    refuse_links(path)
    files = sorted(p for p in path.iterdir() if p.suffix == ".safetensors")
    if not files:
        raise WeightError(f"{path}: no .safetensors files")
    return files


def _digest(f: Path, opener=open_regular) -> FileDigest:
    """Header, hash and size read through one descriptor (no link followed), so all three
    describe the same file even if its name is replaced meanwhile. `opener`:
    `open_version_file` for a file the store may write over (a published one)."""
    with os.fdopen(opener(f), "rb") as fh:
        check_header_of(fh, f.name)
        return FileDigest(f.name, _digest_of(fh, DIGEST), os.fstat(fh.fileno()).st_size, DIGEST)


def _digest_config(f: Path) -> FileDigest:
    """An adapter config: read once through one descriptor, parsed (bounded JSON), hashed."""
    with os.fdopen(open_regular(f), "rb") as fh:
        raw = fh.read(adapters.MAX_CONFIG_BYTES + 1)
        adapters.parse_config(raw, f.name)
        return FileDigest(f.name, _digest_of(fh, DIGEST), os.fstat(fh.fileno()).st_size, DIGEST)


def adapter_files(path: Path) -> list[Path]:
    """The two files of an adapter version (anything else in the directory is not published)."""
    refuse_unsafe(path)
    refuse_links(path)
    adapters.check_files(path)
    return [path / name for name in adapters.FILES]


def digest_files(files: list[Path]) -> list[FileDigest]:
    return [_digest_config(f) if f.name == adapters.CONFIG else _digest(f) for f in files]


def digest_dir(path: Path) -> list[FileDigest]:
    """Hash the safetensors files of a directory in place (publish by reference; the directory
    may be a store version, read as `open_version_file` reads it)."""
    return [_digest(f, open_version_file) for f in weight_files(path)]


class WeightStore:
    def __init__(self, root: str | Path, *, durable: bool = True):
        """`durable=False`: versions are renamed into place before any fsync; `make_durable`
        fsyncs them later (the client's publishes: docs/architecture.md, "Versions before they
        are durable")."""
        self.root = Path(root).resolve()
        self.durable = durable

    def version_path(self, policy: str, version: int) -> Path:
        """A new directory name for `version`, chosen before it is written (`write_image(at=)`):
        a push registers the version with it, and its files appear there, all at once, later."""
        return self._policy_dir(policy) / f"v{version:010d}-{uuid.uuid4().hex[:8]}"

    def _write(self, policy: str, version: int, fill, listing=weight_files,
               writes: set[str] | None = None, at: Path | None = None) -> tuple[Path, list[FileDigest]]:
        """`fill(tmp_dir)` writes the files (`listing` names them: safetensors, or an adapter's
        two files) and may return their digests, taken from the bytes it wrote (then only
        sizes and headers are read back); the rest makes them a committed version (durable
        before the rename unless the store was made with `durable=False`). `writes`: the names
        `fill` will write, given when a spare (`delete`) may be written over; `at`: the
        directory, from `version_path` (else a new one)."""
        parent = self._policy_dir(policy)
        parent.mkdir(parents=True, exist_ok=True)
        if at is not None and (at.parent != parent or at.exists()):
            raise WeightError(f"{at} is not a new version directory of policy {policy!r}")
        name = at.name if at is not None else f"v{version:010d}-{uuid.uuid4().hex[:8]}"
        tmp = parent / f".tmp-{name}"
        with contextlib.ExitStack() as held:
            held.enter_context(_writing(parent))  # (its leftovers cleaned first, see there)
            if writes is None or not _take_spare(parent, tmp, writes, held):
                tmp.mkdir()
            try:
                return self._commit(parent, name, tmp, fill, listing, version)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                held.close()  # our locks: the clean-up needs the policy's lock to itself
                with contextlib.suppress(OSError):
                    _clean(parent)  # what writers killed before left (ours is gone above)
                raise

    def _commit(self, parent: Path, name: str, tmp: Path, fill, listing,
                version: int) -> tuple[Path, list[FileDigest]]:
        digests = fill(tmp)
        names = listing(tmp)
        files = digest_files(names) if digests is None else _checked(names, digests)
        manifest = {"version": version,
                    "files": [[d.name, d.digest, d.bytes, d.algorithm] for d in files],
                    "committed_at": time.time()}
        marker = tmp / COMMIT_MARKER
        marker.write_text(json.dumps(manifest))
        if self.durable:
            _fsync_together([*names, marker], tmp)
        final = parent / name
        os.rename(tmp, final)
        if self.durable:
            _fsync_dir(parent)
        return final, files

    def _policy_dir(self, policy: str) -> Path:
        """`<root>/<policy>`, refused unless it resolves to exactly that: whatever a caller passes
        (`..`, a link planted in the store), nothing is written outside the root."""
        check_id("policy", policy)
        parent = (self.root / policy).resolve()
        if parent.parent != self.root:
            raise WeightError(f"policy {policy!r}: {parent} is not a directory of the store at {self.root}")
        return parent

    def write_tensors(self, policy: str, version: int,
                      tensors: dict[str, Any]) -> tuple[Path, list[FileDigest]]:
        from safetensors.torch import save_file

        def fill(tmp: Path) -> None:
            save_file(tensors, str(tmp / IMAGE_FILE), metadata={"format": "pt"})

        return self._write(policy, version, fill)

    def write_image(self, policy: str, version: int, image: staging.Image, *, at: Path | None = None,
                    digest: FileDigest | None = None) -> tuple[Path, list[FileDigest]]:
        """A packed checkpoint (`staging.Staging.pack`): written to disk while another thread
        hashes the same bytes in memory (BLAKE3 releases the GIL), so the file is never read back.
        `at`: its directory (`version_path`); `digest`: `image_digest(image)`, taken before (a
        push registers it first): then the bytes are only written."""

        def fill(tmp: Path) -> list[FileDigest]:
            if digest is None:
                return [_write_hashed(tmp / IMAGE_FILE, image.view)]
            _write_new(tmp / IMAGE_FILE, image.view)
            return [digest]

        return self._write(policy, version, fill, writes={IMAGE_FILE}, at=at)

    def copy_dir(self, policy: str, version: int, source: Path,
                 listing=weight_files) -> tuple[Path, list[FileDigest]]:
        """The files `listing` names (an adapter: `adapter_files`, nothing else of the directory).

        Copied by the kernel (`copy_fd`: one copy of each page, none through Python's buffers),
        then the copy hashed through a memory map (`mapped`: it is this store's own file, in its
        temp directory): one pass copying while hashing (each chunk written while another
        thread hashes it) measured no faster here, and up to 5x slower under load
        (docs/benchmarks.md). An adapter's two files are hashed as they are read (`digest_files`:
        its config parsed from the same bytes)."""
        files = listing(source)
        weights = listing is weight_files

        def fill(tmp: Path) -> list[FileDigest] | None:
            digests = []
            for f in files:  # opened without following links (the name may have changed since),
                with os.fdopen(open_version_file(f), "rb") as src:  # locked (a store version?)
                    copy_over(src.fileno(), tmp / f.name, os.fstat(src.fileno()).st_size)
                if weights:
                    with mapped(tmp / f.name) as data:
                        digests.append(FileDigest(f.name, _digest_bytes(data), len(data), DIGEST))
            return digests if weights else None

        # (An adapter's two small files gain nothing from a spare.)
        return self._write(policy, version, fill, listing, {f.name for f in files} if weights else None)

    def write_adapter(self, policy: str, version: int, tensors: dict[str, Any],
                      config: bytes) -> tuple[Path, list[FileDigest]]:
        """An adapter version: its LoRA tensors and its PEFT config (JSON bytes), checked and
        hashed from memory as they are written (nothing read back but the tensors' header)."""
        adapters.parse_config(config)
        image = staging.Staging(keep=0).pack(tensors)

        def fill(tmp: Path) -> list[FileDigest]:
            return [_write_hashed(tmp / adapters.WEIGHTS, image.view),
                    _write_hashed(tmp / adapters.CONFIG, memoryview(config))]

        return self._write(policy, version, fill, adapter_files)

    def make_durable(self, path: str | Path) -> None:
        """fsync a version written by a `durable=False` store: its files, manifest and directory
        together, then its parent (the rename). Once this returns, a machine crash keeps it."""
        path = Path(path)
        try:
            _fsync_together(sorted(p for p in path.iterdir() if p.is_file()), path)
        except FileNotFoundError:  # retired meanwhile (another publisher's `keep`): nothing to keep
            return
        _fsync_dir(path.parent)

    def delete(self, path: str | Path) -> None:
        """Remove a version directory this store wrote (never one published by reference).

        A full version's directory is kept instead as its policy's spare when there is none:
        the next version written into the store is written over its files (`_take_spare`), as
        a worker writes over its own spare snapshot. A new 445 MB file here costs its page
        allocation (0.4-1.2 s on this VM's fresh memory, 0.11-0.16 s recycled) where writing
        over cached pages took 0.06-0.07 s; and no deletion's trim (the disk is mounted with
        `discard`) runs beside the swap. The price: one version's worth of disk per policy
        beyond `keep`. A reader of the retired version (a publish copying it, a worker's copy)
        never reads changing bytes: a file it holds is not written over (`_take_spare`), and one
        it opened just before retirement is refused (`open_version_file`)."""
        path = Path(path).resolve()
        if self.root not in path.parents or not (path / COMMIT_MARKER).exists():
            raise WeightError(f"{path} is not a committed version of the store at {self.root}")
        with _writing(path.parent, clean=False):  # (a `.trash-*` of ours is not a leftover)
            if _bytes_in(path) >= SPARE_FROM and not any(path.parent.glob(f"{SPARE}*")):
                os.rename(path, path.with_name(f"{SPARE}{uuid.uuid4().hex[:8]}"))  # atomic, as below
                return
            trash = path.with_name(f".trash-{path.name}")
            os.rename(path, trash)  # atomic: no reader sees a half-deleted version
            shutil.rmtree(trash)


SPARE = ".spare-"
SPARE_FROM = 64 << 20
"""A retired version of at least this many bytes is kept as its policy's spare (an adapter's
files are not worth keeping)."""


def _bytes_in(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and not f.is_symlink())


LEFTOVERS = (".tmp-", ".trash-")
"""A version being written, a version being deleted: a leftover once no writer owns it."""


@contextlib.contextmanager
def _writing(parent: Path, clean: bool = True) -> Iterator[None]:
    """Held by every store write and delete of the policy, from before its `.tmp-*` or
    `.trash-*` exists until it is gone: a shared lock on the policy's directory, which the
    kernel drops when its holder dies. So a `.tmp-*` or `.trash-*` found while that lock can be
    taken exclusively is one whose writer was killed: `clean` removes those first (the first
    write after a kill cleans up; a write that fails cleans up after itself, `_write`). On a
    filesystem without locks on directories (NFS), nothing is ever removed: leftovers stay."""
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if clean:
            _clean(parent, fd)
        with contextlib.suppress(OSError):  # (no locks here: nothing is cleaned either)
            fcntl.flock(fd, fcntl.LOCK_SH)  # (blocks only while a clean-up runs)
        yield
    finally:
        os.close(fd)


def _clean(parent: Path, fd: int | None = None) -> list[str]:
    """Remove the policy's leftovers, if no store writer of the policy is live (`_writing`);
    returns their names. `fd`: the policy directory's, opened by the caller (its lock, if
    taken, is the caller's to drop)."""
    own = fd is None
    if own:
        fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a writer is live (it cleans after), or no locks here
            return []
        removed = []
        with os.scandir(parent) as entries:
            for entry in entries:
                if entry.name.startswith(LEFTOVERS) and entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed.append(entry.name)
        if removed:
            log.warning("the weight store removed %s of %s, left by a writer that was killed",
                        removed, parent)
        return removed
    finally:
        if own:
            os.close(fd)


def _take_spare(parent: Path, tmp: Path, writes: set[str], held: contextlib.ExitStack) -> bool:
    """Rename the policy's spare (if any, and if no other writer took it first) to `tmp`, with
    only the regular files of the names about to be written left in it. Each of those is
    written over in place only under its exclusive lock (kept in `held` until the write is
    done): one a reader still holds (`open_version_file`: a copy of the version this spare was)
    is unlinked instead, its reader keeping its bytes, and written new."""
    for spare in parent.glob(f"{SPARE}*"):
        try:
            os.rename(spare, tmp)
        except FileNotFoundError:  # another writer took it
            continue
        with os.scandir(tmp) as entries:
            for entry in entries:
                if entry.name in writes and entry.is_file(follow_symlinks=False):
                    if _lock_to_write(Path(entry.path), held):
                        continue
                    os.unlink(entry.path)
                elif entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
        return True
    return False


def _lock_to_write(path: Path, held: contextlib.ExitStack) -> bool:
    """Whether this spare's file is ours to write over: its exclusive lock taken (then held
    until `held` closes), so no reader is reading it and none can start."""
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # read by someone (or no locks here: then never written over)
        os.close(fd)
        return False
    held.callback(os.close, fd)
    return True


def verify(path: str | Path, files: list[FileDigest]) -> None:
    """Before a worker loads a version: exactly the registered files, sizes, hashes, headers.

    Size and digest come first: a file that matches its registry entry is the one the
    publisher's checks accepted, so a swapped-in header bomb is never parsed."""
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        raise WeightError(f"{path}: version directory is missing or a symbolic link")
    refuse_unsafe(path)
    refuse_links(path)
    present = {p.name for p in path.iterdir() if p.suffix == ".safetensors"}
    expected = {d.name for d in files}
    if present != expected:
        raise WeightError(f"{path}: safetensors files {sorted(present)} differ from the registered "
                          f"{sorted(expected)}")
    for d in files:
        with os.fdopen(open_regular(path / d.name), "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != d.bytes:
                raise WeightError(f"{d.name}: {size} bytes, registered {d.bytes} (truncated or replaced)")
            check_digest(f, d)
            check_header_of(f, d.name)
