"""Images on the wire, without an engine: stored once per content in a real Redis, limits named,
data URLs converted and remote URLs refused, hostile files refused before any pixel is allocated."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import resource
import time

import pytest
from helpers import drop_a_reply
from PIL import Image
from vlm import encoded, hostile_images, noise_image

from rollq.images import (REF_SCHEME, ImageLoader, ImageRef, chat_images, chat_with_images,
                          digest_of)
from rollq.engine.instant import InstantEngine
from rollq.protocol import (MAX_GROUP_PIXELS, MAX_IMAGE_PIXELS, MAX_IMAGES, Chat, InvalidInput, Sampling,
                            WorkItem, decode_item, encode, pack_tokens)

TRAINER = "trainer"
"""make_client's default trainer id."""
IMAGE = encoded(noise_image(1, (600, 600)))  # ~1 MB: random pixels do not compress


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


async def policy_bytes(redis, pattern: str) -> dict[str, int]:
    return {key.decode(): await redis.memory_usage(key) async for key in redis.scan_iter(match=pattern)}


async def test_an_image_in_100_groups_and_two_jobs_is_stored_once(make_client, redis, policy):
    assert len(IMAGE) > 1_000_000
    client = make_client()
    await client.submit([[1, 7, 20]] * 100, 8, images=[[IMAGE]] * 100, job_id="one")
    await client.submit([[1, 7, 30]] * 10, 8, images=[[IMAGE]] * 10, job_id="two")
    stored = await policy_bytes(redis, f"rollq:{{{policy}}}:image:*")
    assert list(stored) == [client.keys.image(TRAINER, digest_of(IMAGE))]
    assert await redis.strlen(client.keys.image(TRAINER, digest_of(IMAGE))) == len(IMAGE)
    everything = await policy_bytes(redis, f"rollq:{{{policy}}}:*")
    image_key = everything[client.keys.image(TRAINER, digest_of(IMAGE))]
    total = sum(everything.values())
    # 110 groups of 8 samples, one ~1 MB image: ~1 MB in all, not 110 (or 880) MB.
    print(f"\nimage file {len(IMAGE)} B, its key {image_key} B (MEMORY USAGE); all keys of the "
          f"policy {total} B; the image once per group would be {110 * len(IMAGE)} B")
    assert image_key < 1.3 * len(IMAGE) and total - image_key < 200_000
    entries = await redis.xrange(client.keys.work("trainer"), count=1)
    item = decode_item(entries[0][1][b"d"])
    assert item.images == [digest_of(IMAGE)] and len(entries[0][1][b"d"]) < 300


async def test_references_extend_the_image_and_a_missing_one_is_refused(make_client, redis):
    client = make_client()
    ref = await client.upload_image(IMAGE, ttl_s=60)
    assert isinstance(ref, ImageRef)
    assert 0 < await redis.ttl(client.keys.image(TRAINER, ref.digest)) <= 60
    await client.submit([[1, 7]], 1, images=[[ref]], deadline_s=86_400)
    # A job naming the image keeps it at least as long as the job may wait (never shortened).
    assert await redis.ttl(client.keys.image(TRAINER, ref.digest)) > 86_400
    missing = ImageRef(digest_of(b"never uploaded"))
    with pytest.raises(InvalidInput, match="not stored") as e:
        await client.submit([[1, 7]], 1, images=[[missing]])
    assert e.value.field == "images"


