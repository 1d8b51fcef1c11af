"""Attention mass (H2O's heavy hitters) from every paged decode attention: the reference, the
batched torch path, the C kernel and Triton each add, for every position below a row's
length, its softmax probability summed over the row's query heads into a [B, M] buffer.

The reference is checked against a dense softmax computed here (float64, K gathered position
by position); every other implementation against the reference. Each check calls twice into
a buffer holding prior mass below each length and NaN / -0.0 past it: the first call adds the
expected mass to the prior, the second adds it again, and nothing past a length changes by a
bit. The output must be the same bits as a call without mass. Tables are shuffled
(non-contiguous block ids), stale slots and the padding block hold NaN, lengths are ragged
(0, not a multiple of the block size, one long row), GQA and MHA, and some cases hold runs of
rows (one sequence's query positions: one table, lengths one apart, `query_runs`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_quant_paged_attention import KV_DTYPES, make_quant_case

from kvferry_kernels import cpu_attention
from kvferry_kernels.dispatch import get_attention_backend
from kvferry_kernels.kv_quant import QuantPages, dequantize_pages
from kvferry_kernels.paged_attention_ref import paged_decode_attention_ref
from kvferry_kernels.paged_attention_torch import paged_decode_attention_torch
from kvferry_kernels.triton_paged_attention import paged_decode_attention_triton, query_run_rows

NAN = float("nan")
CPU = torch.device("cpu")
Attend = Callable[..., torch.Tensor]  # attend(*case, mass=None) -> out [B, Hq, D]


class Case(NamedTuple):
    q: torch.Tensor  # [B, Hq, D]
    k_cache: torch.Tensor | QuantPages  # [num_blocks, P, Hkv, D]
    v_cache: torch.Tensor | QuantPages  # [num_blocks, P, Hkv, D]
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    sm_scale: float


def make_case(seqs: list[tuple[int, int]], num_q_heads: int, num_kv_heads: int,
              head_dim: int, block_size: int, seed: int,
              device: torch.device = CPU) -> Case:
    """Sequences as (longest length, rows): a sequence's rows share its table, lengths one
    apart up to its longest. Blocks are drawn shuffled from a pool twice the size needed;
    slots past a sequence's longest length and the padding block (every unused table entry)
    hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / block_size) for n, _ in seqs]
    num_blocks = 2 * sum(needed) + 1
    poison = num_blocks - 1
    ids = torch.randperm(poison, generator=gen).tolist()
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    width = max(needed) + 1
    tables, lens = [], []
    for (longest, rows), used in zip(seqs, needed, strict=True):
        table, ids = ids[:used], ids[used:]
        for j, block in enumerate(table):
            for cache in (k_cache, v_cache):
                cache[block, max(0, longest - j * block_size):] = NAN
        for j in range(rows):
            tables.append(table + [poison] * (width - used))
            lens.append(longest - rows + 1 + j)
    k_cache[poison] = NAN
    v_cache[poison] = NAN
    q = torch.randn(len(lens), num_q_heads, head_dim, generator=gen)
    return Case(q.to(device), k_cache.to(device), v_cache.to(device),
                torch.tensor(tables, dtype=torch.int32, device=device),
                torch.tensor(lens, dtype=torch.int32, device=device), head_dim**-0.5)


