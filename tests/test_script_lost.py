"""A Redis restarted between redis-py's SCRIPT LOAD and the EVALSHA after it (redis-py's retry
reconnects to the new server, which holds no scripts) answered NOSCRIPT a second time, which
redis-py raises: the episodes router died of it (stop 36), and any long-running loop that
retries only connection errors would too (the worker's claiming). rollq's clients send such a
call again as EVAL, which runs the script and caches it: no second window. Checked on a real
redis-server, whose script cache is flushed right after each SCRIPT LOAD (the restart)."""

import pytest

from rollq.harness.faults import RedisProcess
from rollq.queue.connection import connect
from rollq.queue.scripts import pipelined


@pytest.fixture
async def forgetful(tmp_path):
    """A client of a private Redis that loses its scripts right after each SCRIPT LOAD."""
    server = RedisProcess(tmp_path, aof=False).start()
    client = connect(server.url)
    load = client.script_load

    async def load_then_lose(*args, **kwargs):
        sha = await load(*args, **kwargs)
        await client.script_flush()  # the restart
        return sha

    client.script_load = load_then_lose
    yield client
    await client.aclose()
    server.stop()


async def test_a_script_call_survives_its_script_lost_after_the_load(forgetful):
    script = forgetful.register_script("return ARGV[1]")
    assert await script(keys=[], args=["once"]) == b"once"
    await forgetful.script_flush()  # lost again: a later call too
    assert await script(keys=[], args=["again"]) == b"again"


async def test_a_pipelined_script_call_survives_its_script_lost_after_the_load(forgetful):
    script = forgetful.register_script("return ARGV[1]")
    replies, _ = await pipelined(forgetful, [(script, [], ["a"]), (script, [], ["b"])])
    assert replies == [b"a", b"b"]
