"""Tensor-parallel workers through the processes (docs/tensor-parallel.md): a prefill worker
split P ways ships K/V to a decode worker split D ways over gRPC, and greedy tokens are
transformers' on every test prompt. A rank killed mid-stream takes its worker out; its
requests migrate and finish token-exact, and no block leaks. Llama, NIXL and Ray:
test_tensor_parallel_llama.py, test_tensor_parallel_nixl.py and test_tensor_parallel_ray.py
(modules of their own, so each runs with its shared deployments)."""

from __future__ import annotations

import asyncio
import os
import signal
from contextlib import ExitStack
from pathlib import Path

import pytest

from deploy import client
from deploy.launcher import Deployment, Process
from kvferry.faults import tag
from tests.conftest import QWEN3_BLOCK_BYTES, assert_pools_clean, busy_process, worker_stats
from tests.deployments import (
    rank_pids,
    reconfigured,
    respawn,
    restarted_in_turn,
    routed,
    until_router_takes,
)
from tests.e2e.test_token_exact import _check_greedy, _generate_all, _reference

pytestmark = pytest.mark.slow

SIZES = [(1, 2), (2, 1), (2, 2)]
SIZE_IDS = [f"{p}-{d}" for p, d in SIZES]


def tp_flag(size: int) -> list[str]:
    return ["--tensor-parallel-size", str(size)]


def split_workers(deployment: Deployment, prefill: int, decode: int,
                  extra: tuple[str, ...] = (), is_layout_kept: bool = True) -> ExitStack:
    """prefill-0 and decode-0 restarted split `prefill` and `decode` ways (1: as they are;
    `extra`: more flags for a split one), for the duration; with `is_layout_kept` (their
    pages as the deployment's router knows them), once that router takes them back."""
    stack = ExitStack()
    names = [name for name, size in (("prefill-0", prefill), ("decode-0", decode))
             if size > 1]
    for name, size in (("prefill-0", prefill), ("decode-0", decode)):
        if size > 1:
            stack.enter_context(reconfigured(deployment, [name], [*tp_flag(size), *extra]))
    if is_layout_kept:
        until_router_takes(deployment, names)
    return stack


def sizes_reported(deployment: Deployment) -> dict[str, int]:
    return {s.role: s.tensor_parallel_size for s in worker_stats(deployment)}


@pytest.mark.parametrize("sizes", SIZES[:2], ids=SIZE_IDS[:2])
def test_greedy_over_grpc_matches_transformers(sizes: tuple[int, int],
                                               qwen3_checkpoint: Path,
                                               qwen3_deployment: Deployment) -> None:
    """The shared deployment's workers restarted split (P, D) ways: the token-exact
    oracle's 20 prompts (1 to 300 tokens, up to 64 new tokens each, all at once). Both
    sides split 2 ways: the next test."""
    with split_workers(qwen3_deployment, *sizes):
        assert sizes_reported(qwen3_deployment) == {"prefill": sizes[0], "decode": sizes[1]}
        _check_greedy(qwen3_checkpoint, qwen3_deployment)


def test_split_both_ways_matches_transformers_and_forks_samples_on_every_rank(
        qwen3_checkpoint: Path, qwen3_deployment: Deployment) -> None:
    """Both workers split 2 ways (one restart for both checks): the oracle's prompts as
    above; then n = 4 seeded samples of one prompt, for each of which the decode worker forks
    the prompt's blocks (the last, partial one copied: `copy_blocks` on every rank), each
    sample's tokens those the whole-model workers gave."""
    prompt = list(range(100, 400))  # 18.75 blocks: a partial last block to copy
    request = client.make_request(prompt, max_tokens=20, seed=77, n=4, temperature=0.9,
                                  ignore_eos=True)
    whole = asyncio.run(client.generate_samples(qwen3_deployment.router_address, request, 120))
    assert len({tuple(s.token_ids) for s in whole}) > 1  # the samples differ
    with split_workers(qwen3_deployment, 2, 2):
        assert sizes_reported(qwen3_deployment) == {"prefill": 2, "decode": 2}
        _check_greedy(qwen3_checkpoint, qwen3_deployment)
        split = asyncio.run(client.generate_samples(qwen3_deployment.router_address, request,
                                                    120))
        assert [s.token_ids for s in split] == [s.token_ids for s in whole]
        assert_pools_clean(qwen3_deployment)


