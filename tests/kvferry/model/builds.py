"""A compiled model built once into a fresh cache, shared by a test module (each build is
~20 s of the machine): the checkpoint, the compiled forward of its first start, the cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from kvferry.model.config import load_model_config
from kvferry.model.transformer import Transformer
from kvferry_kernels.dispatch import get_attention_backend


class Built(NamedTuple):
    checkpoint: Path
    compiled: Any  # the first start's: every package built into an empty cache
    cache: Path


def build(request: pytest.FixtureRequest, arch: str,
          compile_into: Callable[[Transformer, Path], object]) -> Built:
    """`arch`'s seeded checkpoint (its `<arch>_checkpoint` fixture) compiled by
    `compile_into(model, cache)` into a fresh cache."""
    checkpoint: Path = request.getfixturevalue(f"{arch}_checkpoint")
    cache = request.getfixturevalue("tmp_path_factory").mktemp("compile-cache")
    model = Transformer(load_model_config(checkpoint), get_attention_backend("torch"))
    compiled = compile_into(model, cache)
    assert compiled is not None and model.compiled is compiled
    return Built(checkpoint, compiled, cache)