async def test_a_trainers_images_stay_within_its_budget_until_their_holds_expire(make_client, redis,
                                                                                   monkeypatch):
    """Image bytes are outside the prompt byte quota (stored once, shared): each trainer's distinct
    images count against its own budget until a hold's TTL ends, a repeated image never twice,
    not even when a dropped connection makes redis-py send the script again."""
    other = encoded(noise_image(2, (600, 600)))
    client = make_client(max_image_bytes=len(IMAGE) + len(other) // 2)
    lost = drop_a_reply(monkeypatch, client.redis, "EVALSHA",
                        lambda reply: isinstance(reply, list) and len(reply) == 2 and reply[0] == b"ok")
    await client.submit([[1, 7]], 1, images=[[IMAGE]], job_id="first")
    assert lost and await redis.get(client.keys.image_bytes("trainer")) == str(len(IMAGE)).encode()
    await client.submit([[1, 7]] * 3, 1, images=[[IMAGE]] * 3, job_id="again")  # held already
    with pytest.raises(InvalidInput, match=f"hold {len(IMAGE)} bytes; these add {len(other)} more, "
                                           r"over its budget max_image_bytes=\d+") as e:
        await client.submit([[1, 7]], 1, images=[[other]], job_id="over")
    assert e.value.field == "images"
    assert not await redis.exists(client.keys.image(TRAINER, digest_of(other)))
    with pytest.raises(KeyError):
        await client.status("over")  # refused before anything was queued
    await make_client("bob").submit([[1, 7]], 1, images=[[other]])  # bob's budget is his own
    # A hold ends with its TTL: then the bytes count no more.
    small = make_client("carol", max_image_bytes=len(IMAGE) + 1024)
    await small.upload_image(IMAGE, ttl_s=1)
    with pytest.raises(InvalidInput, match="max_image_bytes"):
        await small.upload_image(other, ttl_s=1)
    await asyncio.sleep(1.5)
    await small.upload_image(other, ttl_s=60)
    assert await redis.get(small.keys.image_bytes("carol")) == str(len(other)).encode()
    with pytest.raises(InvalidInput, match="ttl_s"):
        await small.upload_image(other, ttl_s=0)


async def test_the_gateway_refuses_images_over_a_trainers_budget_naming_it(make_gateway, policy):
    import aiohttp

    gw = await make_gateway(max_image_bytes=len(IMAGE) // 2)
    body = {"model": policy, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": data_url(IMAGE)}}]}]}
    async with (aiohttp.ClientSession(gw.url, headers=gw.headers()) as http,
                http.post("/v1/chat/completions", data=io.BytesIO(json.dumps(body).encode()),
                          headers={"Content-Type": "application/json"}) as r):
        error = (await r.json())["error"]  # (a ~1.4 MB body: aiohttp wants it as a stream)
    assert r.status == 400 and error["param"] == "images", error
    assert f"over its budget max_image_bytes={len(IMAGE) // 2}" in error["message"], error


@pytest.mark.parametrize("name", list(hostile_images()))
async def test_hostile_files_are_refused_by_the_client_naming_the_field(make_client, name):
    data = hostile_images()[name]
    client = make_client()
    if name == "truncated jpeg":  # its header is whole: only decoding finds it (the worker does)
        await client.submit([[1, 7]], 1, images=[[data]])
        return
    with pytest.raises(InvalidInput) as e:
        await client.submit([[1, 7], [1, 7]], 1, images=[[], [IMAGE, data]])
    assert e.value.field == "images[1][1]"
    expected = {"png bomb": "too many pixels", "gif": "a GIF file", "svg": "an SVG file",
                "random bytes": "no image format recognized"}[name]
    assert expected in str(e.value)


async def test_limits_name_the_field_and_the_limit(make_client):
    client = make_client()
    with pytest.raises(InvalidInput, match=f"limit is {MAX_IMAGES}") as e:
        await client.submit([[1]], 1, images=[[IMAGE] * (MAX_IMAGES + 1)])
    assert e.value.field == "images[0]"
    big = encoded(noise_image(2, (4097, 4096)).convert("L"), "PNG", compress_level=0)
    with pytest.raises(InvalidInput, match=f"4097 x 4096 = .* the limit is {MAX_IMAGE_PIXELS}") as e:
        await client.submit([[1]], 1, images=[[big[:8 * 1024 * 1024]]])
    assert e.value.field == "images[0][0]"
    three = encoded(Image.new("L", (4096, 3000)))  # each within the limits, together 1.5 times them
    with pytest.raises(InvalidInput, match=f"pixels together; the limit is {MAX_GROUP_PIXELS}") as e:
        await client.submit([[1]], 1, images=[[three] * 3])
    assert e.value.field == "images[0]"
    with pytest.raises(InvalidInput, match="one list of images per group"):
        await client.submit([[1], [2]], 1, images=[[IMAGE]])


async def test_chat_data_urls_become_stored_images_and_remote_urls_are_refused(make_client, redis):
    png, webp = IMAGE, encoded(noise_image(3), "WEBP", lossless=True)
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "w20"}, {"type": "image_url", "image_url": {"url": data_url(png)}},
        {"type": "image_url", "image_url": {"url": data_url(webp, "image/webp")}}]}]
    rewritten, digests = chat_images(messages, "conversations[0]", found := {})
    assert digests == [digest_of(png), digest_of(webp)] and set(found) == set(digests)
    assert rewritten[0]["content"][1] == {"type": "image_url",
                                          "image_url": {"url": REF_SCHEME + digest_of(png)}}
    assert messages[0]["content"][1]["image_url"]["url"].startswith("data:")  # the caller's copy
    client = make_client()
    await client.submit_chat([messages], 1)
    assert await redis.exists(client.keys.image(TRAINER, digest_of(webp)))
    for url in ("https://example.com/cat.png", "file:///etc/passwd", "data:text/plain;base64,AAAA"):
        bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
        with pytest.raises(InvalidInput, match="only data:image") as e:
            await client.submit_chat([bad], 1)
        assert e.value.field == "conversations[0][0].content[0].image_url.url"
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AAAA"}}]}]
    with pytest.raises(InvalidInput, match="text or image_url") as e:
        await client.submit_chat([audio], 1)
    assert e.value.field == "conversations[0][0].content[0].type"


