"""Ports another process binds later: reserved (never handed to a port-0 bind meanwhile), and a
redis-server that could not bind its port is not mistaken for the one that answers there."""

import contextlib
import errno
import socket

import pytest
import redis as redis_sync

from rollq.harness.faults import RedisProcess, reserved_port

BINDS = 1000
"""Port-0 binds held open at once: a few percent of the ephemeral range, without exhausting it
for the other processes on the machine."""


def _bind(port: int, *, reuse: bool) -> socket.socket:
    s = socket.socket()
    if reuse:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port))
    except OSError:
        s.close()
        raise
    return s


@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "reuseaddr"])
def test_port0_binds_never_get_a_reserved_port(reuse):
    reserved = {reserved_port() for _ in range(50)}
    with contextlib.ExitStack() as stack:
        given = {stack.enter_context(_bind(0, reuse=reuse)).getsockname()[1] for _ in range(BINDS)}
    assert len(given) == BINDS
    assert given & reserved == set()


def test_a_reserved_port_is_bound_only_with_reuseaddr_a_closed_one_by_anyone():
    # What makes the port-0 search above skip it, deterministically: the kernel runs the same
    # conflict check for a port-0 bind as for a plain bind of that exact port.
    port = reserved_port()
    with pytest.raises(OSError) as taken:
        _bind(port, reuse=False)
    assert taken.value.errno == errno.EADDRINUSE
    with _bind(port, reuse=True) as late_binder:  # aiohttp's and redis-server's bind
        late_binder.listen(1)
        assert late_binder.getsockname()[1] == port
    # The old way (bind port 0, read, close): nothing holds the port, anyone may take it.
    with _bind(0, reuse=False) as s:
        closed = s.getsockname()[1]
    with _bind(closed, reuse=False) as anyone:
        assert anyone.getsockname()[1] == closed


def test_redis_process_refuses_a_foreign_server_on_its_port(tmp_path):
    own = RedisProcess(tmp_path / "own", aof=False).start()
    try:
        late = RedisProcess(tmp_path / "late", port=own.port, aof=False)
        with pytest.raises(RuntimeError, match=f"served by pid {own.proc.pid}, not by our"):
            late.start()
        assert late.proc.wait(10) != 0  # it could not bind: the port was taken
        assert own.proc.poll() is None
    finally:
        own.stop()


def test_redis_process_without_aof_persists_nothing(tmp_path):
    server = RedisProcess(tmp_path / "redis", aof=False).start()
    try:
        config = redis_sync.Redis.from_url(server.url).config_get("appendonly")
        assert config == {"appendonly": "no"}
    finally:
        server.stop()
