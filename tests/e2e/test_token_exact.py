"""The correctness oracle: greedy output through router + prefill + decode processes is
token-identical to transformers generate (fp32), for Llama and Qwen3 checkpoints."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deploy import client
from deploy.launcher import Deployment
from kvferry.v1 import generation_pb2
from tests.conftest import NIXL, assert_alive, assert_pools_clean, worker_stats
from tests.deployments import reconfigured

# The fast tier keeps the main deployment's case; the rest run in the full tier (--full).
SLOW = pytest.mark.slow

PROMPT_LENGTHS = [1, 2, 3, 7, 15, 16, 17, 31, 33, 48, 64, 65, 100, 127, 129, 160, 200, 255, 280,
                  300]
MAX_TOKENS = [64, 1, 2, 16, 33, 64, 7, 64, 17, 64]


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(42)
    return [torch.randint(1, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _reference(checkpoint: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens (computed once per run: many tests ask for the same)."""
    key = (checkpoint, tuple(prompt), max_tokens)
    if key not in _REFERENCES:
        hf = _hf_model(checkpoint)
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), do_sample=False,
                              max_new_tokens=max_tokens)
        _REFERENCES[key] = out[0, len(prompt):].tolist()
    return list(_REFERENCES[key])


_REFERENCES: dict[tuple[Path, tuple[int, ...], int], list[int]] = {}


_HF: dict[Path, torch.nn.Module] = {}


def _hf_model(checkpoint: Path) -> torch.nn.Module:
    if checkpoint not in _HF:
        _HF[checkpoint] = AutoModelForCausalLM.from_pretrained(checkpoint,
                                                               dtype=torch.float32).eval()
    return _HF[checkpoint]


def _generate_all(checkpoint: Path, deployment: Deployment
                  ) -> list[tuple[list[int], int, client.Completion]]:
    """Every test prompt at once, greedy: (prompt, max_tokens, completion) each."""
    prompts = _prompts(_hf_model(checkpoint).config.vocab_size)
    max_tokens = [MAX_TOKENS[i % len(MAX_TOKENS)] for i in range(len(prompts))]
    requests = [client.make_request(p, temperature=0.0, max_tokens=m)
                for p, m in zip(prompts, max_tokens)]
    results = asyncio.run(client.generate_many(deployment.router_address, requests, 300))
    return list(zip(prompts, max_tokens, results))


# Each architecture over each K/V transport: gRPC streams between processes, NIXL reads of the
# prefill worker's pool, Ray object refs between actors. Shared deployments, except Llama over
# NIXL: the Llama deployment's workers restarted with --kv-transport nixl, then as they were.
@pytest.mark.parametrize("fixture, restarted_with", [
    pytest.param("qwen3_deployment", [], id="qwen3_deployment"),
    pytest.param("qwen3_nixl_deployment", [], marks=SLOW, id="qwen3_nixl_deployment"),
    pytest.param("llama_deployment", [], marks=SLOW, id="llama_deployment"),
    pytest.param("llama_deployment", NIXL, marks=SLOW, id="llama_deployment-on-nixl"),
    *(pytest.param(f"{arch}_ray_deployment", [], marks=[pytest.mark.ray, SLOW],
                   id=f"{arch}_ray_deployment") for arch in ("qwen3", "llama"))])
def test_greedy_matches_transformers(fixture: str, restarted_with: list[str],
                                     request: pytest.FixtureRequest) -> None:
    arch = fixture.split("_", 1)[0]
    checkpoint: Path = request.getfixturevalue(f"{arch}_checkpoint")
    deployment: Deployment = request.getfixturevalue(fixture)
    if restarted_with:
        assert deployment.log_dir is not None
        log = deployment.log_dir / "decode-0.log"
        log_size = log.stat().st_size
        with reconfigured(deployment, ["prefill-0", "decode-0"], restarted_with):
            _check_greedy(checkpoint, deployment)
            assert "nixl K/V transport" in log.read_text()[log_size:]
    else:
        _check_greedy(checkpoint, deployment)
    if fixture == "qwen3_deployment" and len(os.sched_getaffinity(0)) >= 2:
        # placed as serve places them: both workers ran forwards on the other's core too
        assert deployment.log_dir is not None
        for worker in ("prefill-0", "decode-0"):
            log = (deployment.log_dir / f"{worker}.log").read_text()
            assert "core lending: first forward with the partner's cores" in log, worker


