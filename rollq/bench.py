"""`rollq bench [NAME...]`: run the benchmarks in `bench/` and write their tables into
docs/benchmarks.md (between the `rollq bench` markers), with the command, machine and date.

Each benchmark is a script, `bench/<name>.py`, that prints its table and writes
`bench/results/<name>.json`; this module only runs them and turns the JSON into markdown.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHES = ("wire", "submit", "dispatch")
"""Built so far; pass-through, swap and scale are not (see docs/benchmarks.md)."""
BEGIN, END = "<!-- rollq bench: begin -->", "<!-- rollq bench: end -->"


def run(names: list[str]) -> None:
    for name in names:
        script = ROOT / "bench" / f"{name}.py"
        if name not in BENCHES or not script.exists():
            raise SystemExit(f"no benchmark {name!r}; there are: {', '.join(BENCHES)} "
                             "(run from a checkout of rollq)")
        print(f"== {name}", flush=True)
        subprocess.run([sys.executable, str(script)], check=True, cwd=ROOT)


def _wire(r: dict) -> list[str]:
    rows = [f"Encode + decode of one group result (n={r['n']} x {r['tokens']} tokens with logprobs).", "",
            "| codec | time | bytes | vs json |", "|---|---|---|---|"]
    for name, c in r["codecs"].items():
        speedup = c["speedup_vs_json"]
        rows.append(f"| {name} | {c['seconds'] * 1e3:.3f} ms | {c['bytes']:,} | {speedup:.1f}x |")
    return rows


def _submit(r: dict) -> list[str]:
    rows = [f"`submit` latency, prompts of {r['prompt_tokens']} tokens, n=8 (one Redis round trip).", "",
            "| Redis | prompts | p50 | p99 |", "|---|---|---|---|"]
    for name, sizes in r["latency"].items():
        for size, v in sizes.items():
            rows.append(f"| {name} | {size} | {v['p50_ms']:.2f} ms | {v['p99_ms']:.2f} ms |")
    return rows


def _dispatch(r: dict) -> list[str]:
    rollq = r["groups_per_s"]["rollq"]
    rows = [f"{r['groups']:,} no-op groups end to end, one worker process, median of {r['repeats']}.", "",
            "| system | groups/s | rollq / this |", "|---|---|---|"]
    for name, rate in r["groups_per_s"].items():
        rows.append(f"| {name} | {rate:,.0f} | {rollq / rate:.2f}x |")
    targets = [("rollq / bare redis-py >= 0.5", r["rollq_vs_bare"] >= 0.5),
               ("rollq / saq >= 5", r["rollq_vs_saq"] >= 5), ("rollq / arq >= 5", r["rollq_vs_arq"] >= 5)]
    rows += ["", "Targets: " + "; ".join(f"{t}: {'met' if ok else '**missed**'}" for t, ok in targets) + "."]
    return rows


_RENDER = {"wire": _wire, "submit": _submit, "dispatch": _dispatch}


def markdown() -> str:
    out = [BEGIN, "", f"Made by `rollq bench` on {time.strftime('%Y-%m-%d')}, "
           f"{_machine()}. Every ratio compares numbers measured in the same run.", ""]
    for name in BENCHES:
        path = ROOT / "bench" / "results" / f"{name}.json"
        if path.exists():
            out += [f"### {name}", "", *_RENDER[name](json.loads(path.read_text())), ""]
    return "\n".join(out + [END])


def _machine() -> str:
    import os
    import platform

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def update_doc(doc: Path = ROOT / "docs" / "benchmarks.md") -> None:
    text = doc.read_text()
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + markdown() + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n## Benchmarks (`rollq bench`)\n\n" + markdown() + "\n"
    doc.write_text(text)
    print(f"tables written to {doc}")
