"""The `kvferry` command: runs what deploy/args.py parses (its USAGE lists the commands).

The console script is `deploy.cli:main`; `python -m deploy.cli` runs it too.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from deploy.args import DEMO_QUESTION, build_parser
from deploy.default_model import ensure_default_model
from deploy.eviction_args import eviction_argv
from deploy.preflight import check_inputs
from deploy.security_args import (
    public_access_argv,
    public_client_credentials,
    security_argv,
    security_settings,
)
from deploy.serve_args import serve_process_argv
from deploy.speculative_args import speculative_argv
from deploy.tier_args import store_bytes, tier_argv

if TYPE_CHECKING:
    from kvferry.rpc.security import Credentials


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, object]:
    kwargs: dict[str, object] = {"stop": args.stop, "ignore_eos": args.ignore_eos}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            kwargs[name] = value
    return kwargs


async def _print_stream(address: str, prompt: str | None, sampling: dict[str, object],
                        creds: Credentials, chat: str | None = None,
                        command: str = "generate") -> int:
    import grpc

    from deploy import client
    from deploy.client_errors import EXIT_UNREACHABLE, rpc_error_line
    from kvferry.rpc import security

    request = (client.make_request(prompt, **sampling) if chat is None
               else client.make_request(messages=[("user", chat)], **sampling))
    async with security.channel(address, creds) as chan:
        stub = client.public_stub(chan)
        completion = client.Completion()
        try:
            async for msg, latest in client.stream(stub, request):
                completion = latest
                if msg.HasField("chunk"):
                    print(msg.chunk.text, end="", flush=True)
        except grpc.aio.AioRpcError as exc:
            if completion.token_ids:
                print(flush=True)  # the error starts a line of its own
            print(rpc_error_line(command, exc, address, creds.is_tls or creds.ca is not None),
                  file=sys.stderr)
            return EXIT_UNREACHABLE
    reason = client.finish_reason_name(completion.finished).removeprefix("FINISH_REASON_")
    print(f"\n\n[{len(completion.token_ids)} tokens, finish {reason.lower()}] "
          f"TTFT {completion.ttft_s * 1000:.1f} ms, "
          f"mean ITL {completion.mean_itl_s * 1000:.2f} ms")
    return 0


def _deployment(args: argparse.Namespace, store_url: str | None = None):
    from deploy.launcher import Deployment

    router_flags, worker_flags = serve_process_argv(args)
    if args.load_format != "auto":  # the router's fingerprint of the model must be the workers'
        router_flags += ["--load-format", args.load_format]
        worker_flags += ["--load-format", args.load_format]
    kwargs = dict(
        model=args.model, num_prefill=args.num_prefill,  # None: the launcher's default model
        num_decode=args.num_decode, router_port=args.port, http_port=args.http_port,
        block_size=args.block_size,
        kv_pool_size=args.kv_pool_size, torch_threads=args.torch_threads,
        pin_cores=args.pin_cores == "auto", lend_cores=args.lend_cores == "auto",
        memory_utilization=args.memory_utilization,
        attention_backend=args.attention_backend, is_colocated=args.colocated, host=args.host,
        compile=args.compile, compile_batch_sizes=args.compile_batch_sizes,
        prefill_tensor_parallel_size=args.prefill_tensor_parallel_size,
        decode_tensor_parallel_size=args.decode_tensor_parallel_size,
        router_args=([] if args.metrics_port is None else ["--metrics-port",
                                                            str(args.metrics_port)])
        + security_argv(args) + public_access_argv(args) + router_flags
        + eviction_argv(args),
        worker_args=security_argv(args) + ([] if args.prefix_caching
                                           else ["--no-prefix-caching"])
        + (["--kv-transport", args.kv_transport] if args.kv_transport != "ray" else [])
        + (["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype != "auto" else [])
        + ([] if args.max_model_len is None else ["--max-model-len", str(args.max_model_len)])
        + tier_argv(args, store_url) + speculative_argv(args) + eviction_argv(args)
        + worker_flags,
    )
    if args.kv_transport == "ray":
        from deploy.ray_launcher import RayDeployment

        return RayDeployment(**kwargs, ray_address=args.ray_address)
    return Deployment(**kwargs)


def _http_line(deployment, args: argparse.Namespace) -> str:
    """Where the router's OpenAI-compatible API is, as a client's base URL."""
    if args.http_port is None:
        return "OpenAI-compatible HTTP API: off (--http-port)"
    scheme = "https" if security_settings(args).is_tls else "http"
    return f"OpenAI-compatible HTTP API on {scheme}://{deployment.http_address}/v1"


def _store(args: argparse.Namespace):
    """The store `--kv-store-size` asks serve or demo to start (a context: its URL or None)."""
    from deploy.store_server import deployment_store

    size = args.kv_store_size
    return deployment_store(None if size is None else store_bytes(size))


def _serve(args: argparse.Namespace) -> int:
    with _store(args) as store_url:
        return _serve_with(args, store_url)


def _generate(args: argparse.Namespace) -> int:
    """`kvferry generate`: one completion streamed from a running deployment."""
    if args.prompt in (None, "-") and args.chat is None:
        args.prompt = _piped_prompt()  # `echo hi | kvferry generate`, or PROMPT "-"
    if (args.prompt is None) == (args.chat is None):
        print("generate: give exactly one of PROMPT and --chat", file=sys.stderr)
        return 2
    if "://" in args.address:
        print(f"kvferry: generate: --address takes the router's gRPC HOST:PORT (e.g. "
              f"127.0.0.1:50051), not a URL: {args.address}", file=sys.stderr)
        return 2
    return asyncio.run(_print_stream(args.address, args.prompt, _sampling_kwargs(args),
                                     public_client_credentials(args), chat=args.chat))


def _piped_prompt() -> str | None:
    """The prompt from stdin when it is a pipe or a file (None: a terminal, or nothing)."""
    try:
        return None if sys.stdin.isatty() else (sys.stdin.read() or None)
    except (OSError, ValueError):  # no readable stdin (closed, or captured)
        return None


def _starting_line(deployment, served_name: str | None = None) -> str:
    """What serve says at once, so that the model loading that follows is not silence: the
    model under the name the API serves it as (--served-model-name)."""
    from kvferry.model.identity import served_model_name

    workers = (f"{deployment.num_decode} colocated worker(s)" if deployment.is_colocated else
               f"{deployment.num_prefill} prefill + {deployment.num_decode} decode worker(s)")
    name = served_model_name(deployment.model or ensure_default_model(), served_name)
    return (f"kvferry: starting {workers} and a router for {name}; each loads the model "
            "first (Ctrl-C stops)")


def _served_name(deployment, args: argparse.Namespace) -> str:
    from kvferry.model.identity import served_model_name

    return served_model_name(deployment.model or ensure_default_model(),
                             args.served_model_name)


def _serve_planner(args: argparse.Namespace):
    """serve's live planner (--planner-sla), checked before anything starts; None: off."""
    from deploy.planner_args import build_planner

    if args.planner_sla is None and args.planner_profile is None:
        return None
    if args.planner_sla is None or args.planner_profile is None:
        raise ValueError("planner_sla: the live planner needs --planner-sla and "
                         "--planner-profile")
    if args.kv_transport != "ray" or args.colocated:
        raise ValueError("planner_sla: serve scales a disaggregated deployment on Ray "
                         "(--kv-transport ray); on Kubernetes run `kvferry planner`")
    if args.metrics_port is None:
        args.metrics_port = 0  # the planner reads the router's metrics
    return build_planner(args, prefix="planner-")


