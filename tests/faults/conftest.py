"""Fault injection: each test gets its own durable redis-server (AOF, fsync on every write) on a
reserved loopback port, which it may kill, restart or freeze. Run alone: `pytest -m faults`."""

from __future__ import annotations

import pytest

from rollq.harness.faults import RedisProcess


def pytest_collection_modifyitems(items):
    for item in items:
        if "/faults/" in str(item.fspath):
            item.add_marker(pytest.mark.faults)


@pytest.fixture
def durable_redis(tmp_path):
    server = RedisProcess(tmp_path / "redis").start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(durable_redis) -> str:
    """Every fixture of the main conftest (clients, workers, worker processes) uses this server."""
    return durable_redis.url
