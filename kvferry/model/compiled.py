"""The model's forward compiled ahead of time with inductor: per batch-size bucket for the
decode step, or one package with a dynamic row count for both prefill and decode.

What is compiled is the model's dense math: embedding, norms, rotary embedding, the fused
projections, the MLP, the LM head. Attention stays outside the graph as one opaque custom op
per layer (`kvferry::attention`), as vLLM does: it reads the per-step context this module sets
(the closure that writes the layer's K/V to the pool, or the dense stage, and attends over it;
and, for prefill, the callback that ships a layer's K/V once it is written), so block tables,
slot mappings, chunk lengths and context lengths never reach the graph and never cause a
recompile. Padded rows carry token 0 at position 0; attention runs over the real rows only
(padded rows get zeros) and the padded rows' logits are dropped.

Modes. "default" (inductor, oneDNN's packed GEMMs: inductor turns MKL's prepacking off when
compiling ahead of time), "max-autotune" (also benchmarks inductor's C++ GEMM templates against
the library's per shape and keeps the faster) and "auto" (both packages of a
bucket built and timed as whole steps, the faster kept; the choice is recorded beside them)
compile the decode step per bucket (`CompiledDecode`): the batch is padded up to the next
bucket, batches above the largest run eagerly, prefill runs eagerly. "dynamic"
(`CompiledForward`) is ONE package exported with a symbolic row count (1 to `max_rows`,
`DEFAULT_MAX_ROWS` by default) that serves the decode step (all rows' logits) and the prefill
forward (packed chunks, logits of the `logit_rows` sampled only); more rows than `max_rows`
run eagerly, and `pad_rows_to` rounds the rows up to a multiple (1: none). It builds and loads
in about half the time and memory of three buckets (bench/bench_compile_dynamic.py) and calls
the same oneDNN linears on the same packed weight layouts as a bucket: measured in one process
on thread CPU time, its step is within 5% of a bucket's at 8 and 32 rows and faster off them,
having nothing to pad (bench/bench_compile_rows.py, docs/performance.md). torch.export
specializes the sizes 0 and 1, so a package built with a symbolic row count checks for 2 or
more rows only where AOTI_RUNTIME_CHECK_INPUTS asks it to; one row runs unchecked (and is
token-exact: tests/kvferry/model/test_compiled_dynamic.py).

Each package is an AOTInductor package (`torch.export`, then inductor ahead of time, the
weights frozen into it as constants: the packed-weight GEMMs are where most of a CPU step's
time goes), written under `cache_dir` with a key naming everything it was built from (the
checkpoint's content fingerprint, dtype, device, mode, bucket or `max_rows`, torch's version,
this code's source, the CPU's vector ISA and, on CUDA, the device's compute capability), and
loaded from there by every later start: a restart spends seconds, not minutes, where
inductor's own graph cache keeps no graph with packed (mkldnn) weights. Packages and "auto"
choice records are entries of `kvferry_kernels.artifact_cache`: published atomically with a
manifest and verified byte for byte before loading; a bad one is rebuilt with one warning, and
a `cache_dir` another user owns or group or others may write is refused with one warning
(packages are then built into a private temporary directory for this process). `warm_up`
builds or loads every package before the worker reports SERVING; `num_compiles` counts the
graphs in use (built here or loaded) and `num_cache_hits` the loaded ones, so a test can show
that steady state never adds one (a package has no guards: nothing can recompile it).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kvferry.model.step_timing import median_ms
from kvferry.settings import COMPILE_MODES, DEFAULT_COMPILE_BATCH_SIZES, parse_batch_sizes
from kvferry_kernels import artifact_cache

if TYPE_CHECKING:
    from kvferry.model.transformer import AttendFn, LayerDoneFn, Transformer

log = logging.getLogger("kvferry.compile")

DEFAULT_BATCH_BUCKETS = parse_batch_sizes(DEFAULT_COMPILE_BATCH_SIZES)
PACKAGE, CHOICE = "decode.pt2", "choice.json"  # the file in a package's and a choice's entry
DYNAMIC = "dynamic"  # the mode of one package with a dynamic row count (CompiledForward)
# "dynamic"'s rows by default: above a decode batch (at most 4096 sequences: settings'
# batch sizes) and a prefill step's token budget of a few thousand tokens, as vLLM's default
# max_num_batched_tokens for chunked prefill is 2048-8192. The graph has no buffer sized by it.
DEFAULT_MAX_ROWS = 4096

# Of the step running on this thread: .attend (AttendFn), .rows (real rows) and
# .on_layer_done (LayerDoneFn or None).
_step = threading.local()


@torch.library.custom_op("kvferry::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """Layer `layer`'s attention for the step now running on this thread: the first `rows`
    rows are real (their K/V is written, then attended; then the step's `on_layer_done`, if
    any, is told the layer's K/V is in the pool); padded rows give zeros."""
    rows: int = _step.rows
    out = q.new_zeros(q.shape)
    with torch.inference_mode():  # as the eager step: the pool and the stage may be written
        out[:rows] = _step.attend(layer, q[:rows], k[:rows], v[:rows])
    if _step.on_layer_done is not None:
        _step.on_layer_done(layer)
    return out


@attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)