def test_speculative_decoding_on_split_workers_matches_transformers(
        qwen3_checkpoint: Path, draft_checkpoint: Path, qwen3_deployment: Deployment) -> None:
    """Both sides split 2 ways, the decode worker speculating: n-gram drafts, then a draft
    model (whole, on rank 0; the prefill worker builds and ships its prompt K/V) whose
    drafts the split target verifies and rolls back. The oracle's prompts, all at once:
    transformers' greedy tokens, and drafts were made and some accepted."""
    names = ["prefill-0", "decode-0"]
    with restarted_in_turn(qwen3_deployment, names) as restart_with:
        for method in ("ngram", "draft"):
            flags = ["--speculative-method", method, "--num-speculative-tokens", "3"]
            if method == "draft":
                flags += ["--speculative-model", str(draft_checkpoint)]
            restart_with([*tp_flag(2), *flags])
            until_router_takes(qwen3_deployment, names)
            done = _generate_all(qwen3_checkpoint, qwen3_deployment)
            for prompt, limit, got in done:
                assert got.token_ids == _reference(qwen3_checkpoint, prompt, limit), \
                    (method, len(prompt))
            usage = [got.finished.usage for _, _, got in done]
            assert sum(u.num_accepted_tokens for u in usage) > 0, method
            assert sum(u.num_draft_tokens for u in usage) > 0, method
            assert_pools_clean(qwen3_deployment)


@pytest.mark.parametrize(("kv_cache_dtype", "transport"), [("int8", "grpc"),
                                                           ("fp8_e4m3", "nixl")])
def test_quantized_pages_on_split_workers_give_the_whole_workers_tokens(
        kv_cache_dtype: str, transport: str, qwen3_checkpoint: Path,
        qwen3_deployment: Deployment) -> None:
    """Quantized pages (a scale per token and K/V head, so splitting by head changes no
    scale), over gRPC or NIXL (its staging holds quantized whole pages): the oracle's
    prompts through whole workers with those pages, then through workers split (2, 2) with
    them. The same greedy tokens (quantization moves them off transformers', so the whole
    quantized workers are the reference here)."""
    flags = ["--kv-cache-dtype", kv_cache_dtype, "--kv-transport", transport]
    # behind routers of their own: the shared router knows the fp32 layout and refuses them
    with restarted_in_turn(qwen3_deployment, ["prefill-0", "decode-0"]) as restart_with:
        restart_with(flags)
        with routed(qwen3_deployment, f"router-{kv_cache_dtype}", []) as view:
            whole = [got.token_ids for _, _, got in _generate_all(qwen3_checkpoint, view)]
        restart_with([*tp_flag(2), *flags])
        with routed(qwen3_deployment, f"router-tp-{kv_cache_dtype}", []) as view:
            assert sizes_reported(view) == {"prefill": 2, "decode": 2}
            split = [got.token_ids for _, _, got in _generate_all(qwen3_checkpoint, view)]
            assert split == whole
            assert_pools_clean(view)


