"""Pass-through: the same prompt groups through rollq end to end vs straight into one AsyncLLM.

256 prompts x n=8 x 64 tokens (ignore_eos, so every sample is 64 tokens), temperature 1 with the
sampled token's logprob (what RL needs), on a random Llama made here, with the same engine
settings on both sides:

- raw: `AsyncLLM` in a child process, all 256 requests at once, `SamplingParams` as rollq builds
  them (FINAL_ONLY, no detokenizing).
- rollq: a `rollq worker --engine vllm` process, a private redis-server (no persistence), the
  trainer (`RolloutClient`: submit, then take every result) in this process.

The two alternate, each engine started once (start-up and warm-up are not timed). Reported:
completion tokens/s of each (median of the repeats), rollq / raw, and rollq's CPU seconds per
1,000 groups: the worker process without its engine core, the redis-server and the trainer,
next to the raw frontend's own CPU seconds for the same groups.

`--parsing`: the model gets a tokenizer and a hermes tool-call chat template (bench/common.py
`HERMES_TEMPLATE`; both engines then start with their tokenizer) and the worker runs with
`--enable-auto-tool-choice --tool-call-parser hermes`. The token-id groups are the same (the
parser must cost them nothing), and a second pair of runs sends chats instead:

- rollq chat: `RolloutClient.submit_chat`, one user message per group and `TOOLS`; the worker
  renders each with vLLM's renderer, decodes the text and runs the hermes parser on every sample.
- raw AsyncLLM chat: the same rendered prompt ids (rendered once before timing, by the same
  vLLM renderer) and the same SamplingParams (text decoded, special tokens kept), **no parsing
  and no rendering**: this ratio prices the worker's render + parse (+ the chat on the wire).

    python bench/passthrough.py [--repeats 3] [--prompts 256] [--parsing]
    # prints the table, writes bench/results/passthrough.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import HERE, cpu_seconds, make_llama, stop_process, write_result

from rollq.client import RolloutClient
from rollq.config import VLLMSettings
from rollq.harness.faults import RedisProcess
from rollq.queue.keys import Keys

N, MAX_TOKENS, PROMPT_TOKENS = 8, 64, 32
MODEL = dict(hidden=256, layers=4, vocab=4096, intermediate=688)
MAX_NUM_SEQS = 256
MARK = "@passthrough "
"""Prefix of the raw child's replies on stdout, which vLLM's logs share."""


def settings(model: Path) -> VLLMSettings:
    return VLLMSettings(model=str(model), dtype="float32", max_model_len=256, max_num_seqs=MAX_NUM_SEQS,
                        enforce_eager=True, seed=0).validate()


def prompts(count: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[1] + [rng.randrange(3, MODEL["vocab"]) for _ in range(PROMPT_TOKENS - 1)]
            for _ in range(count)]


SAMPLING = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "extra": {"ignore_eos": True}}
PARSER_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
"""One small tool: its JSON is in every rendered prompt, which max_model_len 256 must hold."""


def conversations(count: int) -> list[list[dict]]:
    """One user turn of 12 random letters per group: byte tokens, a prompt of ~115 ids with TOOLS."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [[{"role": "user", "content": "".join(rng.choice(letters) for _ in range(12))}]
            for _ in range(count)]


# --- raw: one AsyncLLM, driven from a child process ----------------------------------------