def test_the_worker_takes_no_media_but_the_groups_images():
    image = noise_image(4)
    digest = digest_of(b"x")
    ok = Chat([{"role": "user", "content": [{"type": "image_url",
                                             "image_url": {"url": REF_SCHEME + digest}}]}])
    [message] = chat_with_images(ok, [digest], [image]).messages
    assert message["content"] == [{"type": "image_pil", "image_pil": image}]
    # A trainer writing items itself could name a URL or embeddings: the worker fetches and
    # unpickles nothing.
    for part in ({"type": "image_url", "image_url": {"url": "http://10.0.0.1/x.png"}},
                 {"type": "image_embeds", "image_embeds": "AAAA"},
                 {"type": "image_url", "image_url": {"url": REF_SCHEME + digest_of(b"other")}}):
        with pytest.raises(InvalidInput) as e:
            chat_with_images(Chat([{"role": "user", "content": [part]}]), [digest], [image])
        assert e.value.field == "chat.messages[0].content[0]"


async def test_the_worker_decodes_hostile_bytes_into_errors_with_bounded_memory(redis, policy):
    """Bytes that skipped the client's checks (written to Redis directly): each is an error
    naming the image, and the bomb allocates nothing (it would take 2.5 GB)."""
    from rollq.queue.keys import Keys

    keys = Keys(policy)
    loader = ImageLoader(redis, keys)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reasons = {}
    for name, data in hostile_images().items():
        await redis.set(keys.image("t", digest_of(data)), data)
        with pytest.raises(InvalidInput) as e:
            await loader.load([digest_of(data)], "t")
        reasons[name] = str(e.value)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    print(reasons, f"max RSS grew by {grown_mb:.0f} MB")
    assert grown_mb < 100
    assert "too many pixels" in reasons["png bomb"] and "truncated" in reasons["truncated jpeg"]
    assert all(r.startswith("images[0]: ") for r in reasons.values())
    # A stored image whose bytes are not its digest's is refused too.
    await redis.set(keys.image("t", digest_of(b"claimed")), IMAGE)
    with pytest.raises(InvalidInput, match="do not hash"):
        await loader.load([digest_of(b"claimed")], "t")
    flat = encoded(Image.new("L", (4096, 3000)))
    await redis.set(keys.image("t", digest_of(flat)), flat)
    with pytest.raises(InvalidInput, match="pixels together") as e:  # before decoding any
        await loader.load([digest_of(flat)] * 3, "t")
    assert e.value.field == "images"
    await redis.set(keys.image("t", digest_of(IMAGE)), IMAGE)
    [decoded] = await loader.load([digest_of(IMAGE)], "t")
    assert decoded.size == (600, 600)


