"""The one-launch split merge of the Triton paged decode attention: the last split program of
each (sequence, K/V head) merges all splits, counted on the workspace's int32 counters.

It must equal the reference and the two-launch path (stage 2) on ragged batches, including
sequences shorter than one split and sequences whose later splits are empty; leave every
counter at zero, so a workspace (and a CUDA graph holding it) can be reused; and refuse a
workspace without counters of the right shape. Outputs and partials start as NaN.
"""

from __future__ import annotations

import pytest
import torch

from kvferry_kernels import triton_paged_attention as tpa
from kvferry_kernels.triton_paged_attention import (
    alloc_decode_workspace,
    paged_decode_attention_triton,
)
from tests.kvferry_kernels.test_quant_paged_attention import (
    dequantized_reference,
    make_quant_case,
)
from tests.kvferry_kernels.test_quant_paged_attention import (
    run_triton as run_triton_quant,
)
from tests.kvferry_kernels.test_triton_paged_attention import (
    make_case,
    poisoned_workspace,
    reference,
    run_triton,
)

NAN = float("nan")

# (seq_lens, Hq, Hkv, head_dim, block_size, num_splits). The interpreter's tile is 64 tokens:
# a sequence of at most 64 lies in split 0 and leaves the later splits empty.
CASES = {
    "b4-g4-short-and-empty": ([1, 15, 130, 0], 8, 2, 64, 16, 3),
    "b2-mha-d128": ([200, 64], 4, 4, 128, 16, 4),
    "b3-g8-p64-five-splits": ([65, 300, 3], 16, 2, 128, 64, 5),
    "b1-mqa32-later-splits-empty": ([257], 32, 1, 64, 32, 8),
    "b5-g2-d80-two-splits": ([1, 2, 64, 65, 129], 4, 2, 80, 16, 2),
}

pytestmark = pytest.mark.triton


