"""`sampling.structured_outputs`: vLLM 0.32's `StructuredOutputsParams` through the queue, and
the bounds checked before it reaches an engine (what vLLM refuses up front, refused up front)."""

from __future__ import annotations

import json

import pytest

from rollq.protocol import (MAX_STRUCTURED_BYTES, InvalidInput, Sampling, StructuredOutputs,
                            WorkItem, decode_item, encode, pack_tokens, sampling_from_dict,
                            validate_sampling)


def check(constraint: dict) -> None:
    validate_sampling(sampling_from_dict({"structured_outputs": constraint}), 1)


def nested(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("constraint", [
    {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    {"json": '{"type": "string"}'}, {"json": {}}, {"regex": "w1[0-9]"}, {"regex": ""},
    {"choice": ["yes", "no"]}, {"grammar": 'root ::= "a" | "b"'}, {"json_object": True},
    {"json": nested(32), "disable_any_whitespace": True, "whitespace_pattern": " ?"},
])
def test_what_vllm_accepts_passes(constraint):
    check(constraint)


@pytest.mark.parametrize("constraint, field, words", [
    ({}, "sampling.structured_outputs", "exactly one"),
    ({"regex": "a", "choice": ["a"]}, "sampling.structured_outputs", "regex, choice"),
    ({"choice": []}, "sampling.structured_outputs.choice", "empty"),
    ({"grammar": "  "}, "sampling.structured_outputs.grammar", "empty"),
    ({"json": " "}, "sampling.structured_outputs.json", "empty"),
    ({"json": "{"}, "sampling.structured_outputs.json", "not valid JSON"),
    ({"json_object": False}, "sampling.structured_outputs.json_object", "true"),
    ({"regex": "a\x00"}, "sampling.structured_outputs.regex", "NUL"),
    ({"regex": "(a*)*b"}, "sampling.structured_outputs.regex", "nested repetition"),
    ({"json": {"type": "string"}, "whitespace_pattern": "( *)*"},
     "sampling.structured_outputs.whitespace_pattern", "nested repetition"),
    ({"json": nested(65)}, "sampling.structured_outputs.json", "nested too deeply"),
    ({"structural_tag": "[" * 81 + "]" * 81}, "sampling.structured_outputs.structural_tag",
     "nested too deeply"),
    ({"choice": ["x" * 1000] * 300}, "sampling.structured_outputs.choice",
     f"limit is {MAX_STRUCTURED_BYTES}"),
])
def test_what_vllm_refuses_up_front_is_refused_with_the_field_named(constraint, field, words):
    with pytest.raises(InvalidInput, match=words) as e:
        check(constraint)
    assert e.value.field == field


def test_a_schema_nested_10000_deep_costs_no_stack():
    """As JSON text (a dict that deep could not even be encoded): refused by nesting, not by a
    RecursionError escaping as a crash."""
    text = '{"a":' * 10_000 + "{}" + "}" * 10_000
    with pytest.raises(InvalidInput, match="nested too deeply") as e:
        check({"json": text})
    assert e.value.field == "sampling.structured_outputs.json"


def test_the_regex_field_and_structured_outputs_exclude_each_other():
    with pytest.raises(InvalidInput, match="excludes") as e:
        validate_sampling(Sampling(regex="a", structured_outputs=StructuredOutputs(choice=["a"])), 1)
    assert e.value.field == "sampling.regex"


def test_the_constraint_crosses_the_queue_intact_and_is_validated_by_the_worker():
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"]}
    so = StructuredOutputs(json=schema, disable_any_whitespace=True)
    item = WorkItem("job", 0, pack_tokens([1, 2]), 1, Sampling(max_tokens=8, structured_outputs=so), 0.0)
    assert decode_item(encode(item)).sampling.structured_outputs == so
    bad = WorkItem("job", 0, pack_tokens([1, 2]), 1,
                   Sampling(structured_outputs=StructuredOutputs(json=nested(100))), 0.0)
    with pytest.raises(InvalidInput, match="nested too deeply"):
        decode_item(encode(bad))


def test_an_unknown_constraint_field_is_named():
    with pytest.raises(InvalidInput, match="unknown field `jsn`"):
        sampling_from_dict({"structured_outputs": {"jsn": {}}})


DEEP = '{"a":' * 10_000 + "{}" + "}" * 10_000


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "w1"}], '
                             '"response_format": {"type": "json_schema", "json_schema": '
                             '{"name": "deep", "schema": %s}}}'),
    ("/v1/completions", '{"model": "%s", "prompt": [1, 2], "structured_outputs": {"json": %s}}'),
])
async def test_a_body_nested_10000_deep_is_a_400_not_a_500(make_gateway, policy, route, body):
    import aiohttp

    gw = await make_gateway()
    async with (aiohttp.ClientSession(gw.url, headers=gw.headers() | {"Content-Type": "application/json"})
                as http, http.post(route, data=body % (policy, DEEP)) as r):
        error = (await r.json())["error"]
        assert r.status == 400, error
    assert "nested too deeply" in error["message"]
    # ...and the same schema as JSON text reaches the nesting check, which names the field.
    async with (aiohttp.ClientSession(gw.url, headers=gw.headers()) as http,
                http.post("/v1/completions", json={"model": policy, "prompt": [1, 2],
                                                   "structured_outputs": {"json": DEEP}}) as r):
        error = (await r.json())["error"]
    assert r.status == 400 and error["field"] == "structured_outputs.json", error
    assert "nested too deeply" in error["message"]


