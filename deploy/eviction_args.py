"""K/V eviction's flags (docs/kv-eviction-design.md), on decode and colocated workers and on
the commands that start them (serve, demo)."""

from __future__ import annotations

import argparse

from kvferry.settings import EVICTION_POLICIES, KvEvictionConfig


def eviction_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument("--kv-eviction", default=EVICTION_POLICIES[0], choices=EVICTION_POLICIES,
                   help=prefix + "none: every token's K/V kept until the request ends; "
                        "streaming (StreamingLLM): only the first --kv-sink-tokens and the "
                        "last --kv-window-tokens, each rounded up to whole blocks, with "
                        "positions within the cache, so a generation may run past the "
                        "model's context in bounded memory (what the model reads changes: "
                        "docs/performance.md measures it); h2o (heavy hitters): the last "
                        "--kv-recent-tokens and the blocks of --kv-heavy-tokens that drew the "
                        "most attention so far, positions those of the text")
    p.add_argument("--kv-sink-tokens", type=int, default=KvEvictionConfig.sink_tokens,
                   help=prefix + "streaming: the first tokens kept (attention sinks)")
    p.add_argument("--kv-window-tokens", type=int, default=KvEvictionConfig.window_tokens,
                   help=prefix + "streaming: the latest tokens kept")
    p.add_argument("--kv-heavy-tokens", type=int, default=KvEvictionConfig.heavy_tokens,
                   help=prefix + "h2o: tokens kept for the attention they drew (whole blocks)")
    p.add_argument("--kv-recent-tokens", type=int, default=KvEvictionConfig.recent_tokens,
                   help=prefix + "h2o: the latest tokens kept")


def eviction_config(args: argparse.Namespace) -> KvEvictionConfig:
    """The flags as a config (ValueError naming the field when one is wrong)."""
    return KvEvictionConfig(args.kv_eviction, args.kv_sink_tokens, args.kv_window_tokens,
                            args.kv_heavy_tokens, args.kv_recent_tokens)


def eviction_argv(args: argparse.Namespace) -> list[str]:
    """A deployment's flags again, for every worker's command line ([] when none)."""
    config = eviction_config(args)
    if not config.is_on:
        return []
    return ["--kv-eviction", config.policy, "--kv-sink-tokens", str(config.sink_tokens),
            "--kv-window-tokens", str(config.window_tokens), "--kv-heavy-tokens",
            str(config.heavy_tokens), "--kv-recent-tokens", str(config.recent_tokens)]
