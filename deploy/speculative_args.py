"""Speculative decoding's flags (vLLM's names), on decode and colocated workers and on the
commands that start them (serve, demo)."""

from __future__ import annotations

import argparse

from kvferry.settings import (
    DEFAULT_NUM_SPECULATIVE_TOKENS,
    DRAFT_KV_MODES,
    SPECULATIVE_METHODS,
    SpeculativeConfig,
)


def speculative_args(p: argparse.ArgumentParser, prefix: str = "") -> None:
    p.add_argument("--speculative-method", default=SPECULATIVE_METHODS[0],
                   choices=SPECULATIVE_METHODS,
                   help=prefix + "ngram: draft the tokens that followed the latest earlier "
                        "occurrence of the last few tokens (prompt lookup, no extra model); "
                        "draft: a smaller model's argmax (--speculative-model); the drafts are "
                        "verified in one forward and greedy and seeded outputs are unchanged")
    p.add_argument("--speculative-model", default="",
                   help=prefix + "draft: the draft model's checkpoint directory (the model's "
                        "tokenizer)")
    p.add_argument("--speculative-draft-kv", default=SpeculativeConfig.draft_kv,
                   choices=DRAFT_KV_MODES,
                   help="draft: where the draft model's K/V of the prompt comes from. "
                        "recompute: the decode worker prefills the draft in its step loop; "
                        "ship: prefill workers (given the same --speculative-model) prefill it "
                        "and push its pages with the model's (grpc K/V transport only); auto: "
                        "ship over grpc, recompute over nixl and ray")
    p.add_argument("--num-speculative-tokens", type=int, default=DEFAULT_NUM_SPECULATIVE_TOKENS,
                   help=prefix + "drafts verified per step at most")
    p.add_argument("--prompt-lookup-min", type=int, default=SpeculativeConfig.prompt_lookup_min,
                   help=prefix + "ngram: the shortest suffix n-gram looked up")
    p.add_argument("--prompt-lookup-max", type=int, default=SpeculativeConfig.prompt_lookup_max,
                   help=prefix + "ngram: the longest suffix n-gram looked up")
    p.add_argument("--speculative-adaptive", default="on", choices=("on", "off"),
                   help=prefix + "on: each sequence verifies the drafts worth their cost, from "
                        "its acceptance so far and the worker's step time by rows (pausing "
                        "when none are); off: always up to --num-speculative-tokens")


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig:
    """The flags as a config (ValueError naming the field when one is wrong)."""
    return SpeculativeConfig(args.speculative_method, args.num_speculative_tokens,
                             args.prompt_lookup_min, args.prompt_lookup_max,
                             args.speculative_adaptive == "on", args.speculative_model,
                             args.speculative_draft_kv)


def speculative_argv(args: argparse.Namespace) -> list[str]:
    """A deployment's flags again, for every worker's command line ([] when off)."""
    config = speculative_config(args)
    if not config.is_on:
        return []
    return ["--speculative-method", config.method, "--num-speculative-tokens",
            str(config.num_tokens), "--prompt-lookup-min", str(config.prompt_lookup_min),
            "--prompt-lookup-max", str(config.prompt_lookup_max),
            "--speculative-adaptive", "on" if config.is_adaptive else "off",
            *(["--speculative-model", config.model, "--speculative-draft-kv", config.draft_kv]
              if config.model else [])]