def _serve_with(args: argparse.Namespace, store_url: str | None) -> int:
    try:
        planner = _serve_planner(args)
    except (ValueError, OSError) as exc:
        print(f"kvferry: serve: {exc}", file=sys.stderr)
        return 2
    deployment = _deployment(args, store_url)
    print(_starting_line(deployment, args.served_model_name), file=sys.stderr, flush=True)
    deployment.start()
    print(f"kvferry serving on {deployment.router_address} ({_served_name(deployment, args)}; "
          "Ctrl-C to stop)", flush=True)
    print(_http_line(deployment, args), flush=True)
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    try:
        if planner is None:
            while not stop.is_set():
                signal.pause()
        else:
            from deploy.planner.loop import run_ray_planner

            run_ray_planner(planner, deployment, args.planner_interval_s, stop)
    finally:
        deployment.stop()
    return 0


def _demo(args: argparse.Namespace) -> int:
    """One question through the whole path. The processes log to files, so that only the
    answer streams here; where they are is printed last."""
    import time

    from kvferry.settings import KVFERRY_HOME

    if args.prompt is not None and args.chat is not None:
        print("kvferry: demo: give --prompt or --chat, not both", file=sys.stderr)
        return 2
    chat = None if args.prompt is not None else (args.chat or DEMO_QUESTION)
    log_dir = Path(args.log_dir or KVFERRY_HOME / "logs" / time.strftime("demo-%Y%m%d-%H%M%S"))
    log_dir.mkdir(parents=True, exist_ok=True)
    with _store(args) as store_url:
        deployment = _deployment(args, store_url)
        deployment.log_dir = log_dir
        with deployment:
            print(f"deployment up: router {deployment.router_address}", file=sys.stderr)
            print(_http_line(deployment, args), file=sys.stderr)
            if chat is not None:
                print(f"> {chat}", flush=True)
            sampling = _sampling_kwargs(args)  # unset: the model's defaults (greedy if asked)
            code = asyncio.run(_print_stream(deployment.router_address, args.prompt, sampling,
                                             public_client_credentials(args), chat, "demo"))
    print(f"logs: {log_dir}")
    return code


