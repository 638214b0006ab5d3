"""Result delivery over HTTP: acknowledging by id, and what a disconnect does to a stream.
A real gateway, a real redis-server and an in-process worker (instant engine)."""

from __future__ import annotations

import aiohttp
from helpers import wait_until


async def _finished(gw, policy: str, make_client, groups: int) -> None:
    """`groups` results of trainer alice waiting in her result stream, none read yet."""
    client = make_client("alice")
    await client.submit([[i + 1] for i in range(groups)], n=1, sampling={"max_tokens": 2})

    async def all_written() -> bool:
        return await client.redis.xlen(client.keys.results("alice")) == groups

    await wait_until(all_written, what=f"{groups} results")


async def test_ack_validates_ids_and_acks_only_what_was_read(make_gateway, make_worker, make_client,
                                                             policy):
    gw = await make_gateway()
    make_worker()
    await _finished(gw, policy, make_client, 2)
    base = f"/v1/policies/{policy}/results"
    async with aiohttp.ClientSession(gw.url, headers=gw.headers()) as http:
        for ids, field in ((["1-0", "\u0661-0"], "ids[1]"), (["1-0", "1-0-0"], "ids[1]"),
                           ([" 1-0"], "ids[0]"), (["1-0"] * 10_001, "ids")):
            async with http.post(f"{base}/ack", json={"ids": ids}) as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["field"] == field, (ids[:2], r.status, body)
        async with http.get(base, params={"count": "1"}) as r:
            [read] = (await r.json())["results"]
        client = make_client("alice")
        entries = await client.redis.xrange(client.keys.results("alice"))
        unread = next(e.decode() for e, _ in entries if e.decode() != read["id"])
        async with http.post(f"{base}/ack", json={"ids": [read["id"], unread]}) as r:
            assert await r.json() == {"acked": 1}
        # The unread result was not deleted with it: it is still delivered, and the quota counts it.
        assert await client.outstanding() == 1
        async with http.get(base) as r:
            assert [x["id"] for x in (await r.json())["results"]] == [unread]
