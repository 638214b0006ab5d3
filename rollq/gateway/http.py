"""Bodies in and out (JSON or msgpack, by Content-Type and Accept) and errors as JSON.

Every error a caller can cause leaves here as `{"error": {"message", "type", "field", "param",
"code"}}` with the matching HTTP status: the shape OpenAI clients parse, plus the field name.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from rollq.gateway.schema import Error, ErrorBody
from rollq.protocol import InvalidInput, QueueFull

JSON = "application/json"
MSGPACK = "application/msgpack"
_MSGPACK_TYPES = {MSGPACK, "application/x-msgpack", "application/vnd.msgpack"}

T = TypeVar("T")
log = logging.getLogger("rollq.gateway")

_KINDS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 409: "conflict_error", 413: "request_too_large",
          415: "invalid_request_error", 429: "rate_limit_error", 504: "timeout_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, field: str | None = None):
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


def error_body(status: int, message: str, field: str | None = None) -> bytes:
    kind = _KINDS.get(status, "server_error")
    return msgspec.json.encode(ErrorBody(Error(message, kind, field, field, status)))


def error_response(status: int, message: str, field: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(status, message, field), content_type=JSON,
                        headers=headers)


_PATH = re.compile(r"`\$\.?([^`]*)`")
_UNKNOWN = re.compile(r"(?:unknown|missing required) field `([^`]*)`$")


BODY_TIMEOUT = web.AppKey("body_timeout_s", float)


class BodyBudget:
    """Bytes of request bodies being read, decoded and handled at once. A JSON body costs the
    gateway many times its size while it is decoded and turned into work items (a 16 MiB submit
    of token ids: ~140 MiB), so concurrent large bodies take turns instead of all at once."""

    def __init__(self, total: int, largest: int):
        self.total = total
        self.largest = largest
        """What a body without a Content-Length may grow to (the body cap)."""
        self.free = total
        self._changed = asyncio.Condition()

    async def take(self, size: int, wait_s: float) -> bool:
        """Reserve `size` bytes, waiting up to `wait_s`; False if they did not come free."""
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: self.free >= size), wait_s)
            except TimeoutError:
                return False
            self.free -= size
            return True

    async def give(self, size: int) -> None:
        async with self._changed:  # uncontended: taken only between awaits, so this never waits
            self.free += size
            self._changed.notify_all()


BODY_BUDGET = web.AppKey("body_budget", BodyBudget)


@web.middleware
async def bounded_bodies(request: web.Request, handler):
    """Reserve a request's body bytes (its Content-Length; the cap when it has none) before the
    handler reads it. aiohttp buffers only ~128 KiB of a body nobody reads yet, so a request
    waiting here holds a socket, not memory. Waits up to the body timeout, then a 503."""
    budget = request.app[BODY_BUDGET]
    if not request.body_exists:
        return await handler(request)
    size = min(budget.largest if request.content_length is None else request.content_length, budget.total)
    if not await budget.take(size, request.app[BODY_TIMEOUT]):
        return error_response(503, f"the gateway is reading {budget.total} bytes of request bodies "
                                   "already, as many as it may at once; retry shortly",
                              headers={"Retry-After": "1"})
    try:
        return await handler(request)
    finally:
        await budget.give(size)


async def read_body(request: web.Request, cls: type[T]) -> T:
    """The request body decoded into `cls`; 400 naming the field when it does not fit."""
    return decode_body(request, await body_bytes(request), cls)


async def body_bytes(request: web.Request) -> bytes:
    """The request body's bytes, within the body timeout; 400 if there are none."""
    limit = request.app[BODY_TIMEOUT]
    try:  # a client trickling its body would otherwise hold the connection for good
        async with asyncio.timeout(limit):
            data = await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body took longer than {limit} s to arrive") from None
    if not data:
        raise ApiError(400, "the request has no body; send a JSON object")
    return data


def decode_body(request: web.Request, data: bytes, cls: type[T]) -> T:
    """`data` decoded into `cls` by the request's Content-Type; 400 naming the field."""
    kind = request.content_type
    try:
        if kind in _MSGPACK_TYPES:
            return msgspec.msgpack.decode(data, type=cls)
        if kind in (JSON, "application/octet-stream", "") or kind.endswith("+json"):
            return msgspec.json.decode(data, type=cls)
    except msgspec.ValidationError as e:
        found = _PATH.search(str(e)) or _UNKNOWN.search(str(e))  # a top-level field has no path
        raise ApiError(400, str(e), found.group(1) if found else None) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"the body is not valid {'msgpack' if kind in _MSGPACK_TYPES else 'JSON'}: {e}") \
            from None
    except RecursionError:  # free-form fields (`meta`, `sampling.extra`) decode to any depth
        raise ApiError(400, "the body is nested too deeply (arrays and objects inside each other "
                            "beyond the decoder's limit of about 1000 levels); flatten meta and "
                            "sampling.extra") from None
    raise ApiError(415, f"Content-Type {kind!r} is not supported; send {JSON} or {MSGPACK}")


def wants_msgpack(request: web.Request) -> bool:
    accept = request.headers.get("Accept", "")
    return any(t in accept for t in _MSGPACK_TYPES)


def reply(request: web.Request, obj: Any, status: int = 200) -> web.Response:
    if wants_msgpack(request):
        return web.Response(status=status, body=msgspec.msgpack.encode(obj), content_type=MSGPACK)
    return web.Response(status=status, body=msgspec.json.encode(obj), content_type=JSON)


@web.middleware
async def errors(request: web.Request, handler):
    """Turn what a caller did wrong into a JSON error; anything else is a logged 500."""
    try:
        return await handler(request)
    except ApiError as e:
        headers = {"WWW-Authenticate": 'Bearer realm="rollq"'} if e.status == 401 else None
        return error_response(e.status, e.message, e.field, headers)
    except InvalidInput as e:
        return error_response(400, str(e), e.field)
    except QueueFull as e:
        return error_response(429, str(e) or "the trainer's quota of outstanding groups is full; "
                                             "retry later or consume results")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(e.status, e.text or e.reason)
    except (RedisConnectionError, RedisTimeoutError) as e:
        # Not the gateway's fault nor the caller's: say so, and that a retry may succeed (the
        # openai SDK and most HTTP clients retry a 503), without a traceback per request.
        log.warning("%s %s: Redis unreachable (%s)", request.method, request.path, e)
        return error_response(503, "Redis is unreachable (restarting, or a network fault); retry "
                                   "shortly", headers={"Retry-After": "1"})
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        return error_response(500, "internal error; the gateway log has the details")
