"""Processes to break on purpose: a durable redis-server that can be killed, restarted and
frozen, for the fault-injection tests and `rollq chaos`."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis as redis_sync


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """redis-server on a fixed loopback port with AOF fsynced on every write, so a SIGKILL loses
    nothing it acknowledged; `restart` brings it back on the same port with the same data."""

    def __init__(self, workdir: Path, *, port: int | None = None, extra: list[str] | None = None,
                 tls_dir: Path | None = None):
        """`tls_dir`: serve TLS only, with server.pem, server.key and ca.pem from there."""
        self.binary = shutil.which("redis-server")
        if self.binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.workdir = workdir
        self.port = port or free_port()
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
        return [self.binary, *ports, "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--appendonly", "yes", "--appendfsync", "always", "--save", "",
                "--logfile", str(self.workdir / "redis.log"), *self.extra]

    def start(self, timeout_s: float = 15) -> RedisProcess:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 15) -> None:
        give_up = time.monotonic() + timeout_s
        client = redis_sync.Redis.from_url(self.url, password=self.password, socket_timeout=1)
        try:
            while True:
                try:
                    if client.ping():
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
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
