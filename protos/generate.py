"""Regenerate the committed gRPC/protobuf stubs: `python protos/generate.py [OUT_DIR]`.

Stubs land in OUT_DIR/kvferry/v1/ (default: the repository root, i.e. the `kvferry.v1`
package). tests/test_protos.py regenerates into a temporary directory and fails on drift.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
REPO_ROOT = PROTO_ROOT.parent


def generate(out_dir: Path) -> list[Path]:
    protos = sorted(PROTO_ROOT.glob("kvferry/v1/*.proto"))
    include = Path(protoc.__file__).resolve().parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    return sorted((out_dir / "kvferry" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT
    for path in generate(target):
        print(path)
