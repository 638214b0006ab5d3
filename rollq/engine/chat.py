"""Conversations -> prompt token ids, and sampled text -> tool calls, on the worker, with vLLM's
own chat rendering and parsers.

vLLM's OpenAI server renders a `/v1/chat/completions` request with `OnlineRenderer.render_chat`
(tool-choice checks, chat-template kwargs resolution, `apply_chat_template`, tokenization, and the
parser's `adjust_request`, which constrains "required"/named tool calls by structured outputs).
This module calls that same function on the worker's engine (its model config and renderer), so a
conversation sent through rollq becomes exactly the token ids and constraints vLLM's server would
generate from; after generation it reads each sample with the same `Parser` and the same rules as
vLLM's `chat_completion_full_generator`. Parsing lives here, not at the gateway, so that every
sample of `submit_chat` carries its tool calls beside its token ids (the gateway has no tokenizer).
Everything that goes wrong while rendering is the group's fault, never the engine's: GroupError.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rollq.closing import MARKED_BASE, after_end, after_marker, special_ids
from rollq.engine.base import GroupError
import msgspec

from rollq.protocol import Chat, InvalidInput, Sample, unpack_tokens

log = logging.getLogger("rollq.engine.chat")



class ChatRenderer:
    """One per engine; vLLM's OnlineRenderer is built on first use (it compiles templates lazily).
    `auto_tools`, `tool_parser`, `reasoning_parser`: `vllm serve`'s flags of the same names."""

    def __init__(self, llm: Any, has_tokenizer: bool, *, auto_tools: bool = False,
                 tool_parser: str | None = None, reasoning_parser: str | None = None):
        self._llm = llm
        self._has_tokenizer = has_tokenizer
        self._online: Any = None
        self._special: set[int] | None = None
        self.auto_tools = auto_tools
        self._parsers = dict(enable_auto_tools=auto_tools, tool_parser=tool_parser,
                             reasoning_parser=reasoning_parser)

    def _renderer(self) -> Any:
        if self._online is None:
            from vllm.renderers.online_renderer import OnlineRenderer

            # The server's defaults (`vllm serve` without chat flags), except that a request may
            # bring its own template: trainers are trusted callers and Jinja runs sandboxed.
            self._online = OnlineRenderer(
                model_config=self._llm.model_config, renderer=self._llm.renderer,
                request_logger=None, chat_template=None, chat_template_content_format="auto",
                trust_request_chat_template=True, **self._parsers)
        return self._online

    async def render(self, chat: Chat, max_tokens: int) -> tuple[Any, Any]:
        """The engine input (prompt token ids) of `chat` and vLLM's request as its parser adjusted
        it (constraints, `skip_special_tokens`), or GroupError with vLLM's reason."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        if not self._has_tokenizer:
            raise GroupError("chat prompt, but this worker's model has no tokenizer (its directory "
                             "needs tokenizer files and a chat template)")
        try:
            check_tools(chat.tools)
        except InvalidInput as e:
            raise GroupError(f"invalid chat: {e}") from None
        try:
            request = _vllm_request(chat, max_tokens, self.auto_tools)
            rendered = await self._renderer().render_chat(request)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # templates raise anything: it is this conversation's fault
            raise GroupError(f"cannot render the chat: {type(e).__name__}: {e}") from None
        if isinstance(rendered, ErrorResponse):
            raise GroupError(f"cannot render the chat: {rendered.error.message}")
        _, (engine_input,) = rendered
        return engine_input, request  # render_chat adjusts the request in place

    async def exact(self, chat: Chat, max_tokens: int, engine_input: Any) -> tuple[Any, int]:
        """The engine input of a chat with an exact prefix (`Chat.prefix_tokens`): those ids, then
        what the template writes after the assistant message they end with; and where
        `engine_input` (the whole conversation rendered from text, as vLLM's server would prompt)
        first differs from it (-1: nowhere, the same ids).

        What the template writes there is read off the template itself, never assumed: the new
        messages rendered after a stand-in assistant message whose content is `closing.MARKER`, by vLLM's
        renderer with the conversation's own tools, template and kwargs; the text after the marker
        is the message's closing (ChatML's `<|im_end|>\n`, Llama 3's `<|eot_id|>`, Gemma's
        `<end_of_turn>\n`), the new messages and the generation prompt. A prefix that ends with a
        special token the closing writes (the sampled end-of-turn token) continues after it."""
        if engine_input.get("multi_modal_data"):
            raise GroupError("a conversation with images cannot continue from exact token ids")
        plain = msgspec.structs.replace(chat, prefix_tokens=b"", prefix_messages=0)
        rendered, _ = await self.render(msgspec.structs.replace(
            plain, messages=[*MARKED_BASE, *chat.messages[chat.prefix_messages:]]), max_tokens)
        text = after_marker(rendered.get("prompt"))
        if text is None:
            raise GroupError("the chat template does not write an assistant message's content as it is "
                             "given; the text it puts after the message is not well defined")
        tokenizer = self._llm.renderer.tokenizer
        after = list(tokenizer.encode(text, add_special_tokens=False))
        prefix = unpack_tokens(chat.prefix_tokens)
        if self._special is None:
            self._special = special_ids(tokenizer)
        ids = prefix + after_end(prefix[-1], after, tokenizer, self._special)
        exact = {k: v for k, v in engine_input.items() if k != "prompt"} | {"prompt_token_ids": ids}
        return exact, first_difference(list(engine_input["prompt_token_ids"]), ids)

    def constrain(self, params: Any, request: Any) -> None:
        """What vLLM's `to_sampling_params` takes from the adjusted request: the tool-call
        constraint (which overrides the group's own regex, as vLLM's overrides response_format)
        and whether special tokens stay in the text (hermes keeps them: its tags may be special)."""
        if request.structured_outputs is not None:
            params.structured_outputs = request.structured_outputs
        params.skip_special_tokens = request.skip_special_tokens

    def parse(self, request: Any, prompt_ids: list[int], samples: list[Sample]) -> list[Sample]:
        """Each sample's vLLM message fields (content, reasoning, tool_calls), as vLLM's server
        fills them; samples unchanged when the worker has no parser."""
        parser_cls = self._renderer().parser
        if parser_cls is None:
            return samples
        kwargs = self._renderer().effective_chat_template_kwargs(request)
        out = []
        for sample in samples:
            # Parsers keep state: one per sample, as vLLM's server makes one per choice.
            parser = parser_cls(self._llm.renderer.tokenizer, request.tools, chat_template_kwargs=kwargs,
                                model_config=self._llm.model_config)
            parser.set_prompt_token_ids(prompt_ids)
            content, reasoning, calls = _message(parser, request, sample, self.auto_tools)
            counted = parser.count_reasoning_tokens(sample.token_ids) if self._parsers["reasoning_parser"] \
                else None
            out.append(msgspec.structs.replace(sample, parsed=True, content=content, reasoning=reasoning,
                                               tool_calls=calls, reasoning_tokens=counted))
        return out


def _message(parser: Any, request: Any, sample: Sample, auto_tools: bool):
    """vLLM's `chat_completion_full_generator` message branches, for one sample."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionNamedToolChoiceParam
    from vllm.renderers.chat_utils import make_tool_call_id

    try:
        reasoning, content, calls = parser.parse(sample.text, request, enable_auto_tools=auto_tools,
                                                 model_output_token_ids=sample.token_ids)
    except Exception as e:  # a parser's bug must not cost the group: the text comes back as text
        log.warning("the tool/reasoning parser failed on a sample (%s: %s); returned as text",
                    type(e).__name__, e)
        reasoning, content, calls = None, sample.text, []
    named = type(request.tool_choice) is ChatCompletionNamedToolChoiceParam
    required = request.tool_choice == "required"
    has_tool_parser = parser.tool_parser is not None
    if named or required:
        content = content or ""
    elif not (auto_tools and has_tool_parser and request.tools and request.tool_choice == "auto"):
        calls = []
    calls = [dict(id=c.id or make_tool_call_id(), type="function",
                  function=dict(name=c.name, arguments=c.arguments)) for c in calls or []]
    if request.parallel_tool_calls is False:  # vLLM's maybe_filter_parallel_tool_calls
        calls = calls[:1]
    return content, reasoning, calls