# Measured with xgrammar 0.2.8, 200 tokens of "a": ("a"*)* 0.69 s of CPU, r* with r ::= "a"*
# 0.38 s, (r s)* 1.05 s (growing with the square of the length); ("a"+)+ 0.02 s, [a]* ~0.
@pytest.mark.parametrize("grammar", [
    'root ::= ("a"*)* "b"', 'root ::= (("a" | "aa")*)* "b"', 'root ::= r* "b"\nr ::= "a"*',
    'root ::= (r s)* "b"\nr ::= "a"*\ns ::= "a"*', 'root ::= (r)+ "b"\nr ::= "a"+ | ""',
    'root ::= ("a"? "a"?)* "b"', 'root ::= ("a"{0,10}){0,10} "b"', 'root ::= ("")+',
])
def test_a_grammar_that_repeats_what_can_match_nothing_is_refused(grammar):
    with pytest.raises(InvalidInput, match="can match nothing") as e:
        check({"grammar": grammar})
    assert e.value.field == "sampling.structured_outputs.grammar"


def test_a_grammar_nested_too_deeply_is_refused():
    with pytest.raises(InvalidInput, match="too deeply") as e:
        check({"grammar": "root ::= " + "(" * 5000 + '"a"' + ")" * 5000})
    assert e.value.field == "sampling.structured_outputs.grammar"


JSON_GRAMMAR = r'''root ::= value
value ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws  # not (x*)*
array ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]*)) ("." [0-9]+)? ([eE] [-+]? [0-9]+)? ws
ws ::= ([ \t\n] ws)?'''


@pytest.mark.parametrize("grammar", [JSON_GRAMMAR, 'root ::= ("a"+)+ "b"', 'root ::= [a]* "b"',
                                     'root ::= ("a"{2,5})* | "c" [0-9]+ "."', 'root ::= "x" ("*" | "(")*'])
def test_grammars_whose_repetitions_consume_pass(grammar):
    check({"grammar": grammar})


def tag(part: dict) -> str:
    return json.dumps({"type": "structural_tag", "format": part})


def tagged(part: dict, begin: str = "<f>") -> dict:
    """`part` inside a triggered tag, as a tool call's arguments are."""
    return {"type": "triggered_tags", "triggers": ["<f"],
            "tags": [{"type": "tag", "begin": begin, "content": part, "end": "</f>"}]}


A = {"type": "const_string", "value": "a"}
NESTED = {"type": "string", "pattern": "(a*)*b"}
ST = "sampling.structured_outputs.structural_tag"


