"""`sampling.regex` reaches the worker's vLLM engine, whose structured-output backend (xgrammar
in vLLM 0.32's `auto` mode) matches it with an Earley parser, token by token, in the engine's
loop. It does not backtrack, but nested repetition makes its state sets grow with every token:
measured with xgrammar 0.2.8, `(a*)*b` took 3.2 s for 200 tokens and `(a{0,10}){0,10}b` 1.5 s
for 50, while `(a+)+b` and `(a|aa)*b` took milliseconds. So such regexes are refused where
sampling settings are validated, with the field named (docs/reliability.md, threat model)."""

from __future__ import annotations

import gc
import time

import pytest

from rollq.protocol import MAX_REGEX_CHARS, InvalidInput, Sampling, validate_sampling


@pytest.mark.parametrize("regex", [
    "(a*)*b", "(a+a+)+b", "(a{0,10}){0,10}b", "(?:x?y*)+z", "((a|b)*c)*d", "(a|(b+))*",
    "x(a?){300}", "(?=(a*)*)b",
])
def test_nested_repetition_is_refused_with_the_field_named(regex):
    with pytest.raises(InvalidInput) as e:
        validate_sampling(Sampling(regex=regex), 1)
    assert e.value.field == "sampling.regex"
    assert "nested" in str(e.value)


@pytest.mark.parametrize("regex", ["a+", "(a+)b+", "(a|aa)*b", "[0-9]{1,5}", r"\d+(\.\d+)?",
                                   "(yes|no)", "[a-z ]{0,1000}\\.", "(ab){3}"])
def test_plain_regexes_pass(regex):
    validate_sampling(Sampling(regex=regex), 1)


def test_regex_length_and_syntax_are_bounded():
    with pytest.raises(InvalidInput, match="characters") as e:
        validate_sampling(Sampling(regex="a" * (MAX_REGEX_CHARS + 1)), 1)
    assert e.value.field == "sampling.regex"
    for bad in ["(a", "a{2,1}", "(" * 1000 + ")" * 1000]:
        with pytest.raises(InvalidInput) as e:
            validate_sampling(Sampling(regex=bad), 1)
        assert e.value.field == "sampling.regex"


def test_checking_a_maximal_regex_is_cheap():
    regex = "(ab|cd)" * (MAX_REGEX_CHARS // 7)
    # This thread's CPU time: process_time() also counted the other threads of the test process
    # (a session engine's, pytest-xdist's), 0.69 s of it once while this parse took far less.
    # Nor a garbage collection the parse's allocations set off: in a test process that holds torch,
    # vLLM and a session engine a full collection walks millions of objects on this thread (CI:
    # 0.78 s where the parse takes 0.02-0.05 s).
    gc.collect()
    gc.disable()
    try:
        start = time.thread_time()
        validate_sampling(Sampling(regex=regex), 1)
        spent = time.thread_time() - start
    finally:
        gc.enable()
    assert spent < 0.5  # CPU time of one parse; generous for a loaded box