def first_difference(a: list[int], b: list[int]) -> int:
    """The first position where `a` and `b` differ (one ending counts), -1 when they are equal."""
    if a == b:
        return -1
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


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


def _vllm_request(chat: Chat, max_tokens: int, auto_tools: bool) -> Any:
    """Our wire conversation -> vLLM's ChatCompletionRequest (pydantic validates the messages and
    the tool choice, with vLLM's messages).

    An absent `tool_choice` with tools is vLLM's default "auto" on a worker that parses tool calls,
    else "none" (text, the tools still handed to the template), so `submit_chat` with tools works on
    any worker; the gateway sends what its caller sent, with vLLM's default, so it answers as vLLM.
    """
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    given: dict[str, Any] = dict(tools=chat.tools) if chat.tools is not None else {}
    if chat.tool_choice is not None:
        given["tool_choice"] = chat.tool_choice
    elif chat.tools:
        given["tool_choice"] = "auto" if auto_tools else "none"
    if chat.reasoning_effort is not None:
        given["reasoning_effort"] = chat.reasoning_effort
    return ChatCompletionRequest(
        parallel_tool_calls=chat.parallel_tool_calls,
        messages=chat.messages, chat_template=chat.chat_template,
        chat_template_kwargs=chat.chat_template_kwargs or None,
        add_generation_prompt=chat.add_generation_prompt,
        continue_final_message=chat.continue_final_message, max_completion_tokens=max_tokens, **given)
