"""rollq's own rewards: `rollq scorer --rewards rollq.scoring.library` offers `math` (when
math-verify is installed: `pip install rollq[score]`) and `code`.

math: `reward_inputs[i]` is group i's gold answer ("1/2", "$\\frac{1}{2}$", "\\boxed{0.5}");
1.0 when Hugging Face's math-verify finds the completion's answer equal to it, else 0.0.

code: `reward_inputs[i]` is {"tests": [{"stdin": ..., "stdout": ...}, ...], "time_s": ...,
"memory_mb": ...}; the completion's last ```python block (or its whole text) runs once per test
in its own process (`python -I`, an empty temporary directory, limits on CPU time, wall time,
address space and file size); the reward is the share of tests whose output matches (trailing
whitespace ignored).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
from typing import Any

from rollq.scoring.rewards import Completion, reward

# --- math ---------------------------------------------------------------------------------------

if importlib.util.find_spec("math_verify") is not None:
    _MATH_VERSION = f"math-verify-{importlib.metadata.version('math-verify')}"

    @reward("math", version=_MATH_VERSION, timeout_s=20, memory_mb=2048)
    def math(completion: Completion, inputs: Any) -> float:
        from math_verify import parse, verify

        if not isinstance(inputs, (str, int, float)) or isinstance(inputs, bool):
            raise TypeError("reward_inputs for 'math' must be the gold answer (a string or number)")
        gold = str(inputs)
        # A bare answer ("1/2") is read as math; math-verify looks for $...$ or \boxed{...}.
        if "$" not in gold and "\\boxed" not in gold:
            gold = f"${gold}$"
        return 1.0 if verify(parse(gold), parse(completion.text)) else 0.0


# --- code ---------------------------------------------------------------------------------------

MAX_TESTS = 64
MAX_TIME_S = 10.0
MAX_MEMORY_MB = 1024
OUTPUT_BYTES = 1024 * 1024
"""Most bytes a program may write (RLIMIT_FSIZE) and that are read of its stdout."""
_FENCE = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)


def program_of(text: str) -> str:
    """The completion's last fenced code block, or its whole text when it has none."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


def _tests(inputs: Any) -> tuple[list[tuple[str, str]], float, int]:
    if not isinstance(inputs, dict) or not isinstance(inputs.get("tests"), list) or not inputs["tests"]:
        raise TypeError("reward_inputs for 'code' must be {'tests': [{'stdin': ..., 'stdout': ...}, ...]}")
    tests = inputs["tests"]
    if len(tests) > MAX_TESTS:
        raise ValueError(f"reward_inputs: {len(tests)} tests; the limit is {MAX_TESTS}")
    pairs = []
    for i, t in enumerate(tests):
        if not (isinstance(t, dict) and isinstance(t.get("stdin", ""), str)
                and isinstance(t.get("stdout"), str)):
            raise TypeError(f"reward_inputs tests[{i}] must be {{'stdin': str, 'stdout': str}}")
        pairs.append((t.get("stdin", ""), t["stdout"]))
    time_s = float(inputs.get("time_s", 2.0))
    memory_mb = int(inputs.get("memory_mb", 256))
    if not 0 < time_s <= MAX_TIME_S or not 16 <= memory_mb <= MAX_MEMORY_MB:
        raise ValueError(f"reward_inputs: time_s in (0, {MAX_TIME_S}] and memory_mb in [16, {MAX_MEMORY_MB}]")
    return pairs, time_s, memory_mb


def _limits(time_s: float, memory_mb: int):
    def apply() -> None:  # in the program's process, before it runs
        cpu = int(time_s) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb * 1024 * 1024,) * 2)
        resource.setrlimit(resource.RLIMIT_FSIZE, (OUTPUT_BYTES,) * 2)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    return apply


def run_program(source: str, stdin: str, time_s: float, memory_mb: int) -> tuple[str, str]:
    """(stdout, '') or ('', why it failed): one run of `source` in a fresh, limited process.
    Its output goes to a file, not a pipe: a process it leaves behind cannot hold the run open."""
    with tempfile.TemporaryDirectory(prefix="rollq-code-") as tmp:
        path = os.path.join(tmp, "main.py")
        with open(path, "w") as f:
            f.write(source)
        with tempfile.TemporaryFile() as given, tempfile.TemporaryFile() as output:
            given.write(stdin.encode())
            given.seek(0)
            proc = subprocess.Popen([sys.executable, "-I", path], cwd=tmp, stdin=given, stdout=output,
                                    stderr=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin", "HOME": tmp},
                                    start_new_session=True, preexec_fn=_limits(time_s, memory_mb))
            try:
                code = proc.wait(timeout=time_s)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)  # whatever it started, too
                proc.wait()
            if code is None:
                return "", f"timed out after {time_s:g} s"
            if code != 0:
                return "", f"exit code {code}"
            output.seek(0)
            return output.read(OUTPUT_BYTES).decode(errors="replace"), ""


def _same(out: str, expected: str) -> bool:
    lines = lambda s: [line.rstrip() for line in s.rstrip().splitlines()]  # noqa: E731
    return lines(out) == lines(expected)


@reward("code", version="1", timeout_s=120, memory_mb=512)
def code(completion: Completion, inputs: Any) -> float:
    tests, time_s, memory_mb = _tests(inputs)
    source = program_of(completion.text)
    passed = 0
    for stdin, expected in tests:
        out, failed = run_program(source, stdin, time_s, memory_mb)
        passed += not failed and _same(out, expected)
    return passed / len(tests)