def _check_greedy(checkpoint: Path, deployment: Deployment) -> None:
    for prompt, limit, got in _generate_all(checkpoint, deployment):
        expected = _reference(checkpoint, prompt, limit)
        assert got.token_ids == expected, f"prompt of {len(prompt)} tokens"
        assert got.finished is not None
        assert got.finished.usage.prompt_tokens == len(prompt)
        assert got.finished.usage.completion_tokens == len(expected)
        eos = _hf_model(checkpoint).generation_config.eos_token_id
        reason = (generation_pb2.FINISH_REASON_STOP if expected[-1] == eos
                  else generation_pb2.FINISH_REASON_LENGTH)
        assert got.finished.reason == reason
    assert_pools_clean(deployment)
    assert_alive(deployment)


@SLOW
def test_text_prompt_streams_the_decoded_completion(qwen3_checkpoint: Path,
                                                    qwen3_deployment: Deployment) -> None:
    tokenizer = AutoTokenizer.from_pretrained(qwen3_checkpoint)
    text = "Café, naïve: 日本語 and the quick brown fox"
    got = asyncio.run(client.generate(
        qwen3_deployment.router_address,
        client.make_request(text, temperature=0.0, max_tokens=40, ignore_eos=True)))
    prompt = tokenizer.encode(text)
    hf = _hf_model(qwen3_checkpoint)
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert got.token_ids == expected
    assert got.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert got.finished.reason == generation_pb2.FINISH_REASON_LENGTH
    assert got.finished.timing.time_to_first_token_s > 0
    assert got.finished.timing.prefill_s > 0 and got.finished.timing.kv_transfer_s > 0
    assert_pools_clean(qwen3_deployment)


@SLOW
def test_compiled_decode_matches_transformers(qwen3_checkpoint: Path,
                                              qwen3_deployment: Deployment) -> None:
    """Decode steps compiled (--compile default) through the processes: the same tokens, and
    no graph compiled after start-up although the batch runs 1 to 20 requests (padded to 4
    or 16; above the largest bucket, eager) and contexts grow from 1 to 364 tokens. The
    shared deployment's decode worker, restarted compiled, then as it was."""
    buckets = "4,16"
    deployment = qwen3_deployment
    with reconfigured(deployment, ["decode-0"],
                      ["--compile", "default", "--compile-batch-sizes", buckets]):
        for prompt, limit, got in _generate_all(qwen3_checkpoint, deployment):
            assert got.token_ids == _reference(qwen3_checkpoint, prompt, limit), \
                f"prompt of {len(prompt)} tokens"
        decode = [s for s in worker_stats(deployment) if s.role == "decode"]
        assert [s.num_compiles for s in decode] == [len(buckets.split(","))]
        assert_pools_clean(deployment)
        assert_alive(deployment)


@SLOW
@pytest.mark.parametrize("fixture", ["qwen3_2p2d_deployment", "llama_deployment"])
def test_contexts_past_2000_tokens_match_transformers(fixture: str,
                                                      request: pytest.FixtureRequest) -> None:
    """A 2,000-token prompt and 100 generated tokens (context 2,100: 132 blocks; Llama's
    RoPE scaling past its original 512 positions), through chunked prefill on the 2p2d
    workers: the same greedy tokens as transformers."""
    deployment: Deployment = request.getfixturevalue(fixture)
    checkpoint: Path = request.getfixturevalue(f"{fixture.split('_', 1)[0]}_checkpoint")
    vocab = _hf_model(checkpoint).config.vocab_size
    prompt = torch.randint(1, vocab, (2000,), generator=torch.Generator().manual_seed(2000)
                           ).tolist()
    generate = client.make_request(prompt, temperature=0.0, max_tokens=100)
    generate.cache_salt = f"test_contexts_past_2000_tokens-{fixture}"
    got = asyncio.run(client.generate(deployment.router_address, generate, 300))
    expected = _reference(checkpoint, prompt, 100)
    assert len(expected) > 50  # a long answer: the context really passes 2,000 tokens
    assert got.token_ids == expected
    assert_pools_clean(deployment)
