"""The decode forward compiled with torch.compile (inductor), one graph per batch-size bucket.

What is compiled is the model's dense math: embedding, norms, rotary embedding, the fused
projections, the MLP, the LM head. Attention stays outside the graph as one opaque custom op
per layer (`kvferry::decode_attention`), as vLLM does: it reads the per-step context this
module sets (the closure that writes the layer's K/V to the pool, or the dense stage, and
attends over it), so block tables, slot mappings and context lengths never reach the graph and
never cause a recompile. The only shape the graph sees is the batch, padded up to the next
bucket (padded rows carry token 0 at position 0; attention runs over the real rows only and
the padded rows' logits are dropped). Batches above the largest bucket run eagerly.

Every bucket is compiled at `warm_up`, before the worker reports SERVING; `num_compiles`
counts the graphs compiled, so a test can show that steady state never recompiles. Modes:
"default" (inductor, weights frozen into the graph as constants) and "max-autotune" (also
benchmarks inductor's C++ GEMM templates against MKL per shape: the packed-weight GEMMs are
where most of a CPU step's time goes). Inductor's caches (generated kernels, autotuning
results) live in `cache_dir` and are reused by the next start; graphs with frozen packed
weights are not in its graph cache (inductor cannot pickle mkldnn tensors), so every start
traces and lowers each bucket again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvferry.settings import COMPILE_MODES, DEFAULT_COMPILE_BATCH_SIZES, parse_batch_sizes

if TYPE_CHECKING:
    from kvferry.model.transformer import AttendFn, Transformer

log = logging.getLogger("kvferry.compile")

DEFAULT_BATCH_BUCKETS = parse_batch_sizes(DEFAULT_COMPILE_BATCH_SIZES)

_step = threading.local()  # .attend (AttendFn) and .rows (real batch) of the running step


@torch.library.custom_op("kvferry::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
                     ) -> torch.Tensor:
    """Layer `layer`'s attention for the step now running on this thread: the first
    `rows` rows are real (their K/V is written, then attended); padded rows give zeros."""
    rows: int = _step.rows
    out = q.new_zeros(q.shape)
    with torch.inference_mode():  # as the eager step: the pool and the stage may be written
        out[:rows] = _step.attend(layer, q[:rows], k[:rows], v[:rows])
    return out


@decode_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


def smallest_bucket(buckets: Sequence[int], batch: int) -> int | None:
    """The smallest of the sorted `buckets` that holds `batch` rows; None when none does."""
    return next((size for size in buckets if size >= batch), None)


def _graph_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                  ) -> torch.Tensor:
    return torch.ops.kvferry.decode_attention(q, k, v, layer)


class _Graph(torch.nn.Module):
    """The weights as parameters (the Transformer's tensors, not copies), so inductor can
    freeze them, and the Transformer's own layer math as forward."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self._model = model
        self._names = list(model.weights)
        for i, name in enumerate(self._names):  # parameters: what inductor's freezing folds
            self.register_parameter(f"w{i}", torch.nn.Parameter(model.weights[name],
                                                                requires_grad=False))
        self.register_buffer("inv_freq", model.inv_freq, persistent=False)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        weights = {name: getattr(self, f"w{i}") for i, name in enumerate(self._names)}
        return self._model.forward_tokens(weights, self.inv_freq, token_ids, positions,
                                          _graph_attend)


class CompiledDecode:
    """The compiled decode forward of one Transformer, per batch-size bucket."""

    def __init__(self, model: Transformer, mode: str = "default",
                 buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
                 cache_dir: str | Path | None = None) -> None:
        if mode not in COMPILE_MODES[1:]:
            raise ValueError(f"compile: expected one of {COMPILE_MODES[1:]}, got {mode!r}")
        if cache_dir is not None:  # read by inductor when it first compiles
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
        import torch._dynamo
        import torch._inductor.config
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        self.model = model
        self.mode = mode
        self.buckets = tuple(sorted(buckets))
        self.num_compiles = 0  # graphs compiled; warm-up compiles one per bucket
        self.warm_up_s = 0.0
        limit = len(self.buckets) + 4
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, limit)
        tuned = list_mode_options("max-autotune-no-cudagraphs") if mode == "max-autotune" else {}
        # Patched around every call, not passed to compile_fx alone: freezing is read before
        # the backend runs too (passed only to compile_fx, no weight is ever packed).
        self._config = {**tuned, "freezing": True}

        def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]
                    ) -> Callable[..., object]:
            self.num_compiles += 1
            return compile_fx(gm, example_inputs)

        self._graph = _Graph(model).eval()
        self._compiled = torch.compile(self._graph, backend=backend, dynamic=False)

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket that holds `batch` rows, or None (run eagerly)."""
        return smallest_bucket(self.buckets, batch)

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn
                 ) -> torch.Tensor | None:
        """Logits [B, vocab] of one decode step, or None when B exceeds every bucket.
        `attend` writes each layer's K/V and attends, for the B real rows."""
        batch = token_ids.shape[0]
        size = self.bucket(batch)
        if size is None:
            return None
        _step.attend, _step.rows = attend, batch
        try:
            with torch.inference_mode(False), torch.no_grad(), \
                    torch._inductor.config.patch(self._config):
                # Outside inference mode (inductor freezes weights only under no_grad), with
                # fresh int64 inputs every time: the graph's guards check dtype and dispatch
                # keys too, and an inference tensor from the caller would recompile.
                padded = torch.zeros(2, size, dtype=torch.int64, device=token_ids.device)
                padded[0, :batch] = token_ids
                padded[1, :batch] = positions
                logits = self._compiled(padded[0], padded[1])
        finally:
            _step.attend = _step.rows = None
        return logits[:batch]

    def warm_up(self) -> None:
        """Compile every bucket now (before the worker serves), attending to nothing."""
        start = time.perf_counter()
        device = self.model.device

        def attend_nothing(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                           ) -> torch.Tensor:
            return torch.zeros_like(q)

        for size in self.buckets:
            t0 = time.perf_counter()
            tokens = torch.zeros(size, dtype=torch.int64, device=device)
            self(tokens, torch.zeros_like(tokens), attend_nothing)
            log.info("compiled the decode step for batch %d (%s) in %.1f s", size, self.mode,
                     time.perf_counter() - t0)
        self.warm_up_s = time.perf_counter() - start
        log.info("decode step compiled for batch sizes %s in %.1f s",
                 ",".join(map(str, self.buckets)), self.warm_up_s)


def compile_decode(model: Transformer, mode: str, buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
                   cache_dir: str | Path | None = None) -> CompiledDecode | None:
    """Compile `model`'s decode step for every bucket now and make its decode steps use it;
    mode "off" keeps (or makes) it eager."""
    if mode == "off":
        model.compiled = None
        return None
    compiled = CompiledDecode(model, mode, buckets, cache_dir)
    compiled.warm_up()
    model.compiled = compiled
    return compiled
