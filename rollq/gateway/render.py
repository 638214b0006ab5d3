"""Caller input the gateway walks, renders or tokenizes: capped first, then worked off the loop.

One rule for every route (chat, completions, episodes and their turns): a free-form field
(`messages`, `tools`, `chat_template_kwargs`, `sampling`, ...) is walked without recursion and
refused past `MAX_DEPTH` levels or `MAX_NODES` values, and text bound for the tokenizer past
`MAX_PROMPT_CHARS` characters, before anything renders it. A caller's chat template (a
`chat_template` field, or that key inside `chat_template_kwargs`) is refused unless the
operator started the gateway with `--trust-request-chat-template`. What is rendered or
tokenized then runs in `RenderWorkers`: spawned helper processes holding the gateway's
tokenizer, each render within `RENDER_TIMEOUT_S` (an alarm in the helper; the gateway kills the
helpers if even that does not end it) and `RENDER_MEMORY_BYTES` (an address-space limit), so a
Jinja loop or a string built by a template costs a helper, never the event loop or the
gateway's memory. Every refusal is an `InvalidInput` (a 400 naming the field and the limit).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import resource
import shutil
import signal
import tempfile
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from rollq.protocol import MAX_CHAT_BYTES, MAX_PROMPT_CHARS, InvalidInput

MAX_DEPTH = 32
"""Arrays and objects inside each other in one free-form field. OpenAI messages need ~6 (a
content part's image_url); tool schemas a few more. `copy.deepcopy` and Jinja recurse per level."""
MAX_NODES = 200_000
"""Values (containers, strings, numbers) in one free-form field: bounds the walk itself."""
RENDER_TIMEOUT_S = 5.0
RENDER_MEMORY_BYTES = 1024 * 1024 * 1024
"""Address space a helper may grow by while it renders (beyond what it holds at start)."""
STUCK_S = 60.0
"""How long the gateway waits for a render, at most, before it kills the helpers: the alarm ends
a render in Python; this, one stuck in C (and it covers the helpers' start, seconds when busy)."""
RENDER_PROCESSES = 2

log = logging.getLogger("rollq.gateway")
_TRUST_HINT = "start the gateway with --trust-request-chat-template to allow it"


def check_tree(value: Any, field: str) -> int:
    """The characters of the strings (keys and values) in `value`; InvalidInput(field) when it
    is nested deeper than MAX_DEPTH or holds more than MAX_NODES values. Iterative: a body
    nested 900 deep (under msgspec's decoder limit) must not reach Python's recursion limit."""
    chars = nodes = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise InvalidInput(field, f"holds more than {MAX_NODES} values; the limit is {MAX_NODES}")
        if isinstance(item, str):
            chars += len(item)
        elif isinstance(item, (dict, list)):
            if depth > MAX_DEPTH:
                raise InvalidInput(field, f"is nested more than {MAX_DEPTH} levels deep (arrays and "
                                          f"objects inside each other); the limit is {MAX_DEPTH}")
            if isinstance(item, dict):
                chars += sum(len(k) for k in item if isinstance(k, str))
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)
    return chars


def check_text(value: Any, field: str, limit: int = MAX_PROMPT_CHARS) -> None:
    """`check_tree`, and at most `limit` characters: what the tokenizer would be given."""
    chars = check_tree(value, field)
    if chars > limit:
        raise InvalidInput(field, f"has {chars} characters of text; the limit is {limit}")


def check_chat(messages: Any, tools: Any, kwargs: Any, response_format: Any = None) -> None:
    """A chat completion's free-form fields, before the gateway walks them (its images,
    `copy.deepcopy`, the work item's encoding) and a worker renders them: at most the worker's
    `MAX_CHAT_BYTES` of text in all. An image part's data URL is not text: it leaves the chat as
    stored image bytes (bounded by the image limits, `images.chat_images`) before any worker
    renders it."""
    chars = -_image_url_chars(messages)
    for field, value in (("messages", messages), ("tools", tools), ("chat_template_kwargs", kwargs),
                         ("response_format", response_format)):
        chars += check_tree(value, field)
        if chars > MAX_CHAT_BYTES:
            raise InvalidInput(field, f"the conversation has more than {MAX_CHAT_BYTES} characters of "
                                      f"text; the limit is {MAX_CHAT_BYTES}")


