"""Wire benchmark: encode + decode one group result (n=8 x 1,024 tokens, with logprobs).

rollq's codec (msgspec msgpack, packed int32 tokens and float32 logprobs) against JSON and
pickle of the same data as plain Python lists, measured in the same run. Medians of repeats.
Also the checked codec of one work item (a 512-token prompt, n=8): what a worker pays to decode
and check it, and what the client pays to check and encode it.

    python bench/wire.py            # prints the tables, writes bench/results/wire.json
    python bench/wire.py --repeats 3 --loops 20     # quicker, noisier
"""

from __future__ import annotations

import argparse
import json
import pickle  # noqa: TID251 (a timing baseline on our own in-memory objects; nothing read from a wire)
import random
import statistics
import time

from common import write_result

from rollq import protocol
from rollq.protocol import (GroupResult, Sample, Sampling, WorkItem, decode_item, decode_result, encode,
                            pack_floats, pack_tokens)

N, TOKENS, REPEATS, LOOPS = 8, 1024, 7, 50


def make_result() -> tuple[GroupResult, dict]:
    rng = random.Random(0)
    samples = []
    plain = {"job_id": "job", "group_index": 3, "status": "ok", "samples": []}
    for _ in range(N):
        tokens = [rng.randrange(150_000) for _ in range(TOKENS)]
        logprobs = [-rng.random() * 5 for _ in range(TOKENS)]
        samples.append(Sample(pack_tokens(tokens), pack_floats(logprobs), "length",
                              versions=[(7, 0)]))
        plain["samples"].append({"tokens": tokens, "logprobs": logprobs, "finish_reason": "length",
                                 "versions": [[7, 0]]})
    return GroupResult("job", 3, "ok", samples=samples, prompt=pack_tokens(range(512))), plain


def make_item() -> WorkItem:
    sampling = Sampling(temperature=0.7, top_p=0.95, max_tokens=1024, stop_token_ids=[2], logprobs=5,
                        stop=["</answer>"], extra={"ignore_eos": False})
    return WorkItem("job", 3, pack_tokens(range(512)), N, sampling, 1.0, max_staleness=2)


def timed(round_trip) -> float:
    """Median seconds per encode + decode."""
    runs = []
    for _ in range(REPEATS):
        began = time.perf_counter()
        for _ in range(LOOPS):
            round_trip()
        runs.append((time.perf_counter() - began) / LOOPS)
    return statistics.median(runs)


def main() -> None:
    global REPEATS, LOOPS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed runs (the median is shown)")
    parser.add_argument("--loops", type=int, default=LOOPS, help="round trips per timed run")
    args = parser.parse_args()
    REPEATS, LOOPS = args.repeats, args.loops
    result, plain = make_result()
    rollq_bytes = encode(result)
    def rollq_to_lists():
        back = decode_result(encode(result))
        return [(s.token_ids, s.token_logprobs) for s in back.samples]

    codecs = {
        "rollq (msgspec, packed arrays)": (lambda: decode_result(encode(result)), len(rollq_bytes)),
        "rollq, then unpacked to lists": (rollq_to_lists, len(rollq_bytes)),
        "json (lists)": (lambda: json.loads(json.dumps(plain)), len(json.dumps(plain))),
        # A baseline on local data only: rollq never unpickles anything that crossed a wire.
        "pickle (lists)": (lambda: pickle.loads(pickle.dumps(plain)),  # noqa: S301
                           len(pickle.dumps(plain))),
    }
    rows = {name: (timed(fn), size) for name, (fn, size) in codecs.items()}
    base = rows["json (lists)"][0]
    print(f"{'codec':34} {'encode+decode':>14} {'bytes':>10} {'vs json':>8}")
    for name, (seconds, size) in rows.items():
        print(f"{name:34} {seconds * 1e3:11.3f} ms {size:10,} {base / seconds:7.1f}x")
    item = make_item()
    data = encode(item)
    # The client checks a job's groups one after the other (what they share is checked once).
    check = getattr(protocol, "encode_item", None) or (lambda it: (protocol.validate_item(it), encode(it)))
    items = {"worker: decode_item": timed(lambda: decode_item(data)),
             "client: check and encode": timed(lambda: check(item))}
    print(f"\n{'work item (checked)':34} {'time':>14} {'bytes':>10}")
    for name, seconds in items.items():
        print(f"{name:34} {seconds * 1e6:11.2f} us {len(data):10,}")
    write_result("wire", {"n": N, "tokens": TOKENS, "codecs": {
        name: {"seconds": s, "bytes": b, "speedup_vs_json": base / s} for name, (s, b) in rows.items()},
        "items": {name: {"seconds": s, "bytes": len(data)} for name, s in items.items()}})

if __name__ == "__main__":
    main()
