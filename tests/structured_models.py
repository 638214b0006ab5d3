"""A tiny model whose tokenizer can spell JSON: byte-level BPE (every byte a token, no merges)
plus whole-word tokens "w{i}" filling the vocabulary, and tests/models.py's chat template. The
word-level chat model cannot write `{` at all, so a JSON constraint would leave it nothing to say.
The tokenizer is bench/common.py's `save_byte_tokenizer` (the pass-through bench uses it too)."""

from __future__ import annotations

import sys
from pathlib import Path

from models import CHAT_SPECIALS, CHAT_TEMPLATE, VOCAB, make_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import byte_level_vocab, save_byte_tokenizer  # noqa: E402

BYTES = {c: i for c, i in byte_level_vocab(CHAT_SPECIALS, 0).items() if i >= len(CHAT_SPECIALS)}
"""Token id of each byte-level character ("Ġ" is a space, "Ċ" a newline)."""
WHITESPACE = [BYTES[c] for c in "ĠĊĉč"]


def make_byte_model(path: Path, *, seed: int = 0) -> Path:
    make_model(path, seed=seed)
    save_byte_tokenizer(path, vocab=VOCAB, specials=CHAT_SPECIALS, chat_template=CHAT_TEMPLATE)
    return path
