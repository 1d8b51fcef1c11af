"""The security flags every kvferry command shares (TLS, cluster token, health port), and
their settings: one place for `deploy.args` and the commands that pass them on."""

from __future__ import annotations

import argparse

from kvferry.settings import SecuritySettings


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
