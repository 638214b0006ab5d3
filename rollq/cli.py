"""`rollq` command line: every flag also reads an environment variable (ROLLQ_*, REDIS_URL)."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import signal
import sys
import types
import typing
from pathlib import Path

import click
import msgspec
from rich.logging import RichHandler

from rollq.config import (GatewaySettings, VLLMSettings, WorkerSettings, default_weight_store,
                          default_worker_id, field_docs)
from rollq.protocol import InvalidInput
from rollq.queue.connection import DEFAULT_URL


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(message)s", datefmt="[%X]",
                        handlers=[RichHandler(show_path=False, rich_tracebacks=True)])


@click.group()
@click.option("--log-level", default="info", envvar="ROLLQ_LOG_LEVEL", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def main(log_level: str) -> None:
    """rollq: rollout service for asynchronous RL of language models."""
    _setup_logging(log_level)


def _setting(cls: type, name: str, *, flag: str | None = None, envvar: str | None = None,
             help: str | None = None):
    """A click option for the settings field `name` of `cls`: its default, type and help come
    from the settings class, so the CLI never holds a second copy of them. A list field is a
    repeatable option; a bool field given a single `flag` is that flag alone."""
    field = next(f for f in msgspec.structs.fields(cls) if f.name == name)
    default = None if field.default is msgspec.NODEFAULT else field.default
    kind = [field.type]
    if isinstance(field.type, types.UnionType):  # `int | None`: an int option, default None
        kind = [t for t in typing.get_args(field.type) if t is not type(None)]
    kwargs: dict = dict(default=default, show_default=default not in (None, []),
                        help=help or _FIELD_DOCS[cls].get(name))
    dashed = name.replace("_", "-")
    if typing.get_origin(kind[0]) is list:
        kwargs.update(multiple=True, type=typing.get_args(kind[0])[0], default=None, show_default=False)
    elif typing.get_origin(kind[0]) is typing.Literal:
        kwargs["type"] = click.Choice(typing.get_args(kind[0]))
    elif kind[0] is bool:
        if flag is not None and "/" not in flag:
            kwargs["is_flag"] = True
        flag = flag or f"--{dashed}/--no-{dashed}"
    else:
        kwargs["type"] = kind[0]
    return click.option(flag or f"--{dashed}", name, envvar=envvar or f"ROLLQ_{name.upper()}", **kwargs)


_FIELD_DOCS = {cls: field_docs(cls) for cls in (WorkerSettings, VLLMSettings, GatewaySettings)}


def _worker_options(command):
    for name in reversed(WorkerSettings.__struct_fields__):
        command = _setting(WorkerSettings, name, envvar="REDIS_URL" if name == "redis_url" else None,
                           help="Consumer name [default: host-pid-random]."
                           if name == "worker_id" else None)(command)
    return command


def _engine_options(command):
    command = click.option("--engine-arg", "engine_args", multiple=True, metavar="NAME=JSON",
                           help="Any other vLLM AsyncEngineArgs field, e.g. --engine-arg "
                                "block_size=32.")(command)
    special = {"model": dict(help="vLLM: local model directory."),
               "enable_prefix_caching": dict(flag="--prefix-caching/--no-prefix-caching",
                                             envvar="ROLLQ_PREFIX_CACHING")}
    for name in reversed(VLLMSettings.__struct_fields__):
        if name != "engine_args":
            command = _setting(VLLMSettings, name, **special.get(name, {}))(command)
    return command


@main.command()
@_worker_options
@_engine_options
def worker(**flags) -> None:
    """Serve one policy's queue with one engine."""
    engine_flags = {name: flags.pop(name) for name in list(flags) if name in VLLMSettings.__struct_fields__}
    flags["worker_id"] = flags["worker_id"] or default_worker_id()
    try:
        settings = WorkerSettings(**flags).validate()
        vllm_settings = None
        if settings.engine == "vllm":
            if not engine_flags["model"]:
                raise InvalidInput("model", "--engine vllm needs --model DIR (a local model directory)")
            engine_flags["engine_args"] = _parse_engine_args(engine_flags["engine_args"])
            vllm_settings = VLLMSettings(**engine_flags).validate()
            if settings.swap_mode == "keep" and vllm_settings.enable_lora:
                # A reload drops vLLM's adapters, among them the zero adapter the CPU build's
                # full-weight requests carry (engine/lora.py); frozen requests would resume
                # without it. Not built: refuse rather than guess.
                raise InvalidInput("swap_mode", "--swap-mode keep with --enable-lora is not "
                                                "supported; use drain or interrupt")
    except InvalidInput as e:
        raise click.BadParameter(str(e)) from None
    code = asyncio.run(_serve(settings, vllm_settings))
    # The engine is closed and the queue has what the worker held: what is left is the
    # interpreter's teardown, whose cyclic collections walk every object vLLM and torch made
    # (4-8 s of CPU on a loaded 2-core machine, measured with py-spy: gc_collect_main). Frozen
    # objects are not walked, and the process's exit returns their memory at once.
    gc.freeze()
    sys.exit(code)


