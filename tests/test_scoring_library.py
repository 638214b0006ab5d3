"""rollq's reward library (`rollq.scoring.library`), called as a scorer's child calls it: math
through math-verify, and code run in a limited process per test case."""

from __future__ import annotations

import time

import pytest

from rollq.scoring import Completion
from rollq.scoring.rewards import find_rewards


def _text(text: str) -> Completion:
    return Completion(text, [], "stop")


def test_math_rewards_an_equal_answer_whatever_its_form():
    math = find_rewards("rollq.scoring.library")["math"]
    assert math.spec.version.startswith("math-verify-")
    reward = math.fn
    assert reward(_text("Halving 1 gives \\boxed{\\frac{1}{2}}."), "0.5") == 1.0
    assert reward(_text("So the answer is $0.5$"), "$\\frac{1}{2}$") == 1.0
    assert reward(_text("The answer is \\boxed{3}"), 4) == 0.0
    assert reward(_text("no answer at all"), "7") == 0.0
    with pytest.raises(TypeError, match="gold answer"):
        reward(_text("\\boxed{1}"), {"answer": 1})


SQUARE = "Here it is:\n```python\nn = int(input())\nprint(n * n)\n```\n"
TESTS = {"tests": [{"stdin": "3\n", "stdout": "9\n"}, {"stdin": "4", "stdout": "16"},
                   {"stdin": "5", "stdout": "26"}], "time_s": 2}


def test_code_reward_is_the_share_of_tests_passed():
    code = find_rewards("rollq.scoring.library")["code"].fn
    assert code(_text(SQUARE), TESTS) == pytest.approx(2 / 3)
    assert code(_text("print(int(input()) ** 2)"), TESTS) == pytest.approx(2 / 3)  # no fence: the text
    assert code(_text("```python\nraise SystemExit(3)\n```"), TESTS) == 0.0
    with pytest.raises(TypeError, match="tests"):
        code(_text(SQUARE), {"cases": []})


def test_code_runs_with_time_and_memory_limits_and_no_leftovers():
    from rollq.scoring.library import run_program

    assert run_program("while True: pass", "", 0.5, 64) == ("", "timed out after 0.5 s")
    out, failed = run_program("x = bytearray(512 * 1024 * 1024)\nprint('allocated')", "", 5, 64)
    assert (out, failed) == ("", "exit code 1")  # MemoryError under RLIMIT_AS
    # A program that starts a sleeper and exits: the sleeper is killed with its process group.
    out, failed = run_program("import os, subprocess, sys\n"
                              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                              "print(p.pid)", "", 5, 256)
    assert not failed
    pid = int(out)
    give_up = time.monotonic() + 10
    while _alive(pid):  # SIGKILL lands at once, the state shows it a moment later
        assert time.monotonic() < give_up, f"process {pid} the program started is still running"
        time.sleep(0.01)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie until init reaps it
    except FileNotFoundError:
        return False
