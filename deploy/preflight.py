"""Checks of a `kvferry` command line's flags, files and model before anything starts, so
that bad input fails fast (workers and the router before binding ports, `serve` and `demo`
before launching processes) and deploy/cli.py can report it in one line."""

from __future__ import annotations

import argparse
from dataclasses import replace

from deploy.args import router_settings, worker_settings
from deploy.default_model import DEFAULT_MODEL_SAMPLING, ensure_default_model
from deploy.eviction_args import eviction_config
from deploy.security_args import check_client_tls, security_settings
from deploy.speculative_args import speculative_config
from deploy.tier_args import tier_settings
from kvferry.rpc.security import refuse_plaintext_token
from kvferry.settings import (
    RouterSettings,
    SpeculativeConfig,
    WorkerSettings,
    parse_batch_sizes,
)
from kvferry.settings.sampling import SamplingDefaults
from kvferry.settings.sizes import check_pool_size


def _check_model(model: str | None) -> None:
    from kvferry.model.config import load_model_config

    load_model_config(model or ensure_default_model())


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _check_tokenizer(model: str | None) -> None:
    """The router's tokenizer loads (tokenizers raises bare Exceptions, KeyError or
    UnicodeDecodeError on a broken file: each becomes one line naming the folder)."""
    from transformers import AutoTokenizer

    from kvferry.model.config import load_model_config

    path = load_model_config(model or ensure_default_model()).path
    try:
        AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - whatever the library raises, said in one line
        raise ValueError(f"model: cannot read the tokenizer in {path}: "
                         f"{_first_line(exc)}") from exc


def check_tokenizer_file(path) -> None:
    """`kvferry bench --tokenizer`: a tokenizer.json (or a folder holding one) that loads."""
    from tokenizers import Tokenizer

    file = path / "tokenizer.json" if path.is_dir() else path
    try:
        Tokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - whatever the library raises, said in one line
        raise ValueError(f"tokenizer: cannot read {file}: {_first_line(exc)}") from exc


def _check_max_model_len(settings: WorkerSettings) -> None:
    """A decode worker's pool holds one request of its --max-model-len (logged when the
    default is lowered to what the pool holds)."""
    from deploy.worker_model import max_model_len_for
    from kvferry.model.config import load_model_config

    max_model_len_for(settings, load_model_config(settings.model))


def _check_tensor_parallel(settings: WorkerSettings) -> None:
    """--tensor-parallel-size splits the model: it divides the query heads and the MLP,
    and divides the K/V heads or is a multiple of them (ValueError naming the flag)."""
    if settings.tensor_parallel_size == 1:
        return
    from deploy.worker_model import rank_config
    from kvferry.model.config import load_model_config

    rank_config(settings, load_model_config(settings.model))


def _check_draft(model: str, speculative: SpeculativeConfig) -> None:
    """A draft model (--speculative-model) that loads and shares the model's vocabulary,
    refused here (ValueError naming the flag) rather than by a worker mid-start."""
    if speculative.method != "draft":
        return
    from kvferry.model.config import load_model_config

    try:
        draft = load_model_config(speculative.model)
    except Exception as exc:  # noqa: BLE001 - transformers' config errors have no one base
        raise ValueError(f"speculative_model: {_first_line(exc)}") from None
    vocab = load_model_config(model).vocab_size
    if draft.vocab_size != vocab:
        raise ValueError(f"speculative_model: its vocabulary of {draft.vocab_size} tokens "
                         f"differs from the model's {vocab}; a draft model must share the "
                         "model's tokenizer")


def check_ports_free(host: str, ports: dict[str, int | None]) -> None:
    """Each given port (by setting name; None or 0: any free port) can be bound on `host`,
    checked before any model loads: ValueError naming the flag when something listens there.
    (A port taken between this check and the bind still fails at the bind.)"""
    import socket

    for name, port in ports.items():
        if not port or not 0 < port < 65536:  # any free port, or refused by the settings
            continue
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind
            try:
                sock.bind((host, port))
            except OSError as exc:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{name}: cannot bind {host}:{port} ({exc.strerror}); give "
                                 f"another {flag}, or 0 for any free port") from None