def _parse_engine_args(pairs: tuple[str, ...]) -> dict:
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep:
            raise InvalidInput("engine_args", f"{pair!r} is not NAME=VALUE")
        try:
            out[name] = json.loads(value)
        except json.JSONDecodeError:
            out[name] = value  # a bare string
    return out


async def _serve(s: WorkerSettings, vllm_settings: VLLMSettings | None) -> int:
    from rollq.queue.connection import check_durability, connect
    from rollq.worker.stats import WorkerStats

    log = logging.getLogger("rollq.worker")
    redis = connect(s.redis_url)
    metrics = None
    try:
        # Both before the engine starts: a refusal should not cost an engine start-up (minutes
        # for vLLM on CPU), and a port picked before then may be taken by the time it is up.
        await check_durability(redis, require=s.require_durable, log=log)
        stats = WorkerStats(s.policy)
        if s.metrics_port is not None:
            metrics = await _serve_metrics(stats, s.metrics_host, s.metrics_port, log)
    except RuntimeError as e:
        log.error("%s", e)
        await redis.aclose()
        return 2
    try:
        return await _run_worker(s, vllm_settings, redis, stats)
    finally:
        if metrics is not None:
            await metrics.cleanup()
        await redis.aclose()


async def _serve_metrics(stats, host: str, port: int, log: logging.Logger):
    from rollq.worker.stats import serve_metrics

    try:
        runner = await serve_metrics(stats.registry, host, port)
    except OSError as e:
        raise RuntimeError(f"--metrics-port {port}: cannot serve /metrics on {host}:{port} "
                           f"({e.strerror}); pick another port, or 0 for any free one") from e
    bound = runner.addresses[0][1]  # the port the kernel gave, for --metrics-port 0
    log.info("metrics on http://%s:%d/metrics", host, bound)
    return runner


async def _run_worker(s: WorkerSettings, vllm_settings: VLLMSettings | None, redis, stats) -> int:
    from rollq.engine.instant import InstantEngine
    from rollq.worker.build import build_worker
    from rollq.worker.swap import load_pinned

    seq_budget = base_schema = None
    if vllm_settings is not None:
        from rollq.engine.vllm import VLLMEngine
        from rollq.registry.safetensors_check import dir_schema

        engine = await VLLMEngine.start(vllm_settings, version=s.base_version)
        seq_budget = vllm_settings.max_num_seqs
        base_schema = dir_schema(Path(vllm_settings.model))
    else:
        engine = InstantEngine(delay_s=s.instant_delay_s, version=s.base_version)
    try:
        w, follower = build_worker(s, redis, engine, max_inflight_seqs=seq_budget,
                                   base_schema=base_schema, stats=stats)
        if s.pin_version is not None:
            await load_pinned(w.engine, w.registry, w.heartbeat, w.worker_id, s.pin_version, base_schema,
                              s.tolerance())
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, w.stop)
        return await w.run(follower)
    finally:
        await engine.close()


