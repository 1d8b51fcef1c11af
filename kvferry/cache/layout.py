"""The K/V layout: the one definition of how big a worker's K/V pages are.

`KvShape` is the geometry a model fixes (layers, kv heads, head dim, dtype) and owns the
arithmetic: bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element.
`KvLayout` is that geometry plus what a running pool adds (block size, model fingerprint):
what two workers must share to exchange pages (mirrors proto `KvLayout`). `kvferry plan` and
the router's headroom use the shape; pools, the wire format and the peers' handshake use the
layout. The dtype table lives here too, once; the token -> block rounding is
`kvferry.cache.budget`'s.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvferry.errors import missing_model

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from kvferry.cache.pool import KvPool


class KvDtype(NamedTuple):
    """One element type K/V may be stored in."""

    torch_dtype: torch.dtype | None  # None: sized for `kvferry plan` only; no pool holds it
    size_bytes: int
    scale_bytes: int = 0  # per token and K/V head, beside the values (quantized pages)


DTYPES: dict[str, KvDtype] = {
    "float32": KvDtype(torch.float32, 4),
    "float16": KvDtype(torch.float16, 2),
    "bfloat16": KvDtype(torch.bfloat16, 2),
    # Quantized pages (`--kv-cache-dtype`, kernels/kvferry_kernels/kv_quant.py): a float32
    # scale per token and K/V head travels with the values.
    "int8": KvDtype(torch.int8, 1, 4),
    "fp8_e4m3": KvDtype(torch.float8_e4m3fn, 1, 4),
    # vLLM's fp8 cache (one scale per layer): `kvferry plan` sizes it; no pool stores it.
    "fp8": KvDtype(None, 1),
}
# Names a pool's K/V may be stored as besides the model's own dtype (--kv-cache-dtype).
QUANTIZED_KV_DTYPES = ("int8", "fp8_e4m3")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a pool stores `name` in; ValueError naming `dtype` when it has none."""
    entry = DTYPES.get(name)
    if entry is None or entry.torch_dtype is None:
        pool_names = sorted(n for n, e in DTYPES.items() if e.torch_dtype is not None)
        raise ValueError(f"dtype: no K/V pool stores {name!r}; one of {pool_names}")
    return entry.torch_dtype


def dtype_name(dtype: torch.dtype) -> str:
    """The table's name of a pool's torch dtype (the inverse of `torch_dtype`)."""
    for name, entry in DTYPES.items():
        if entry.torch_dtype == dtype:
            return name
    raise ValueError(f"unsupported dtype {dtype}")


