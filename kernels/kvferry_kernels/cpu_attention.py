"""Decode attention on CPU, each sequence read up to its own length, over the paged pool in
place (`paged`) or over dense per-sequence K/V rows (`__call__`): `cpu_decode_attention.c`,
compiled with the machine's C compiler on first use and called through ctypes.

Why C and not torch ops: the torch path (`paged_attention_torch.dense_decode_attention`)
attends every row over the batch's longest length, and its batched matmuls are G-row GEMMs
(the query heads of one KV head), which MKL runs at about half of memory speed. The kernel
reads each row's K and V once, up to its length. Why ctypes and not a torch extension: the
file needs no torch header, so it compiles in under a second with nothing but `cc`, where a
torch extension takes a minute and ninja.

`load(cache_dir)` builds the library once per source, compiler, CPU and flags into `cache_dir`
(a private temporary directory when None) and returns a `CpuAttention`, or None where there is
no compiler or the build fails (the caller keeps the torch path). The library is an entry of
`kvferry_kernels.artifact_cache`: built in scratch, fsynced and renamed into place with a
manifest, and verified byte for byte before `ctypes.CDLL` maps it (a truncated library would
SIGBUS the worker; a stub would silently keep it on torch). A bad entry is rebuilt with one
warning; a cache directory another user owns, or group or others may write, is refused with one
warning and the library built in a private temporary directory instead.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from kvferry_kernels import artifact_cache
from kvferry_kernels.paged_attention_ref import check_mass

log = logging.getLogger("kvferry.kernels")

# "torch": attend with torch ops (the paths before this kernel, kept for comparison); anything
# else: this kernel where it builds.
CPU_ATTENTION_ENV = "KVFERRY_CPU_ATTENTION"
SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
LIBRARY = "cpu_decode_attention.so"  # the file inside the cache entry
CFLAGS = ("-O3", "-march=native", "-shared", "-fPIC")
# Both entries end with the attention mass: a float pointer (None: NULL, no mass) and its
# row stride.
_MASS_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64]
_ARGTYPES = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6
             + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
             + _MASS_ARGTYPES)
_PAGED_ARGTYPES = ([ctypes.c_void_p] * 6 + [ctypes.c_int64] * 10
                   + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                      ctypes.c_int64] + [ctypes.c_void_p] * 3 + _MASS_ARGTYPES)


# Most rows of one sequence the kernel attends together (`run_of_rows` finds them): a
# speculative step's last token and drafts. Grouping was faster at every length measured, 16
# to 4096 tokens (bench/bench_query_runs.py, docs/performance.md), so it is always on.
MAX_RUN = 16


def _mass_args(mass: torch.Tensor | None) -> tuple[int | None, int]:
    """The kernel's last two arguments: the mass buffer's address (None: NULL) and row
    stride."""
    return (None, 0) if mass is None else (mass.data_ptr(), mass.stride(0))


class CpuAttention:
    """The loaded kernel: `__call__` has dense_decode_attention's contract, except that K
    and V may be wider than the longest length (positions past a row's length are never
    read, so they need not even be finite). Both entries take an optional `mass`
    (`paged_attention_ref.check_mass`, on the CPU): each row's probabilities summed over its
    query heads are added to mass[b, :seq_lens[b]], and the output is the same bits."""

    def __init__(self, path: Path) -> None:
        self.path = path
        library = ctypes.CDLL(str(path))
        self._fn = library.kvferry_decode_attention_f32
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = None
        self._paged = library.kvferry_paged_decode_attention_f32
        self._paged.argtypes = _PAGED_ARGTYPES
        self._paged.restype = ctypes.c_int

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 seq_lens: torch.Tensor, sm_scale: float, *,
                 mass: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, Hq, D]; k, v [B, Hkv, L, D] with unit stride over D and D over positions,
        the same strides for both; seq_lens [B], each in [1, L]. Returns [B, Hq, D]."""
        batch, num_q_heads, head_dim = q.shape
        num_kv_heads, length = k.shape[1], k.shape[2]
        if not (q.dtype == k.dtype == v.dtype == torch.float32 and k.stride() == v.stride()
                and k.stride(3) == 1 and k.stride(2) == head_dim and q.device.type == "cpu"):
            raise ValueError("cpu attention: fp32 CPU tensors, K and V strided alike, "
                             "[B, Hkv, L, D] with D and positions dense")
        lens = seq_lens.to(torch.int32).contiguous()
        shortest, longest = (int(x) for x in torch.aminmax(lens)) if batch else (1, 1)
        if shortest < 1 or longest > length:
            raise ValueError(f"cpu attention: seq_lens must lie in [1, {length}]")
        if mass is not None:
            check_mass(mass, q, lens, length)
        q = q.contiguous()
        out = torch.empty_like(q)
        group = num_q_heads // num_kv_heads
        stride = -(-longest // 16) * 16  # scores' scratch per query head
        scratch = torch.empty(num_q_heads * stride)
        offsets = torch.empty(stride, dtype=torch.int64)
        self._fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), lens.data_ptr(),
                 batch, num_kv_heads, group, head_dim, k.stride(0), k.stride(1), sm_scale,
                 scratch.data_ptr(), stride, offsets.data_ptr(), *_mass_args(mass))
        return out

    def paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
              max_run: int | None = None, *,
              mass: torch.Tensor | None = None) -> torch.Tensor:
        """`paged_decode_attention_torch`'s contract over full-precision pages, read in place:
        q [B, Hq, D]; k_cache, v_cache [num_blocks, block_size, Hkv, D] fp32, each page
        dense and both strided alike; block_tables [B, max_blocks]; seq_lens [B], each >= 1
        and within its table. The same bits as `__call__` over the same K/V laid densely.
        Consecutive rows of one sequence (`kvferry_kernels.query_runs`, at most `max_run`,
        default MAX_RUN; 1: none) are attended together, each K/V line read once for
        all of them: the same bits."""
        batch, num_q_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads = k_cache.shape[:3]
        if not (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
                and k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
                and k_cache.stride(2) == head_dim and k_cache.stride(1) == num_kv_heads * head_dim
                and q.device.type == "cpu"):
            raise ValueError("cpu paged attention: fp32 CPU pages [blocks, block_size, Hkv, D], "
                             "each page dense, K and V strided alike")
        if mass is not None:
            check_mass(mass, q, seq_lens, block_tables.shape[1] * block_size)
        lens = seq_lens.to(torch.int32).contiguous()
        tables = block_tables.to(torch.int32).contiguous()
        longest = int(lens.max()) if batch else 1
        run = max(1, min(MAX_RUN if max_run is None else max_run, batch))
        q = q.contiguous()
        out = torch.empty_like(q)
        group = num_q_heads // num_kv_heads
        stride = -(-longest // 16) * 16
        scratch = torch.empty(run * num_q_heads * stride)
        offsets = torch.empty(stride, dtype=torch.int64)
        rows = torch.empty(2, run * num_q_heads * head_dim)  # a run's queries and outputs
        qlen = torch.empty(run * num_q_heads, dtype=torch.int64)
        status = self._paged(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            lens.data_ptr(), tables.data_ptr(), tables.shape[1], num_blocks, batch,
            num_kv_heads, group, head_dim, block_size, k_cache.stride(0), k_cache.stride(1),
            k_cache.stride(2), sm_scale, scratch.data_ptr(), stride, offsets.data_ptr(), run,
            rows[0].data_ptr(), rows[1].data_ptr(), qlen.data_ptr(), *_mass_args(mass))
        if status != 0:
            raise ValueError("cpu paged attention: a sequence length outside [1, its table] "
                             "or a block table entry outside the pool")
        return out


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu() -> str:
    """What -march=native compiles for: the CPU's model and flags (a cache shared by
    machines keeps one library per kind of CPU)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _build(compiler: str, scratch: Path) -> None:
    """Compile SOURCE into the (private, empty) scratch directory of a cache entry."""
    subprocess.run([compiler, *CFLAGS, "-o", str(scratch / LIBRARY), str(SOURCE), "-lm"],
                   check=True, capture_output=True, text=True, timeout=120)


def wanted() -> bool:
    """Whether the kernel may be used: not switched off by KVFERRY_CPU_ATTENTION=torch."""
    return os.environ.get(CPU_ATTENTION_ENV) != "torch"


@functools.cache
def load(cache_dir: Path | None = None) -> CpuAttention | None:
    """The kernel, built into `cache_dir` unless a verified build is there already; None when
    it cannot be built."""
    compiler = _compiler()
    if compiler is None:
        log.warning("cpu attention: no C compiler (cc, gcc or $CC): torch attention instead")
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
        key = hashlib.sha256(SOURCE.read_bytes() + version.encode() + _cpu().encode()
                             + " ".join(CFLAGS).encode()).hexdigest()[:24]
        folder = artifact_cache.cache_root(cache_dir, log, "kvferry-kernels-")
        entry = artifact_cache.get_or_build(folder / f"cpu_decode_attention-{key}",
                                            functools.partial(_build, compiler), log)
        return CpuAttention(entry.path / LIBRARY)  # verified: only now is it mapped
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("cpu attention: build failed (%s): torch attention instead", detail)
        return None


__all__ = ["CPU_ATTENTION_ENV", "CpuAttention", "load", "wanted"]
