"""The OpenAPI 3.1 document, built from the gateway's route table and the msgspec types of its
bodies (msgspec writes their JSON Schema), so the document lists exactly the routes served."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from rollq.gateway.schema import ErrorBody

REF = "#/components/schemas/{name}"


@dataclass(frozen=True)
class Param:
    name: str
    default: Any
    minimum: int | None = None
    maximum: int | None = None
    enum: tuple[str, ...] | None = None

    def schema(self) -> dict:
        if self.enum:
            return {"type": "string", "enum": list(self.enum)}
        return {"type": "integer", "default": self.default, "minimum": self.minimum, "maximum": self.maximum}


def openapi_document(routes: list) -> dict:
    types = [ErrorBody] + [t for r in routes for t in (r.body, r.reply) if t is not None]
    schemas, components = msgspec.json.schema_components(types, ref_template=REF)
    by_type = dict(zip(types, schemas))
    paths: dict[str, dict] = {}
    for r in routes:
        op: dict[str, Any] = {"summary": r.summary, "tags": [r.tag],
                              "operationId": f"{r.method.lower()}_{_slug(r.path)}"}
        params = [{"name": name, "in": "path", "required": True,
                   "schema": {"type": "string", "enum": list(r.path_values[name])} if name in r.path_values
                   else {"type": "string", "pattern": "^[A-Za-z0-9._\\-]+$", "maxLength": 128}}
                  for name in re.findall(r"{(\w+)}", r.path)]
        params += [{"name": p.name, "in": "query", "required": False, "schema": p.schema()} for p in r.query]
        if params:
            op["parameters"] = params
        if r.body is not None:
            op["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": by_type[r.body]},
                "application/msgpack": {"schema": by_type[r.body]}}}
        content = {}
        if r.reply is not None:
            content = {"application/json": {"schema": by_type[r.reply]},
                       "application/msgpack": {"schema": by_type[r.reply]}}
        elif r.media:
            content = {r.media: {"schema": {"type": "object"} if r.media == "application/json"
                                 else {"type": "string"}}}
        op["responses"] = {str(r.status): {"description": "OK", **({"content": content} if content else {})}}
        for code in r.errors:
            op["responses"][str(code)] = {"description": _ERRORS.get(code, "error"),
                                          "content": {"application/json": {"schema": by_type[ErrorBody]}}}
        op["security"] = [] if r.public else [{"bearer": []}]
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "rollq gateway", "version": "1",
                 "description": "Rollout service for asynchronous RL: submit prompt groups, stream "
                                "results with token ids, logprobs and policy versions, publish weights."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }


_ERRORS = {400: "invalid request (the error names the field)", 401: "missing or invalid bearer token",
           403: "the token may not use this policy or path", 404: "not found", 409: "conflict",
           413: "body too large", 429: "the trainer's quota is full", 503: "Redis unreachable",
           504: "no result within the timeout"}


def _slug(path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", path.lower()).strip("_") or "root"