_GATEWAY_OPTIONS: dict[str, dict] = {
    # The environment variables gateways have always read; others are ROLLQ_<FIELD>.
    "redis_url": dict(envvar="REDIS_URL"),
    "host": dict(envvar="ROLLQ_GATEWAY_HOST"),
    "port": dict(envvar="ROLLQ_GATEWAY_PORT"),
    "tokens": dict(envvar="ROLLQ_GATEWAY_TOKENS",
                   help='JSON file {"<token>": {"trainer": ..., "policies": [...], "scopes": [...]}} '
                        "(scopes: rollouts (the default), publish, observe)."),
    "no_auth": dict(flag="--no-auth", envvar="ROLLQ_GATEWAY_NO_AUTH"),
    "public_observe": dict(flag="--public-observe", envvar="ROLLQ_GATEWAY_PUBLIC_OBSERVE"),
    "policies": dict(flag="--policy", envvar="ROLLQ_POLICY"),
    "gateway_id": dict(envvar="ROLLQ_GATEWAY_ID"),
    "weight_store": dict(help=f"Where published copies go [default: {default_weight_store()}]."),
    "weight_roots": dict(flag="--weight-root"),
    "require_durable": dict(flag="--require-durable"),
    "header_timeout_s": dict(envvar="ROLLQ_GATEWAY_HEADER_TIMEOUT_S"),
    "body_timeout_s": dict(envvar="ROLLQ_GATEWAY_BODY_TIMEOUT_S"),
    "max_connections": dict(envvar="ROLLQ_GATEWAY_MAX_CONNECTIONS"),
    "max_reply_bytes": dict(envvar="ROLLQ_GATEWAY_MAX_REPLY_BYTES"),
    "body_bytes_in_flight": dict(envvar="ROLLQ_GATEWAY_BODY_BYTES_IN_FLIGHT"),
    "trust_request_chat_template": dict(flag="--trust-request-chat-template"),
    "return_tokens_as_token_ids": dict(flag="--return-tokens-as-token-ids"),
}


def _gateway_options(command):
    for name in reversed(GatewaySettings.__struct_fields__):
        command = _setting(GatewaySettings, name, **_GATEWAY_OPTIONS.get(name, {}))(command)
    return command


@main.command()
@_gateway_options
def gateway(policies: tuple[str, ...] | None, weight_store: str | None,
            weight_roots: tuple[str, ...] | None, **flags) -> None:
    """HTTP API, OpenAI-compatible completions, /metrics and the live dashboard."""
    from rollq.gateway.app import load_tokenizer, start_gateway

    extra = {"weight_store": weight_store} if weight_store else {}
    try:
        settings = GatewaySettings(policies=list(policies or ()),
                                   weight_roots=[Path(p) for p in weight_roots or ()],
                                   **extra, **flags).validate()
    except InvalidInput as e:
        raise click.BadParameter(str(e)) from None
    if settings.no_auth and settings.host not in ("127.0.0.1", "localhost", "::1"):
        logging.getLogger("rollq.gateway").warning("--no-auth on %s: anyone who reaches it may submit "
                                                   "and publish", settings.host)

    async def serve() -> None:
        try:
            runner, _ = await start_gateway(settings, tokenizer=load_tokenizer(settings.tokenizer))
        except RuntimeError as e:  # --require-durable refused this Redis
            raise click.ClickException(str(e)) from None
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(serve())


@main.command()
@click.option("--redis-url", envvar="REDIS_URL", default=DEFAULT_URL, show_default=True)
@click.option("--policy", envvar="ROLLQ_POLICY", required=True)
@click.option("--rewards", "target", envvar="ROLLQ_REWARDS", required=True,
              help="The operator's reward module: `pkg.mod` or a path to a .py file "
                   "(e.g. rollq.scoring.library: math, code).")
@click.option("--scorer-id", envvar="ROLLQ_SCORER_ID", default=None, help="Default: host-pid-random.")
@click.option("--processes", default=2, show_default=True, help="Child processes for sync rewards.")
@click.option("--max-inflight", default=16, show_default=True, help="Groups scored at once.")
@click.option("--lease-s", default=30.0, show_default=True,
              help="Seconds a held group stays this scorer's without a renewal (renewed every "
                   "lease/3): the groups of a scorer that is killed or frozen wait this long before "
                   "another scorer takes them. At least 1.")
