# ruff: noqa: F811 (fixtures imported from swap_fixtures are test arguments by design)
"""Real vLLM workers (CPU) on the 3-primary / 3-replica Redis Cluster of tests/test_cluster.py
(one cluster per session, tests/cluster_fixtures.py): the single-node tests' own bodies, run
again with `redis_url` naming the cluster.

- greedy completions equal transformers', sampled logprobs within float32 tolerance
  (tests/test_engine_vllm.py);
- a version published while groups run, the worker interrupting them: every token labelled
  with, and checked against, the version that produced it (tests/test_swaps_vllm.py).

The module borrows the session's engine (no second engine start) and leaves it on version 0.
"""

import pytest
import redis as redis_sync
from cluster_fixtures import ClusterProcesses, shared_cluster

# Swap fixtures (imported: tests/conftest.py is not ours to grow); `swap_engine` is our own below.
from swap_fixtures import engine_v1, follower, publisher, versions  # noqa: F401

# Collected here as tests of this module, so they run against the cluster's URL.
from test_engine_vllm import (test_greedy_completions_equal_transformers,  # noqa: F401
                              test_sampled_logprobs_match_transformers)
from test_swaps_vllm import test_publish_while_200_groups_run as publish_while_groups_run

from rollq.queue.keys import Keys


@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory) -> ClusterProcesses:
    return shared_cluster(request, tmp_path_factory)


@pytest.fixture(scope="module")
def redis_url(cluster) -> str:
    return cluster.url


@pytest.fixture(autouse=True)
def ran_on_the_cluster(cluster, policy):
    """After each test: its policy's keys are on the primary that serves their slot."""
    yield
    node = cluster.primary_of(Keys(policy).trainers)
    with redis_sync.Redis(port=node.port) as r:
        assert list(r.scan_iter(match=f"rollq:{{{policy}}}:*", count=1000)), \
            f"no key of policy {policy} on port {node.port}"


@pytest.fixture(scope="module")
async def swap_engine(vllm_engine, tiny_model):
    """The session's float32 engine (engine_v1 puts it on version 1: the same weights), put
    back on version 0 for the tests that run after this module."""
    yield vllm_engine
    if vllm_engine.version != 0:
        await vllm_engine.swap(0, str(tiny_model))


async def test_publish_while_groups_run_with_an_interrupting_swap(publisher, follower, versions, caplog):
    """Interrupt mode: the cut samples carry two segments, each checked against its version."""
    await publish_while_groups_run("interrupt", None, publisher, follower, versions, caplog)