async def raw_serve(model: Path, count: int) -> None:
    """The raw side: for each 'go' (token ids) or 'chat' line on stdin, one timed run; a JSON
    line on stdout each."""
    from rollq.engine.chat import ChatRenderer
    from rollq.engine.vllm import VLLMEngine, sampling_params
    from rollq.protocol import Chat, Sampling

    engine = await VLLMEngine.start(settings(model))
    params = {"go": sampling_params(Sampling(**SAMPLING), N)}
    batches = {"go": prompts(count)}
    if engine.has_tokenizer:  # --parsing: the chats rendered here, untimed, as the worker renders them
        renderer = ChatRenderer(engine.llm, True, auto_tools=True, tool_parser="hermes")
        params["chat"] = sampling_params(Sampling(**SAMPLING, return_text=True), N)
        batches["chat"] = []
        for messages in conversations(count):
            rendered, request = await renderer.render(Chat(messages, tools=TOOLS), MAX_TOKENS)
            renderer.constrain(params["chat"], request)  # the same for every chat here
            batches["chat"].append(rendered["prompt_token_ids"])

    async def one(i: int, prompt: list[int], run: int, kind: str) -> int:
        async for out in engine.llm.generate({"prompt_token_ids": prompt}, params[kind],
                                             request_id=f"{run}-{i}"):
            final = out
        return sum(len(c.token_ids) for c in final.outputs)

    print(f"{MARK}ready", flush=True)
    for run, line in enumerate(sys.stdin):
        kind = line.strip()
        cpu0, began = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i, p, run, kind) for i, p in enumerate(batches[kind]))))
        elapsed, cpu1 = time.perf_counter() - began, resource.getrusage(resource.RUSAGE_SELF)
        cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
        prompt_tokens = statistics.mean(len(p) for p in batches[kind])
        print(MARK + json.dumps({"seconds": elapsed, "tokens": tokens, "cpu_s": cpu,
                                 "prompt_tokens": prompt_tokens}), flush=True)
    await engine.close()