def test_preemption_swaps_pages_out_and_in_through_every_rank(
        qwen3_tiny_deployment: Deployment, qwen3_deployment: Deployment) -> None:
    """The tiny deployment's decode worker split 2 ways with a pool of 12 (half-size)
    blocks, behind a round-robin router that sends requests whatever its headroom: it must
    preempt, swapping each victim's pages out of every rank and back. Eight greedy requests
    still give the tokens of the roomy deployment."""
    deployment = qwen3_tiny_deployment
    pool = ["--kv-pool-size", f"{12 * QWEN3_BLOCK_BYTES // 2}B"]
    requests = [client.make_request(list(range(10 + i, 30 + i)), temperature=0.0,
                                    max_tokens=40 + 5 * i, ignore_eos=True) for i in range(8)]
    roomy = asyncio.run(client.generate_many(qwen3_deployment.router_address, requests, 300))
    with reconfigured(deployment, ["decode-0"], [*tp_flag(2), *pool]), \
            routed(deployment, "router-tp-round-robin", ["--policy", "round_robin"]) as view:
        (decode,) = [s for s in worker_stats(view) if s.role == "decode"]
        assert (decode.tensor_parallel_size, decode.total_blocks) == (2, 12)
        squeezed = asyncio.run(client.generate_many(view.router_address, requests, 300))
        assert [c.token_ids for c in squeezed] == [c.token_ids for c in roomy]
        (decode,) = [s for s in worker_stats(view) if s.role == "decode"]
        assert decode.num_preemptions > 0
        assert_pools_clean(view)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


def test_a_rank_killed_mid_stream_migrates_its_requests(
        qwen3_checkpoint: Path, qwen3_2p2d_deployment: Deployment,
        qwen3_deployment: Deployment) -> None:
    """Both decode workers of the 2p2d deployment split 2 ways. Once a paced greedy stream
    has tokens, one rank of the decode worker holding it is killed: that worker exits (its
    other rank with it), the request migrates to the other one and finishes with exactly
    the undisturbed tokens; the surviving pools are all free again."""
    deployment = qwen3_2p2d_deployment
    prompt = list(range(70, 150))
    generate = client.make_request(prompt, max_tokens=200, ignore_eos=True, temperature=0.0)
    generate.cache_salt = "test_tensor_parallel_workers-rank-kill"
    undisturbed = asyncio.run(client.generate(qwen3_deployment.router_address, generate, 120))
    with reconfigured(deployment, ["decode-0", "decode-1"], tp_flag(2)):
        # Both taken back first: the migration needs the other one healthy in the router (a
        # clean-clone CI run migrated before its next stats refresh: "no healthy decode
        # worker").
        until_router_takes(deployment, ["decode-0", "decode-1"])
        generate.request_id = "rank-kill" + tag(decode_step_delay_s=0.02)  # 4 s at least
        got, victim, rank = _kill_a_rank_mid_stream(deployment, generate, 10)
        assert victim.popen.wait(30) == 75  # EXIT_RANK_LOST: it left at once
        assert _gone(rank)
        assert got.token_ids == undisturbed.token_ids
        assert got.finished.usage.completion_tokens == 200
        log = (deployment.log_dir / "router.log").read_text()
        assert "rank-kill" in log and "migrating" in log
        log = (deployment.log_dir / f"{victim.name}.log").read_text()
        assert "tensor-parallel rank lost" in log
        respawn(victim.name, deployment, extra_args=tuple(tp_flag(2)))
        assert_pools_clean(deployment)


def _kill_a_rank_mid_stream(deployment: Deployment, request: object, after_tokens: int
                            ) -> tuple[client.Completion, Process, int]:
    """Stream `request`; once `after_tokens` arrived, SIGKILL rank 1 of the decode worker
    running it. The completed stream, that worker and the rank's pid."""
    from kvferry.rpc import grpc_util
    from kvferry.v1 import generation_pb2_grpc

    async def run() -> tuple[client.Completion, Process, int]:
        async with grpc_util.channel(deployment.router_address) as chan:
            stub = generation_pb2_grpc.GenerationServiceStub(chan)
            completion, victim, rank = client.Completion(), None, 0
            async for _, latest in client.stream(stub, request, timeout_s=120):
                completion = latest
                if victim is None and len(completion.token_ids) >= after_tokens:
                    victim = await asyncio.to_thread(busy_process, deployment, "decode")
                    assert victim is not None
                    (rank,) = rank_pids(deployment, victim)
                    os.kill(rank, signal.SIGKILL)
            assert victim is not None
            return completion, victim, rank

    return asyncio.run(run())
