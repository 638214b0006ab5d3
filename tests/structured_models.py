"""A tiny model whose tokenizer can spell JSON: byte-level BPE (every byte a token, no merges)
plus whole-word tokens "w{i}" filling the vocabulary, and tests/models.py's chat template. The
word-level chat model cannot write `{` at all, so a JSON constraint would leave it nothing to say."""

from __future__ import annotations

from pathlib import Path

from models import CHAT_SPECIALS, CHAT_TEMPLATE, VOCAB, make_model
from tokenizers import pre_tokenizers

BYTES = {char: len(CHAT_SPECIALS) + i for i, char in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
"""Token id of each byte-level character ("Ġ" is a space, "Ċ" a newline)."""
WHITESPACE = [BYTES[c] for c in "ĠĊĉč"]


def make_byte_model(path: Path, *, seed: int = 0) -> Path:
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    make_model(path, seed=seed)
    vocab = {name: i for i, name in enumerate(CHAT_SPECIALS)} | BYTES
    word = 0
    while len(vocab) < VOCAB:
        vocab.setdefault(f"w{word}", len(vocab))
        word += 1
    core = Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True) for t in CHAT_SPECIALS])
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path