def _image_url_chars(messages: Any) -> int:
    """The characters of the `image_url` URLs of chat content parts (of messages whose depth
    and size `check_tree` bounds in the same call)."""
    chars = 0
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, dict) else None
        for part in content if isinstance(content, list) else ():
            url = part.get("image_url") if isinstance(part, dict) else None
            url = url.get("url") if isinstance(url, dict) else None
            if isinstance(url, str):
                chars += len(url)
    return chars


def refuse_template(trusted: bool, kwargs: dict[str, Any] | None, template: str | None = None,
                    kwargs_field: str = "chat_template_kwargs") -> None:
    """A caller's template would run where it is rendered (the gateway, the workers): refused
    unless the operator trusts request templates, as vLLM's server does."""
    if trusted:
        return
    if template is not None:
        raise InvalidInput("chat_template", f"a request's chat template is refused: {_TRUST_HINT}")
    if "chat_template" in (kwargs or {}):
        raise InvalidInput(f"{kwargs_field}.chat_template",
                           f"a request's chat template is refused: {_TRUST_HINT}")


# --- in the helper processes ------------------------------------------------------------------

_tokenizer: Any = None
_OUT_OF_MEMORY = (f"rendering needed more than {RENDER_MEMORY_BYTES // 2**20} MiB of memory; the limit "
                  f"is {RENDER_MEMORY_BYTES // 2**20} MiB")


class _Alarm(Exception):
    pass


def _on_alarm(signum, frame):
    raise _Alarm


def _start_helper(tokenizer_dir: str, fast: bool) -> None:
    # Not niced, unlike the publish helpers: a render is a request's own work, awaited by its
    # caller, and at nice +10 on a busy box a helper took over 60 s to start.
    global _tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # no thread pool: one render, one thread
    # A fast tokenizer is all of it in tokenizer.json and its config: loaded as the base class,
    # which spares the import of torch that AutoTokenizer makes (15 s of CPU against 2).
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    loader = PreTrainedTokenizerFast if fast else AutoTokenizer
    _tokenizer = loader.from_pretrained(tokenizer_dir, local_files_only=True)
    # Its lazy imports (Jinja's too) and ours, before the limit is set and outside any alarm. A
    # tokenizer without a chat template still encodes completions' text prompts: warming its
    # template up would raise, and the helper would die before its first job.
    _tokenizer.encode("warm up")
    if getattr(_tokenizer, "chat_template", None):
        _tokenizer.apply_chat_template([{"role": "user", "content": "warm up"}], tokenize=True)
    import rollq.client.episodes  # noqa: F401
    with open("/proc/self/statm") as f:
        held = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = held + RENDER_MEMORY_BYTES
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    signal.signal(signal.SIGALRM, _on_alarm)


def _render(kind: str, args: tuple) -> tuple[str, Any]:
    """In a helper: ("", token ids (or a decode's text, or a tokenize's [ids, token strings])),
    or (the refusal's message, [])."""
    from rollq.client.episodes import chat_closing  # imported by _start_helper

    signal.setitimer(signal.ITIMER_REAL, RENDER_TIMEOUT_S)
    try:
        if kind == "encode":
            return "", list(_tokenizer.encode(*args))
        if kind == "decode":  # /detokenize: as vLLM's renderer, special tokens kept
            return "", _tokenizer.decode(args[0])
        if kind == "tokenize":  # /tokenize: the ids, and their token strings when asked for
            prompt, kwargs, strs = args
            if isinstance(prompt, str):
                ids = _tokenizer.encode(prompt, **kwargs)
            else:  # as vLLM's renderer: rendered and tokenized by the template (return_dict=False)
                ids = _tokenizer.apply_chat_template(prompt, tokenize=True, return_dict=False, **kwargs)
            ids = [int(t) for t in ids]  # a kwarg such as return_tensors makes other types
            return "", [ids, _tokenizer.convert_ids_to_tokens(ids) if strs else None]
        messages, kwargs = args
        if kind == "continuation":  # [ids, where its end-of-turn token is]
            return "", list(chat_closing(_tokenizer, messages, **kwargs))
        rendered = _tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                  return_dict=False, **kwargs)
        return "", list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    except _Alarm:
        return f"rendering took longer than {RENDER_TIMEOUT_S} s; the limit is {RENDER_TIMEOUT_S} s", []
    except MemoryError:  # a message made in advance: there may be no memory to make one now
        return _OUT_OF_MEMORY, []
    except InvalidInput as e:
        return str(e).split(": ", 1)[-1], []
    except Exception as e:  # the template's own error (an unknown role, a raise_exception)
        return f"the chat template refused them: {str(e)[:500]}", []
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


