"""Process settings refuse bad values with a ValueError that names the field."""

from __future__ import annotations

import pytest

from kvferry.settings import WorkerSettings

BAD_WORKER_FIELDS = {
    "role": {"role": "both"},
    "decode_stage_mib": {"decode_stage_mib": -1},
    "kv_max_resends": {"kv_max_resends": -1},
    "max_waiting": {"max_waiting": 0},
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
