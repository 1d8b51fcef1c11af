"""`kvferry profile`'s flags (deploy/profile_cmd.py runs it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from deploy.parser import comma_ints
from kvferry.settings import DEFAULT_BLOCK_SIZE, DEFAULT_KV_TRANSPORT, KV_TRANSPORTS, LOAD_FORMATS

PROFILE_POOL_SIZE = "1GiB"  # room for the largest decode batch of the sweep


def _ints(text: str) -> tuple[int, ...]:
    try:
        return comma_ints(text, 1)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_profile_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measure prefill, decode and K/V transfer costs here, "
                                       "for plan --sla")
    p.add_argument("--model", default=None,
                   help="checkpoint directory (default: the default model)")
    p.add_argument("--out", type=Path, default=None,
                   help="profile file (default: KVFERRY_HOME/profiles/MODEL-DTYPE-DEVICE-"
                        "TRANSPORT.json)")
    p.add_argument("--kv-transport", default=DEFAULT_KV_TRANSPORT, choices=KV_TRANSPORTS,
                   help="how the prefill worker ships K/V to the decode worker")
    p.add_argument("--kv-pool-size", default=PROFILE_POOL_SIZE,
                   help="each worker's K/V pool, as serve's flag (the plan's pools are this)")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                   help="tokens per K/V block (page)")
    p.add_argument("--load-format", default=LOAD_FORMATS[0], choices=LOAD_FORMATS,
                   help="auto: the checkpoint's weights; dummy: random ones of its shapes")
    p.add_argument("--prompt-lens", type=_ints, default=None,
                   help="prefill sweep: prompt tokens, comma-separated")
    p.add_argument("--decode-batches", type=_ints, default=None,
                   help="decode sweep: running sequences, comma-separated")
    p.add_argument("--decode-contexts", type=_ints, default=None,
                   help="decode sweep: prompt tokens of each sequence, comma-separated")
    p.add_argument("--repeats", type=int, default=3, help="prefill: runs of each point")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="the deployment's logs (default: KVFERRY_HOME/logs/profile-DATE)")