# Bad input, reported in one line with exit status 2: settings raise ValueError naming the
# field (json.JSONDecodeError and UnicodeDecodeError are ValueErrors too), files OSError,
# configs KeyError. Caught only while inputs are checked and loaded (deploy/preflight.py), and
# around commands that do nothing else (plan, make-certs, make-model), never mid-serving.
INPUT_ERRORS = (ValueError, OSError, KeyError)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, KeyError):
        return f"missing key {exc}"
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _make_files(args: argparse.Namespace) -> int:
    """`make-certs` and `make-model`: write files under --out."""
    if args.command == "make-certs":
        if importlib.util.find_spec("cryptography") is None:
            raise ValueError("make-certs: needs the cryptography package: "
                             "pip install cryptography")
        from deploy.certs import DEFAULT_NAMES, make_certs

        print(make_certs(Path(args.out), tuple(args.name) or DEFAULT_NAMES).summary())
        return 0
    from kvferry.model.checkpoint import SPECS, make_model
    from kvferry.model.shapes import make_shape

    if args.shape is not None:
        path = make_shape(Path(args.out), args.shape)
        print(f"wrote {args.shape}'s config and a placeholder tokenizer to {path}; serve it "
              "with --load-format dummy (random weights: for timing, its answers are noise)")
        return 0
    path = make_model(Path(args.out), SPECS[args.arch])
    print(f"wrote a tiny {args.arch} checkpoint with seeded random weights to {path}: for "
          "tests and wiring, its answers are noise (the real default model needs no "
          "--model)")
    return 0


EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a command Ctrl-C stopped


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C anywhere (a model loading, a deployment starting, an answer streaming): one
    line and exit status 130; whatever had started is stopped on the way out."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        print("\nkvferry: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    from kvferry import logs

    logs.setup(args.log_level, args.log_format)
    from deploy import processes

    try:
        if args.command == "plan":
            from deploy.plan_cmd import run_plan

            return run_plan(args)
        if args.command == "profile":
            from deploy.profile_cmd import run_profile

            return run_profile(args)
        if args.command == "planner":
            from deploy.planner_cmd import run_planner

            return run_planner(args)
        if args.command in ("make-certs", "make-model"):
            return _make_files(args)
        settings = check_inputs(args)
        if getattr(args, "cpus", None) is not None:  # a worker or router placed by serve
            from deploy.placement import pin_self
            from kvferry.settings.cpus import parse_cpu_list

            pin_self(parse_cpu_list(args.cpus))
    except INPUT_ERRORS as exc:
        print(f"kvferry: {_one_line(exc)}", file=sys.stderr)
        return 2
    if args.command in ("prefill-worker", "decode-worker", "colocated-worker"):
        asyncio.run(processes.run_worker(settings))
        return 0
    if args.command == "router":
        asyncio.run(processes.run_router(settings))
        return 0
    if args.command == "serve":
        return _serve(args)
    if args.command == "generate":
        return _generate(args)
    if args.command == "chat":
        from deploy.chat import run_chat

        return run_chat(args.address, _sampling_kwargs(args),
                        public_client_credentials(args), system=args.system)
    if args.command == "demo":
        return _demo(args)
    if args.command == "bench":
        from deploy.loadgen.cli import run as run_bench

        return run_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
