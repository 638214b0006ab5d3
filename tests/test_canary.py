"""The canary's wire type and verdict without an engine (rollq/canary.py; the engine's side:
test_canary_vllm.py): limits named by field, the default sequences, the figures."""

from __future__ import annotations

import math

import msgspec
import pytest

from rollq.canary import (MAX_CANARY_BYTES, MAX_CANARY_SEQUENCES, MAX_CANARY_TOKENS, TOLERANCES, Canary,
                          Tolerance, compare, decode_canary, default_sequences, encode_canary,
                          reference)
from rollq.protocol import InvalidInput, pack_floats, pack_tokens, unpack_floats


def canary(seqs, lps, **kw) -> Canary:
    return Canary(sequences=[pack_tokens(s) for s in seqs], logprobs=[pack_floats(x) for x in lps],
                  dtype="float32", **kw)


def test_round_trip_keeps_the_override():
    c = canary([[1, 2, 3]], [[-1.5, -0.25]], tolerance=Tolerance(max_abs=0.5, mean_abs=0.1, kl=0.01))
    back = decode_canary(encode_canary(c))
    assert back.token_ids() == [[1, 2, 3]] and back.tolerance == c.tolerance and back.dtype == "float32"


@pytest.mark.parametrize("bad, field, words", [
    (canary([[1, 2, 3]], [[-1.0]]), "canary.logprobs[0]", "1 values for 3 tokens"),
    (canary([[1, 2], [3, 4]], [[-1.0]]), "canary.logprobs", "1 entries for 2 sequences"),
    (canary([[1, 2]], [[0.5]]), "canary.logprobs[0]", "not a finite log probability"),
    (canary([[1, 2]], [[math.nan]]), "canary.logprobs[0]", "not a finite log probability"),
    (canary([[1, -2]], [[-1.0]]), "canary.sequences[0]", "negative token id"),
    (canary([[1]], [[]]), "canary.sequences", "8"),  # one token: nothing to score
    (canary([[1, 2]] * (MAX_CANARY_SEQUENCES + 1), [[-1.0]] * (MAX_CANARY_SEQUENCES + 1)),
     "canary.sequences", str(MAX_CANARY_SEQUENCES)),
])
def test_a_bad_canary_is_refused_naming_the_field_and_the_limit(bad, field, words):
    with pytest.raises(InvalidInput) as e:
        decode_canary(msgspec.msgpack.encode(bad))
    assert e.value.field.startswith(field) and words in str(e.value), str(e.value)


def test_the_token_budget_is_checked_before_the_canary_leaves():
    with pytest.raises(InvalidInput, match=f"36000 tokens; the limit is {MAX_CANARY_TOKENS}"):
        encode_canary(canary([list(range(4000))] * 9, [[-1.0] * 3999] * 9))


def test_too_many_bytes_are_refused_before_any_decode():
    with pytest.raises(InvalidInput, match=f"the limit is {MAX_CANARY_BYTES}"):
        decode_canary(b"\x00" * (MAX_CANARY_BYTES + 1))


def test_default_sequences_walk_the_whole_vocabulary_when_it_fits():
    seqs = default_sequences(512)
    assert len(seqs) == 8 and {len(s) for s in seqs} == {128}
    walk = [t for s in seqs for t in s]
    assert sorted(walk[:512]) == list(range(512)) and walk == [t for s in default_sequences(512) for t in s]
    big = [t for s in default_sequences(151_936) for t in s]
    assert len(set(big)) == 1024 and max(big) < 151_936  # a sample of a large vocabulary, no repeats


def test_compare_figures_and_a_nan_refuses():
    c = canary([[1, 2, 3]], [[-1.0, -2.0]])
    v = compare(c, [[-1.0, -2.0 + 1e-3]], engine_dtype="float32")
    assert v.max_abs == pytest.approx(1e-3) and v.mean_abs == pytest.approx(5e-4) and v.worst == (0, 2)
    assert v.kl == pytest.approx((math.expm1(1e-3) - 1e-3) / 2) and not v.accepted
    assert compare(c, [[-1.0, -2.0 + 1e-3]], engine_dtype="bfloat16").accepted  # the coarser dtype's
    nan = compare(c, [[-1.0, math.nan]], engine_dtype="bfloat16", tolerance=Tolerance(1e9, 1e9, 1e9))
    assert not nan.accepted and nan.max_abs == math.inf
    assert TOLERANCES["float32"].max_abs < TOLERANCES["bfloat16"].max_abs


def test_reference_batches_by_length_gives_the_model_its_mode_back_and_matches_teacher_forcing(tmp_path):
    from models import load_reference, make_model, token_logprobs

    model = load_reference(make_model(tmp_path / "m")).train()
    sequences = [[5, 6, 7, 8], [9, 10, 11, 12], [300, 2]]
    c = reference(model, sequences)
    assert model.training and c.dtype == "float32" and c.token_ids() == sequences
    model.eval()
    for ids, values in zip(sequences, c.logprobs):
        expected = token_logprobs(model, ids[:1], ids[1:])
        assert max(abs(a - b) for a, b in zip(unpack_floats(values), expected)) < 1e-5
    with pytest.raises(InvalidInput, match="two tokens at least"):
        reference(model, [[1]])
    with pytest.raises(InvalidInput, match="texts need the tokenizer"):
        reference(model, texts=["w9 w10"])
