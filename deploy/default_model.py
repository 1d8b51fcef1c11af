"""The default model of every command and benchmark given no `--model`: a tiny seeded Qwen3
checkpoint, written once under KVFERRY_HOME (kvferry.settings.DEFAULT_MODEL_DIR)."""

from __future__ import annotations

import sys

from kvferry.settings import DEFAULT_MODEL_DIR


def ensure_default_model() -> str:
    """The default checkpoint's directory, made first if missing."""
    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        from kvferry.model.checkpoint import make_model

        print(f"creating the default model in {DEFAULT_MODEL_DIR}", file=sys.stderr)
        make_model(DEFAULT_MODEL_DIR)
    return str(DEFAULT_MODEL_DIR)
