"""The real default model (SmolLM2-135M-Instruct) end to end: greedy output through router +
prefill + decode processes is token-identical to transformers `generate` (fp32), for plain
and chat-templated prompts of 1 to ~500 tokens. The deployment is given the `.gguf` file:
its processes load the directory it was converted into, the one transformers loads here, so
one deployment checks both the conversion and the serving. Its decode worker speculates
(n-gram drafts, tests/conftest.py SPECULATIVE): greedy output must not change."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from deploy import client
from deploy.launcher import Deployment
from tests.conftest import COMPILED, SPECULATIVE, assert_alive, assert_pools_clean, worker_stats
from tests.deployments import reconfigured
from tests.e2e.test_metrics import scrape, value

pytestmark = pytest.mark.slow

MAX_NEW_TOKENS = 32
_PARAGRAPH = ("Disaggregated serving runs the prompt on one machine and the generation on "
              "another, so that long prompts do not stall the tokens of running requests. ")
_CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Explain in two sentences why the sky is blue."}],
    [{"role": "user", "content": "Summarize this text in one sentence:\n" + _PARAGRAPH * 8}],
]


def _prompts(tokenizer) -> list[list[int]]:
    """Plain text (1 token, a sentence, ~500 tokens) and chat-templated conversations."""
    long_text = tokenizer.encode(_PARAGRAPH * 30)[:500]
    plain = [tokenizer.encode("The")[:1], tokenizer.encode("The capital of France is"),
             long_text]
    chats = [list(tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                tokenize=True, return_dict=False))
             for chat in _CHATS]
    return plain + chats


@pytest.fixture(scope="module")
def tokenizer(smollm2_checkpoint: Path):
    return AutoTokenizer.from_pretrained(smollm2_checkpoint)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return _prompts(tokenizer)


def _deploy(model: Path, logs: Path) -> Iterator[Deployment]:
    deployment = Deployment(model=str(model), log_dir=logs, compile=COMPILED,
                            worker_args=[*SPECULATIVE, "--metrics-port", "0"]).start()
    try:
        yield deployment
    finally:
        deployment.stop()


@pytest.fixture(scope="module")
def gguf_deployment(smollm2_gguf: Path, smollm2_checkpoint: Path,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Given the .gguf file; smollm2_checkpoint (the conversion) exists before it starts."""
    yield from _deploy(smollm2_gguf, tmp_path_factory.mktemp("smollm2-gguf-logs"))


@pytest.fixture(scope="module")
def served(gguf_deployment: Deployment, prompts: list[list[int]]) -> list[list[int]]:
    """The deployment's greedy tokens for every prompt, one request at a time."""
    return [_serve(gguf_deployment, prompt) for prompt in prompts]


def _serve(deployment: Deployment, prompt: list[int]) -> list[int]:
    request = client.make_request(prompt, temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    completion = asyncio.run(client.generate(deployment.router_address, request, 300))
    assert completion.finished is not None
    return list(completion.token_ids)


def test_prompts_cover_plain_and_chat_and_1_to_500_tokens(prompts: list[list[int]],
                                                          tokenizer) -> None:
    lengths = [len(p) for p in prompts]
    assert min(lengths) == 1 and max(lengths) >= 450 and len(prompts) >= 5
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert sum(im_start in p for p in prompts) == len(_CHATS)


def test_greedy_matches_transformers(smollm2_checkpoint: Path, prompts: list[list[int]],
                                     served: list[list[int]],
                                     gguf_deployment: Deployment) -> None:
    hf = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, served):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                              dtype=torch.long), do_sample=False, max_new_tokens=MAX_NEW_TOKENS)
        expected = out[0, len(prompt):].tolist()
        assert got == expected, f"prompt of {len(prompt)} tokens"
        assert len(got) == MAX_NEW_TOKENS or got[-1] == 2  # a full answer, or one that ended
    decode = next(p for p in gguf_deployment.processes if p.name == "decode-0")
    samples = scrape(decode.metrics_port)
    assert value(samples, "kvferry_spec_decode_draft_tokens_total") > 0  # it did speculate
    assert value(samples, "kvferry_spec_decode_accepted_tokens_total") > 0
    assert_pools_clean(gguf_deployment)
    assert_alive(gguf_deployment)


