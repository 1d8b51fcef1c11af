"""Every kustomize tree rendered once per session."""

from __future__ import annotations

import pytest
from k8s_manifests import TREES, render


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    return {tree: render(tree) for tree in TREES}
