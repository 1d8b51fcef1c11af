"""Process settings refuse bad values with a ValueError that names the field."""

from __future__ import annotations

import pytest
import torch

from kvferry.model.prefill_batch import token_budget_for
from kvferry.settings import (
    CPU_PREFILL_TOKEN_BUDGET,
    DEFAULT_PREFILL_TOKEN_BUDGET,
    WorkerSettings,
)

BAD_WORKER_FIELDS = {
    "role": {"role": "both"},
    "decode_stage_mib": {"decode_stage_mib": -1},
    "kv_max_resends": {"kv_max_resends": -1},
    "max_waiting": {"max_waiting": 0},
    "prefill_token_budget": {"prefill_token_budget": 0},
    "block_size": {"block_size": 24},
    "kv_transport": {"kv_transport": "rdma"},
    "attention_backend": {"attention_backend": "flash"},
    "cuda_graphs": {"cuda_graphs": "auto"},
}


@pytest.mark.parametrize("field", list(BAD_WORKER_FIELDS))
def test_bad_worker_setting_names_its_field(field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        WorkerSettings(**{"role": "decode", "model": "m", **BAD_WORKER_FIELDS[field]})


def test_good_worker_settings_are_accepted() -> None:
    settings = WorkerSettings(role="decode", model="m", decode_stage_mib=0)
    assert settings.decode_stage_mib == 0


def test_the_prefill_token_budget_defaults_by_device_and_a_given_one_wins() -> None:
    """None (the flag left out): 512 prompt tokens per forward on CPU, 2048 on CUDA."""
    assert WorkerSettings(role="prefill", model="m").prefill_token_budget is None
    assert token_budget_for(torch.device("cpu")) == CPU_PREFILL_TOKEN_BUDGET == 512
    assert token_budget_for(torch.device("cuda")) == DEFAULT_PREFILL_TOKEN_BUDGET == 2048
    assert token_budget_for(torch.device("cpu"), 2048) == 2048
    assert token_budget_for(torch.device("cuda"), 64) == 64