def test_chat_answer_is_sensible(served: list[list[int]], tokenizer) -> None:
    """A real model, not noise: the greedy answer names Paris."""
    answer = tokenizer.decode(served[3], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_the_model_as_its_own_draft_serves_the_same_tokens(
        smollm2_checkpoint: Path, prompts: list[list[int]], served: list[list[int]],
        gguf_deployment: Deployment) -> None:
    """Draft-model speculation on the real model, the model drafting for itself (nothing
    smaller shares its tokenizer here; its own argmax is mostly accepted): the decode worker
    restarted with `--speculative-method draft`, every prompt at once, the tokens the n-gram
    worker served (which match transformers, above)."""
    deployment = gguf_deployment
    flags = ["--speculative-method", "draft", "--speculative-model", str(smollm2_checkpoint)]
    with reconfigured(deployment, ["decode-0"], flags):
        requests = [client.make_request(p, temperature=0.0, max_tokens=MAX_NEW_TOKENS)
                    for p in prompts]
        results = asyncio.run(client.generate_many(deployment.router_address, requests, 300))
        assert [list(r.token_ids) for r in results] == served
        usage = [r.finished.usage for r in results if r.finished is not None]
        drafted = sum(u.num_draft_tokens for u in usage)
        assert sum(u.num_accepted_tokens for u in usage) >= 0.8 * drafted > 0
        assert_pools_clean(deployment)
        assert_alive(deployment)


def test_split_three_ways_on_both_sides_serves_the_same_tokens(
        prompts: list[list[int]], served: list[list[int]], gguf_deployment: Deployment) -> None:
    """The real model split over 3 ranks on each side (tensor parallelism: its 9 heads, 3
    K/V heads and MLP 1,536 wide split only 3 ways; docs/tensor-parallel.md), speculating
    (n-gram) as the deployment does, pages over gRPC, every prompt at once: the tokens the
    whole model served (which match transformers, above). Over Ray:
    tests/e2e/test_tensor_parallel_ray.py; split pages over NIXL (staging on each side):
    tests/e2e/test_tensor_parallel_nixl.py."""
    deployment = gguf_deployment
    with reconfigured(deployment, ["prefill-0", "decode-0"], ["--tensor-parallel-size", "3"]):
        assert {s.role: s.tensor_parallel_size for s in worker_stats(deployment)} == {
            "prefill": 3, "decode": 3}
        requests = [client.make_request(p, temperature=0.0, max_tokens=MAX_NEW_TOKENS)
                    for p in prompts]
        results = asyncio.run(client.generate_many(deployment.router_address, requests, 300))
        assert [list(r.token_ids) for r in results] == served
        assert_pools_clean(deployment)
        assert_alive(deployment)


def test_compiled_forwards_serve_the_same_tokens_at_every_batch(
        prompts: list[list[int]], served: list[list[int]], gguf_deployment: Deployment) -> None:
    """The deployment runs the product's default, --compile dynamic: one package per worker
    (loaded by the second from the first's build) serving prefill and decode. Every prompt at
    once (prefill batches of several prompts, decode batches of 1 to 6): the tokens served one
    at a time (which match transformers, above), and no compile after start-up."""
    deployment = gguf_deployment
    requests = [client.make_request(p, temperature=0.0, max_tokens=MAX_NEW_TOKENS)
                for p in prompts]
    results = asyncio.run(client.generate_many(deployment.router_address, requests, 300))
    assert [list(r.token_ids) for r in results] == served
    assert [(s.role, s.num_compiles) for s in worker_stats(deployment)] == [
        ("prefill", 1), ("decode", 1)]
    assert_pools_clean(deployment)
    assert_alive(deployment)
