"""Tool-calling settings and checks that need no engine: the worker's parser flags are checked as
`vllm serve` checks them, before an engine starts."""

from __future__ import annotations

import pytest

from rollq.config import VLLMSettings
from rollq.protocol import Chat, InvalidInput, validate_chat


@pytest.mark.parametrize("flags, field, words", [
    (dict(enable_auto_tool_choice=True), "enable_auto_tool_choice", "needs --tool-call-parser"),
    (dict(tool_call_parser="hermez"), "tool_call_parser", "is not one of vLLM's tool parsers: "),
    (dict(reasoning_parser="nope"), "reasoning_parser", "is not one of vLLM's reasoning parsers: "),
])
def test_parser_flags_are_checked_before_the_engine_starts(tmp_path, flags, field, words):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(InvalidInput) as bad:
        VLLMSettings(model=str(tmp_path), **flags).validate()
    assert bad.value.field == field and words in str(bad.value)


def test_known_parsers_pass(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    settings = VLLMSettings(model=str(tmp_path), enable_auto_tool_choice=True, tool_call_parser="pythonic",
                            reasoning_parser="deepseek_r1").validate()
    assert settings.engine_kwargs()["reasoning_parser"] == "deepseek_r1"  # vLLM's engine takes it too


def test_a_tool_choice_outside_vllms_is_refused_naming_it():
    with pytest.raises(InvalidInput) as bad:
        validate_chat(Chat([{"role": "user", "content": "hi"}], tool_choice="sometimes"), "conversations[0]")
    assert bad.value.field == "conversations[0].tool_choice"
    validate_chat(Chat([{"role": "user", "content": "hi"}], tool_choice={"type": "function",
                                                                        "function": {"name": "f"}}))
