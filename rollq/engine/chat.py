"""Conversations -> prompt token ids on the worker, with vLLM's own chat rendering.

vLLM's OpenAI server renders a `/v1/chat/completions` request with `OnlineRenderer.render_chat`
(tool-choice checks, chat-template kwargs resolution, `apply_chat_template`, tokenization). This
module calls that same function on the worker's engine (its model config and renderer), so a
conversation sent through rollq becomes exactly the token ids vLLM's server would generate from.
Everything that goes wrong while rendering is the group's fault, never the engine's: GroupError.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollq.engine.base import GroupError
from rollq.protocol import Chat, InvalidInput


class ChatRenderer:
    """One per engine; vLLM's OnlineRenderer is built on first use (it compiles templates lazily)."""

    def __init__(self, llm: Any, has_tokenizer: bool):
        self._llm = llm
        self._has_tokenizer = has_tokenizer
        self._online: Any = None

    def _renderer(self) -> Any:
        if self._online is None:
            from vllm.renderers.online_renderer import OnlineRenderer

            # The server's defaults (`vllm serve` without chat flags), except that a request may
            # bring its own template: trainers are trusted callers and Jinja runs sandboxed.
            self._online = OnlineRenderer(
                model_config=self._llm.model_config, renderer=self._llm.renderer,
                request_logger=None, chat_template=None, chat_template_content_format="auto",
                trust_request_chat_template=True)
        return self._online

    async def render(self, chat: Chat, max_tokens: int) -> Any:
        """The engine input (prompt token ids) of `chat`, or GroupError with vLLM's reason."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if not self._has_tokenizer:
            raise GroupError("chat prompt, but this worker's model has no tokenizer (its directory "
                             "needs tokenizer files and a chat template)")
        try:
            check_tools(chat.tools)
        except InvalidInput as e:
            raise GroupError(f"invalid chat: {e}") from None
        try:
            request = _vllm_request(chat, max_tokens)
            rendered = await self._renderer().render_chat(request)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # templates raise anything: it is this conversation's fault
            raise GroupError(f"cannot render the chat: {type(e).__name__}: {e}") from None
        if isinstance(rendered, ErrorResponse):
            raise GroupError(f"cannot render the chat: {rendered.error.message}")
        _, (engine_input,) = rendered
        return engine_input


def check_tools(tools: Any, field: str = "tools") -> None:
    """The tool shape vLLM's server accepts (`ChatCompletionToolsParam`), checked before anything
    renders: a malformed tool is an error naming it, not a template's KeyError or pydantic's list."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise InvalidInput(field, "must be a list of tools")
    for i, tool in enumerate(tools):
        at = f"{field}[{i}]"
        if not isinstance(tool, dict):
            raise InvalidInput(at, 'must be an object: {"type": "function", "function": {"name": ...}}')
        if tool.get("type", "function") != "function":
            raise InvalidInput(f"{at}.type", f'is {tool["type"]!r}; only "function" tools exist')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidInput(f"{at}.function", "is required: an object with `name` and optional "
                                                 "`description` and `parameters`")
        if not isinstance(function.get("name"), str):
            raise InvalidInput(f"{at}.function.name", "is required: a string")
        if not isinstance(function.get("description", ""), (str, type(None))):
            raise InvalidInput(f"{at}.function.description", "must be a string")
        if not isinstance(function.get("parameters", {}), (dict, type(None))):
            raise InvalidInput(f"{at}.function.parameters", "must be an object (a JSON schema)")


def _vllm_request(chat: Chat, max_tokens: int) -> Any:
    """Our wire conversation -> vLLM's ChatCompletionRequest (pydantic validates the messages).

    `tool_choice` is "none": rollq returns text and never parses tool calls, and vLLM then still
    hands `tools` to the template (unless started with --exclude-tools-when-tool-choice-none).
    """
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    given: dict[str, Any] = dict(tools=chat.tools, tool_choice="none") if chat.tools else {}
    return ChatCompletionRequest(
        messages=chat.messages, chat_template=chat.chat_template,
        chat_template_kwargs=chat.chat_template_kwargs or None,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message, max_completion_tokens=max_tokens, **given)
