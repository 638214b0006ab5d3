"""The `observe` scope guards every trainer's names, queue counts and the workers' errors and
failure reasons on every gateway route that shows them, not only /metrics and the dashboard."""

from __future__ import annotations

import json

import aiohttp

from rollq.queue.keys import Keys
from rollq.queue.workers import Failure, Totals
from rollq.worker.heartbeat import Heartbeat

SECRET = "alice-secret-job"
"""A job id of alice's and the error text a worker reports: only an observer may read either."""


async def test_status_and_workers_show_others_only_to_observers(make_gateway, make_client, redis,
                                                                policy):
    """bob (rollouts only) sees the versions, the workers' versions and states, and his own
    queue; alice (observe) sees every trainer's queue and the workers' last error and failures.
    The other routes that list workers (/server_info, /get_world_size) show neither. Before
    (review-turn3): /status and /workers showed bob alice's name, counts and the errors."""
    gw = await make_gateway()
    await make_client("alice").submit([[1]], n=1, job_id=SECRET)
    await make_client("bob").submit([[2]], n=1, job_id="bobs")
    failure = Failure(0.0, SECRET, 0, "failed", f"engine error in {SECRET}")
    await Heartbeat(redis, Keys(policy), "w1", ttl_s=60).beat(
        version=0, inflight=1, state="serving", last_error=f"redis: lost {SECRET}",
        totals=Totals(groups={"failed": 1}, failures=[failure]))
    async with aiohttp.ClientSession(gw.url) as http:
        async def get(path: str, who: str):
            async with http.get(path, headers=gw.headers(who)) as r:
                assert r.status == 200, await r.text()
                return await r.json()

        status = f"/v1/policies/{policy}/status"
        workers = f"/v1/policies/{policy}/workers"
        mine = await get(status, "bob")
        assert [q["trainer"] for q in mine["queues"]] == ["bob"] and mine["queues"][0]["waiting"] == 1
        [w] = mine["workers"]
        assert (w["worker_id"], w["version"], w["state"]) == ("w1", 0, "serving")
        assert w["last_error"] == "" and w["totals"]["failures"] == [] and not w["totals"]["groups"]
        assert await get(workers, "bob") == mine["workers"]
        for path in (status, workers, f"/server_info?model={policy}", f"/get_world_size?model={policy}"):
            body = json.dumps(await get(path, "bob"))
            assert SECRET not in body and "alice" not in body, (path, body)

        everything = await get(status, "alice")
        assert [q["trainer"] for q in everything["queues"]] == ["alice", "bob"]
        [w] = await get(workers, "alice")
        assert SECRET in w["last_error"] and w["totals"]["failures"][0][1] == SECRET
