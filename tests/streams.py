"""Server-sent chunk streams of /v1/chat/completions and /v1/completions: read, joined per
choice (as a client accumulates deltas), and sorted by kind, for comparing rollq with vLLM."""

from __future__ import annotations

import json

import aiohttp


async def sse(http: aiohttp.ClientSession, url: str, body: dict, headers: dict | None = None) -> list:
    """The `data:` payloads of one streamed request, `[DONE]` as the string."""
    async with http.post(url, json=body, headers=headers) as r:
        text = await r.text()
        assert r.status == 200, text
        assert r.headers["Content-Type"].startswith("text/event-stream"), r.headers
    events = [e for e in text.split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def join(chunks: list[dict]) -> dict[int, dict]:
    """Per choice index: its deltas joined (content, reasoning, text, tool-call arguments,
    logprobs, token ids concatenated; role, finish and stop reason, prompt ids as sent)."""
    out: dict[int, dict] = {}
    for chunk in chunks:
        for c in chunk["choices"]:
            j = out.setdefault(c["index"], {})
            if chunk.get("prompt_token_ids") is not None:
                j["prompt_token_ids"] = chunk["prompt_token_ids"]
            if c.get("prompt_token_ids") is not None:
                j["prompt_token_ids"] = c["prompt_token_ids"]
            delta = c.get("delta", {})
            for key in ("role",):
                if delta.get(key):
                    j[key] = delta[key]
            for key, value in (("content", delta.get("content")), ("reasoning", delta.get("reasoning")),
                               ("text", c.get("text"))):
                if value is not None:
                    j[key] = j.get(key, "") + value
            for call in delta.get("tool_calls") or []:
                mine = j.setdefault("tool_calls", {}).setdefault(call["index"], {"arguments": ""})
                for key in ("id", "type"):
                    if call.get(key):
                        mine[key] = call[key]
                function = call.get("function") or {}
                if function.get("name"):
                    mine["name"] = function["name"]
                mine["arguments"] += function.get("arguments") or ""
            logprobs = c.get("logprobs")
            if logprobs is not None:
                if "content" in logprobs:
                    j.setdefault("logprobs", []).extend(logprobs["content"])
                else:
                    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                        j.setdefault(key, []).extend(logprobs[key])
            if c.get("token_ids") is not None:
                j.setdefault("token_ids", []).extend(c["token_ids"])
            if c.get("finish_reason") is not None:
                j["finish_reason"], j["stop_reason"] = c["finish_reason"], c.get("stop_reason")
    return out


def kinds(chunks: list[dict]) -> dict[str, list[dict]]:
    """Chunks by kind: role (chat's first), finish (a choice's last), usage (no choices)."""
    out: dict[str, list[dict]] = {"role": [], "finish": [], "usage": [], "other": []}
    for chunk in chunks:
        if not chunk["choices"]:
            out["usage"].append(chunk)
        elif "role" in chunk["choices"][0].get("delta", {}):
            out["role"].append(chunk)
        elif chunk["choices"][0].get("finish_reason") is not None:
            out["finish"].append(chunk)
        else:
            out["other"].append(chunk)
    return out


def shape(value):
    """The keys of a chunk, recursively (values aside): what the two servers must agree on."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        # Completions' top_logprobs are maps from token strings: their keys are values here.
        maps = all(isinstance(v, dict) and all(isinstance(x, float) for x in v.values()) for v in value if v)
        return [shape(value[0])] if value and isinstance(value[0], dict) and not maps else "list"
    return None if value is None else "value"