# --- in the gateway ---------------------------------------------------------------------------

def _retrieved(done: asyncio.Future) -> None:
    if not done.cancelled():
        done.exception()


class RenderWorkers:
    """Renders and tokenizes with the gateway's tokenizer in `processes` spawned helpers,
    started on first use (in a thread: starting them took ~0.2 s); `close()` when the gateway
    stops. At most `processes` renders run at once; more wait their turn without queueing work."""

    def __init__(self, tokenizer: Any | None, processes: int = RENDER_PROCESSES):
        self.tokenizer = tokenizer
        self._saved: str | None = None
        """The tokenizer saved for the helpers to load (the gateway may hold one made in memory)."""
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._started: Future | None = None
        self._lock = threading.Lock()
        self._turns = asyncio.Semaphore(processes)

    def start(self) -> None:
        """Start the helpers now, in a thread (not on the loop), so the first render does not
        wait for them (spawning and importing transformers: seconds on a busy box)."""
        if self.tokenizer is not None:
            threading.Thread(target=self._submit, args=("encode", ("",)), name="render-start",
                             daemon=True).start()

    def _submit(self, kind: str, args: tuple) -> tuple[ProcessPoolExecutor, Future, Future]:
        """The pool, the future of its first task (done once a helper is up) and the new one's."""
        with self._lock:
            for _ in range(2):
                if self._saved is None:
                    self._saved = tempfile.mkdtemp(prefix="rollq-tokenizer-")
                    self.tokenizer.save_pretrained(self._saved)
                if self._pool is None:
                    fast = bool(getattr(self.tokenizer, "is_fast", False))
                    self._pool = ProcessPoolExecutor(self.processes, multiprocessing.get_context("spawn"),
                                                     initializer=_start_helper, initargs=(self._saved, fast))
                    self._started = self._pool.submit(_render, "encode", ("",))  # done once one is up
                try:
                    return self._pool, self._started, self._pool.submit(_render, kind, args)
                except BrokenProcessPool:
                    self._pool = None
            raise BrokenProcessPool("the render helpers could not be started")

    def _drop(self, pool: ProcessPoolExecutor, kill: bool) -> None:
        with self._lock:
            if self._pool is pool:  # not one another caller started since
                self._pool = None
        if kill:  # the helper is stuck in C past its alarm: nothing else ends it
            for process in list(getattr(pool, "_processes", {}).values()):
                process.kill()
        pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, field: str, kind: str, *args: Any) -> list[int]:
        """Token ids; InvalidInput(field) with the template's or the limit's refusal."""
        if self.tokenizer is None:
            raise InvalidInput(field, "this gateway has no tokenizer (--tokenizer): send token ids")
        async with self._turns:
            pool, first, future = await asyncio.to_thread(self._submit, kind, args)
            started, done = asyncio.wrap_future(first), asyncio.wrap_future(future)
            for waited in (started, done):
                waited.add_done_callback(_retrieved)  # a helper killed after we stopped waiting
            try:
                # The helper's alarm ends a render; this ends a helper the alarm could not. The
                # clock starts once a helper is up: starting one took over 60 s on a busy box.
                await asyncio.wait([started])
                refused, ids = await asyncio.wait_for(asyncio.shield(done), STUCK_S)
            except asyncio.CancelledError:
                # The caller keeps its turn until the helper is done: callers that hang up
                # cannot pile renders up behind the pool.
                await asyncio.wait([done], timeout=STUCK_S)
                raise
            except TimeoutError:
                self._drop(pool, kill=True)
                raise InvalidInput(field, f"rendering took longer than {STUCK_S} s; the "
                                          f"limit is {RENDER_TIMEOUT_S} s") from None
            except BrokenProcessPool:  # the helper died: out of memory beyond the limit's reach
                self._drop(pool, kill=False)
                raise InvalidInput(field, "rendering them killed the helper process (out of memory?); "
                                          f"the limit is {RENDER_MEMORY_BYTES // 2**20} MiB") from None
            except Exception as e:  # raised past _render's own handlers (out of memory in them)
                log.info("a render failed in its helper: %r", e)
                raise InvalidInput(field, f"rendering them failed ({type(e).__name__}); the limits "
                                          f"are {RENDER_TIMEOUT_S} s and {RENDER_MEMORY_BYTES // 2**20} "
                                          "MiB") from None
        if refused:
            raise InvalidInput(field, refused)
        return ids

    async def chat(self, messages: list[dict[str, Any]], kwargs: dict[str, Any], first: bool,
                   trusted: bool) -> tuple[list[int], int | None]:
        """An episode's messages as token ids: rendered whole with the generation prompt
        (`first`; None), else what the template writes after the last reply's content and where
        its end-of-turn token is in it (`chat_closing`: the turn skips through it when the reply
        ended with it, `Episodes.turn(end_token_at=)`)."""
        check_text(messages, "messages")
        check_tree(kwargs, "chat_template_kwargs")
        refuse_template(trusted, kwargs)
        if first:
            return await self.run("messages", "chat", messages, kwargs), None
        ids, end = await self.run("messages", "continuation", messages, kwargs)
        return ids, end

    async def tokenize(self, prompt: str | list[dict[str, Any]], kwargs: dict[str, Any], strs: bool,
                       trusted: bool) -> tuple[list[int], list[str] | None]:
        """`POST /tokenize`: a text `prompt` (kwargs: add_special_tokens) or chat messages
        (kwargs: the template's, tools among them) as vLLM's server tokenizes them; the ids and,
        with `strs`, their token strings."""
        if isinstance(prompt, str):
            if len(prompt) > MAX_PROMPT_CHARS:
                raise InvalidInput("prompt", f"has {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
            field = "prompt"
        else:
            check_chat(prompt, kwargs.get("tools"), {k: v for k, v in kwargs.items() if k != "tools"})
            refuse_template(trusted, kwargs)
            field = "messages"
        ids, token_strs = await self.run(field, "tokenize", prompt, kwargs, strs)
        return ids, token_strs

    async def decode(self, ids: list[int], field: str = "tokens") -> str:
        """`POST /detokenize`: ids inside the tokenizer's vocabulary (checked here), as text."""
        if len(ids) > MAX_PROMPT_CHARS:
            raise InvalidInput(field, f"has {len(ids)} tokens; the limit is {MAX_PROMPT_CHARS}")
        if self.tokenizer is not None:
            size = len(self.tokenizer)
            if ids and not 0 <= min(ids) <= max(ids) < size:  # in C: a million ids in ~20 ms
                bad = next(t for t in ids if not 0 <= t < size)
                raise InvalidInput(field, f"token id {bad} is outside the tokenizer's vocabulary of "
                                          f"{size} tokens (ids 0..{size - 1})")
        return await self.run(field, "decode", ids)

    async def encode(self, text: str, field: str) -> list[int]:
        if len(text) > MAX_PROMPT_CHARS:
            raise InvalidInput(field, f"has {len(text)} characters; the limit is {MAX_PROMPT_CHARS}")
        return await self.run(field, "encode", text)

    def close(self) -> None:
        """Queued renders are dropped; a helper busy with one ends it (within its alarm). The
        saved tokenizer is removed once the helpers are gone: one still starting reads it."""
        with self._lock:
            pool, saved, self._pool, self._saved = self._pool, self._saved, None, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

        def remove() -> None:
            if pool is not None:
                pool.shutdown(wait=True)
            if saved is not None:
                shutil.rmtree(saved, ignore_errors=True)

        threading.Thread(target=remove, name="render-close").start()