class Raw:
    def __init__(self, model: Path, count: int):
        self.proc = subprocess.Popen([sys.executable, str(HERE / "passthrough.py"), "--raw", str(model),
                                      str(count)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, cwd=HERE)
        if self._reply() != "ready":
            raise RuntimeError("the raw AsyncLLM process did not start")

    def _reply(self) -> str:
        """The child's next marked line (vLLM logs to the same stdout)."""
        for line in self.proc.stdout:
            if line.startswith(MARK):
                return line[len(MARK):].strip()
        raise RuntimeError("the raw AsyncLLM process exited")

    def run(self, kind: str = "go") -> dict:
        self.proc.stdin.write(f"{kind}\n")
        self.proc.stdin.flush()
        return json.loads(self._reply())

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# --- rollq: worker process + redis-server + trainer ----------------------------------------

class Rollq:
    def __init__(self, model: Path, redis: RedisProcess, parsing: bool = False, profile: str | None = None):
        s = settings(model)
        self.redis = redis
        self.policy = "passthrough"
        python = [sys.executable, *(["-m", "cProfile", "-o", profile] if profile else [])]
        self.worker = subprocess.Popen(
            [*python, "-m", "rollq", "worker", "--engine", "vllm", "--redis-url", redis.url,
             "--policy", self.policy, "--model", s.model, "--dtype", s.dtype,
             "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
             "--enforce-eager", "--seed", str(s.seed), "--poll-s", "0.2", *(PARSER_FLAGS if parsing else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    async def wait_ready(self, client: RolloutClient, timeout_s: float = 600) -> None:
        give_up = time.monotonic() + timeout_s
        while not await client.redis.exists(Keys(self.policy).workers):
            if self.worker.poll() is not None or time.monotonic() > give_up:
                raise RuntimeError("the rollq worker did not start")
            await asyncio.sleep(0.5)

    async def run(self, client: RolloutClient, batch: list, chat: bool = False) -> dict:
        """`batch`: token-id prompts, or with `chat` conversations (sent with TOOLS)."""
        redis_pid = self.redis.proc.pid
        before = (cpu_seconds(self.worker.pid), cpu_seconds(redis_pid), cpu_seconds(os.getpid()))
        began = time.perf_counter()
        if chat:
            await client.submit_chat(batch, N, SAMPLING, tools=TOOLS)
        else:
            await client.submit(batch, n=N, sampling=SAMPLING)
        results = await client.take(len(batch), timeout_s=600)
        elapsed = time.perf_counter() - began
        after = (cpu_seconds(self.worker.pid), cpu_seconds(redis_pid), cpu_seconds(os.getpid()))
        if len(results) != len(batch) or any(r.status != "ok" for r in results):
            errors = {r.error for r in results if r.status != "ok"}
            raise RuntimeError(f"rollq returned {len(results)} of {len(batch)} groups, or failures: {errors}")
        if chat and not all(s.parsed for r in results for s in r.samples):
            raise RuntimeError("a chat sample came back unparsed: is the worker's tool parser on?")
        tokens = sum(len(s.token_ids) for r in results for s in r.samples)
        worker, redis, trainer = (b - a for a, b in zip(before, after))
        out = {"seconds": elapsed, "tokens": tokens, "cpu_s": worker + redis + trainer,
               "cpu_worker_s": worker, "cpu_redis_s": redis, "cpu_trainer_s": trainer}
        if chat:
            out["tool_calls"] = sum(len(s.tool_calls) for r in results for s in r.samples)
        return out

    def close(self) -> None:
        stop_process(self.worker)


def _summary(runs: dict[str, list[dict]], count: int) -> dict:
    per_s = {name: statistics.median(r["tokens"] / r["seconds"] for r in rs) for name, rs in runs.items()}
    cpu_per_1k = {name: statistics.median(r["cpu_s"] for r in rs) / count * 1000 for name, rs in runs.items()}
    raw, rollq = per_s  # (the raw side first)
    return {"tokens_per_s": per_s, "ratio": per_s[rollq] / per_s[raw], "cpu_s_per_1k_groups": cpu_per_1k,
            "runs": runs}


async def main(repeats: int, count: int, parsing: bool = False, profile: str | None = None) -> dict:
    runs: dict[str, list[dict]] = {"raw AsyncLLM": [], "rollq": []}
    chat_runs: dict[str, list[dict]] = {"raw AsyncLLM, chat ids (no parse)": [], "rollq chat (parsed)": []}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_llama(Path(tmp) / "model", **MODEL, chat=parsing)
        redis = RedisProcess(Path(tmp), aof=False).start()
        raw = Raw(model, count)
        rollq = Rollq(model, redis, parsing, profile)
        try:
            async with RolloutClient(redis.url, policy=rollq.policy, trainer_id="bench",
                                     max_outstanding=10**7) as client:
                await rollq.wait_ready(client)
                batch, chats = prompts(count), conversations(count)
                if parsing:  # untimed: the worker builds vLLM's renderer and compiles the template
                    await rollq.run(client, chats[:1], chat=True)
                for _ in range(repeats):
                    runs["raw AsyncLLM"].append(raw.run())
                    runs["rollq"].append(await rollq.run(client, batch))
                    if parsing:
                        chat_runs["raw AsyncLLM, chat ids (no parse)"].append(raw.run("chat"))
                        chat_runs["rollq chat (parsed)"].append(await rollq.run(client, chats, chat=True))
        finally:
            raw.close()
            rollq.close()
            redis.stop()
    load.append(os.getloadavg()[0])
    result = {"prompts": count, "n": N, "max_tokens": MAX_TOKENS, "model": MODEL, "repeats": repeats,
              "parsing": parsing, "load": load, **_summary(runs, count)}
    if parsing:
        result["chat"] = _summary(chat_runs, count) | {
            "prompt_tokens": chat_runs["raw AsyncLLM, chat ids (no parse)"][0]["prompt_tokens"],
            "tool_calls": chat_runs["rollq chat (parsed)"][-1]["tool_calls"]}
    return result


def report(r: dict) -> None:
    print(f"pass-through: {r['prompts']} prompts x n={r['n']} x {r['max_tokens']} tokens, "
          f"median of {r['repeats']}, parsing {'on' if r['parsing'] else 'off'}, "
          f"load {r['load'][0]:.1f} -> {r['load'][1]:.1f}")
    for part in (r, r.get("chat")):
        if part is None:
            continue
        for name, rate in part["tokens_per_s"].items():
            cpu = part["cpu_s_per_1k_groups"][name]
            print(f"{name:34}{rate:10.0f} tok/s   CPU {cpu:6.1f} s per 1,000 groups")
        print(f"rollq / raw = {part['ratio']:.3f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--parsing", action="store_true", help="a tokenizer, a hermes template and the "
                        "worker's tool parser on; also chats with tools (see above)")
    parser.add_argument("--profile-worker", metavar="PATH", help="run the worker under cProfile (its "
                        "asyncio thread: frontend, queue, render, parse), stats written to PATH on exit")
    parser.add_argument("--raw", nargs=2, metavar=("MODEL", "PROMPTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw:
        asyncio.run(raw_serve(Path(args.raw[0]), int(args.raw[1])))
    else:
        result = asyncio.run(main(args.repeats, args.prompts, args.parsing, args.profile_worker))
        report(result)
        write_result("passthrough", result)
