"""One owner for the Redis data model (issue 13): every name inside rollq's Redis values is defined
in `rollq/queue/names.py`, and the Lua scripts take them from the generated preamble.

Two checks: on the source (a script that spells a lowercase word of its own, or uses a constant
the preamble does not define, fails here before it can write a name Python never reads), and
on real Redis (what the scripts wrote is exactly what Python defines)."""

import re
from typing import get_args

import pytest

from rollq.protocol import Status
from rollq.queue.keys import EVERY_POLICY, Keys, policy_of
from rollq.queue.names import (STATUS_COUNTERS, DeadField, JobField, JobState, ResultField, WorkField,
                               lua_names, lua_preamble)
from rollq.queue.scripts import NAMES, body

LUA_WORDS = {"local", "if", "then", "else", "elseif", "end", "for", "in", "do", "return", "not", "and",
             "or", "true", "false", "nil", "while", "break", "function", "repeat", "until"}
SYMBOLS = {"", "*", "~", "-", "-inf", "+inf"}
"""Literals that are Redis syntax (stream ids and the `-` inside one, ranges), not names."""


def _code_and_strings(script: str) -> tuple[str, list[str]]:
    code = re.sub(r"--[^\n]*", "", script)
    strings = re.findall(r"'([^']*)'|\"([^\"]*)\"", code)
    return re.sub(r"'[^']*'|\"[^\"]*\"", "''", code), [a or b for a, b in strings]


def names_used(script: str) -> set[str]:
    """Upper-case identifiers of a script's code: its preamble constants, KEYS and ARGV."""
    code, _ = _code_and_strings(script)
    return set(re.findall(r"\b[A-Z][A-Z0-9_]*\b", code)) - {"KEYS", "ARGV"}


def own_words(script: str) -> list[str]:
    """String literals that are not Redis commands, options or syntax: names it spells itself."""
    _, strings = _code_and_strings(script)
    return [s for s in strings if s not in SYMBOLS and not re.fullmatch(r"[A-Z]+|-?[0-9]+", s)]


@pytest.mark.parametrize("name", NAMES)
def test_a_script_uses_only_names_python_defines(name):
    unknown = names_used(body(name)) - set(lua_names())
    assert not unknown, f"{name}.lua uses {sorted(unknown)}, which rollq/queue/names.py does not define"


@pytest.mark.parametrize("name", NAMES)
def test_a_script_spells_no_name_of_its_own(name):
    spelled = own_words(body(name))
    assert not spelled, (f"{name}.lua spells {spelled}: take the name from the preamble "
                         "(rollq/queue/names.py), so Python and Lua cannot drift apart")


def test_the_checks_catch_a_misspelling():
    script = "redis.call('HSET', KEYS[1], JOB_STAT, STATE_DONE)\nredis.call('HGET', KEYS[1], 'state')"
    assert names_used(script) - set(lua_names()) == {"JOB_STAT"}
    assert own_words(script) == ["state"]


def test_the_preamble_defines_every_name_once_and_is_valid_lua_syntax():
    names = lua_names()
    assert len(lua_preamble().splitlines()) == len(names)
    assert not set(names) & LUA_WORDS
    # Quoted as is into Lua ('...'): letters, '_' and ':' (ConversationBytesField.TOTAL's colon
    # keeps it apart from every id) need no escape there.
    assert all(re.fullmatch(r"[a-z_:]+", v) for v in names.values()), "quoted as is into Lua"


def test_the_job_record_counts_every_result_status():
    assert [c.value for c in STATUS_COUNTERS] == list(get_args(Status))


def test_every_policy_glob_and_policy_of_agree_with_keys():
    keys = Keys("math-1")
    for name in ("trainers", "latest", "workers"):
        pattern, key = getattr(EVERY_POLICY, name), getattr(keys, name)
        assert re.fullmatch(re.escape(pattern).replace(r"\*", ".*"), key)
        assert policy_of(key) == "math-1"
    assert policy_of(keys.work("alice")) == "math-1"
    with pytest.raises(ValueError, match="not a rollq key"):
        policy_of("other:{x}:trainers")


async def test_what_the_scripts_write_is_what_python_defines(redis, policy, make_client, make_worker):
    """Enqueue, cancel and finish (ok, cancelled, dead letter) through the real scripts, then read
    the raw keys: every field and state is one of names.py's."""
    keys, trainer = Keys(policy), "trainer"
    client = make_client(trainer)
    job = await client.submit([[1], [2]], n=1, max_version=5)
    [(_, entry)] = await redis.xrange(keys.work(trainer), count=1)
    assert {f.decode() for f in entry} == set(WorkField)
    record = await redis.hgetall(keys.job(trainer, job))
    # (`cut` is only an over-sampled job's: score_pick.lua writes it, tests/test_scoring.py reads it.)
    assert {f.decode() for f in record} == set(JobField) - {JobField.FINISHED_AT, JobField.CUT}
    assert record[JobField.STATE.encode()].decode() == JobState.PENDING
    cancelled = await client.submit([[3]], n=1)
    assert await client.cancel(cancelled) == 1
    assert await redis.hget(keys.job(trainer, cancelled), JobField.STATE) == JobState.CANCELLED.encode()

    await redis.xadd(keys.work(trainer), {WorkField.ITEM: b"not an item"})  # dead-lettered
    make_worker()
    results = await client.take(4, timeout_s=30, ack="manual")
    assert sorted(r.status for r in results) == ["cancelled", "failed", "ok", "ok"]
    record = await redis.hgetall(keys.job(trainer, job))
    assert {f.decode() for f in record} == set(JobField) - {JobField.CUT}
    assert record[JobField.STATE.encode()].decode() == JobState.DONE
    assert await redis.hget(keys.job(trainer, cancelled), JobField.STATE) == JobState.CANCELLED.encode()
    for _, result in await redis.xrange(keys.results(trainer)):
        assert {f.decode() for f in result} == set(ResultField)
    [(_, dead)] = await redis.xrange(keys.dead)
    assert {f.decode() for f in dead} == set(DeadField)