@pytest.mark.parametrize("params", CASES.values(), ids=CASES.keys())
def test_one_launch_matches_reference_and_two_launches(
    params: tuple, device: torch.device
) -> None:
    lens, hq, hkv, d, p, splits = params
    case = make_case(lens, hq, hkv, d, p, device, seed=sum(lens) + hq)
    one = run_triton(case, splits, one_launch=True)
    assert not one.isnan().any()
    torch.testing.assert_close(one, reference(case), atol=1e-5, rtol=1e-5)
    two = run_triton(case, splits, one_launch=False)
    torch.testing.assert_close(one, two, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_one_launch_on_quantized_pages(kv_dtype: str, device: torch.device) -> None:
    case = make_quant_case([1, 17, 130, 0], 8, 2, 64, 16, kv_dtype, device, seed=41)
    one = run_triton_quant(case, 3, one_launch=True)
    assert not one.isnan().any()
    torch.testing.assert_close(one, dequantized_reference(case), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(one, run_triton_quant(case, 3, one_launch=False), atol=1e-6,
                               rtol=1e-6)


@pytest.mark.parametrize("one_launch", [True, False])
def test_merge_of_more_splits_than_one_load_holds(
    one_launch: bool, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Tiles of 2 splits (x 4 heads x 64 D; stage 2: x 1 head): 5 splits take three loads.
    monkeypatch.setattr(tpa, "_MERGE_TILE_ELEMS", 4 * 2 * 64)
    monkeypatch.setattr(tpa, "_STAGE2_TILE_ELEMS", 2 * 64)
    case = make_case([300, 70, 0], 8, 2, 64, 16, device, seed=59)
    out = run_triton(case, 5, one_launch=one_launch)
    torch.testing.assert_close(out, reference(case), atol=1e-5, rtol=1e-5)


def test_counters_return_to_zero_and_the_workspace_is_reusable(device: torch.device) -> None:
    case = make_case([130, 45, 7], 8, 2, 64, 16, device, seed=43)
    ws = poisoned_workspace(3, 8, 2, 64, 4, device)
    first = paged_decode_attention_triton(*case, workspace=ws)  # 4 splits, from the workspace
    assert torch.equal(ws.counters, torch.zeros(3, 2, dtype=torch.int32, device=device))
    shorter = case._replace(seq_lens=torch.tensor([64, 0, 5], dtype=torch.int32, device=device))
    torch.testing.assert_close(
        paged_decode_attention_triton(*shorter, workspace=ws), reference(shorter), atol=1e-5,
        rtol=1e-5,
    )
    again = paged_decode_attention_triton(*case, workspace=ws)
    assert torch.equal(again, first)
    assert not ws.counters.any()
    torch.testing.assert_close(first, reference(case), atol=1e-5, rtol=1e-5)


class _Stage2Launch:
    """Stands in for the stage-2 kernel: records that it was launched."""

    def __init__(self, kernel: object) -> None:
        self.kernel = kernel
        self.num_launches = 0

    def __getitem__(self, grid: tuple[int, ...]) -> object:
        self.num_launches += 1
        return self.kernel[grid]  # type: ignore[index]


def test_one_launch_is_the_default_with_several_splits(
    device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    stage2 = _Stage2Launch(tpa._decode_stage2_kernel)
    monkeypatch.setattr(tpa, "_decode_stage2_kernel", stage2)
    case = make_case([130, 20], 8, 2, 64, 16, device, seed=47)
    for one_launch in (None, True):
        run_triton(case, 3, one_launch=one_launch)
    run_triton(case, 1, one_launch=False)  # one split: the output is written directly
    assert stage2.num_launches == 0
    torch.testing.assert_close(run_triton(case, 3, one_launch=False), reference(case),
                               atol=1e-5, rtol=1e-5)
    assert stage2.num_launches == 1


@pytest.mark.parametrize(
    "counters",
    [
        None,
        torch.zeros(2, 8, dtype=torch.int32),  # [B, Hq], not [B, Hkv]
        torch.zeros(2, dtype=torch.int32),
        torch.zeros(2, 2, dtype=torch.int64),
    ],
    ids=["none", "per-query-head", "per-sequence", "int64"],
)
def test_rejects_a_workspace_without_the_right_counters(
    counters: torch.Tensor | None, device: torch.device
) -> None:
    case = make_case([40, 9], 8, 2, 64, 16, device, seed=53)
    ws = alloc_decode_workspace(2, 8, 2, 64, 3, device)
    bad = ws._replace(counters=counters if counters is None else counters.to(device))
    with pytest.raises(ValueError, match=r"workspace\.counters must be int32 \[B, Hkv\]"):
        paged_decode_attention_triton(*case, workspace=bad)
    with pytest.raises(ValueError, match="counters"):
        paged_decode_attention_triton(*case, workspace=bad, one_launch=False)


def test_programs_per_sm_table_and_split_formula() -> None:
    # Measured on an H200: two per SM for 8 K/V heads, eight for 32.
    assert (tpa.programs_per_sm(8), tpa.programs_per_sm(32)) == (2, 8)
    for num_kv_heads in (1, 3, 12, 40):  # the nearest key at or below
        below = max(k for k in tpa._PROGRAMS_PER_SM if k <= num_kv_heads)
        assert tpa.programs_per_sm(num_kv_heads) == tpa._PROGRAMS_PER_SM[below]
    # 132 SMs (an H200), block_n 64, 32k tokens: 512 tiles, at most 128 splits by length.
    assert tpa.splits_for_occupancy(1, 8, 32768, 64, 132, 2) == 33
    assert tpa.splits_for_occupancy(1, 32, 32768, 64, 132, 8) == 33
    assert tpa.splits_for_occupancy(1, 1, 32768, 64, 132, 8) == 64  # capped at _MAX_SPLITS
    assert tpa.splits_for_occupancy(1, 8, 1024, 64, 132, 2) == 4  # 16 tiles, 4 per split
    assert tpa.splits_for_occupancy(17, 8, 32768, 64, 132, 2) == 1  # the SMs are full
