"""Startup checks: a Redis that may lose acknowledged work is warned about, or refused with
--require-durable, by workers and the gateway."""

import subprocess
import sys

import pytest

from rollq.harness.faults import RedisProcess


def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rollq", *args], capture_output=True, text=True,
                          timeout=timeout, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})


@pytest.mark.parametrize("extra, problem", [(["--appendonly", "no"], "AOF is off"),
                                            (["--maxmemory-policy", "allkeys-lru"], "allkeys-lru")])
def test_worker_and_gateway_refuse_a_redis_that_may_lose_work(tmp_path, extra, problem):
    server = RedisProcess(tmp_path / "redis", extra=extra).start()
    try:
        worker = run("worker", "--redis-url", server.url, "--require-durable")
        assert worker.returncode == 2 and problem in worker.stdout + worker.stderr
        gateway = run("gateway", "--redis-url", server.url, "--no-auth", "--port", "0", "--require-durable")
        assert gateway.returncode != 0 and problem in gateway.stdout + gateway.stderr
    finally:
        server.stop()


def log_until_serving(*args: str) -> str:
    """Start `rollq worker ARGS`, return its log up to "serving policy", stop it."""
    proc = subprocess.Popen([sys.executable, "-m", "rollq", "worker", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"})
    try:
        seen = ""
        while "serving policy" not in seen:
            line = proc.stdout.readline()
            assert line, f"the worker ended: {seen}"
            seen += line
        return seen
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stdout.close()


def test_without_the_flag_a_worker_warns_and_serves(tmp_path):
    server = RedisProcess(tmp_path / "redis", extra=["--appendonly", "no"]).start()
    try:
        assert "AOF is off" in log_until_serving("--redis-url", server.url)
    finally:
        server.stop()


def test_durable_redis_passes(durable_redis):
    assert "AOF" not in log_until_serving("--redis-url", durable_redis.url, "--require-durable")
