"""Print the project's dependencies for the CPU (router) image, one requirement a line.

torch is installed beforehand from the CPU wheel index; Triton, Ray and grpcio-tools are left
out (GPU kernels, the Ray transport, stub generation). tests/k8s/test_images.py checks that the
router and the CPU worker path import without them.
"""

from __future__ import annotations

import re
import sys
import tomllib

EXCLUDED = ("torch", "triton", "ray", "grpcio-tools")


def requirement_name(requirement: str) -> str:
    """'grpcio==1.85.1' -> 'grpcio' (normalised: lower case, '_' and '.' as '-')."""
    name = re.match(r"[A-Za-z0-9._-]+", requirement.strip())
    if name is None:
        raise ValueError(f"dependencies: cannot read a name in {requirement!r}")
    return re.sub(r"[._]+", "-", name.group(0)).lower()


def cpu_requirements(pyproject_path: str) -> list[str]:
    with open(pyproject_path, "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    return [dep for dep in dependencies if requirement_name(dep) not in EXCLUDED]


if __name__ == "__main__":
    print("\n".join(cpu_requirements(sys.argv[1] if len(sys.argv) > 1 else "pyproject.toml")))