# Issue 43, item 5: each of these reached xgrammar unchecked before (the regex in a structural tag:
# 1.0 s of engine CPU for 200 tokens, 0.001 s for `a*b`); each failed this test before.
@pytest.mark.parametrize("constraint, field, words", [
    ({"structural_tag": tag({"type": "regex", "pattern": "(a*)*b"})}, f"{ST}.format.pattern",
     "nested repetition"),
    ({"structural_tag": tag({"type": "grammar", "grammar": 'root ::= ("a"*)* "b"'})},
     f"{ST}.format.grammar", "can match nothing"),
    ({"structural_tag": tag({"type": "grammar", "grammar": 'start: ("a"*)* "b"'})},
     f"{ST}.format.grammar", "Lark"),
    ({"structural_tag": tag({"type": "star", "content": {"type": "star", "content": A}})},
     f"{ST}.format.content", "can match nothing and is repeated"),
    ({"structural_tag": tag({"type": "sequence", "elements": [
        A, {"type": "repeat", "min": 1, "max": -1, "content": {"type": "optional", "content": A}}]})},
     f"{ST}.format.elements[1].content", "can match nothing and is repeated"),
    ({"structural_tag": tag(tagged({"type": "json_schema", "json_schema": {
        "type": "object", "properties": {"x": NESTED}}}))},
     f"{ST}.format.tags[0].content.json_schema.properties.x.pattern", "nested repetition"),
    ({"structural_tag": tag(tagged({"type": "or", "elements": [A, {"type": "regex", "pattern": "(a+)+"}]}))},
     f"{ST}.format.tags[0].content.elements[1].pattern", "nested repetition"),
    ({"structural_tag": tag(tagged({"type": "any_text"}, begin=""))}, f"{ST}.format.tags[0].begin",
     "must not be empty"),
    ({"structural_tag": json.dumps({"structures": [{"begin": "<a>", "schema": NESTED, "end": "</a>"}],
                                    "triggers": ["<a"]})}, f"{ST}.structures[0].schema.pattern",
     "nested repetition"),
    ({"structural_tag": tag({"type": "something_new"})}, f"{ST}.format.type", "not a part rollq checks"),
    ({"structural_tag": json.dumps({"format": A})}, ST, "structural_tag"),
    ({"json": {"type": "object", "properties": {"x": NESTED}}},
     "sampling.structured_outputs.json.properties.x.pattern", "nested repetition"),
    ({"json": {"type": "array", "items": [{"type": "object", "patternProperties": {"(a*)*": {}}}]}},
     "sampling.structured_outputs.json.items[0].patternProperties['(a*)*']", "nested repetition"),
    ({"grammar": 'start: ("a"*)* "b"'}, "sampling.structured_outputs.grammar", "Lark"),
    # Repetition written as recursion (as xgrammar itself writes `*`): s ::= "" | r s, r nullable.
    ({"grammar": 'root ::= s "b"\ns ::= "" | r s\nr ::= "" | "a" r'}, "sampling.structured_outputs.grammar",
     "s derives itself"),
])
def test_structured_outputs_are_checked_whatever_the_nesting(constraint, field, words):
    with pytest.raises(InvalidInput, match=words) as e:
        check(constraint)
    assert e.value.field == field


@pytest.mark.parametrize("constraint", [
    {"structural_tag": tag(tagged({"type": "json_schema", "json_schema": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "[a-z]+@x\\.com"}}}}))},
    {"structural_tag": json.dumps({"structures": [
        {"begin": "<a>", "schema": {"type": "object"}, "end": "</a>"}], "triggers": ["<a"]})},
    {"structural_tag": tag({"type": "sequence", "elements": [
        {"type": "plus", "content": {"type": "plus", "content": A}},  # as ("a"+)+: consumes
        {"type": "repeat", "min": 0, "max": 3, "content": {"type": "regex", "pattern": "b+"}},
        {"type": "tags_with_separator", "separator": ",", "tags": [
            {"type": "tag", "begin": "<g>", "content": {"type": "grammar", "grammar": 'root ::= "x"*'},
             "end": "</g>"}]},
        {"type": "tag", "begin": "<r>", "content": {"type": "any_text"}, "end": ["</r>", "</s>"]}]})},
    {"json": {"type": "object", "properties": {"pattern": {"type": "string", "default": "(a*)*"}},
              "examples": [{"pattern": "(a*)*"}]}},  # data, not regexes
    {"grammar": 'root ::= e\ne ::= e "+" t | t\nt ::= "x"'},  # left recursion that consumes
])
def test_structured_outputs_that_cost_a_bounded_amount_pass(constraint):
    check(constraint)


def test_a_chat_tools_parameters_are_checked_as_schemas():
    """A named tool_choice (and some tool parsers) makes vLLM constrain to a tool's parameters."""
    from rollq.protocol import Chat, validate_chat

    tools = [{"type": "function", "function": {"name": "e"}},  # (no parameters)
             {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "[a-z]+"}}}}},
             {"type": "function", "function": {"name": "g", "parameters": {
                 "type": "object", "properties": {"x": NESTED}}}}]
    with pytest.raises(InvalidInput, match="nested repetition") as e:
        validate_chat(Chat([{"role": "user", "content": "hi"}], tools=tools))
    assert e.value.field == "chat.tools[2].function.parameters.properties.x.pattern"
    validate_chat(Chat([{"role": "user", "content": "hi"}], tools=tools[:2]))
