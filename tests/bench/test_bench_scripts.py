"""Every bench script still imports against today's code: a name moved elsewhere in the
package breaks a script nobody runs in the suite (bench_simulator.py once imported a constant
from a module it had left). One subprocess imports them all, each as its own module, with
`--help` as its command line (the scripts that read their flags on import print them and
exit 0)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

IMPORT_ALL = """
import importlib.util, pathlib, sys
failed = []
for path in sorted(pathlib.Path("bench").glob("*.py")):
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    sys.argv = [str(path), "--help"]
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:
        if exc.code not in (0, None):
            failed.append(f"{path}: exit {exc.code}")
    except Exception as exc:
        failed.append(f"{path}: {type(exc).__name__}: {exc}")
print("FAILED " + " | ".join(failed) if failed else "OK")
"""


def test_every_bench_script_imports() -> None:
    scripts = sorted((ROOT / "bench").glob("*.py"))
    assert len(scripts) > 30
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "OK", out.stdout[-3000:]