def smallest_bucket(buckets: Sequence[int], batch: int) -> int | None:
    """The smallest of the sorted `buckets` that holds `batch` rows; None when none does."""
    return next((size for size in buckets if size >= batch), None)


def _graph_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                  ) -> torch.Tensor:
    return torch.ops.kvferry.attention(q, k, v, layer)


class _Graph(torch.nn.Module):
    """The weights as parameters (the Transformer's tensors, not copies), so inductor can
    freeze them, and the Transformer's own layer math as forward: every row's logits."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self._model = model
        self._names = list(model.weights)
        for i, name in enumerate(self._names):  # parameters: what inductor's freezing folds
            self.register_parameter(f"w{i}", torch.nn.Parameter(model.weights[name],
                                                                requires_grad=False))
        self.register_buffer("inv_freq", model.inv_freq, persistent=False)

    def _weights(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"w{i}") for i, name in enumerate(self._names)}

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self._model.forward_tokens(self._weights(), self.inv_freq, token_ids, positions,
                                          _graph_attend)


class _RowsGraph(_Graph):
    """`_Graph` with the logits of `logit_rows` [R] only (the dynamic package's graph)."""

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                logit_rows: torch.Tensor) -> torch.Tensor:
        return self._model.forward_tokens(self._weights(), self.inv_freq, token_ids, positions,
                                          _graph_attend, logit_rows)


def _source_digest() -> str:
    """This module's and the model's source: a change to either builds new packages."""
    from kvferry.model import transformer

    digest = hashlib.sha256()
    for module_file in sorted({__file__, transformer.__file__}):
        digest.update(Path(module_file).read_bytes())
    return digest.hexdigest()