def dense_mass(case: Case) -> torch.Tensor:  # [B, max_blocks * P] float32
    """The mass from first principles: each row's K gathered position by position, every
    query head against its K/V head (repeat_interleave), softmax in float64, summed."""
    q, k_cache, _, table, lens, sm_scale = case
    if isinstance(k_cache, QuantPages):
        k_cache = dequantize_pages(k_cache)
    block_size = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    mass = torch.zeros(q.shape[0], table.shape[1] * block_size, dtype=torch.float64)
    for b, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n)
        k = k_cache.cpu()[table[b].cpu().long()[pos // block_size], pos % block_size]
        k = k.double().repeat_interleave(group, dim=1)  # [n, Hq, D]
        scores = torch.einsum("hd,nhd->hn", q[b].cpu().double(), k) * sm_scale
        mass[b, :n] = torch.softmax(scores, dim=-1).sum(dim=0)
    return mass.float().to(q.device)


def ref_mass(case: Case) -> torch.Tensor:  # [B, max_blocks * P] float32
    mass = torch.zeros(case.q.shape[0], _width(case), device=case.q.device)
    paged_decode_attention_ref(*case, mass=mass)
    return mass


def _width(case: Case) -> int:
    return case.block_table.shape[1] * case.k_cache.shape[1]


def _primed(case: Case, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A mass buffer holding prior mass in [0, 1) below each length and NaN / -0.0 past it,
    and the mask of the positions below each length."""
    batch, width = case.q.shape[0], _width(case)
    valid = torch.arange(width) < case.seq_lens.cpu()[:, None]  # [B, M]
    past = torch.full((batch, width), NAN)
    past[:, 1::2] = -0.0
    prior = torch.rand(batch, width, generator=torch.Generator().manual_seed(seed))
    return torch.where(valid, prior, past).to(case.q.device), valid.to(case.q.device)


def check_adds_mass(attend: Attend, case: Case, want: torch.Tensor, *, atol: float = 1e-5,
                    rtol: float = 1e-5, seed: int = 0) -> None:
    """Two calls of `attend` into a primed buffer add `want` twice below each length, leave
    every bit past it, and give the output of a call without mass, bit for bit."""
    mass, valid = _primed(case, seed)
    before = mass.clone()
    out = attend(*case, mass=mass)
    torch.testing.assert_close(mass[valid], before[valid] + want[valid], atol=atol, rtol=rtol)
    num_q_heads = case.q.shape[1]
    added = torch.where(valid, mass - before, 0.0).sum(dim=1)
    expected = (case.seq_lens > 0).float() * num_q_heads  # each head's probabilities sum to 1
    torch.testing.assert_close(added, expected, atol=1e-4, rtol=1e-5)
    attend(*case, mass=mass)
    torch.testing.assert_close(mass[valid], before[valid] + 2 * want[valid], atol=2 * atol,
                               rtol=rtol)
    assert torch.equal(mass.view(torch.int32)[~valid], before.view(torch.int32)[~valid])
    assert torch.equal(out, attend(*case))


def _has_compiler() -> bool:
    return cpu_attention._compiler() is not None


@functools.cache
def _built_kernel() -> cpu_attention.CpuAttention | None:
    return cpu_attention.load(None)


def _cpu_kernel() -> cpu_attention.CpuAttention:
    """The C kernel; the test is skipped where there is no compiler (the torch path serves
    there), and fails where one is but the kernel does not build."""
    if not _has_compiler():
        pytest.skip("no C compiler (cc, gcc or $CC): the C kernel cannot be built")
    loaded = _built_kernel()
    assert loaded is not None, "a C compiler is there: the kernel must build"
    return loaded


def _cpu(*case: object, mass: torch.Tensor | None = None) -> torch.Tensor:
    return _cpu_kernel().paged(*case, mass=mass)


def _nonempty(case: Case) -> Case:
    """The rows of length >= 1 (the C kernel's contract)."""
    rows = (case.seq_lens > 0).nonzero().flatten()
    return Case(case.q[rows], case.k_cache, case.v_cache, case.block_table[rows],
                case.seq_lens[rows], case.sm_scale)


# (sequences as (longest, rows), Hq, Hkv, D, block size). D = 48 takes the C kernel's plain
# loop, 32 and 64 its register paths.
CASES = {
    "gqa3-ragged": ([(0, 1), (9, 1), (16, 1), (37, 1), (5, 1)], 6, 2, 32, 8),
    "gqa4-runs": ([(12, 3), (5, 1), (21, 2), (2, 1)], 8, 2, 48, 4),
    "mha-runs": ([(7, 1), (30, 4), (1, 1)], 3, 3, 64, 16),
}
IMPLEMENTATIONS = {"torch": paged_decode_attention_torch, "cpu": _cpu}


@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
def test_reference_mass_is_the_dense_softmax_summed_over_heads(params: tuple) -> None:
    seqs, *shape = params
    case = make_case(seqs, *shape, seed=1)
    check_adds_mass(paged_decode_attention_ref, case, dense_mass(case))


@pytest.mark.parametrize("name", IMPLEMENTATIONS)
@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
def test_each_implementation_adds_the_reference_mass(name: str, params: tuple) -> None:
    seqs, *shape = params
    case = make_case(seqs, *shape, seed=2)
    if name == "cpu":
        case = _nonempty(case)
    check_adds_mass(IMPLEMENTATIONS[name], case, ref_mass(case))


def test_c_kernel_s_runs_give_each_row_the_mass_it_gets_alone() -> None:
    """Rows of one sequence attended together (`max_run` 16) and alone (1): the same bits,
    mass and output; and the dense entry over the same K/V laid densely: the same bits."""
    kernel = _cpu_kernel()
    case = _nonempty(make_case(CASES["gqa4-runs"][0], 8, 2, 32, 4, seed=3))
    masses = [torch.zeros(case.q.shape[0], _width(case)) for _ in range(3)]
    together = kernel.paged(*case, mass=masses[0])
    alone = kernel.paged(*case, max_run=1, mass=masses[1])
    assert torch.equal(together, alone) and torch.equal(masses[0], masses[1])
    q, k_cache, v_cache, table, lens, sm_scale = case
    dense = torch.zeros(2, q.shape[0], k_cache.shape[2], _width(case), q.shape[2])
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        blocks, slots = table[b].long()[pos // k_cache.shape[1]], pos % k_cache.shape[1]
        dense[0, b, :, :n] = k_cache[blocks, slots].transpose(0, 1)
        dense[1, b, :, :n] = v_cache[blocks, slots].transpose(0, 1)
    assert torch.equal(kernel(q, dense[0], dense[1], lens, sm_scale, mass=masses[2]), together)
    assert torch.equal(masses[2], masses[0])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_torch_path_over_quantized_pages(kv_dtype: str) -> None:
    case = Case(*make_quant_case([13, 0, 16, 29], 8, 2, 32, 8, kv_dtype, CPU,
                                 seed=4))
    want = ref_mass(case)
    torch.testing.assert_close(want, dense_mass(case), atol=1e-5, rtol=1e-5)
    check_adds_mass(paged_decode_attention_torch, case, want)


@pytest.mark.triton
@pytest.mark.parametrize(("num_splits", "one_launch"), [(1, None), (2, True), (3, False)])
@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
def test_triton_adds_the_reference_mass(params: tuple, num_splits: int,
                                        one_launch: bool | None, device: torch.device) -> None:
    """One split (its own max and sum stored for the mass), split partials merged in the
    split kernel or by stage 2; runs of rows attended together where the case has them."""
    seqs, *shape = params
    case = make_case(seqs, *shape, seed=5, device=device)
    runs = None
    if any(rows > 1 for _, rows in seqs):
        runs = query_run_rows(case.block_table, case.seq_lens, shape[0], shape[1])

    def attend(*args: object, mass: torch.Tensor | None = None) -> torch.Tensor:
        return paged_decode_attention_triton(*args, num_splits=num_splits,
                                             one_launch=one_launch, run_rows=runs, mass=mass)

    check_adds_mass(attend, case, ref_mass(case))


@pytest.mark.triton
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_triton_over_quantized_pages(kv_dtype: str, device: torch.device) -> None:
    case = Case(*make_quant_case([13, 0, 16, 29], 8, 2, 32, 8, kv_dtype, device, seed=6))

    def attend(*args: object, mass: torch.Tensor | None = None) -> torch.Tensor:
        return paged_decode_attention_triton(*args, num_splits=2, mass=mass)

    check_adds_mass(attend, case, ref_mass(case))


@pytest.mark.triton
def test_triton_half_precision_queries(device: torch.device) -> None:
    """fp16 q and pages: scores from fp16 inputs, so the mass is close, not equal."""
    case = make_case(CASES["gqa3-ragged"][0], 6, 2, 32, 8, seed=7, device=device)
    half = Case(case.q.half(), case.k_cache.half(), case.v_cache.half(), *case[3:])

    def attend(*args: object, mass: torch.Tensor | None = None) -> torch.Tensor:
        return paged_decode_attention_triton(*args, num_splits=2, mass=mass)

    check_adds_mass(attend, half, ref_mass(half), atol=2e-3, rtol=2e-3)


def test_dispatch_forwards_mass(tmp_path: Path) -> None:
    """The "torch" backend with its C kernel (fp32 CPU pages) and, for quantized pages, its
    torch path: both add the reference's mass."""
    _cpu_kernel()  # skips without a compiler
    backend = get_attention_backend("torch", cpu_kernel_dir=tmp_path)
    assert backend.cpu_kernel is not None
    case = _nonempty(make_case(CASES["gqa4-runs"][0], 8, 2, 32, 4, seed=8))
    check_adds_mass(backend.decode_attention, case, ref_mass(case))
    quant = Case(*make_quant_case([5, 17], 4, 2, 32, 8, "int8", CPU, seed=8))
    check_adds_mass(backend.decode_attention, quant, ref_mass(quant))


@pytest.mark.triton
def test_triton_backend_forwards_mass(device: torch.device) -> None:
    case = make_case([(4, 1), (11, 1)], 4, 1, 32, 8, seed=9, device=device)
    check_adds_mass(get_attention_backend("triton").decode_attention, case, ref_mass(case))


MASS_ERRORS = {
    "float64": (lambda m: m.double(), "float32"),
    "rows": (lambda m: m[:1], "float32"),
    "strided": (lambda m: m.t().contiguous().t(), "contiguous"),
    "short": (lambda m: m[:, :16].contiguous(), "fewer than the longest"),
}


@pytest.mark.parametrize("name", ["ref", *IMPLEMENTATIONS])
@pytest.mark.parametrize("error", MASS_ERRORS.values(), ids=MASS_ERRORS.keys())
def test_a_buffer_that_does_not_fit_is_refused(name: str, error: tuple) -> None:
    change, match = error
    case = make_case([(17, 1), (9, 1)], 4, 2, 32, 8, seed=10)
    attend = {"ref": paged_decode_attention_ref, **IMPLEMENTATIONS}[name]
    with pytest.raises(ValueError, match=match):
        attend(*case, mass=change(torch.zeros(2, _width(case))))
    fitted = torch.zeros(2, 17)  # exactly the longest length: enough
    attend(*case, mass=fitted)
    torch.testing.assert_close(fitted, ref_mass(case)[:, :17])


def test_c_kernel_leaves_the_mass_alone_when_it_refuses_a_table() -> None:
    """The second row's table names a block outside the pool: an error, and the first
    row's mass is not added either."""
    case = make_case([(5, 1), (9, 1)], 4, 2, 32, 8, seed=11)
    table = case.block_table.clone()
    table[1, 1] = case.k_cache.shape[0]
    mass = torch.zeros(2, _width(case))
    with pytest.raises(ValueError, match="outside the pool"):
        _cpu_kernel().paged(*case._replace(block_table=table), mass=mass)
    assert not mass.any()


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(seqs=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 3)), min_size=1,
                     max_size=4),
       group=st.sampled_from([1, 2, 3, 4]), num_kv_heads=st.integers(1, 2),
       block_size=st.sampled_from([1, 3, 4, 16]), head_dim=st.sampled_from([8, 32]))
def test_any_batch_mass_matches_the_dense_softmax(seqs: list[tuple[int, int]], group: int,
                                                  num_kv_heads: int, block_size: int,
                                                  head_dim: int) -> None:
    seqs = [(max(longest, rows), rows) for longest, rows in seqs]
    case = make_case(seqs, group * num_kv_heads, num_kv_heads, head_dim, block_size, seed=12)
    want = dense_mass(case)
    torch.testing.assert_close(ref_mass(case), want, atol=1e-5, rtol=1e-5)
    for name, attend in IMPLEMENTATIONS.items():
        if name == "cpu" and not _has_compiler():
            continue
        mass = torch.zeros_like(want)
        attend(*case, mass=mass)
        torch.testing.assert_close(mass, want, atol=1e-5, rtol=1e-5)