@click.option("--grace-s", default=10.0, show_default=True, help="Shutdown: time to finish held groups.")
@click.option("--max-deliveries", type=int, default=None,
              help="Deliveries before a group fails. Default: 5 (scoring.scorer.MAX_DELIVERIES: why).")
@click.option("--refuse-unoffered", is_flag=True,
              help="While this scorer is live, refuse a scored submit whose reward no live scorer "
                   "offers (a misspelt name fails at submit). Without it such a job is queued and "
                   "waits for a scorer that offers its reward, as one submitted before any scorer.")
def scorer(redis_url: str, policy: str, target: str, scorer_id: str | None, processes: int,
           max_inflight: int, lease_s: float, grace_s: float, max_deliveries: int | None,
           refuse_unoffered: bool) -> None:
    """Score generated groups of scored jobs with the operator's reward functions."""
    from rollq.protocol import check_id
    from rollq.scoring.scorer import MAX_DELIVERIES, serve

    max_deliveries = MAX_DELIVERIES if max_deliveries is None else max_deliveries
    for name, value, low in (("processes", processes, 1), ("max_inflight", max_inflight, 1),
                             ("lease_s", lease_s, 1.0), ("grace_s", grace_s, 0.0),
                             ("max_deliveries", max_deliveries, 1)):
        if value < low:
            raise click.BadParameter(f"{name}={value} must be >= {low}")
    scorer_id = check_id("scorer_id", scorer_id or default_worker_id())
    asyncio.run(serve(redis_url, check_id("policy", policy), target, scorer_id=scorer_id,
                      processes=processes, max_inflight=max_inflight, lease_s=lease_s, grace_s=grace_s,
                      max_deliveries=max_deliveries, refuse_unoffered=refuse_unoffered))


@main.command()
@click.option("--redis-url", envvar="REDIS_URL", default=DEFAULT_URL, show_default=True)
@click.option("--policy", envvar="ROLLQ_POLICY", default=None, help="One policy; default: all.")
def status(redis_url: str, policy: str | None) -> None:
    """Versions, workers and queue depths, as tables."""
    from rich.console import Console

    from rollq.queue.connection import connect
    from rollq.status import policies, policy_status, render

    async def show() -> None:
        redis = connect(redis_url)
        try:
            names = [policy] if policy else await policies(redis)
            if not names:
                click.echo(f"no rollq policies in {redis_url}")
            for name in names:
                render(await policy_status(redis, name), Console())
        finally:
            await redis.aclose()

    asyncio.run(show())


@main.command()
@click.option("--steps", type=int, default=None, help="GRPO steps of each run [40; tools: 16].")
@click.option("--groups", type=int, default=None, help="Prompt groups per step [16; tools: 8].")
@click.option("--n", default=8, show_default=True, help="Samples per group.")
@click.option("--staleness", default=2, show_default=True, help="The async run's bound.")
@click.option("--out", "out_dir", default="demo-output", show_default=True, type=click.Path())
@click.option("--redis-url", envvar="REDIS_URL", default=None,
              help="Use this Redis; default: a private redis-server for the demo.")
@click.option("--port", default=8000, show_default=True,
              help="The dashboard's port (another free one if taken); 0: no gateway.")
@click.option("--hold", is_flag=True, help="Keep the dashboard up after the runs, until Ctrl-C.")
@click.option("--task", type=click.Choice(["even", "tools"]), default="even", show_default=True,
              help="even: single-turn GRPO, synchronous vs asynchronous; tools: GRPO over "
                   "multi-turn tool-use episodes (examples/tool_agent.py; --steps, --groups, --n).")
@click.option("--long-tail-reward", is_flag=True,
              help="even: two asynchronous runs with a reward waiting 0-2 s per sample, computed by "
                   "the trainer vs by a `rollq scorer`: time per step, side by side.")
