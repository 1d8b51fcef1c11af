"""The flags of the commands that talk to a running deployment as a public client
(`generate`, `chat`, and `demo`'s question): where, how securely, with which key, and how to
sample."""

from __future__ import annotations

import argparse

from deploy.security_args import API_KEY_ENV, client_tls_args


def sampling_args(p: argparse.ArgumentParser) -> None:
    for flag, kind, text in (
            ("--max-tokens", int, "tokens to generate at most (default: the router's, "
                                  "min(256, the context left))"),
            ("--temperature", float, "0: greedy (default: the model's, as the router says)"),
            ("--top-p", float, "nucleus sampling mass in (0, 1] (default: the model's)"),
            ("--top-k", int, "keep the k most likely tokens, 0: off (default: the model's)"),
            ("--seed", int, "same seed, same request: same tokens (default: none)")):
        p.add_argument(flag, type=kind, default=None, help=text)
    p.add_argument("--stop", action="append", default=[],
                   help="a stop string: generation ends before it (repeatable)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the model's end-of-sequence token")


def _client_args(p: argparse.ArgumentParser) -> None:
    client_tls_args(p)
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="the router's API key, sent as `authorization: Bearer KEY` (default: "
                        f"${API_KEY_ENV})")
    sampling_args(p)


def add_client_commands(sub: argparse._SubParsersAction) -> None:
    """`generate` and `chat`."""
    p = sub.add_parser("generate", help="stream one completion from a running deployment")
    p.add_argument("prompt", nargs="?", default=None,
                   help="prompt text (or give --chat); '-' or none with a pipe: read stdin")
    p.add_argument("--chat", default=None, metavar="MESSAGE",
                   help="send MESSAGE as one user chat message (the model's chat template "
                        "applies) instead of a prompt")
    p.add_argument("--address", default="127.0.0.1:50051", help="the router's public HOST:PORT")
    _client_args(p)

    p = sub.add_parser("chat", help="interactive conversation with a running deployment "
                                    "(Ctrl-C stops an answer, Ctrl-D exits)")
    p.add_argument("--address", default="127.0.0.1:50051", help="the router's public HOST:PORT")
    p.add_argument("--system", default=None, help="system message that opens the conversation")
    _client_args(p)
