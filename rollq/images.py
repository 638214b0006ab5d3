"""Images of prompt groups: checked where they enter, stored once per content, decoded safely.

A group names its images by BLAKE3 digest (`WorkItem.images`); the bytes live once per trainer
under `Keys.image(trainer, digest)`, so a group of 8 samples with a 1 MB image puts 1 MB on Redis,
and the same image in 100 groups or jobs of one trainer is still stored once. Each submit that
names an image extends its expiry to at least `ttl_s` from now (never shortens it): it outlives
every job that names it as long as jobs finish within `ttl_s` of their submit (the default is a
week; a job's deadline, when longer, extends it).

Where images come from: encoded files (PNG, JPEG, WebP: the formats checked, by Pillow, from
the header, without decoding pixels), `ImageRef`s of images uploaded before, and in chats,
`image_url` parts holding `data:` URLs. Remote URLs are refused: workers fetch nothing from the
network. The worker reads the bytes back, checks their digest, and decodes them with Pillow in
a thread, after checking the dimensions in the header, so a decompression bomb is refused
before any pixel is allocated; a truncated or foreign file is an `InvalidInput` naming it.
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import binascii
import copy
import io
import re
from typing import Any

import blake3
import msgspec
from PIL import Image, UnidentifiedImageError

from rollq.protocol import (DERIVED_SEPARATOR, MAX_GROUP_PIXELS, MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS,
                            MAX_IMAGES, Chat, InvalidInput)
from rollq.queue.keys import Keys
from rollq.queue.names import Reply

FORMATS = ("PNG", "JPEG", "WEBP")
"""What Pillow may open: everything else (GIF, SVG, TIFF, ...) is refused by name."""
IMAGE_TTL_S = 7 * 86_400
REF_SCHEME = "rollq-image:"
"""A chat's image_url part on the wire: `rollq-image:<digest>` (the bytes are in Redis)."""
_DATA_URL = re.compile(r"data:image/[a-z0-9.+-]+;base64,", re.IGNORECASE)
_TEXT_PARTS = {"text", "input_text", "output_text", "refusal", "thinking"}


class ImageRef(msgspec.Struct, frozen=True):
    """An image already stored (`RolloutClient.upload_image`): submits name it by digest only."""

    digest: str


