"""The local Ray instance `kvferry serve --kv-transport ray` starts (deploy/ray_launcher.py)
authenticates every connection: a process without its token cannot join it, one with the
token can."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow]

START = """
import sys
from deploy.ray_launcher import start_local_ray
context = start_local_ray(include_dashboard=False, log_to_driver=False, num_cpus=1)
print(context.address_info["gcs_address"], flush=True)
sys.stdin.read()  # until the test closes it
"""

JOIN = """
import sys
import ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
    print("joined", ray.get(ray.remote(lambda: 41 + 1).remote()))
except Exception as exc:
    print("refused", type(exc).__name__)
"""


def _join(address: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, "-c", JOIN, address], capture_output=True, text=True,
                         timeout=180, env=env)
    return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else out.stderr[-2000:]


def test_a_process_without_the_token_cannot_join_the_local_ray(tmp_path: Path) -> None:
    ray_tmp = tempfile.mkdtemp(prefix="kvr", dir="/tmp")  # unix socket paths must stay short
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(HOME=str(tmp_path), RAY_TMPDIR=ray_tmp, RAY_ADDRESS="")  # Ray's token goes here
    server = subprocess.Popen([sys.executable, "-c", START], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env,
                              cwd=Path(__file__).parents[2])
    try:
        address = server.stdout.readline().strip()  # type: ignore[union-attr]
        assert ":" in address, "the local Ray instance did not start"
        assert (tmp_path / ".ray" / "auth_token").exists()  # Ray made a token
        assert _join(address, {**env, "RAY_AUTH_MODE": "disabled"}) == "refused ConnectionError"
        assert _join(address, {**env, "RAY_AUTH_MODE": "token",
                               "RAY_AUTH_TOKEN": "not-the-token-0123456789abcdef"}) == \
            "refused ConnectionError"
        assert _join(address, {**env, "RAY_AUTH_MODE": "token"}) == "joined 42"
    finally:
        server.stdin.close()  # type: ignore[union-attr]
        server.wait(60)
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"],
                       capture_output=True, env=env, timeout=60)