def _check_deployment(args: argparse.Namespace) -> None:
    """What `serve` and `demo` would hand their processes, refused here before any starts."""
    if args.num_decode < 1 or (args.num_prefill < 1 and not args.colocated):
        raise ValueError(f"num_prefill/num_decode: need >= 1 of each (--colocated: >= 1 decode), "
                         f"got {args.num_prefill}/{args.num_decode}")
    check_pool_size(args.kv_pool_size)
    settings = WorkerSettings(
        role="colocated", model=args.model or "", host=args.host, port=args.port,
        block_size=args.block_size, kv_pool_size=args.kv_pool_size,
        memory_utilization=args.memory_utilization,
        attention_backend=args.attention_backend, metrics_port=args.metrics_port,
        compile=args.compile, compile_batch_sizes=args.compile_batch_sizes,
        kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len,
        security=security_settings(args), tiers=tier_settings(args),
        speculative=speculative_config(args), kv_eviction=eviction_config(args))
    refuse_plaintext_token(settings.security)
    if args.public_client_auth and args.tls_ca is None:
        raise ValueError("public_client_auth: needs --tls-ca to verify client certificates")
    SamplingDefaults().overridden(args.override_generation_config)  # ValueError naming it
    if args.drain_timeout_s < 0:
        raise ValueError(f"drain_timeout_s: must be >= 0, got {args.drain_timeout_s}")
    check_ports_free(args.host, {"port": args.port, "http_port": args.http_port,
                                 "metrics_port": args.metrics_port,
                                 "health_port": args.health_port})
    _check_model(args.model)  # last: without --model, the default model may be converted
    _check_tokenizer(args.model)
    _check_draft(args.model or ensure_default_model(), speculative_config(args))
    model = args.model or ensure_default_model()
    sizes = {"prefill": args.prefill_tensor_parallel_size,
             "decode": args.decode_tensor_parallel_size}
    for role, size in sizes.items():  # each side's flags, then its split of the model
        if size != 1 and (role == "decode" or not args.colocated):
            _check_tensor_parallel(replace(settings, model=model, tensor_parallel_size=size,
                                           kv_transport=args.kv_transport))
    if settings.max_model_len is not None:
        _check_max_model_len(replace(settings, model=model,
                                     tensor_parallel_size=sizes["decode"]))


def check_inputs(args: argparse.Namespace) -> WorkerSettings | RouterSettings | None:
    """Refuse bad flags, files and models before anything starts (ValueError naming the
    field, OSError naming the file); the settings a worker or the router runs on."""

    if args.command in ("prefill-worker", "decode-worker", "colocated-worker"):
        settings = worker_settings(args, model="")  # flags first, model last:
        refuse_plaintext_token(settings.security)  # without --model, the default model
        check_pool_size(settings.kv_pool_size)  # may be converted
        check_ports_free(settings.host, {"port": settings.port,
                                         "metrics_port": settings.metrics_port,
                                         "health_port": settings.security.health_port})
        settings = replace(settings, model=settings.model or ensure_default_model())
        _check_model(settings.model)
        _check_tensor_parallel(settings)
        if settings.role != "prefill" or settings.ships_draft_kv:
            _check_draft(settings.model, settings.speculative)
        if settings.role in ("decode", "colocated"):
            _check_max_model_len(settings)
        return settings
    if args.command == "router":
        settings = router_settings(args, model="")
        refuse_plaintext_token(settings.security)
        check_ports_free(settings.host, {"port": settings.port,
                                         "http_port": settings.http_port,
                                         "metrics_port": settings.metrics_port,
                                         "health_port": settings.security.health_port})
        if not settings.model:  # the default model samples as its card says, unless told
            settings = replace(settings, model=ensure_default_model(),
                               override_generation_config=settings.override_generation_config
                               or DEFAULT_MODEL_SAMPLING)
        _check_model(settings.model)
        _check_tokenizer(settings.model)
        return settings
    if args.command in ("serve", "demo"):
        _check_deployment(args)
    elif args.command in ("generate", "chat"):
        check_client_tls(args)
    elif args.command == "bench":
        for path in (args.dataset_path, args.tokenizer):
            if path is not None and not path.exists():
                raise FileNotFoundError(f"no such file or directory: {path}")
        if args.tokenizer is not None:
            check_tokenizer_file(args.tokenizer)
        check_pool_size(args.kv_pool_size)
        parse_batch_sizes(args.compile_batch_sizes)
        if args.model not in ("default", "tiny"):  # keywords: bench_model resolves them
            _check_model(args.model)
    return None
