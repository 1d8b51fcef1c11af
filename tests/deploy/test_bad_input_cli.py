"""Bad input to any `kvferry` command: one line on stderr naming the problem, exit status 2,
no traceback. Each command runs as a subprocess on input that fails
before any model loads, port binds or process starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from deploy import zygote

REPO = Path(__file__).resolve().parents[2]
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2, "n_head": 2,
        "n_embd": 8}


@pytest.fixture(scope="module")
def bad(tmp_path_factory: pytest.TempPathFactory, qwen3_checkpoint: Path) -> dict[str, Path]:
    """Named bad inputs: paths that are missing, empty, garbage or of an unservable model."""
    root = tmp_path_factory.mktemp("bad")
    (root / "empty").mkdir()
    (root / "garbage.gguf").write_bytes(bytes(range(256)) * 8)
    binary = root / "binary"
    binary.mkdir()
    (binary / "config.json").write_bytes(b"GGUF\x03\x00\x00\x00\xff\xfe\x00\x81" * 64)
    unknown = root / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    gpt2 = root / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps(GPT2))
    (root / "weights.bin").write_bytes(b"\x00\x01")
    (root / "token").write_text("not-sent-in-clear\n")
    broken = root / "broken-tokenizer"  # a servable checkpoint whose tokenizer is garbage
    shutil.copytree(qwen3_checkpoint, broken)
    (broken / "tokenizer.json").write_bytes(b"\xff\xfe{ not a tokenizer" * 16)
    return {"missing": root / "missing", "empty": root / "empty",
            "garbage_gguf": root / "garbage.gguf", "binary": binary, "unknown": unknown,
            "gpt2": gpt2, "weights": root / "weights.bin", "token": root / "token",
            "broken_tok": broken, "qwen3": qwen3_checkpoint,
            "root": root}


def _run(argv: list[str], home: Path, fresh: bool) -> subprocess.CompletedProcess:
    """The command in a fresh interpreter, or (not `fresh`) forked by the run's zygote
    (deploy/zygote.py: the same `deploy.cli` in a process that imported torch already)."""
    env = {**os.environ, "KVFERRY_HOME": str(home)}  # where a .gguf would be converted
    if fresh:
        env[zygote.ZYGOTE_ENV] = "off"
    return zygote.run(argv, env, REPO, 120)


def _assert_one_line(result: subprocess.CompletedProcess, *names: str) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stdout + result.stderr, result.stderr
    assert result.returncode == 2, result.stderr
    assert len(lines) == 1 and lines[0].startswith("kvferry: "), result.stderr
    assert any(name in lines[0] for name in names), lines[0]


# (command line with {placeholders} for the bad inputs, words one of which the line must name)
PLAN_CASES = [
    ("plan --model {missing}", ["does not exist"]),
    ("plan --model {empty}", ["no config.json"]),
    ("plan --model {garbage_gguf}", ["garbage.gguf"]),
    ("plan --model {binary}/config.json", ["not a valid JSON"]),
    ("plan --model {binary}", ["not a valid JSON"]),
    ("plan --model {unknown}", ["no-such-architecture"]),
    ("plan --model {weights}", ["neither a checkpoint directory"]),
    ("plan --layers 2 --kv-heads 1 --head-dim 8 --block-size 3", ["block_size"]),
    ("plan --layers 2 --kv-heads 1 --head-dim 8 --pool-size -1", ["pool_size"]),
    ("plan --layers 2 --kv-heads 1 --head-dim 8 --dtype float64", ["dtype"]),
]
SERVE_CASES = [
    ("serve --model {missing}", ["missing"]),
    # a Hugging Face id: said not to be downloaded, not "no config.json"
    ("serve --model HuggingFaceTB/SmolLM2-135M-Instruct", ["downloads nothing"]),
    ("serve --model {gpt2}", ["architecture"]),
    ("serve --model {missing} --kv-pool-size -1", ["kv_pool_size"]),
    ("serve --model {missing} --block-size 3", ["block_size"]),
    ("serve --model {missing} --port 99999", ["port"]),
    ("demo --model {binary}", ["not a valid JSON"]),
    ("demo --model {missing} --num-decode 0", ["num_decode"]),
    ("serve --model {broken_tok}", ["tokenizer"]),
    ("serve --model {missing} --kv-store-size 1GiB", ["kv_store_size"]),
    ("serve --model {missing} --kv-disk-cache-dir /tmp/x", ["kv_disk_cache_dir"]),
    ("demo --model {missing} --kv-host-cache-size 99TiB", ["kv_host_cache_size"]),
    ("serve --model {missing} --kv-host-cache-size 1MiB --kv-store-size 1GiB "
     "--kv-store-password-file {missing}", ["kv_store_password_file", "no password"]),
    # the live planner: refused before any actor starts
    ("serve --model {qwen3} --planner-sla ttft-p90=500", ["planner_sla"]),
    ("serve --model {qwen3} --planner-sla ttft-p90=500 --planner-profile {missing}",
     ["--kv-transport ray"]),
    ("serve --model {qwen3} --kv-transport ray --planner-sla ttft-p90=500 "
     "--planner-profile {missing}", ["missing"]),
    ("serve --model {qwen3} --kv-transport ray --planner-sla ttft-p90=500 "
     "--planner-profile {missing} --planner-patience 0", ["planner_patience"]),
]
PROCESS_CASES = [
    ("prefill-worker --model {missing}", ["missing"]),
    ("decode-worker --model {empty}", ["no config.json"]),
    ("colocated-worker --model {gpt2}", ["architecture"]),
    ("prefill-worker --model {unknown}", ["no-such-architecture"]),
    ("--log-level WARNING decode-worker --model {garbage_gguf}", ["garbage.gguf"]),
    ("decode-worker --model {missing} --kv-pool-size -1", ["kv_pool_size"]),
    ("prefill-worker --model {missing} --kv-host-cache-size 1GiB --kv-store-url http://x",
     ["kv_store_url"]),
    ("decode-worker --model {missing} --kv-host-cache-size 1MiB --kv-store-url redis://h:1 "
     "--kv-store-password-file {missing}", ["kv_store_password_file", "cannot read"]),
    ("prefill-worker --model {missing} --block-size 3", ["block_size"]),
    ("prefill-worker --model {missing} --speculative-draft-kv ship", ["speculative_draft_kv"]),
    ("decode-worker --model {missing} --kv-eviction streaming --kv-window-tokens 0",
     ["kv_window_tokens"]),
    ("colocated-worker --model {missing} --kv-eviction streaming --speculative-method draft "
     "--speculative-model {missing}", ["kv_eviction"]),
    ("serve --model {missing} --kv-eviction h2o --speculative-method ngram", ["kv_eviction"]),
    ("decode-worker --model {missing} --kv-eviction h2o --kv-recent-tokens 0",
     ["kv_recent_tokens"]),
    ("demo --model {missing} --kv-eviction h2o --kv-heavy-tokens -16", ["kv_heavy_tokens"]),
    ("decode-worker --model {qwen3} --speculative-method draft --speculative-model {unknown}",
     ["speculative_model"]),
    ("prefill-worker --model {qwen3} --speculative-method draft --speculative-model {gpt2} "
     "--speculative-draft-kv ship", ["speculative_model"]),
    ("decode-worker --model {missing} --speculative-method draft --speculative-model {empty} "
     "--speculative-draft-kv ship --kv-transport nixl", ["speculative_draft_kv"]),
    ("colocated-worker --model {missing} --port 99999", ["port"]),
    ("router --model {missing} --prefill 127.0.0.1:1 --decode 127.0.0.1:2", ["missing"]),
    ("router --model {gpt2} --prefill 127.0.0.1:1 --decode 127.0.0.1:2", ["architecture"]),
    ("router --model {missing}", ["prefill/decode"]),
    ("router --model {broken_tok} --prefill 127.0.0.1:1 --decode 127.0.0.1:2", ["tokenizer"]),
    # No --model: the flags are refused before the default model is converted (which would
    # take a minute and print more than one line into the fresh KVFERRY_HOME)
    ("decode-worker --block-size 3", ["block_size"]),
    ("router --prefill 127.0.0.1:1", ["prefill/decode"]),
]
# A cluster token without TLS would cross the network in clear: refused before the
# model is even looked at, naming the flags to add.
TOKEN_CASES = [
    ("prefill-worker --model {missing} --cluster-token-file {token}", ["--tls-cert"]),
    ("router --model {missing} --prefill 127.0.0.1:1 --decode 127.0.0.1:2 "
     "--cluster-token-file {token}", ["--tls-cert"]),
    ("serve --model {missing} --cluster-token-file {token}", ["--tls-cert"]),
]
OTHER_CASES = [
    ("generate hello --tls-cert {missing} --tls-key {missing}", ["no such file"]),
    ("generate hello --address http://127.0.0.1:8000", ["not a URL"]),
    ("make-model --out {weights}/model", ["weights.bin"]),
    ("make-certs --out {weights}/certs", ["weights.bin", "cryptography"]),
    ("bench --dataset-name jsonl --dataset-path {missing}", ["missing"]),
    ("bench --model {gpt2}", ["architecture"]),
    ("bench --dataset-name jsonl --dataset-path {weights} --tokenizer {broken_tok}",
     ["tokenizer"]),
]


# Cases marked slow run in the full tier only, forked by the run's zygote; the fast tier keeps
# one of each kind, each in a fresh interpreter (which imports torch and transformers: seconds
# apiece).
QUICK = {"plan --model {garbage_gguf}", "serve --model {missing} --port 99999",
         "prefill-worker --model {missing}", "router --model {gpt2} --prefill 127.0.0.1:1 "
         "--decode 127.0.0.1:2", "serve --model {missing} --cluster-token-file {token}"}
CASES = [pytest.param(command, names, marks=() if command in QUICK else pytest.mark.slow)
         for command, names in
         PLAN_CASES + SERVE_CASES + PROCESS_CASES + TOKEN_CASES + OTHER_CASES]


@pytest.mark.parametrize("command,names", CASES)
def test_bad_input_is_one_line_and_status_2(command: str, names: list[str],
                                            bad: dict[str, Path]) -> None:
    argv = [part.format(**{k: str(v) for k, v in bad.items()}) for part in command.split()]
    _assert_one_line(_run(argv, bad["root"] / "home", fresh=command in QUICK), *names)