def demo(steps: int | None, groups: int | None, n: int, staleness: int, out_dir: str, redis_url: str | None,
         port: int, hold: bool, task: str, long_tail_reward: bool) -> None:
    """Asynchronous GRPO on CPU: a synchronous and an asynchronous run, side by side, rewards
    computed by a `rollq scorer` (or, with --task tools, multi-turn tool-use episodes)."""
    from rollq.harness.demo import DemoSettings
    from rollq.harness.demo import demo as run_demo

    if task == "tools":
        from rollq.harness.demo_tools import tools_demo

        asyncio.run(tools_demo(steps or 16, out_dir, redis_url, groups=groups or 8, n=n))
        return
    steps, groups = steps or 40, groups or 16

    settings = DemoSettings(steps=steps, groups=groups, n=n, staleness=staleness,
                            out_dir=Path(out_dir), redis_url=redis_url, gateway_port=port, hold=hold,
                            long_tail_reward=long_tail_reward)
    asyncio.run(run_demo(settings))


@main.command()
@click.argument("names", nargs=-1)
def bench(names: tuple[str, ...]) -> None:
    """Run benchmarks (default: all) and write their tables into docs/benchmarks.md."""
    from rollq.harness import bench as benchmarks

    benchmarks.run(list(names) or list(benchmarks.BENCHES))
    benchmarks.update_doc()


@main.command()
@click.option("--policy", required=True)
@click.option("--user", required=True, help="The trainer id (or a worker user's name with --worker).")
@click.option("--worker", is_flag=True, help="Rules for workers, the gateway and `rollq status`.")
@click.option("--publisher", is_flag=True, help="The trainer may also publish weight versions.")
def acl(policy: str, user: str, worker: bool, publisher: bool) -> None:
    """Print the Redis `ACL SETUSER` command giving one trainer (or the workers) its keys only,
    with a new random password."""
    import secrets

    from rollq.security import trainer_acl, worker_acl

    password = secrets.token_urlsafe(24)
    try:
        rules = worker_acl(policy, user, password) if worker else trainer_acl(policy, user, password,
                                                                             publisher=publisher)
    except InvalidInput as e:
        raise click.BadParameter(str(e)) from None
    # A selector "(...)" is one argument: quoted for redis-cli.
    click.echo("ACL SETUSER " + " ".join(f'"{r}"' if " " in r else r for r in rules))
    click.echo(f"# then connect with redis://{user}:{password}@HOST:6379/0", err=True)
    click.echo("# Redis Cluster: ACLs are per node; run it on every node, replicas too "
               "(redis-cli --cluster call HOST:PORT ACL SETUSER ...)", err=True)


@main.command()
@click.option("--minutes", default=3.0, show_default=True, help="How long to inject faults.")
@click.option("--workers", default=None, type=int,
              help="Worker processes [default: 3 instant-engine workers; --weights: 2 vLLM workers].")
@click.option("--weights", is_flag=True,
              help="Weight faults (publish storms with keep=1, corrupted, rewritten and truncated "
                   "files) against vLLM workers of a tiny model; every sample checked against "
                   "transformers under its labelled version.")
@click.option("--episodes", is_flag=True,
              help="Multi-turn episodes (n branches; one trainer through the gateway) under trainer, "
                   "gateway, worker and Redis kills; every served turn looked for in its record.")
@click.option("--scorers", type=int, default=None,
              help="The queue run: `rollq scorer` processes (killed and frozen too) scoring a third "
                   "of the jobs (plain, dynamic sampling and over-sampling); 0: no scored jobs "
                   "[default: 2].")
@click.option("--seed", type=int, default=None, help="Random seed (printed; default: random).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the summary here.")
@click.option("--workdir", type=click.Path(file_okay=False), default=None,
              help="--episodes: keep the journals, the processes' logs and Redis's data here "
                   "[default: a temporary directory, removed].")
