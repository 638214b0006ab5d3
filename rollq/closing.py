"""What a chat template writes after an assistant message's content (its closing, the next
messages and the generation prompt), read off the template itself; and how much of it a sample
already wrote. One owner for both front doors of an exact multi-turn prompt: conversations
(`engine/chat.py` `ChatRenderer.exact`, on the worker with vLLM's renderer) and episodes
(`client/episodes.py` `chat_continuation`, and the gateway's `messages` turns, with a Hugging Face
tokenizer). Free of vLLM and of rollq's other modules, so the client, the gateway's render helpers
and the worker all import it.

Never assumed: ChatML closes an assistant message with `<|im_end|>\n`, Llama 3 with `<|eot_id|>`
alone, Gemma with `<end_of_turn>\n`, and a sample ends with the end token (a stop token) or is cut
(max_tokens, a stop string). The text after a marker content is what the template writes; the
sample's last token says which part of it the sample already wrote.
"""

from __future__ import annotations

from typing import Any

MARKER = "rollq-end-of-content-7e1f"
"""The content of the stand-in assistant message new messages are rendered after: what the
template writes after it is what follows an assistant message's content."""
MARKED_BASE = ({"role": "user", "content": "x"}, {"role": "assistant", "content": MARKER})


def after_marker(rendered: Any) -> str | None:
    """The text a rendering of `MARKED_BASE + messages` has after the marker; None when the
    template does not write an assistant message's content as given (exactly once, as text)."""
    if not isinstance(rendered, str) or rendered.count(MARKER) != 1:
        return None
    return rendered[rendered.index(MARKER) + len(MARKER):]


def closing_end(after: list[int], tokenizer: Any, special: set[int]) -> int:
    """Where in `after` (what the template writes after an assistant message's content) the
    special end token a sample may have ended with sits: the first special token, with only
    whitespace before it (a template that writes "\n" then its end token); -1 when text or
    nothing special comes first."""
    for i, token in enumerate(after):
        if token in special:
            return i
        if tokenizer.decode([token]).strip():
            return -1
    return -1


def skip_sampled(last: int, after: list[int], end: int) -> list[int]:
    """`after` past its end token at `end` (`closing_end`) when the sample's last token `last` is
    that token (it was sampled there and is not written twice); else all of it."""
    return after[end + 1:] if 0 <= end < len(after) and after[end] == last else after


def after_end(last: int, after: list[int], tokenizer: Any, special: set[int]) -> list[int]:
    """`after` past the end token a sample ended with (`last`): a special token the closing writes
    first, or after whitespace, was sampled there and is not written twice. Anything else (a
    sample cut by max_tokens or a stop string, or whose end token is not the one the template
    closes with) is followed by the whole closing."""
    return skip_sampled(last, after, closing_end(after, tokenizer, special))


def special_ids(tokenizer: Any) -> set[int]:
    """Its special tokens: the named ones (eos, ...) and the added tokens marked special (ChatML's
    `<|im_end|>`, which many tokenizers do not name)."""
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
