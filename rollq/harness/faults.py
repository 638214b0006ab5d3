"""Processes to break on purpose: a redis-server that can be killed, restarted and frozen, for
the fault-injection tests and `rollq chaos` (and, without AOF, the test session and the demo);
and the loopback ports other processes bind later."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis as redis_sync

from rollq.children import stop_child


def reserved_port() -> int:
    """A loopback port for another process to bind (with SO_REUSEADDR, as aiohttp and
    redis-server do) in the next 60 s, which the kernel will not hand out meanwhile.

    A port read from a closed port-0 socket is free only until the next port-0 bind on the
    machine (a gateway, a redis-server of another test run, vLLM), which may be given the same
    port: the late binder then dies with EADDRINUSE. Here the port is left in TIME_WAIT instead:
    the kernel then skips it for port-0 binds and outgoing connections, while an explicit bind
    with SO_REUSEADDR succeeds.
    """
    with contextlib.closing(socket.socket()) as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        address = listener.getsockname()
        with contextlib.closing(socket.create_connection(address)):
            accepted, _ = listener.accept()
            accepted.close()  # closes first: its TIME_WAIT holds the port
        return address[1]


# The old name: every caller binds the port later, so every caller needs it reserved (and
# callers on other branches get the reserved port without an edit).
free_port = reserved_port


class RedisProcess:
    """redis-server on a reserved loopback port, by default with AOF fsynced on every write, so a
    SIGKILL loses nothing it acknowledged; `restart` brings it back on the same port with the same
    data. The one place rollq and its tests start a redis-server."""

    def __init__(self, workdir: Path, *, port: int | None = None, aof: bool = True,
                 extra: list[str] | None = None, tls_dir: Path | None = None):
        """`aof=False`: no persistence at all (the test session, the demo); `tls_dir`: serve TLS
        only, with server.pem, server.key and ca.pem from there."""
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.workdir = workdir
        self.port = port or reserved_port()
        self.aof = aof
        self.extra = extra or []
        self.tls_dir = tls_dir
        self.proc: subprocess.Popen | None = None
        self.password: str | None = None
        """The default user's password, once a test sets one (for the readiness check)."""

    @property
    def url(self) -> str:
        if self.tls_dir:
            return f"rediss://127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls_dir / 'ca.pem'}"
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        ports = ["--port", str(self.port)]
        if self.tls_dir:
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no",
                     "--tls-cert-file", str(self.tls_dir / "server.pem"),
                     "--tls-key-file", str(self.tls_dir / "server.key"),
                     "--tls-ca-cert-file", str(self.tls_dir / "ca.pem")]
        aof = ["--appendonly", "yes", "--appendfsync", "always"] if self.aof else ["--appendonly", "no"]
        return [self.binary, *ports, "--bind", "127.0.0.1", "--dir", str(self.workdir), *aof,
                "--save", "", "--logfile", str(self.workdir / "redis.log"), *self.extra]

    def start(self, timeout_s: float = 15) -> RedisProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 15) -> None:
        """Until our own process answers on the port. A ping is not enough: if the port was
        taken, our server exits and whoever holds the port answers (e.g. another test run's
        redis-server, which may go away later)."""
        give_up = time.monotonic() + timeout_s
        client = redis_sync.Redis.from_url(self.url, password=self.password, socket_timeout=1)
        try:
            while True:
                try:
                    pid = client.info("server")["process_id"]
                    if pid != self.proc.pid:
                        raise RuntimeError(
                            f"port {self.port} is served by pid {pid}, not by our redis-server "
                            f"(pid {self.proc.pid}, exit code {self.proc.poll()}); "
                            f"log: {self.workdir / 'redis.log'}")
                    return
                except (redis_sync.ConnectionError, redis_sync.TimeoutError,
                        redis_sync.exceptions.BusyLoadingError):
                    pass
                if self.proc.poll() is not None or time.monotonic() > give_up:
                    raise RuntimeError(f"redis-server on port {self.port} did not come up; "
                                       f"log: {self.workdir / 'redis.log'}")
                time.sleep(0.05)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final save; only what the AOF already holds survives."""
        self.proc.kill()
        self.proc.wait(10)

    def restart(self, down_s: float = 0.0) -> None:
        self.kill()
        time.sleep(down_s)
        self.start()

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None:
            stop_child(self.proc, 10, group=False)