class _Packages:
    """What the compiled forwards share: the verified on-disk cache of their packages, the
    keys naming them, and the counts a test reads."""

    def __init__(self, model: Transformer, mode: str, cache_dir: str | Path | None) -> None:
        # Refused (one warning) when not private: a private temporary directory instead.
        self.cache_dir = (None if cache_dir is None else artifact_cache.cache_root(
            Path(cache_dir), log, "kvferry-compile-"))
        if self.cache_dir is not None:  # read by inductor when it first compiles
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(self.cache_dir))
        self.model = model
        self.mode = mode
        self.num_compiles = 0  # graphs in use: built here or loaded from cache_dir
        self.num_cache_hits = 0  # of those, the loaded ones
        self.num_builds = 0  # packages compiled here ("auto" builds both modes of a bucket)
        self.warm_up_s = 0.0
        # Everything a package depends on but its mode and size, hashed once (sources read);
        # the thread count too: inductor writes it into its kernels' parallel regions.
        self._key_base = hashlib.sha256()
        for part in (model.config.fingerprint, str(model.dtype), str(model.device),
                     torch.__version__, _source_digest(), str(torch.get_num_threads()),
                     artifact_cache.native_target(model.device)):
            self._key_base.update(part.encode() + b"\0")

    def package_key(self, size: int, mode: str | None = None) -> str:
        """What names the package of `mode` (this one's by default) for `size` rows (a
        bucket, or "dynamic"'s max_rows): everything its code and constants depend on. For
        "auto", the name of the bucket's choice."""
        digest = self._key_base.copy()
        digest.update(f"{mode or self.mode}\0{size}".encode())
        return digest.hexdigest()[:32]

    def _build(self, size: int, mode: str, scratch: Path) -> None:
        """Export and compile the package for `size` rows into (empty, private) `scratch`."""
        raise NotImplementedError

    def _package(self, size: int, mode: str) -> tuple[Callable[..., torch.Tensor], bool]:
        """The package of `mode` for `size` rows, loaded from cache_dir or built; and whether
        it was loaded."""

        if self.cache_dir is None:  # a package for this process only (loading copies it)
            with tempfile.TemporaryDirectory(prefix="kvferry-decode-") as tmp:
                self._build(size, mode, Path(tmp))
                return load_package(Path(tmp) / PACKAGE, self.model.device), False
        entry = self.cache_dir / "aoti" / f"decode-{self.package_key(size, mode)}"
        cached = artifact_cache.get_or_build(
            entry, functools.partial(self._build, size, mode), log)
        # Verified against its manifest: only now is it loaded.
        return load_package(cached.path / PACKAGE, self.model.device), cached.is_hit


_EXTRACTED_LOCK = threading.Lock()


def load_package(path: Path, device: torch.device) -> Callable[..., torch.Tensor]:
    """Load the AOTInductor package at `path`, leaving nothing on disk. Loading extracts the
    package (its shared object, weights included: 600 MB for the real model) into a fresh
    folder under $TMPDIR, which torch removes only when the loader is destroyed, never in a
    worker that exits without destructors or is killed: a suite starting a few dozen workers
    filled a CI machine's disk. Here the folder is made inside one of ours and removed once
    loaded on CPU (the shared object is mapped, so its pages live until the process ends);
    on an accelerator, whose kernel binaries may be read at their first call, at exit."""
    import torch._inductor

    with _EXTRACTED_LOCK:
        scratch = tempfile.mkdtemp(prefix="kvferry-aoti-")
        before = os.environ.get("TMPDIR")
        os.environ["TMPDIR"] = scratch  # where the C++ loader extracts
        try:
            runner = torch._inductor.aoti_load_package(str(path))
        finally:
            if before is None:
                del os.environ["TMPDIR"]
            else:
                os.environ["TMPDIR"] = before
    if device.type == "cpu":
        shutil.rmtree(scratch, ignore_errors=True)
    else:
        atexit.register(shutil.rmtree, scratch, True)
    return runner