@dataclass(frozen=True)
class KvShape:
    """The K/V geometry of a model at one dtype, and all the byte arithmetic on it."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: unknown {self.dtype!r}; one of {sorted(DTYPES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")

    @property
    def bytes_per_token_layer(self) -> int:
        """K and V of one token in one layer (with their scales when quantized)."""
        entry = DTYPES[self.dtype]
        return 2 * self.num_kv_heads * (self.head_dim * entry.size_bytes + entry.scale_bytes)

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_layer

    def bytes_per_block(self, block_size: int) -> int:
        """K and V of one block in every layer: the unit a pool is carved into."""
        return block_size * self.bytes_per_token

    @staticmethod
    def from_config(path: str | Path, dtype: str = "bfloat16") -> KvShape:
        """From a checkpoint directory, a config.json or a .gguf file (no weights needed), in
        any architecture's field names: see `read_hf_config`. ValueError naming what is
        missing when the config describes no attention K/V."""
        hf = read_hf_config(path)
        heads = _config_int(hf, "num_attention_heads", path)
        head_dim = getattr(hf, "head_dim", None) or _config_int(hf, "hidden_size", path) // heads
        return KvShape(
            num_layers=_config_int(hf, "num_hidden_layers", path),
            num_kv_heads=_kv_heads(hf, heads),
            head_dim=head_dim,
            dtype=dtype,
        )


def read_hf_config(path: str | Path) -> PretrainedConfig:
    """A model's config through transformers' AutoConfig (local files only), so each
    architecture's own field names (GPT-2's `n_layer`, `n_head`, `n_embd`) answer to the
    standard ones (`num_hidden_layers`...) through its config class's `attribute_map`.

    `path`: a checkpoint directory, a config.json file or a .gguf file. A config without
    `model_type` is read as written, in the standard names. Errors are one-line ValueErrors
    (FileNotFoundError for a missing path) naming the path and the problem."""
    from transformers import AutoConfig, PretrainedConfig

    source, kwargs = _config_source(Path(path))
    try:
        raw, _ = PretrainedConfig.get_config_dict(source, local_files_only=True, **kwargs)
        if "model_type" not in raw:
            return PretrainedConfig.from_dict(raw)
        return AutoConfig.from_pretrained(source, local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        # transformers' messages run to several lines; the first one names the problem.
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"model: cannot read the config of {path}: {first_line}") from exc


def _config_source(path: Path) -> tuple[str, dict[str, str]]:
    """What AutoConfig is given for `path`: a directory or a file, and `gguf_file` for GGUF."""
    if not path.exists():
        raise FileNotFoundError(f"{missing_model(path)}: no such file or directory")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"model: no config.json in {path}")
        return str(path), {}
    if path.suffix == ".gguf":
        if importlib.util.find_spec("gguf") is None:
            raise ValueError(f"model: reading {path} needs the gguf package: pip install gguf")
        return str(path.parent), {"gguf_file": path.name}
    if path.suffix != ".json":
        raise ValueError(f"model: {path} is neither a checkpoint directory, a config.json "
                         "nor a .gguf file")
    return str(path), {}


def _config_int(hf: PretrainedConfig, name: str, path: str | Path) -> int:
    value = getattr(hf, name, None)
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"model: the config of {path} has no {name} (got {value!r}); "
                         "kvferry sizes attention K/V only")
    return value


def _kv_heads(hf: PretrainedConfig, num_heads: int) -> int:
    """K/V heads: 1 for multi-query configs (GPT-BigCode, early Falcon), else the config's
    own count (`num_key_value_heads`; Falcon's `num_kv_heads`, in older configs `n_head_kv`),
    else one per query head."""
    if getattr(hf, "multi_query", False) and not getattr(hf, "new_decoder_architecture", False):
        return 1
    for name in ("num_key_value_heads", "num_kv_heads", "n_head_kv"):
        value = getattr(hf, name, None)
        if isinstance(value, int) and value >= 1:
            return value
    return num_heads


@dataclass(frozen=True)
class KvLayout:
    """A pool's layout: its shape, block size and model. Two workers exchange pages only when
    their layouts are equal. Built from a peer's message without validation, so that
    `mismatch` can name what differs; only a validated layout's sizes are asked for."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    model_fingerprint: str = ""  # empty when only sizes matter (`kvferry plan`)

    @staticmethod
    def of_pool(pool: KvPool, model_fingerprint: str) -> KvLayout:
        return KvLayout(
            pool.num_layers, pool.whole_kv_heads, pool.head_dim, pool.block_size,
            pool.kv_cache_dtype if pool.is_quantized else dtype_name(pool.dtype),
            model_fingerprint,
        )

    @cached_property
    def shape(self) -> KvShape:
        """The geometry part (validated here: ValueError on a bad dtype or size)."""
        return KvShape(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @property
    def bytes_per_layer_block(self) -> int:
        """K and V of one block in one layer."""
        return self.block_size * self.shape.bytes_per_token_layer

    def mismatch(self, other: KvLayout) -> str | None:
        """Name the first field that differs, or None when the layouts match."""
        for field in fields(self):
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                return f"layout.{field.name}: sender has {theirs!r}, receiver has {mine!r}"
        return None
