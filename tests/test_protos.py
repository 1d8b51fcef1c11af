"""The committed stubs must equal what protos/generate.py produces from the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    # In a process of its own: grpc_tools' compiler crashes (SIGSEGV) on import in a process
    # that has loaded NIXL's libraries, as the NIXL tests' process has.
    out = subprocess.run([sys.executable, str(REPO / "protos" / "generate.py"), str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    fresh = sorted((tmp_path / "kvferry" / "v1").glob("*_pb2*.py*"))
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