def chaos(minutes: float, workers: int | None, weights: bool, episodes: bool, scorers: int | None,
          seed: int | None, json_path: str | None, workdir: str | None) -> None:
    """Random worker and scorer kills and freezes, Redis restarts and killed connections while a
    trainer submits (a third of its jobs scored, with dynamic sampling and over-sampling) and
    publishes (or, with --weights, weight faults); exits non-zero if any group was lost or
    delivered twice, a scored one came with a wrong reward, an over-sampled job delivered more
    than asked or did not end done, or a scorer ended by itself (--weights: or any token was
    labelled with the wrong version; --episodes: or any turn was lost, applied twice, or left an
    episode running)."""
    import msgspec

    workers = workers if workers is not None else (2 if weights else 3)
    if not 0 < minutes <= 24 * 60 or not 1 <= workers <= 64:
        raise click.BadParameter("minutes must be in (0, 1440] and workers in [1, 64]")
    if weights and episodes:
        raise click.BadParameter("--weights and --episodes are two runs: give one")
    if scorers is not None and (weights or episodes):
        raise click.BadParameter("--scorers is the queue run's (without --weights or --episodes)")
    scorers = 2 if scorers is None else scorers
    if not 0 <= scorers <= 16:
        raise click.BadParameter(f"scorers={scorers} must be in [0, 16]")
    if episodes:
        from rollq.harness.chaos.episodes import EpisodeChaosSettings, chaos_episodes
        from rollq.harness.chaos.episodes import render as render_episodes

        if workdir is not None:
            Path(workdir).mkdir(parents=True, exist_ok=True)
        summary = asyncio.run(chaos_episodes(EpisodeChaosSettings(
            minutes=minutes, workers=workers, seed=seed, workdir=Path(workdir) if workdir else None)))
        render_episodes(summary)
    elif weights:
        from rollq.harness.chaos.weights import WeightChaosSettings, chaos_weights
        from rollq.harness.chaos.weights import render as render_weights

        summary = asyncio.run(chaos_weights(WeightChaosSettings(minutes=minutes, workers=workers,
                                                                seed=seed)))
        render_weights(summary)
    else:
        from rollq.harness.chaos.run import ChaosSettings, render
        from rollq.harness.chaos.run import chaos as run_chaos

        summary = asyncio.run(run_chaos(ChaosSettings(minutes=minutes, workers=workers, scorers=scorers,
                                                      seed=seed)))
        render(summary)
    if json_path:
        Path(json_path).write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
    sys.exit(0 if summary.ok else 1)


@main.command(context_settings=dict(ignore_unknown_options=True, allow_extra_args=True))
@click.option("--workers", envvar="ROLLQ_WORKERS", default=1, show_default=True,
              help="Worker processes on this host.")
@click.option("--gpus-per-worker", envvar="ROLLQ_GPUS_PER_WORKER", default=0, show_default=True,
              help="GPU hosts: devices per worker (CUDA_VISIBLE_DEVICES, tensor-parallel size).")
@_setting(WorkerSettings, "grace_s")
@click.argument("worker_args", nargs=-1, type=click.UNPROCESSED)
def pool(workers: int, gpus_per_worker: int, grace_s: float, worker_args: tuple[str, ...]) -> None:
    """Run WORKERS `rollq worker` processes, restart any that dies, stop all on SIGTERM.

    Other options are passed to every worker, e.g. `rollq pool --workers 2 --engine vllm
    --model DIR`.
    """
    from rollq.worker.pool import Pool

    if not 1 <= workers <= 1024:
        raise click.BadParameter(f"workers={workers} must be between 1 and 1024")
    if gpus_per_worker < 0:
        raise click.BadParameter("gpus_per_worker must be >= 0")
    if any(a.startswith("--worker-id") for a in worker_args):
        raise click.BadParameter("--worker-id: each pool worker names itself (host-pid-random)")
    p = Pool(workers, [*worker_args, "--grace-s", str(grace_s)], gpus_per_worker=gpus_per_worker,
             grace_s=grace_s)

    async def run() -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, p.stop)
        return await p.run()

    sys.exit(asyncio.run(run()))


if __name__ == "__main__":
    main()
