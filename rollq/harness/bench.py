"""`rollq bench [NAME...]`: run the benchmarks in `bench/` and write their tables into
docs/benchmarks.md (between the `rollq bench` markers), with the command, machine and date.

Each benchmark is a script, `bench/<name>.py`, that prints its table and writes
`bench/results/<name>.json`; this module only runs them and turns the JSON into markdown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCHES = ("wire", "submit", "dispatch", "scale", "passthrough", "swap", "episodes", "scoring")
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
    worst = min(c["speedup_vs_json"] for name, c in r["codecs"].items() if name.startswith("rollq"))
    return rows + ["", f"Target: rollq >= 3x faster than json: {_met(worst >= 3)} (unpacking included)."]


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
    targets = [("rollq / bare redis-py >= 0.6", r["rollq_vs_bare"] >= 0.6),
               ("rollq / saq >= 5", r["rollq_vs_saq"] >= 5), ("rollq / arq >= 5", r["rollq_vs_arq"] >= 5)]
    rows += ["", "Targets: " + "; ".join(f"{t}: {_met(ok)}" for t, ok in targets) + "."]
    return rows


def _met(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _scale(r: dict) -> list[str]:
    m = r["memory"]
    rows = [f"Redis memory per queued group ({m['groups']:,} groups of {m['prompt_tokens']}-token prompts, "
            f"n=8): {m['bytes_per_group']:,.0f} bytes vs {m['raw_token_bytes']:,} bytes of raw tokens = "
            f"**{m['ratio']:.2f}x** (target <= 1.3: {_met(m['ratio'] <= 1.3)}).", "",
            f"{r['workers_groups']:,} no-op groups end to end by worker processes (2 cores):", "",
            "| workers | groups/s |", "|---|---|"]
    rows += [f"| {k} | {v:,.0f} |" for k, v in r["workers_groups_per_s"].items()]
    rows += ["", "Costs with groups queued ahead (16-token prompts):", "",
             "| queued | submit of 64 prompts, p50 | claim + finish per group |", "|---|---|---|"]
    rows += [f"| {d['depth']:,} | {d['submit64_p50_ms']:.2f} ms | {d['claim_finish_us_per_group']:.0f} us |"
             for d in r["depth"]]
    flat = max(r["submit_growth"], r["finish_growth"]) <= 2
    rows += ["", f"Growth from the fewest to the most queued: submit {r['submit_growth']:.2f}x, claim + "
             f"finish {r['finish_growth']:.2f}x (target: within 2x: {_met(flat)})."]
    if "trainers_seen" in r:  # (results written before issue 27 have no such part)
        rows += ["", "Claim + finish per group (listing the streams each claim, as a worker does) after "
                     "trainers came and went (each one group, served and acknowledged):", "",
                 "| trainers seen | streams a claim reads | claim + finish per group |", "|---|---|---|"]
        rows += [f"| {t['seen']:,} | {t['streams_listed']} | {t['claim_finish_us_per_group']:.0f} us |"
                 for t in r["trainers_seen"]]
        rows += ["", f"Growth: {r['seen_growth']:.2f}x (target <= 1.3: {_met(r['seen_growth'] <= 1.3)})."]
    return rows


def _passthrough(r: dict) -> list[str]:
    m = r["model"]
    rows = [f"{r['prompts']} prompts x n={r['n']} x {r['max_tokens']} tokens (ignore_eos, logprobs), random "
            f"Llama (hidden {m['hidden']}, {m['layers']} layers, vocab {m['vocab']}), float32, max_num_seqs "
            f"256, median of {r['repeats']}.", "",
            "| path | tokens/s | CPU s per 1,000 groups (outside the engine core) |", "|---|---|---|"]
    if r.get("parsing"):  # (results before issue 26's acceptance 5 have no such field)
        rows[0] += (" Parsing on: the model has a tokenizer and a hermes tool-call template, the worker "
                    "runs with `--enable-auto-tool-choice --tool-call-parser hermes`.")
    for name, rate in r["tokens_per_s"].items():
        rows.append(f"| {name} | {rate:,.0f} | {r['cpu_s_per_1k_groups'][name]:.1f} |")
    chat = r.get("chat")
    if chat:
        for name, rate in chat["tokens_per_s"].items():
            rows.append(f"| {name} | {rate:,.0f} | {chat['cpu_s_per_1k_groups'][name]:.1f} |")
    rows += ["", f"rollq / raw: **{r['ratio']:.3f}** (target >= 0.97: {_met(r['ratio'] >= 0.97)})."]
    if chat:
        rows += ["", f"Chats (`submit_chat` with one tool, prompts of {chat['prompt_tokens']:.0f} rendered "
                     f"ids): rollq chat / raw: **{chat['ratio']:.3f}**. The worker renders each chat and "
                     "runs the hermes parser on every sample; raw gets the same rendered ids and "
                     "SamplingParams (text decoded) and neither renders nor parses, so this ratio prices "
                     "render + parse."]
    if r.get("load"):
        rows += ["", f"Load average (1 min) {r['load'][0]:.1f} at the start, {r['load'][1]:.1f} at the end "
                     "(2 cores; other sessions' runs share them)."]
    return rows


SWAP_PHASES = ("trainer stall", "registered", "store", "hash in place", "verify", "drain", "pause", "load",
               "push", "canary", "resume")
CANARY_MODES = ("copy + canary", "copy + small canary")


def _swap(r: dict) -> list[str]:
    rows = [f"Publish to serving, {r['bytes'] / 1e6:.0f} MB checkpoint (float32 safetensors), median of "
            f"{r['repeats']} per mode; seconds.", "", *_phase_table(r["modes"])]
    rows += _swap_notes(r)
    tp = r.get("tp")
    if tp:
        copy, push = tp["modes"].get("copy"), tp["modes"].get("state_dict + push")
        rows += ["", f"The same on a worker with tensor_parallel_size={tp['tensor_parallel_size']} (vLLM's "
                     f"CPU build, ranks unbound; {tp.get('date', r.get('date', ''))}, median of "
                     f"{tp['repeats']}; each rank reads and checks the whole push):", "",
                 *_phase_table(tp["modes"]), ""]
        if copy and push:
            ratio = push["total_s"] / copy["total_s"]
            rows.append(f"- TP={tp['tensor_parallel_size']}: state_dict + push: publish -> serving / "
                        f"copy's **{ratio:.2f}** (issue 40's target <= 0.6: {_met(ratio <= 0.6)}); "
                        f"publish -> serving / its floor **{push['ratio_vs_floor']:.2f}**.")
        if tp.get("load"):
            rows.append(f"- load average (1 min) {tp['load'][0]:.1f} at the start, {tp['load'][1]:.1f} "
                        "at the end.")
    return rows + ["", *SWAP_PHASES_EXPLAINED]


def _phase_table(modes: dict) -> list[str]:
    rows = ["| phase | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
    seen = {k for m in modes.values() for k in m["phases_s"]}
    phases = [k for k in SWAP_PHASES if k in seen]
    rows += [f"| {k} | " + " | ".join(f"{m['phases_s'][k]:.2f}" if k in m["phases_s"] else "–"
                                      for m in modes.values()) + " |" for k in phases]
    rows.append("| **publish to serving** | " + " | ".join(
        f"**{m['total_s']:.2f}** ({m['gb_per_s']:.2f} GB/s)" for m in modes.values()) + " |")
    rows.append("| raw read, page cache | " + " | ".join(
        f"{m['raw_warm_s']:.3f}" for m in modes.values()) + " |")
    rows.append("| raw read, cold | " + " | ".join(
        f"{m['raw_cold_s']:.3f}" if m["raw_cold_s"] else "n/a" for m in modes.values()) + " |")
    return rows


def _swap_notes(r: dict) -> list[str]:
    modes, rows = r["modes"], [""]
    for mode, m in modes.items():
        cold = f"{m['ratio_vs_cold']:.3f}" if m["ratio_vs_cold"] else "n/a"
        best = max(m["ratio_vs_warm"], m["ratio_vs_cold"] or 0)
        rows.append(f"- {mode}: swap / raw read bandwidth **{m['ratio_vs_warm']:.3f}** (page cache), "
                    f"**{cold}** (cold) (target >= 0.5: {_met(best >= 0.5)}).")
        if m.get("ratio_vs_floor"):
            ratio = m["ratio_vs_floor"]
            what = ("its paused push: vLLM's load of tensors already in the engine's memory"
                    if "push" in m["phases_s"] else "cold read + the worker's load")
            rows.append(f"- {mode}: publish -> serving / engine floor ({what}, per publish; floor "
                        f"{m['floor_s']:.2f} s) **{ratio:.2f}** "
                        f"(target <= 1.3: {_met(ratio <= 1.3)}).")
        if "trainer stall" in m["phases_s"]:
            stall = m["phases_s"]["trainer stall"]
            first = m.get("stall_first_s")
            first = f"; the client's first publish, which allocates its staging buffer, {first:.3f} s" \
                if first is not None else ""
            rows.append(f"- {mode}: the trainer is held **{stall:.3f} s** per publish, median"
                        f"{first} (target <= 0.1: {_met(stall <= 0.1)}).")
    copy = modes.get("copy")
    if copy and "state_dict + push" in modes:
        ratio = modes["state_dict + push"]["total_s"] / copy["total_s"]
        rows.append(f"- state_dict + push: publish -> serving / copy's **{ratio:.2f}** (issue 40's "
                    f"target <= 0.6: {_met(ratio <= 0.6)}).")
    for mode in CANARY_MODES:
        if copy and mode in modes:
            ratio = modes[mode]["total_s"] / copy["total_s"]
            default = mode == CANARY_MODES[0]
            rows.append(f"- {mode}: publish -> serving / copy's **{ratio:.2f}**"
                        + (f" (issue 41's target <= 1.10: {_met(ratio <= 1.10)})" if default else "")
                        + f"; the trainer's reference (transformers, float32) "
                        f"{r.get('reference_s', {}).get(mode, float('nan')):.2f} s per publish.")
    a = r.get("adapter")
    if a:
        ms = a["total_s"] * 1000
        judged = "servable_s" not in a  # older results: the raw figure was the one judged
        rows.append(f"- adapter version (rank {a['rank']}, {a['bytes'] / 1e6:.1f} MB of adapter on the "
                    f"same base): publish -> first token of a probe group **{ms:.1f} ms**, median of "
                    f"{a['repeats']} (store {a['store_s'] * 1000:.1f} ms{_probe_ms(a)})"
                    + (f" (target <= 50 ms: {_met(ms <= 50)})." if judged else "."))
        if "servable_s" in a:
            servable, resident = a["servable_s"] * 1000, a["resident_s"] * 1000
            judged = "loaded_s" not in a  # older results: judged on this figure
            rows.append(f"- adapter version, publish -> servable (the raw figure less the same probe "
                        f"on the adapter once resident, {resident:.1f} ms: the probe's own CPU forward "
                        f"pass, paid by every group whatever its version): **{servable:.1f} ms**"
                        + (f" (target <= 50 ms: {_met(servable <= 50)})." if judged else "."))
        if "loaded_s" in a:
            loaded = a["loaded_s"] * 1000
            rows.append(f"- adapter version, publish -> loaded (the worker's own stamp of the moment "
                        f"groups can run on it, from its heartbeat; no probe subtracted): "
                        f"**{loaded:.1f} ms** (target <= 50 ms: {_met(loaded <= 50)}).")
    if r.get("load"):
        rows.append(f"- load average (1 min) {r['load'][0]:.1f} at the start, {r['load'][1]:.1f} "
                    "at the end (2 cores; other sessions' runs share them).")
    return rows


SWAP_PHASES_EXPLAINED = [
    "The phases, in order (each byte's passes in brackets):",
    "- *trainer stall* (state_dict only): `publish_weights` copying the trainer's tensors into a "
    "staging buffer laid out as the safetensors file; the trainer goes on after it [1 memcpy].",
    "- *registered*: from the call to the version's announcement (the worker learns of it then); a "
    "push registers before its files are written, every other path after.",
    "- *store*: the publish task, to its end. Copy: the kernel copies the files into the store "
    "(sendfile, over the files of the policy's spare, a retired version), the copies are hashed "
    "through a memory map (BLAKE3), renamed into place and registered "
    "[copy, hash]; state_dict: the staging buffer written to disk while another thread hashes it "
    "in memory, renamed, registered [write + hash at once]. Then, while workers already verify "
    "it, the fsyncs and `keep`: so *store* overlaps *verify* and the phases add up to more than "
    "the end to end. *hash in place* (by reference): the trainer's files hashed where they are, "
    "registered [hash]. The publisher's BLAKE3 pass binds the version's label to these bytes.",
    "- *verify*: the worker, told by the announcement stream, pins the version, copies its files "
    "over a spare snapshot of its own (sendfile into existing blocks and pages), hashes the copy "
    "through a memory map and checks headers and every tensor's shape [copy, hash]: the bytes the "
    "engine will read are the bytes hashed (issue 21).",
    "- *drain*: groups that may not cross the swap finish on the old version (none here).",
    "- *pause*: vLLM pauses generation.",
    "- *load*: vLLM's `reload_weights` of the snapshot (layers materialized again, weights copied "
    "in and repacked for the CPU kernels) and one probe token proving them [read by vLLM].",
    "- *resume*: generation resumes; the probe group's one token then marks the end to end.",
    "- *engine floor*: per publish, the cold read of the files (their pages evicted first) plus "
    "that publish's *load*: what any swap through vLLM pays at least. The ratio is end to end "
    "over it. Each publish starts once the worker's processes are idle and the disk is settled; "
    "each mode's first three publishes are not measured (the steady state: store and worker each "
    "hold a spare to write over).",
    "- *adapter*: publish -> loaded is the worker's own stamp (its heartbeat's `last_adapter`) of "
    "when groups could first run on the version, less the publish call's start (one host, one "
    "clock): the PEFT state dict, the store up to registration, the worker's copy, checks and "
    "`add_lora`. The probe figures beside it include a CPU forward pass of the whole model.",
]


def episodes_table(r: dict) -> list[str]:
    rows = [f"{r['episodes']} episodes x {r['turns']} turns on 2 vLLM workers (prompt {r['prompt']}, "
            f"+{r['new']} new and {r['sampled']} sampled tokens per turn, KV blocks of "
            f"{r['block_size']} tokens); turns 2..{r['turns']}:", "",
            "| affinity | prefix-cache hit rate (vLLM) | turns on another worker | mean time per turn | "
            "first turns per worker |", "|---|---|---|---|---|"]
    for run in r["runs"]:
        rows.append(f"| {'on' if run['affinity'] else 'off'} | {run['hit_rate']:.1%} | "
                    f"{run['turns_elsewhere']} of {run['turns']} | {run['turn_s_mean'] * 1e3:.0f} ms | "
                    f"{sorted(run['episodes_per_worker'].values())} |")
    f = r["fresh"]
    rows += ["", f"A fresh request of the same total length (nothing cached), {f['requests']} in the "
                 f"same waves: {f['request_s_mean'] * 1e3:.0f} ms mean.",
             f"Target: hit rate >= 80 % with affinity: "
             f"{'met' if r['runs'][0]['hit_rate'] >= 0.8 else 'missed'}."]
    return rows


def _scoring(r: dict) -> list[str]:
    rows = [f"{r['groups']:,} groups (n={r['n']}) end to end per row, one instant-engine worker, one "
            f"`rollq scorer` with {r['processes']} child processes for sync rewards; a no-op reward, "
            "so what is priced is scoring's own path (the scoring stream, the scorer's claim, the "
            "reward call, the second finish).", "",
            "| reward | groups/s | added per group |", "|---|---|---|",
            f"| none | {r['plain_groups_per_s']:,.0f} | – |",
            f"| sync no-op (child process) | {r['sync_noop_groups_per_s']:,.0f} | "
            f"{r['sync_overhead_ms_per_group']:.2f} ms |",
            f"| async no-op (scorer's loop) | {r['async_noop_groups_per_s']:,.0f} | "
            f"{r['async_overhead_ms_per_group']:.2f} ms |"]
    rows += ["", "A ratio, not a target: the worker, the scorer, its children, Redis and the trainer "
                 "share the 2 cores."]
    if r.get("load"):
        rows[-1] += (f" Load average (1 min) {r['load'][0]:.1f} at the start, {r['load'][1]:.1f} at the end "
                     "(other sessions' runs share them).")
    return rows


def _probe_ms(a: dict) -> str:
    return f", the probe's one token {a['generation_s'] * 1000:.1f} ms" if "generation_s" in a else ""


_RENDER = {"wire": _wire, "submit": _submit, "dispatch": _dispatch, "scale": _scale,
           "passthrough": _passthrough, "swap": _swap,
           "episodes": episodes_table, "scoring": _scoring}


def results_dir() -> Path:
    """Where the benchmarks write their JSON (ROLLQ_BENCH_RESULTS overrides, e.g. for tests)."""
    return Path(os.environ.get("ROLLQ_BENCH_RESULTS", ROOT / "bench" / "results"))


def markdown(kept: dict[str, str] | None = None) -> str:
    """The tables block: each benchmark with results rendered anew; one without results keeps
    its section from `kept` (running one benchmark must not erase the others' tables)."""
    kept = kept or {}
    out = [BEGIN, "", f"Made by `rollq bench` on {time.strftime('%Y-%m-%d')}, "
           f"{_machine()}. Every ratio compares numbers measured in the same run.", ""]
    for name in BENCHES:
        path = results_dir() / f"{name}.json"
        if path.exists():
            out += [f"### {name}", "", *_RENDER[name](json.loads(path.read_text())), ""]
        elif name in kept:
            out += [kept[name], ""]
    return "\n".join(out + [END])


def _sections(block: str) -> dict[str, str]:
    """The `### name` sections of an existing tables block, by name."""
    found = {}
    for part in block.split("\n### ")[1:]:
        name, _, body = part.partition("\n")
        found[name.strip()] = f"### {name}\n{body}".rstrip()
    return found


def _machine() -> str:
    import platform

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def update_doc(doc: Path = ROOT / "docs" / "benchmarks.md") -> None:
    text = doc.read_text()
    if BEGIN in text and END in text:
        kept = _sections(text[text.index(BEGIN) + len(BEGIN):text.index(END)])
        text = text[:text.index(BEGIN)] + markdown(kept) + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n## Benchmarks (`rollq bench`)\n\n" + markdown() + "\n"
    doc.write_text(text)
    print(f"tables written to {doc}")