@pytest.mark.parametrize("skew_s", [-8 * 86_400, 8 * 86_400])
async def test_image_holds_expire_on_redis_clock_whatever_the_clients(make_client, redis, monkeypatch,
                                                                      skew_s):
    """Holds and image TTLs keep one clock, Redis's: a client whose clock lags by more than an
    image's TTL (or runs ahead) keeps its images counted against the trainer's budget while Redis
    stores them. With the client's clock (before): a lagging client's hold was dropped by the next
    submit from a right clock (and the trainer could store more than its budget), one ahead
    dropped every hold of its trainer's other clients."""
    other = encoded(noise_image(2, (600, 600)))
    skewed = make_client(max_image_bytes=len(IMAGE) + len(other) - 1)
    right = make_client(max_image_bytes=len(IMAGE) + len(other) - 1)
    first, second = (skewed, right) if skew_s < 0 else (right, skewed)
    now = time.time()
    with monkeypatch.context() as m:
        if first is skewed:
            m.setattr(time, "time", lambda: now + skew_s)
        await first.upload_image(IMAGE)
    assert await redis.ttl(first.keys.image(TRAINER, digest_of(IMAGE))) > 86_400
    with monkeypatch.context() as m, pytest.raises(InvalidInput, match="max_image_bytes"):
        if second is skewed:
            m.setattr(time, "time", lambda: now + skew_s)
        await second.upload_image(other)
    assert await redis.get(right.keys.image_bytes(TRAINER)) == str(len(IMAGE)).encode()


class _ImageReadingEngine(InstantEngine):
    """The instant engine, but reading each group's images as the vLLM engine does (through the
    worker's `ImageLoader`; a missing image fails the group): the test is about which keys a
    worker reads, not about vision (tests/test_images_vllm.py)."""

    class images:
        loader = None

    async def generate_group(self, item):
        from rollq.engine.base import GroupError

        try:
            loaded = await self.images.loader.load(item.images)
        except InvalidInput as e:
            raise GroupError(f"image refused: {e}") from None
        assert all(im.size == (600, 600) for im in loaded)
        return await super().generate_group(item)


async def test_a_worker_reads_the_images_of_the_trainer_whose_stream_the_group_came_from(
        make_client, make_worker):
    """Images are per trainer: a group reads its own trainer's copy (its derived ids' too), and a
    group naming an image only another trainer stored fails "not stored": a trainer cannot get
    another's image into its samples by naming its digest."""
    make_worker(engine=_ImageReadingEngine(delay_s=0.001))
    alice, bob = make_client("alice"), make_client("bob")
    ref = await alice.upload_image(IMAGE)
    await alice.submit([[1]], 1, images=[[ref]], job_id="hers")
    [hers] = await alice.take(1, timeout_s=30)
    assert hers.status == "ok", hers.reason
    # bob forges a reference to alice's digest past his client's check (the worker is the gate).
    item = WorkItem("forged", 0, pack_tokens([2]), 1, Sampling(max_tokens=2), 0.0, images=[ref.digest])
    await bob.redis.sadd(bob.keys.trainers, "bob")
    await bob.redis.xadd(bob.keys.work("bob"), {"d": encode(item)})
    [forged] = await bob.take(1, timeout_s=30)
    assert forged.status == "failed" and "is not stored" in forged.reason