class CompiledDecode(_Packages):
    """The compiled decode forward of one Transformer, per batch-size bucket. Prefill (a
    call with `logit_rows`) is not covered: it runs eagerly."""

    def __init__(self, model: Transformer, mode: str = "default",
                 buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
                 cache_dir: str | Path | None = None) -> None:
        if mode not in COMPILE_MODES[1:] or mode == DYNAMIC:
            modes = tuple(m for m in COMPILE_MODES[1:] if m != DYNAMIC)
            raise ValueError(f"compile: expected one of {modes}, got {mode!r}")
        super().__init__(model, mode, cache_dir)
        self.buckets = tuple(sorted(buckets))
        self.modes: dict[int, str] = {}  # the package mode each bucket runs ("auto" chooses)
        self.step_ms: dict[int, dict[str, float]] = {}  # "auto": median ms per step, per mode
        self._graph = _Graph(model).eval()
        self._runners: dict[int, Callable[..., torch.Tensor]] = {}

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket that holds `batch` rows, or None (run eagerly)."""
        return smallest_bucket(self.buckets, batch)

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                 logit_rows: torch.Tensor | None = None,
                 on_layer_done: LayerDoneFn | None = None) -> torch.Tensor | None:
        """Logits [B, vocab] of one decode step, or None when B exceeds every bucket or the
        call is a prefill's (`logit_rows` given). `attend` writes each layer's K/V and
        attends, for the B real rows."""
        size = self.bucket(token_ids.shape[0])
        if size is None or logit_rows is not None or on_layer_done is not None:
            return None
        runner = self._runners.get(size)
        if runner is None:
            raise RuntimeError(f"compile: bucket {size} was not warmed up")
        return _run(runner, size, token_ids, positions, attend)

    def _build(self, size: int, mode: str, scratch: Path) -> None:
        """Export and compile bucket `size` into a package in (empty, private) `scratch`."""
        tokens = torch.zeros(size, dtype=torch.int64, device=self.model.device)
        export_package(self._graph, tokens, scratch / PACKAGE, mode)
        self.num_builds += 1

    def _choose(self, size: int) -> tuple[Callable[..., torch.Tensor], bool]:
        """"auto": the mode recorded for this bucket in cache_dir, else both modes' packages
        timed against each other here (inductor's autotuning times each GEMM alone, with its
        weights warm, which misjudges a step that streams every weight once), the faster
        kept and recorded."""
        record = None
        if self.cache_dir is not None:
            record = self.cache_dir / "aoti" / f"choice-{self.package_key(size)}"
            chosen = (_read_choice(record / CHOICE) if artifact_cache.lookup(record, log)
                      else None)
            if chosen is not None:
                self.modes[size] = chosen
                return self._package(size, chosen)
        packages = {mode: self._package(size, mode) for mode in AUTO_MODES}
        tokens = torch.zeros(size, dtype=torch.int64, device=self.model.device)
        self.step_ms[size] = median_ms({  # attending nothing: the modes differ in dense math
            mode: functools.partial(_run, runner, size, tokens, tokens, attend_nothing)
            for mode, (runner, _) in packages.items()})
        chosen = min(AUTO_MODES, key=lambda m: self.step_ms[size][m])
        self.modes[size] = chosen
        log.info("decode step for batch %d: %s chosen (ms per step: %s)", size, chosen,
                 ", ".join(f"{m} {t:.2f}" for m, t in self.step_ms[size].items()))
        if record is not None:
            text = json.dumps({"mode": chosen, "ms_per_step": self.step_ms[size]})
            artifact_cache.discard(record)  # an entry that names no valid mode
            artifact_cache.get_or_build(record, lambda scratch: (scratch / CHOICE).write_text(
                text), log)
        return packages[chosen]

    def warm_up(self) -> None:
        """Build or load every bucket now (before the worker serves), then run each once,
        attending to nothing."""
        start = time.perf_counter()
        device = self.model.device
        for size in self.buckets:
            t0 = time.perf_counter()
            if self.mode == "auto":
                self._runners[size], loaded = self._choose(size)
            else:
                self.modes[size] = self.mode
                self._runners[size], loaded = self._package(size, self.mode)
            self.num_compiles += 1
            self.num_cache_hits += loaded
            tokens = torch.zeros(size, dtype=torch.int64, device=device)
            self(tokens, torch.zeros_like(tokens), attend_nothing)
            log.info("decode step for batch %d (%s): %s in %.1f s", size, self.modes[size],
                     "loaded" if loaded else "compiled", time.perf_counter() - t0)
        self.warm_up_s = time.perf_counter() - start
        log.info("decode step compiled for batch sizes %s in %.1f s (%d of %d from the cache)",
                 ",".join(map(str, self.buckets)), self.warm_up_s, self.num_cache_hits,
                 len(self.buckets))


EXACT_ROWS = 16  # row counts up to this run as they are; above, on row_grid's sizes


def row_grid(rows: int) -> int:
    """`rows` rounded up to the next of four sizes per power of two above EXACT_ROWS (20, 24,
    28, 32, 40, ... 512, 640, ...): at most 25% more rows, and a worker meets at most ~50 row
    counts in all. Each new row count a package runs keeps about a MiB of native memory for
    good (the tiny model: +440 MiB of RSS over 400 distinct counts, none over the same three
    repeated; a soak's prefill worker grew 22% after warm-up): unbounded, a long-running
    worker's memory would creep with every new prompt length."""
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - 3)
    return -(-rows // step) * step


class CompiledForward(_Packages):
    """The whole forward of one Transformer as ONE package ("dynamic"), for 1 to `max_rows`
    rows: the decode step and the prefill forward alike. Rows run on `row_grid`'s sizes,
    rounded up to a multiple of `pad_rows_to` (at most max_rows); more than max_rows run
    eagerly."""

    def __init__(self, model: Transformer, max_rows: int = DEFAULT_MAX_ROWS,
                 cache_dir: str | Path | None = None, pad_rows_to: int = 1) -> None:
        if max_rows < 2:  # export specialises a dimension of size 1: it needs room above it
            raise ValueError(f"compile max_rows: expected at least 2, got {max_rows}")
        if pad_rows_to < 1:
            raise ValueError(f"compile pad_rows_to: expected at least 1, got {pad_rows_to}")
        super().__init__(model, DYNAMIC, cache_dir)
        self.max_rows = max_rows
        self.pad_rows_to = pad_rows_to
        self._graph = _RowsGraph(model).eval()
        self._runner: Callable[..., torch.Tensor] | None = None

    def padded_rows(self, rows: int) -> int | None:
        """The rows the package runs for `rows` real ones, or None (run eagerly)."""
        if not 1 <= rows <= self.max_rows:  # the package's range of rows
            return None
        return min(-(-row_grid(rows) // self.pad_rows_to) * self.pad_rows_to, self.max_rows)

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                 logit_rows: torch.Tensor | None = None,
                 on_layer_done: LayerDoneFn | None = None) -> torch.Tensor | None:
        """Logits [R, vocab] of the `logit_rows` (default every row) of one forward over the
        T tokens, or None when T exceeds max_rows. `attend` writes each layer's K/V and
        attends for the T real rows; `on_layer_done(layer)` follows each layer's attend."""
        size = self.padded_rows(token_ids.shape[0])
        if size is None:
            return None
        if self._runner is None:
            raise RuntimeError("compile: the dynamic package was not warmed up")
        device = token_ids.device
        rows = (torch.arange(token_ids.shape[0], device=device) if logit_rows is None
                else logit_rows.to(device, torch.int64))
        return _run(self._runner, size, token_ids, positions, attend, rows, on_layer_done)

    def _build(self, size: int, mode: str, scratch: Path) -> None:
        """Export with symbolic T and R (examples away from 0 and 1, and from each other,
        which export would otherwise take for a rule) and compile into `scratch`."""
        tokens_dim = torch.export.Dim("tokens", min=1, max=size)
        rows_dim = torch.export.Dim("logit_rows", min=1, max=size)
        device = self.model.device
        tokens = torch.zeros(min(size, 8), dtype=torch.int64, device=device)
        rows = torch.arange(min(size, 8) - 1, dtype=torch.int64, device=device)
        export_package(self._graph, tokens, scratch / PACKAGE, "default",
                       ({0: tokens_dim}, {0: tokens_dim}, {0: rows_dim}), rows)
        self.num_builds += 1

    def warm_up(self) -> None:
        """Build or load the package now (before the worker serves), then run it once,
        attending to nothing."""
        start = time.perf_counter()
        self._runner, loaded = self._package(self.max_rows, DYNAMIC)
        self.num_compiles += 1
        self.num_cache_hits += loaded
        tokens = torch.zeros(1, dtype=torch.int64, device=self.model.device)
        self(tokens, tokens, attend_nothing)
        self.warm_up_s = time.perf_counter() - start
        log.info("forward compiled for 1-%d rows (padded to a multiple of %d): %s in %.1f s",
                 self.max_rows, self.pad_rows_to, "loaded" if loaded else "compiled",
                 self.warm_up_s)


AUTO_MODES = ("default", "max-autotune")  # what "auto" chooses between, per bucket


def _read_choice(path: Path) -> str | None:
    """The mode a verified choice record names, or None when it names none of AUTO_MODES."""
    try:
        chosen = json.loads(path.read_text())["mode"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return chosen if chosen in AUTO_MODES else None


def export_package(graph: torch.nn.Module, tokens: torch.Tensor, package: Path, mode: str,
                   dynamic_shapes: tuple[dict[int, object], ...] | None = None,
                   logit_rows: torch.Tensor | None = None) -> None:
    """`graph` exported at example `tokens` (positions alike, and `logit_rows` where given:
    a third input) and compiled ahead of time into the file `package`, its weights frozen
    and packed; `dynamic_shapes` as torch.export takes them (None: every shape the
    example's)."""
    import torch._inductor
    from torch._inductor import list_mode_options

    tuned = list_mode_options("max-autotune-no-cudagraphs") if mode == "max-autotune" else {}
    inputs = (tokens, torch.zeros_like(tokens)) + (() if logit_rows is None else (logit_rows,))
    with torch.inference_mode(False), torch.no_grad():
        # Outside inference mode: inductor freezes (and packs) weights only under no_grad.
        exported = torch.export.export(graph, inputs, dynamic_shapes=dynamic_shapes,
                                       strict=False)
        torch._inductor.aoti_compile_and_package(
            exported, package_path=str(package), inductor_configs={**tuned, "freezing": True})


def attend_nothing(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                   ) -> torch.Tensor:
    return torch.zeros_like(q)


def _run(runner: Callable[..., torch.Tensor], size: int, token_ids: torch.Tensor,
         positions: torch.Tensor, attend: AttendFn, logit_rows: torch.Tensor | None = None,
         on_layer_done: LayerDoneFn | None = None) -> torch.Tensor:
    """One forward of a package over the real rows of token_ids and positions, padded to
    `size` rows. A bucket's package gives every row's logits (the real ones kept); the
    dynamic one takes `logit_rows` and gives theirs."""
    batch = token_ids.shape[0]
    _step.attend, _step.rows, _step.on_layer_done = attend, batch, on_layer_done
    try:
        padded = torch.zeros(2, size, dtype=torch.int64, device=token_ids.device)
        padded[0, :batch] = token_ids
        padded[1, :batch] = positions
        if logit_rows is not None:
            return runner(padded[0], padded[1], logit_rows)
        logits = runner(padded[0], padded[1])
    finally:
        _step.attend = _step.rows = _step.on_layer_done = None
    return logits[:batch]


def compile_model(model: Transformer, mode: str, buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS,
                  cache_dir: str | Path | None = None, max_rows: int = DEFAULT_MAX_ROWS,
                  pad_rows_to: int = 1) -> CompiledDecode | CompiledForward | None:
    """Compile `model` now and make its forwards use it: "dynamic" one package for prefill
    and decode of up to `max_rows` rows (rounded up to a multiple of `pad_rows_to`; `buckets`
    unused), the other modes the decode step per bucket (`max_rows`, `pad_rows_to` unused);
    mode "off" keeps (or makes) it eager."""
    if mode == "off":
        model.compiled = None
        return None
    compiled: CompiledDecode | CompiledForward
    if mode == DYNAMIC:
        compiled = CompiledForward(model, max_rows, cache_dir, pad_rows_to)
    else:
        compiled = CompiledDecode(model, mode, buckets, cache_dir)
    compiled.warm_up()
    model.compiled = compiled
    return compiled


compile_decode = compile_model  # its name while only the decode step was compiled
