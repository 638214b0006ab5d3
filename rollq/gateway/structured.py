"""The OpenAI/vLLM request fields that constrain sampling -> `Sampling.structured_outputs` and
`Sampling.logit_bias`, with the meanings vLLM 0.32's `ChatCompletionRequest` and
`CompletionRequest` give them (`structured_outputs_from_response_format`, `SamplingParams`).

Checked here, before anything is queued, so the caller gets a 400 naming its own field
(`response_format.json_schema.schema`, `structured_outputs.regex`, `logit_bias`), not the
wire's (`sampling.structured_outputs.json`). What only the engine can judge (a grammar xgrammar
cannot compile, a token id outside the model's vocabulary) fails the group with vLLM's words.
"""

from __future__ import annotations

from typing import Any

from rollq.protocol import (InvalidInput, StructuredOutputs, typed, validate_logit_bias,
                            validate_structured_outputs)


def _from_response_format(response_format: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's `ResponseFormat`: the constraint it sets (None for `text`)."""
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidInput("response_format", "When response_format type is 'json_schema', the "
                                                  "'json_schema' field must be provided.")
        if not isinstance(spec.get("name"), str):
            raise InvalidInput("response_format.json_schema.name", "is required (a string)")
        schema = spec.get("schema")
        if schema is not None and not isinstance(schema, dict):
            raise InvalidInput("response_format.json_schema.schema", "must be an object")
        return {"json": schema}
    if kind == "structural_tag":
        raise InvalidInput("response_format", "type 'structural_tag' is not supported by rollq; give "
                                              "structured_outputs.structural_tag instead")
    raise InvalidInput("response_format.type", f"must be 'text', 'json_object' or 'json_schema', "
                                               f"got {kind!r}"[:200])


def structured_outputs_of(structured_outputs: dict[str, Any] | None,
                          response_format: dict[str, Any] | None) -> StructuredOutputs | None:
    """`response_format` overrides the fields of `structured_outputs` it sets, as in vLLM."""
    overrides = _from_response_format(response_format) if response_format is not None else None
    if structured_outputs is None and overrides is None:
        return None
    fields = dict(structured_outputs or {}) | (overrides or {})
    field = "response_format" if overrides else "structured_outputs"
    so = typed(field, fields, StructuredOutputs)
    try:
        validate_structured_outputs(so, "structured_outputs")
    except InvalidInput as e:
        named = e.field
        if overrides and named in ("structured_outputs.json", "structured_outputs.json_object"):
            named = "response_format.json_schema.schema" if "json" in overrides else "response_format"
        raise InvalidInput(named, str(e).split(": ", 1)[1]) from None
    return so


def logit_bias_of(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """Token-id strings -> ids, each bias clamped to [-100, 100], as vLLM's `SamplingParams`."""
    if logit_bias is None:
        return None
    bias, bad = {}, []
    for token, value in logit_bias.items():
        try:
            bias[int(token)] = min(100.0, max(-100.0, value))
        except ValueError:
            bad.append(token)
    if bad:
        raise InvalidInput("logit_bias", f"contains key(s) that cannot be converted to integer token "
                                         f"IDs: {bad[:5]!r}"[:300])
    validate_logit_bias(bias, "logit_bias")
    return bias
