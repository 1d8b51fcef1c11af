"""K/V eviction (`--kv-eviction streaming|h2o`) on a live deployment: the shared
deployment's decode worker restarted with a budget of 4 sink and 60 window tokens (1 + 4
blocks of 16) serves a greedy request whose prompt alone is past the budget and whose
generation runs far past it: every token arrives, the worker gave up what the budget did not
hold (`kvferry_kv_evicted_blocks_total`), and every pool is clean afterwards. Under either
policy, a decode worker killed mid-stream after its evictions began: the request migrates to
the other (which evicts in its turn) and completes, and every pool and index is clean. (Each
step's bound is tested in tests/decode_worker/test_streaming_eviction.py and
test_h2o_eviction.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from deploy import cli, client
from deploy.args import build_parser
from deploy.launcher import Deployment
from kvferry.cache.layout import KvShape
from kvferry.errors import InvalidArgument
from kvferry.faults import tag
from kvferry.model.config import load_model_config
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.rpc import convert
from kvferry.settings import KvEvictionConfig
from kvferry_kernels.dispatch import get_attention_backend
from router import admission
from router.request import GenerateInput
from tests.conftest import ORACLE_DTYPE, assert_alive, assert_pools_clean, worker_stats
from tests.decode_worker.engines import cpu_engine, serve_local
from tests.deployments import kill_decode_mid_stream, reconfigured, respawn, routed
from tests.e2e.test_metrics import scrape, value

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
BUDGET_BLOCKS = 1 + 4


def test_streaming_eviction_serves_far_past_its_budget(qwen3_deployment: Deployment) -> None:
    deployment = qwen3_deployment
    flags = ["--kv-eviction", "streaming", "--kv-sink-tokens", "4", "--kv-window-tokens", "60"]
    with reconfigured(deployment, ["decode-0"], flags):
        prompt = [7 + i % 300 for i in range(100)]  # 7 blocks: past the budget on arrival
        request = client.make_request(prompt, temperature=0.0, max_tokens=300, ignore_eos=True)
        got = asyncio.run(client.generate(deployment.router_address, request, 300))
        assert got.finished is not None and len(got.token_ids) == 300
        decode = next(p for p in deployment.processes if p.name == "decode-0")
        evicted = value(scrape(decode.metrics_port), "kvferry_kv_evicted_blocks_total")
        # The last token's position is 398: 25 blocks written, at most the budget's kept.
        written = -(-(len(prompt) + 299) // BLOCK_SIZE)
        assert evicted >= written - BUDGET_BLOCKS, (evicted, written)
        assert_pools_clean(deployment)
        assert_alive(deployment)


def _streaming_in_process(checkpoint: Path, prompt: list[int], max_tokens: int,
                          num_blocks: int = 64, kv_cache_dtype: str = "auto") -> list[int]:
    """Greedy tokens of the in-process engine under POLICIES["streaming"], on a float32 pool
    of `num_blocks` blocks (pages of `kv_cache_dtype`)."""
    model = Transformer(load_model_config(checkpoint), get_attention_backend("torch"),
                        torch.float32, torch.device("cpu"))
    eviction = KvEvictionConfig("streaming", sink_tokens=4, window_tokens=60)
    engine = cpu_engine(model, BLOCK_SIZE, num_blocks, kv_cache_dtype, eviction=eviction)
    return serve_local(engine, prompt, max_tokens)[0]


def test_generation_several_times_the_decode_pool_completes_token_exact(
        qwen3_checkpoint: Path, qwen3_deployment: Deployment) -> None:
    """The decode worker restarted with a pool of 12 blocks (192 tokens) and streaming
    eviction (5 blocks a sequence), behind a router told the same policy: 40 prompt tokens
    and 800 more (4.4 times the pool) are admitted (the router counts the policy's budget,
    kvferry/cache/budget.py, as the pool does), every token arrives, equal to the in-process
    engine's with the same policy and pool, and the pool is free afterwards. (A router not
    told of the policy refuses such a request: tests/kvferry/cache/test_budget.py.)"""
    deployment = qwen3_deployment
    config = load_model_config(qwen3_checkpoint)
    per_block = KvShape(config.num_layers, config.num_kv_heads, config.head_dim,
                        "float32").bytes_per_block(BLOCK_SIZE)
    flags = ["--kv-pool-size", str(12 * per_block), *POLICIES["streaming"]]
    prompt = [17 + i % 270 for i in range(40)]
    want = _streaming_in_process(qwen3_checkpoint, prompt, 800, num_blocks=12)
    request = client.make_request(prompt, temperature=0.0, max_tokens=800, ignore_eos=True)
    request.cache_salt = "past-the-pool"
    with (reconfigured(deployment, ["decode-0"], flags),
          routed(deployment, "router-evicting", POLICIES["streaming"]) as view):
        got = asyncio.run(client.generate(view.router_address, request, 300))
        assert got.finished is not None and got.token_ids == want and len(want) == 800
        assert_pools_clean(deployment)


def test_eviction_over_nixl_with_ngram_drafts_is_token_exact(
        qwen3_checkpoint: Path, qwen3_nixl_deployment: Deployment) -> None:
    """Over NIXL the prefill worker prefills the prompt whole and the decode worker reads its
    pages, then bounds the sequence before its first step; the deployment's n-gram drafts
    (4 a step) are verified as the window moves. With a prompt inside the budget (40 tokens,
    5 blocks of 16 kept) and 300 tokens generated past it, the tokens are the in-process
    engine's with the same policy and no speculation, drafts were accepted, and every pool
    is clean."""
    deployment = qwen3_nixl_deployment
    names = ["decode-0", "decode-1"]
    prompt = [19 + (i * 5) % 11 for i in range(40)]  # repeats: the n-gram proposer finds drafts
    want = _streaming_in_process(qwen3_checkpoint, prompt, 300)
    request = client.make_request(prompt, temperature=0.0, max_tokens=300, ignore_eos=True)
    request.cache_salt = "eviction-over-nixl"
    with (reconfigured(deployment, names, POLICIES["streaming"]),
          routed(deployment, "router-evicting-nixl", POLICIES["streaming"]) as view):
        got = asyncio.run(client.generate(view.router_address, request, 300))
        assert got.finished is not None and got.token_ids == want

        def total(metric: str) -> float:
            return sum(value(scrape(p.metrics_port), metric)
                       for p in deployment.processes if p.name in names)

        assert total("kvferry_kv_evicted_blocks_total") >= (
            -(-(len(prompt) + 299) // BLOCK_SIZE) - BUDGET_BLOCKS)
        assert total("kvferry_spec_decode_accepted_tokens_total") > 0
        assert_pools_clean(deployment)


def test_eviction_on_int8_pages_over_grpc_is_token_exact(qwen3_checkpoint: Path,
                                                         qwen3_deployment: Deployment) -> None:
    """The prefill and decode workers restarted with int8 pages and streaming eviction:
    40 prompt tokens and 150 more (the sinks' keys re-rotated and quantized again at each
    of ~7 evictions) are the in-process engine's with the same pages and policy, and every
    pool is clean."""
    deployment = qwen3_deployment
    names = ["prefill-0", "decode-0"]
    flags = ["--kv-cache-dtype", "int8", *POLICIES["streaming"]]
    prompt = [23 + i % 250 for i in range(40)]
    want = _streaming_in_process(qwen3_checkpoint, prompt, 150, kv_cache_dtype="int8")
    request = client.make_request(prompt, temperature=0.0, max_tokens=150, ignore_eos=True)
    request.cache_salt = "eviction-int8"
    with (reconfigured(deployment, names, flags),
          routed(deployment, "router-evicting-int8", POLICIES["streaming"]) as view):
        got = asyncio.run(client.generate(view.router_address, request, 300))
        assert got.finished is not None and got.token_ids == want
        evicted = sum(value(scrape(p.metrics_port), "kvferry_kv_evicted_blocks_total")
                      for p in deployment.processes if p.name == "decode-0")
        assert evicted >= -(-(len(prompt) + 149) // BLOCK_SIZE) - BUDGET_BLOCKS
        assert_pools_clean(deployment)


POLICIES = {
    "streaming": ["--kv-eviction", "streaming", "--kv-sink-tokens", "4",
                  "--kv-window-tokens", "60"],
    "h2o": ["--kv-eviction", "h2o", "--kv-heavy-tokens", "32", "--kv-recent-tokens", "48"],
}


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_migration_mid_eviction_leaves_every_pool_clean(
        policy: str, qwen3_2p2d_deployment: Deployment) -> None:
    """Every worker evicts (5-block budget): the prefill workers while prefilling, pushing
    the prompt's kept pages; the decode worker streaming the request is killed (-9) once 120
    of its 300 tokens arrived. The router re-prefills prompt + tokens so far on the other
    pair, which evicts as it goes, and the request finishes: under streaming with exactly the
    undisturbed tokens (the re-prefill reads what decoding read: test_eviction_prefill.py);
    under H2O the tokens before the kill (the pushed pages carry no attention mass, so the
    decode worker's choices after a push start from none). Every pool is clean."""
    deployment, flags = qwen3_2p2d_deployment, POLICIES[policy]
    names = ["decode-0", "decode-1"]
    with reconfigured(deployment, ["prefill-0", "prefill-1", *names], flags):
        prompt = [11 + i % 290 for i in range(100)]
        request = client.make_request(prompt, temperature=0.0, max_tokens=300,
                                      ignore_eos=True)
        request.cache_salt = f"eviction-migration-{policy}"
        undisturbed = asyncio.run(client.generate(deployment.router_address, request, 120))
        request.request_id = f"evict-migrate-{policy}" + tag(decode_step_delay_s=0.01)
        evicted = {p.name: value(scrape(p.metrics_port), "kvferry_kv_evicted_blocks_total")
                   for p in deployment.processes if p.name in names}

        got, victim = kill_decode_mid_stream(deployment, request, 120)
        assert got.finished is not None and len(got.token_ids) == 300
        assert got.token_ids[:120] == undisturbed.token_ids[:120]
        if policy == "streaming":
            assert got.token_ids == undisturbed.token_ids
        survivor = next(p for p in deployment.processes
                        if p.name in names and p.name != victim.name)
        after = value(scrape(survivor.metrics_port), "kvferry_kv_evicted_blocks_total")
        assert after > evicted[survivor.name]  # the migrated leg evicted there
        respawn(victim.name, deployment, extra_args=tuple(flags))
        assert_pools_clean(deployment)
        assert_alive(deployment)


def test_a_router_told_of_the_policy_lets_generation_pass_the_context(
        qwen3_checkpoint: Path, qwen3_deployment: Deployment) -> None:
    """`serve --kv-eviction streaming` tells the router too: a request of 100 prompt tokens
    and 4,100 more (past the model's 4,096) is served in full, by a decode worker holding
    5 blocks for it; a router not told refuses it, naming sampling.max_tokens. (What the
    decode worker keeps is checked at every step in tests/decode_worker.)"""
    args = build_parser().parse_args(["serve", "--model", "m", *POLICIES["streaming"]])
    router_args = cli._deployment(args).router_args
    assert router_args[router_args.index("--kv-eviction") + 1] == "streaming"
    context = load_model_config(qwen3_checkpoint).max_position_embeddings
    prompt = [11 + i % 290 for i in range(100)]
    request = client.make_request(prompt, temperature=0.0, max_tokens=context + 4,
                                  ignore_eos=True)
    deployment = qwen3_deployment
    with (reconfigured(deployment, ["decode-0"], POLICIES["streaming"]),
          routed(deployment, "router-bounded", ["--kv-eviction", "streaming"]) as view):
        got = asyncio.run(client.generate(view.router_address, request, 300))
        assert got.finished is not None and len(got.token_ids) == context + 4
        assert_pools_clean(deployment)
    config = load_model_config(qwen3_checkpoint)
    inp = GenerateInput("r", None, prompt, SamplingParams(max_tokens=context + 4,
                                                          temperature=0.0), True)
    with pytest.raises(InvalidArgument) as exc:
        admission.resolve_sampling(inp, config, len(prompt))
    assert exc.value.field == "sampling.max_tokens"
    assert admission.resolve_sampling(
        inp, config, len(prompt), is_generation_bounded=True).max_tokens == context + 4
    # A request that opts out (sampling.kv_eviction "none") is bounded by the context again.
    kept = GenerateInput("r", None, prompt, SamplingParams(max_tokens=context + 4,
                                                           kv_eviction="none"), True)
    with pytest.raises(InvalidArgument) as exc:
        admission.resolve_sampling(kept, config, len(prompt), is_generation_bounded=True)
    assert exc.value.field == "sampling.max_tokens"
    unset_kept = GenerateInput("r", None, prompt, SamplingParams(kv_eviction="none"), False)
    assert admission.resolve_sampling(unset_kept, config, context - 10,
                                       is_generation_bounded=True).max_tokens == 10
    assert convert.sampling_from_proto(convert.sampling_to_proto(
        kept.params)).kv_eviction == "none"
    bad = GenerateInput("r", None, prompt, SamplingParams(kv_eviction="h2o"), False)
    with pytest.raises(InvalidArgument) as exc:  # a request cannot choose another policy
        admission.resolve_sampling(bad, config, len(prompt), is_generation_bounded=True)
    assert exc.value.field == "sampling.kv_eviction"
    unset = GenerateInput("r", None, prompt, SamplingParams(), False)
    assert admission.resolve_sampling(unset, config, context - 10).max_tokens == 10
    assert admission.resolve_sampling(unset, config, context - 10,
                                       is_generation_bounded=True).max_tokens == 256


@pytest.mark.parametrize(("fixture", "names"), [
    ("colocated_deployment", ["colocated-0"]), ("qwen3_deployment", ["prefill-0", "decode-0"])],
    ids=["colocated", "grpc-push"])
def test_a_long_prompt_is_prefilled_evicting_as_it_goes(
        fixture: str, names: list[str], qwen3_checkpoint: Path,
        request: pytest.FixtureRequest) -> None:
    """A 200-token prompt with a 5-block budget, on a colocated worker or on a prefill
    worker that pushes its kept pages (gRPC) to a decode worker: prefilled up to the budget,
    then a block at a time (the oldest window block evicted before each), so the worker gave
    up the prompt's blocks past the budget while prefilling, and the tokens are those the
    in-process engine serves with the same policy (tests/decode_worker/
    test_eviction_prefill.py checks those against decoding the prompt token by token). The
    same prompt from a request that opts out gets the tokens of a worker without eviction."""
    deployment: Deployment = request.getfixturevalue(fixture)
    flags = ["--speculative-method", "off", *POLICIES["streaming"]]
    prompt = [13 + i % 280 for i in range(200)]
    model = Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"),
                        torch.float32, torch.device("cpu"))
    config = KvEvictionConfig("streaming", sink_tokens=4, window_tokens=60)
    want = serve_local(cpu_engine(model, BLOCK_SIZE, 64, eviction=config), prompt, 50)[0]
    unbounded = serve_local(cpu_engine(model, BLOCK_SIZE, 64), prompt, 50)[0]
    with reconfigured(deployment, names, flags):
        # A request that opts out (sampling.kv_eviction "none") is served as without eviction.
        kept = client.make_request(prompt, temperature=0.0, max_tokens=50, ignore_eos=True,
                                   kv_eviction="none")
        kept.cache_salt = f"long-prompt-kept-{fixture}"
        assert asyncio.run(client.generate(deployment.router_address, kept, 120)
                           ).token_ids == unbounded
        request = client.make_request(prompt, temperature=0.0, max_tokens=50, ignore_eos=True)
        request.cache_salt = f"long-prompt-{fixture}"
        got = asyncio.run(client.generate(deployment.router_address, request, 120))
        assert got.token_ids == want
        evicted = sum(value(scrape(p.metrics_port), "kvferry_kv_evicted_blocks_total")
                      for p in deployment.processes if p.name in names[-1:])
        # 200 + 49 tokens written: 16 blocks, at most 5 kept; the prompt's 8 evicted blocks
        # were given up where it was prefilled
        prompt_evicted = (len(prompt) - BUDGET_BLOCKS * BLOCK_SIZE) // BLOCK_SIZE + 1
        written = -(-(len(prompt) + 49) // BLOCK_SIZE)
        assert evicted == written - BUDGET_BLOCKS - (prompt_evicted if len(names) > 1 else 0)
        assert_pools_clean(deployment)


@pytest.mark.ray
def test_eviction_over_ray_is_token_exact(qwen3_checkpoint: Path, ray_session: None) -> None:
    """Workers as Ray actors under streaming eviction, behind a router told the policy: as
    over NIXL, the prefill worker prefills the prompt whole (40 tokens, inside the 5-block
    budget) and its pages go through Ray's object store; the decode worker evicts as the
    300 tokens generated pass the budget. The tokens are the in-process engine's with the
    same policy (which are not those without it), the decode worker gave up the blocks the
    budget did not hold, and every pool is clean."""
    from deploy.ray_launcher import RayDeployment

    prompt = [29 + (i * 7) % 230 for i in range(40)]
    want = _streaming_in_process(qwen3_checkpoint, prompt, 300)
    model = Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"),
                        torch.float32, torch.device("cpu"))
    assert want != serve_local(cpu_engine(model, BLOCK_SIZE, 64), prompt, 300)[0]
    deployment = RayDeployment(
        model=str(qwen3_checkpoint), worker_args=[*ORACLE_DTYPE, *POLICIES["streaming"]],
        router_args=POLICIES["streaming"]).start()
    try:
        request = client.make_request(prompt, temperature=0.0, max_tokens=300,
                                      ignore_eos=True)
        got = asyncio.run(client.generate(deployment.router_address, request, 300))
        assert got.finished is not None and got.token_ids == want
        (decode,) = [s for s in worker_stats(deployment) if s.role == "decode"]
        assert decode.kv_evicted_blocks >= (
            -(-(len(prompt) + 299) // BLOCK_SIZE) - BUDGET_BLOCKS)
        assert_pools_clean(deployment)
    finally:
        deployment.stop()
