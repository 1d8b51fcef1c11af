"""The security flags every kvferry command shares (TLS, cluster token, health port), and
their settings: one place for `deploy.args` and the commands that pass them on."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from kvferry.settings import SecuritySettings

if TYPE_CHECKING:
    from kvferry.rpc.security import Credentials

API_KEY_ENV = "KVFERRY_API_KEY"  # vLLM reads VLLM_API_KEY the same way


def tls_args(p: argparse.ArgumentParser, is_member: bool = True,
              is_one_process: bool = False) -> None:
    """TLS flags; `is_member`: also the cluster token (router, workers, serve, demo);
    `is_one_process`: also the plaintext health port (router, workers)."""
    p.add_argument("--tls-cert", default=None,
                   help="PEM certificate: serve TLS; also the client certificate of calls")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tls-ca", default=None,
                   help="PEM CA bundle verifying peers; workers then require client "
                        "certificates (mTLS)")
    p.add_argument("--tls-server-name", default=None,
                   help="name expected in servers' certificates (default: the address's host)")
    if is_member:
        p.add_argument("--cluster-token-file", default=None,
                       help="shared secret: internal calls carry it, workers refuse calls "
                            "without it (UNAUTHENTICATED); health checks stay open")
    if is_one_process:
        p.add_argument("--health-port", type=int, default=None,
                       help="also serve grpc.health.v1 alone, in plaintext, on this port "
                            "(Kubernetes gRPC probes cannot speak TLS)")


def security_settings(args: argparse.Namespace) -> SecuritySettings:
    return SecuritySettings(
        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
        tls_server_name=args.tls_server_name,
        cluster_token_file=getattr(args, "cluster_token_file", None),
        health_port=getattr(args, "health_port", None),
    )


def security_argv(args: argparse.Namespace) -> list[str]:
    """The security flags of `args` as a command line (serve/demo pass them to every process)."""
    argv = []
    for name in ("tls_cert", "tls_key", "tls_ca", "tls_server_name", "cluster_token_file"):
        value = getattr(args, name, None)
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def public_access_args(p: argparse.ArgumentParser) -> None:
    """The router's public-API identity flags (router, serve, demo)."""
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require `Authorization: Bearer KEY` on the public APIs (HTTP /v1/*, "
                        "every gRPC GenerationService call); repeatable, each key a tenant "
                        f"with its own prefix cache and request ids; also ${API_KEY_ENV}. "
                        "A command line is visible to local users: prefer --api-keys-file")
    p.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help="API keys, one per line (# comments), as --api-key")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model id the APIs report and the OpenAI API's `model` takes "
                        "(default: the checkpoint's own name, e.g. SmolLM2-135M-Instruct.Q4_1 "
                        "for the default model)")
    p.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="sampling defaults for requests that leave a field unset, over the "
                        "checkpoint's generation_config.json, e.g. '{\"temperature\": 0.7}' "
                        "(keys: temperature, top_p, top_k); default: the checkpoint's, else "
                        "temperature 1.0, top_p 1.0, top_k off")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="report each request's cached prompt tokens (HTTP usage."
                        "prompt_tokens_details, gRPC Usage.cached_prompt_tokens and K/V bytes "
                        "shipped); off by default: they tell a client what other requests of "
                        "its cache namespace sent")


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """Every API key of a command line: --api-key, --api-keys-file, then $KVFERRY_API_KEY."""
    from router.identity import check_key, read_keys_file

    keys = list(getattr(args, "api_key", None) or [])
    if getattr(args, "api_keys_file", None):
        keys += read_keys_file(args.api_keys_file)
    if os.environ.get(API_KEY_ENV):
        keys.append(os.environ[API_KEY_ENV].strip())
    for key in keys:
        check_key(key)
    return tuple(dict.fromkeys(keys))


def public_access_argv(args: argparse.Namespace) -> list[str]:
    """The flags above as a command line, for serve/demo to pass to the router (the
    environment variable reaches it by inheritance)."""
    argv = []
    for key in getattr(args, "api_key", None) or []:
        argv += ["--api-key", key]
    if getattr(args, "api_keys_file", None):
        argv += ["--api-keys-file", args.api_keys_file]
    if getattr(args, "enable_prompt_tokens_details", False):
        argv.append("--enable-prompt-tokens-details")
    if getattr(args, "served_model_name", None):
        argv += ["--served-model-name", args.served_model_name]
    if getattr(args, "override_generation_config", None):
        argv += ["--override-generation-config", args.override_generation_config]
    return argv


def client_api_key(args: argparse.Namespace) -> str | None:
    """The key a client command sends: its --api-key (the first, for serve/demo), else
    $KVFERRY_API_KEY."""
    given = getattr(args, "api_key", None)
    if isinstance(given, list):
        given = given[0] if given else None
    return given or os.environ.get(API_KEY_ENV) or None


def client_tls_args(p: argparse.ArgumentParser) -> None:
    """TLS flags of a public client (generate, chat, bench): the CA alone makes the channel
    TLS; a certificate only for a router that requires one (--public-client-auth)."""
    p.add_argument("--tls-ca", default=None, metavar="PEM",
                   help="CA bundle verifying the router's certificate: connect with TLS "
                        "(the CA is enough)")
    p.add_argument("--tls-cert", default=None, metavar="PEM",
                   help="client certificate, only for a router started with "
                        "--public-client-auth (mTLS); with --tls-key")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    p.add_argument("--tls-server-name", default=None, metavar="NAME",
                   help="name expected in the router's certificate (default: the address's "
                        "host)")


def check_client_tls(args: argparse.Namespace) -> None:
    """A public client's TLS flags: ValueError naming the flag (no server rules: a client may
    give the CA alone)."""
    from pathlib import Path

    if (getattr(args, "tls_cert", None) is None) != (getattr(args, "tls_key", None) is None):
        raise ValueError("tls_cert/tls_key: give both or neither (a client certificate is "
                         "needed only by a router with --public-client-auth)")
    for name in ("tls_cert", "tls_key", "tls_ca"):
        path = getattr(args, name, None)
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{name}: no such file {path!r}")
        if path is not None and b"-----BEGIN " not in Path(path).read_bytes():
            raise ValueError(f"{name}: {path} holds no PEM block (-----BEGIN ...)")


def public_client_credentials(args: argparse.Namespace) -> Credentials:
    """What a client of the public port dials with: TLS when it has a CA or a certificate,
    a client certificate only when given, no cluster token, and the API key (as
    `authorization: Bearer`) when there is one."""
    from pathlib import Path

    from kvferry.rpc.security import Credentials

    check_client_tls(args)

    def read(name: str) -> bytes | None:
        path = getattr(args, name, None)
        return None if path is None else Path(path).read_bytes()

    return Credentials(read("tls_cert"), read("tls_key"), read("tls_ca"),
                       getattr(args, "tls_server_name", None), client_api_key(args))
