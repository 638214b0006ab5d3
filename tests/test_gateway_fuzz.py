"""Issue 28, acceptance 3: fuzzed chat-completion and episode bodies (Hypothesis, bounded) never
get a 5xx and never hang. A gateway process with `--tokenizer` (episodes' messages are rendered
by it), an instant-engine worker serving what is accepted, and arbitrary JSON in every free-form
field: roles, contents, template arguments, sampling, nested up to 1,200 deep."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
import requests
from conftest import reserved_port
from gateway_fixtures import write_tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import stop_process  # noqa: E402
from bench.gateway_soak import start_gateway, start_worker  # noqa: E402

POLICY = f"fuzz{uuid.uuid4().hex[:6]}"
CLIENT_TIMEOUT_S = 60
"""A request unanswered this long is a hang (the gateway's own bounds are 5-30 s)."""

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                    st.text(max_size=20), st.sampled_from(["w10", "w11 w12", "<|user|>", "<s>"]))
values = st.recursive(
    scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


def nest(depth: int, inner: object) -> object:
    for _ in range(depth):
        inner = [inner]
    return inner


deep = st.builds(nest, st.integers(0, 1200), values)
anything = st.one_of(values, deep)
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                           "content": st.one_of(st.text(max_size=30), anything)},
                          optional={"name": st.text(max_size=5), "x": anything, "tool_calls": anything}),
    anything)
messages = st.lists(message, max_size=4)
template_kwargs = st.dictionaries(st.sampled_from(["enable_thinking", "x", "tools", "documents"]), anything,
                                  max_size=3)

chat_bodies = st.fixed_dictionaries(
    {"model": st.just(POLICY), "messages": messages, "timeout_s": st.just(30)},
    optional={"max_tokens": st.integers(-2, 5), "n": st.integers(-1, 3),
              "chat_template_kwargs": template_kwargs, "tools": anything, "temperature": st.floats(-1, 3),
              "logprobs": st.booleans(),
              "top_logprobs": st.integers(-1, 30), "stop": anything, "response_format": anything})
episode_bodies = st.fixed_dictionaries(
    {"sampling": st.one_of(st.just({"max_tokens": 2}), st.dictionaries(st.text(max_size=12), anything,
                                                                         max_size=3))},
    optional={"messages": messages, "prompt": st.one_of(st.lists(st.integers(-5, 600), max_size=5), anything),
              "n": st.integers(-1, 3), "chat_template_kwargs": template_kwargs,
              "episode_id": st.text(max_size=10),
              "ttl_s": st.integers(-1, 10**6), "deadline_s": st.floats(-1, 30)})


@pytest.fixture(scope="module")
def gateway(redis_url, tmp_path_factory):
    from models import make_chat_model

    tmp = tmp_path_factory.mktemp("fuzz")
    tokens = write_tokens(tmp / "tokens.json", POLICY)
    port = reserved_port()
    log = tmp / "gateway.log"
    proc = start_gateway(redis_url, port, "--tokens", str(tmp / "tokens.json"),
                         "--tokenizer", str(make_chat_model(tmp / "chat")), log=str(log))
    worker = start_worker(redis_url, POLICY)
    http = requests.Session()
    http.headers["Authorization"] = f"Bearer {tokens['alice']}"
    yield f"http://127.0.0.1:{port}", http, log
    http.close()
    stop_process(worker)
    stop_process(proc)
    assert "Traceback" not in log.read_text()


def _post(gateway, path: str, body: dict) -> None:
    url, http, log = gateway
    r = http.post(url + path, data=json.dumps(body), headers={"Content-Type": "application/json"},
                  timeout=CLIENT_TIMEOUT_S)
    assert r.status_code < 500, (r.status_code, r.text[:500], json.dumps(body)[:500])
    if r.status_code >= 400:
        assert r.json()["error"]["message"], r.text


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=chat_bodies)
def test_fuzzed_chat_bodies(gateway, body):
    _post(gateway, "/v1/chat/completions", body)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=episode_bodies)
def test_fuzzed_episode_bodies(gateway, body):
    _post(gateway, f"/v1/policies/{POLICY}/episodes", body)
