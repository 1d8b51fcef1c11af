"""Tensor-parallel workers as Ray actors, each side split its way
(tests/e2e/test_tensor_parallel_workers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvferry.faults import FAULTS_ENV, PER_REQUEST
from tests.conftest import ORACLE_DTYPE
from tests.e2e.test_tensor_parallel_workers import sizes_reported
from tests.e2e.test_token_exact import _check_greedy

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def test_greedy_over_ray_matches_transformers(qwen3_checkpoint: Path, ray_session: None
                                              ) -> None:
    """Workers as Ray actors (pages through Ray's object store), both sides split 2 ways:
    the prefill worker's rank 0 gathers whole pages from its ranks (`read_pages`), the decode
    worker's rank 0 gives each rank its heads (`write_pages`). Sides of different sizes use
    the same whole-page path on every transport but NIXL; they are checked over gRPC
    (test_tensor_parallel_workers.py, sizes 1-2 and 2-1) and NIXL
    (test_tensor_parallel_nixl.py), and 3-3 below on the real model."""
    from deploy.ray_launcher import RayDeployment

    sizes = (2, 2)

    deployment = RayDeployment(
        model=str(qwen3_checkpoint), env={FAULTS_ENV: PER_REQUEST}, worker_args=ORACLE_DTYPE,
        prefill_tensor_parallel_size=sizes[0], decode_tensor_parallel_size=sizes[1]).start()
    try:
        assert sizes_reported(deployment) == {"prefill": sizes[0], "decode": sizes[1]}
        _check_greedy(qwen3_checkpoint, deployment)
    finally:
        deployment.stop()


def test_the_real_model_split_three_ways_over_ray_matches_transformers(
        smollm2_checkpoint: Path, ray_session: None) -> None:
    """The real default model (9 heads, 3 K/V heads: only 3 splits it) split 3 ways on both
    sides, as Ray actors: a plain and a chat prompt, greedy, against transformers."""
    import asyncio

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deploy import client
    from deploy.ray_launcher import RayDeployment

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    prompts = [tokenizer.encode("The capital of France is"),
               list(tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))]
    hf = AutoModelForCausalLM.from_pretrained(smollm2_checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                dtype=torch.long), do_sample=False, max_new_tokens=16
                                )[0, len(p):].tolist() for p in prompts]
    deployment = RayDeployment(model=str(smollm2_checkpoint), worker_args=ORACLE_DTYPE,
                               prefill_tensor_parallel_size=3,
                               decode_tensor_parallel_size=3).start()
    try:
        assert sizes_reported(deployment) == {"prefill": 3, "decode": 3}
        requests = [client.make_request(p, temperature=0.0, max_tokens=16) for p in prompts]
        results = asyncio.run(client.generate_many(deployment.router_address, requests, 300))
        assert [list(r.token_ids) for r in results] == expected
    finally:
        deployment.stop()
