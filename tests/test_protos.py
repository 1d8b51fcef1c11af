"""The committed stubs must equal what protos/generate.py produces from the .proto files."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("protogen", REPO / "protos" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    fresh = _generator().generate(tmp_path)
    assert fresh, "no stubs generated"
    committed = sorted((REPO / "kvferry" / "v1").glob("*_pb2*.py*"))
    assert [p.name for p in fresh] == [p.name for p in committed]
    for new, old in zip(fresh, committed):
        assert new.read_text() == old.read_text(), (
            f"{old.name} drifted from the .proto files: run python protos/generate.py"
        )


def test_every_field_and_rpc_is_commented() -> None:
    for proto in sorted((REPO / "protos" / "kvferry" / "v1").glob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            stripped = line.strip()
            is_field = stripped.endswith(";") and "=" in stripped and not stripped.startswith(
                ("syntax", "option"))
            if is_field or stripped.startswith(("rpc ", "message ", "service ", "enum ")):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1}: {stripped}"
