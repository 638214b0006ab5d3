"""The reference of `rollq chaos --weights` sees a mislabel: samples built here from transformers'
own greedy decoding (`generate`, what the reference used before its teacher-forced passes),
labelled right, then with the wrong version, the wrong swap position, or an EOS mid-segment."""

import pytest
import torch

from rollq.harness.chaos.reference import WEIGHT_SETS, Reference, WeightSets, make_tiny_model

PROMPT = [1, 20, 4]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return Reference(WeightSets(make_tiny_model(tmp_path_factory.mktemp("chaos-reference") / "model")))


@torch.no_grad()
def _generate(reference: Reference, weight_set: int, prefix: list[int], count: int) -> list[int]:
    """Greedy decoding one token at a time (KV cache), independent of the forward passes checked."""
    model = reference.sets.models[weight_set]
    ids = torch.tensor([prefix])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=count, do_sample=False,
                         pad_token_id=0, eos_token_id=model.config.eos_token_id)
    return out[0, len(prefix):].tolist()


def _swapped(reference: Reference, first: int, second: int, cut: int, length: int) -> list[int]:
    """`cut` tokens greedy under weight set `first`, then the rest greedy under `second`."""
    head = _generate(reference, first, PROMPT, cut)
    return head + _generate(reference, second, PROMPT + head, length - cut)


def test_right_labels_pass_and_each_mislabel_is_found(reference):
    tokens = _swapped(reference, 0, 1, 12, 30)
    assert len(tokens) == 30  # the tiny model does not pick EOS here: both segments are full
    assert reference.mislabels(PROMPT, tokens, [(0, 0), (1, 12)]) == []
    assert reference.mislabels(PROMPT, tokens, [(3, 0), (4, 12)]) == []  # version v: weight set v % 3

    # The second segment labelled with another weight set's version: found, with who made it.
    wrong = reference.mislabels(PROMPT, tokens, [(0, 0), (2, 12)])
    assert len(wrong) == 1 and "tokens [12:30] labelled version 2" in wrong[0]
    assert "equal the greedy continuation of weight sets [1]" in wrong[0]
    # One label for the whole sample: the tokens after the swap are not weight set 0's.
    assert len(reference.mislabels(PROMPT, tokens, [(0, 0)])) == 1
    # The swap put two tokens early or late: the segment that straddles it is nobody's.
    for cut in (10, 14):
        wrong = reference.mislabels(PROMPT, tokens, [(0, 0), (1, cut)])
        assert len(wrong) == 1 and "weight sets []" in wrong[0], (cut, wrong)


def test_the_weight_sets_continue_differently(reference):
    """Else a mislabel between weight sets could not show: the chaos run counts such prompts."""
    prompts = [[1, 7 + 13 * i, 3 + i] for i in range(6)] + [[1, 5]]
    continuations = [reference.greedy(w, prompts, 24) for w in range(WEIGHT_SETS)]
    for w in range(WEIGHT_SETS):  # batched greedy equals one prompt at a time
        assert [list(c) for c in continuations[w]] == [_generate(reference, w, p, 24) for p in prompts]
    assert all(len(set(of_prompt)) == WEIGHT_SETS for of_prompt in zip(*continuations))


def test_eos_inside_a_segment_is_a_mislabel(reference):
    """Greedy decoding stops at EOS (vLLM's does): a segment with EOS before its last token was not
    decoded greedily. Made visible by naming a token that occurs once in the sample EOS."""
    tokens = _generate(reference, 0, PROMPT, 12)
    at = next(i for i, t in enumerate(tokens) if tokens.count(t) == 1)
    eos_before = reference.eos
    reference.eos = tokens[at]
    try:
        assert reference.mislabels(PROMPT, tokens[:at + 1], [(0, 0)]) == []  # ends with EOS: fine
        assert len(reference.mislabels(PROMPT, tokens, [(0, 0)])) == 1
        # Cut right after it, each segment ends with EOS or has none: as `generate` judged them.
        assert reference.mislabels(PROMPT, tokens, [(0, 0), (3, at + 1)]) == []
    finally:
        reference.eos = eos_before