def digest_of(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def check_image(data: Any, field: str) -> tuple[str, int, int]:
    """An encoded image's format and size, read from its header only; InvalidInput naming
    `field` and the limit if it is not a PNG, JPEG or WebP file within the limits."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise InvalidInput(field, f"must be the bytes of a PNG, JPEG or WebP file (or an ImageRef), "
                                  f"not {type(data).__name__}")
    if len(data) > MAX_IMAGE_BYTES:
        raise InvalidInput(field, f"is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES}")
    try:
        with Image.open(io.BytesIO(data), formats=FORMATS) as im:
            fmt, (width, height) = im.format, im.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # Pillow's own bomb check runs inside open() on sizes far above ours.
        raise InvalidInput(field, f"has too many pixels ({e}); the limit is {MAX_IMAGE_PIXELS}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        seen = _looks_like(bytes(data[:256])) or (
            "no image format recognized" if isinstance(e, UnidentifiedImageError) else _first_line(e))
        raise InvalidInput(field, f"is not a PNG, JPEG or WebP image ({seen})") from None
    if width * height > MAX_IMAGE_PIXELS:
        raise InvalidInput(field, f"is {width} x {height} = {width * height} pixels; the limit is "
                                  f"{MAX_IMAGE_PIXELS}")
    return fmt, width, height


def decode_image(data: bytes, field: str) -> Image.Image:
    """Decode all pixels (blocking: run it in a thread). The header is checked first, so no
    decode allocates more than MAX_IMAGE_PIXELS x 4 bytes; a truncated file raises, never pads."""
    check_image(data, field)
    try:
        im = Image.open(io.BytesIO(data), formats=FORMATS)
        im.load()  # animated PNG/WebP: the first frame, as vLLM's own loader takes
    except (Image.DecompressionBombError, Image.DecompressionBombWarning, UnidentifiedImageError,
            OSError, SyntaxError, ValueError) as e:
        raise InvalidInput(field, f"cannot be decoded ({_first_line(e)})") from None
    return im


def from_data_url(url: Any, field: str) -> bytes:
    """The bytes of a `data:image/...;base64,` URL; any other URL (http, file, ...) is refused."""
    if not isinstance(url, str):
        raise InvalidInput(field, "must be a string: a data:image/...;base64,... URL")
    match = _DATA_URL.match(url)
    if match is None:
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise InvalidInput(field, f"{shown!r}: only data:image/...;base64, URLs are taken (rollq "
                                  f"fetches nothing from the network or the disk)")
    payload = url[match.end():]
    if len(payload) > (MAX_IMAGE_BYTES + 2) // 3 * 4:
        raise InvalidInput(field, f"holds more than {MAX_IMAGE_BYTES} bytes; the limit is {MAX_IMAGE_BYTES}")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise InvalidInput(field, f"is not valid base64 ({e})") from None


_MAGIC = [(b"GIF8", "a GIF file"), (b"<svg", "an SVG file"), (b"<?xml", "an XML file"),
          (b"II*\x00", "a TIFF file"), (b"MM\x00*", "a TIFF file"), (b"BM", "a BMP file"),
          (b"%PDF", "a PDF file")]


def _looks_like(head: bytes) -> str:
    """What a refused file seems to be, for the message only (Pillow decides what is refused)."""
    head = head.lstrip()
    return next((name for magic, name in _MAGIC if head.startswith(magic)), "")


def check_group_pixels(sizes: list[tuple[int, int]], field: str) -> None:
    total = sum(w * h for w, h in sizes)
    if total > MAX_GROUP_PIXELS:
        raise InvalidInput(field, f"its images have {total} pixels together; the limit is {MAX_GROUP_PIXELS}")


def _first_line(e: Exception) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


# --- Trainer side: from what the caller gave to digests, checked, and stored ------------------

def group_images(images: Any, field: str, found: dict[str, bytes | None]) -> list[str]:
    """One group's images (bytes or ImageRef) -> digests; each new image's bytes go into `found`
    (digest -> bytes, or None for a reference that must already be stored)."""
    if images is None:
        return []
    if isinstance(images, (bytes, bytearray, memoryview, ImageRef)):
        images = [images]
    if not isinstance(images, (list, tuple)):
        raise InvalidInput(field, "must be a list of images (bytes of PNG/JPEG/WebP files or ImageRefs)")
    if len(images) > MAX_IMAGES:
        raise InvalidInput(field, f"{len(images)} images in one group; the limit is {MAX_IMAGES}")
    digests, sizes = [], []
    for i, image in enumerate(images):
        if isinstance(image, ImageRef):
            if not re.fullmatch(r"[0-9a-f]{64}", image.digest):
                raise InvalidInput(f"{field}[{i}]", "ImageRef.digest must be 64 lowercase hex digits")
            found.setdefault(image.digest, None)
            digests.append(image.digest)
            continue
        sizes.append(check_image(image, f"{field}[{i}]")[1:])
        data = bytes(image)
        digest = digest_of(data)
        found[digest] = data
        digests.append(digest)
    check_group_pixels(sizes, field)  # references are checked by the worker
    return digests


def chat_images(messages: list[dict[str, Any]], field: str,
                found: dict[str, bytes | None]) -> tuple[list[dict[str, Any]], list[str]]:
    """A conversation whose `image_url` parts hold data URLs -> the same conversation with
    `rollq-image:<digest>` URLs (a copy; the caller's stays), and the digests in order."""
    digests: list[str] = []
    sizes: list[tuple[int, int]] = []
    out = copy.deepcopy(messages)
    for m, message in enumerate(out):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for k, part in enumerate(content):
            at = f"{field}[{m}].content[{k}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _TEXT_PARTS:
                continue
            if kind != "image_url":
                raise InvalidInput(f"{at}.type", f"is {kind!r}: content parts are text or image_url")
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            data = from_data_url(url, f"{at}.image_url.url")
            sizes.append(check_image(data, f"{at}.image_url.url")[1:])
            digest = digest_of(data)
            found[digest] = data
            digests.append(digest)
            content[k] = {"type": "image_url", "image_url": {"url": REF_SCHEME + digest}}
    if len(digests) > MAX_IMAGES:
        raise InvalidInput(field, f"{len(digests)} images in one conversation; the limit is {MAX_IMAGES}")
    check_group_pixels(sizes, field)
    return out, digests


async def store_images(script: Any, keys: Keys, trainer: str, found: dict[str, bytes | None],
                       ttl_s: int, budget: int) -> int:
    """Make every image of `found` live at least `ttl_s` more seconds, writing only those Redis
    does not hold, within the trainer's image budget (`store_images.lua`); returns the bytes
    written. InvalidInput for a reference (None) to an image Redis no longer holds (upload it
    again), or for images that would take the trainer over `budget` bytes."""
    if not found:
        return 0
    digests = list(found)
    args: list[Any] = [ttl_s, budget]
    for digest in digests:
        args += [digest, found[digest] or b""]
    owner = image_owner(trainer)
    reply = await script(keys=[keys.image_holds(trainer), keys.image_bytes(trainer),
                               *(keys.image(owner, d) for d in digests)], args=args)
    word = Reply(reply[0].decode())
    if word is Reply.GONE:
        raise InvalidInput("images", f"image {reply[1].decode()} is not stored (expired or never "
                                     "uploaded): upload it again")
    if word is Reply.BYTES:
        raise InvalidInput("images", f"the images trainer {trainer!r} keeps stored (each until its "
                                     "TTL after the last submit naming it) hold "
                                     f"{int(reply[1])} bytes; these add {int(reply[2])} more, over its "
                                     f"budget max_image_bytes={budget}")
    return int(reply[1])


# --- Worker side: digests -> checked, decoded images --------------------------------------------

def image_owner(trainer: str) -> str:
    """Whose images a trainer id stores and reads: a derived id's user (`alice~purpose~owner`
    -> `alice`), so an image alice uploaded serves her episodes and gateway requests too."""
    return trainer.split(DERIVED_SEPARATOR, 1)[0]


SERVING_FOR: contextvars.ContextVar[str] = contextvars.ContextVar("rollq_images_serving_for")
"""The trainer whose group the current task serves: the worker sets it per group from the stream
it read the group from (`GroupServer.serve`). A work item carries no trainer id, so a forged item
cannot name another trainer's images."""


class ImageLoader:
    """Reads a group's images from Redis and decodes them off the event loop."""

    def __init__(self, redis: Any, keys: Keys):
        self.redis, self.keys = redis, keys

    async def load(self, digests: list[str], trainer: str | None = None) -> list[Image.Image]:
        """`trainer`: whose images (default: the group being served, `SERVING_FOR`)."""
        owner = image_owner(trainer or SERVING_FOR.get())
        pipe = self.redis.pipeline(transaction=False)
        for digest in digests:
            pipe.get(self.keys.image(owner, digest))
        blobs = await pipe.execute()
        for i, (digest, data) in enumerate(zip(digests, blobs)):
            if data is None:
                raise InvalidInput(f"images[{i}]", f"image {digest} is not stored (expired?): "
                                                   f"submit the group again")
            if digest_of(data) != digest:
                raise InvalidInput(f"images[{i}]", f"the bytes stored under {digest} do not hash to it")
        # Every header before any pixel: the group's total is bounded, not only each image.
        check_group_pixels([check_image(data, f"images[{i}]")[1:] for i, data in enumerate(blobs)],
                           "images")
        return await asyncio.to_thread(
            lambda: [decode_image(data, f"images[{i}]") for i, data in enumerate(blobs)])


def chat_with_images(chat: Chat, digests: list[str], images: list[Image.Image]) -> Chat:
    """The worker's conversation for vLLM's renderer: each `rollq-image:` part becomes an
    `image_pil` part holding the decoded image. Any other media part (a remote or file URL, image
    embeddings, audio, video) is refused: the worker fetches nothing and unpickles nothing."""
    by_digest = dict(zip(digests, images))
    messages = []
    for m, message in enumerate(chat.messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            messages.append(message)
            continue
        parts = []
        for k, part in enumerate(content):
            at = f"chat.messages[{m}].content[{k}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in _TEXT_PARTS:
                parts.append(part)
                continue
            url = part.get("image_url") if kind == "image_url" else None
            url = url.get("url") if isinstance(url, dict) else url
            if not (isinstance(url, str) and url.startswith(REF_SCHEME)):
                raise InvalidInput(at, f"a {kind!r} part that is not an image of the group: send "
                                       f"images as data URLs through the client")
            digest = url[len(REF_SCHEME):]
            if digest not in by_digest:
                raise InvalidInput(at, f"image {digest[:16]}... is not among the group's images")
            parts.append({"type": "image_pil", "image_pil": by_digest[digest]})
        messages.append({**message, "content": parts})
    return msgspec.structs.replace(chat, messages=messages)
