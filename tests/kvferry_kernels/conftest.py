"""Kernel tests run the Triton kernels in the interpreter unless told otherwise.

TRITON_INTERPRET must be set before anything imports triton (triton decides at decoration
time whether a kernel is interpreted), so it is set here, at conftest import, ahead of the
test modules. On a GPU machine run with TRITON_INTERPRET=0 to compile the kernels natively.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

INTERPRET = os.environ["TRITON_INTERPRET"] == "1"


@pytest.fixture(scope="session")
def device() -> torch.device:
    """CUDA when the kernels are compiled natively, else CPU for the interpreter."""
    if not INTERPRET and torch.cuda.is_available():
        return torch.device("cuda")
    if not INTERPRET:
        pytest.skip("TRITON_INTERPRET=0 but no CUDA device")
    return torch.device("cpu")
