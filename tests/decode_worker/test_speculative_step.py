"""Speculative decoding in an in-process decode engine (decode_worker/spec/drafting.py): drafts
verified over flattened rows give the tokens of decoding without them, whatever the drafts
were (all right, all wrong, right then wrong), greedy and seeded; rejected drafts' K/V is
rolled back across block boundaries (4-token blocks, up to 6 drafts), and every block comes
back with the pool's integrity intact."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from decode_worker.engine import DecodeEngine
from decode_worker.sequence import DecodeSeq
from kvferry.cache.budget import blocks_for_tokens
from kvferry.model.config import load_model_config
from kvferry.model.sampling import SamplingParams
from kvferry.model.transformer import Transformer
from kvferry.settings import SpeculativeConfig
from kvferry_kernels.dispatch import get_attention_backend
from tests.decode_worker.engines import collect_tokens, cpu_engine, push_random_prompt
from tests.waiting import until

BLOCK_SIZE = 4
PROMPT = 10
MAX_TOKENS = 24
POOL_BLOCKS = 40
REQUESTS = {"A": 1, "B": 2}  # request id -> the seed of its pushed prompt K/V


@pytest.fixture(scope="module")
def model(qwen3_checkpoint: Path) -> Transformer:
    return Transformer(load_model_config(qwen3_checkpoint), get_attention_backend("torch"),
                       torch.float32, torch.device("cpu"))


class Scripted:
    """Drafts from a known continuation (`reference`: the tokens decoding without drafts
    gives), spoilt after `right` drafts (None: never); counts what it was asked."""

    def __init__(self, reference: list[int], right: int | None, vocab: int) -> None:
        self.reference, self.right, self.vocab = reference, right, vocab
        self.seen = 0
        self.num_proposals = 0

    def extend(self, tokens: list[int]) -> None:
        self.seen += len(tokens)

    def propose(self, k: int) -> list[int]:
        self.num_proposals += 1
        drafts = self.reference[self.seen: self.seen + k]
        if self.right is not None:
            drafts = [t if j < self.right else (t + 1) % self.vocab for j, t in enumerate(drafts)]
        return drafts


def _engine(model: Transformer, speculative: SpeculativeConfig | None) -> DecodeEngine:
    return cpu_engine(model, BLOCK_SIZE, POOL_BLOCKS, speculative=speculative)


def _push(engine: DecodeEngine, request_id: str, seed: int) -> None:
    push_random_prompt(engine, request_id, PROMPT, seed)


def _decode(engine: DecodeEngine, params: SamplingParams,
            stop: list[int] | None = None) -> dict[str, list[int]]:
    """Both requests reserved, pushed and decoding together; each one's tokens (first
    included). Afterwards every block is free and the pool's integrity holds."""
    async def run() -> dict[str, list[int]]:
        engine.start()
        try:
            queues = {}
            for request_id, seed in REQUESTS.items():
                await engine.reserve(request_id, PROMPT, MAX_TOKENS, 30.0)
                _push(engine, request_id, seed)
                queues[request_id] = engine.attach(request_id, 7, params, MAX_TOKENS - 1,
                                                   stop or [])
            tokens: dict[str, list[int]] = {}
            for request_id, queue in queues.items():
                tokens[request_id] = await collect_tokens(queue, request_id, [7])
            await until(lambda: not engine.steps.running, "the step loop idle")
            stats = engine.stats(check_integrity=True)
            assert stats.integrity_ok, stats.integrity_error
            assert stats.free_blocks == POOL_BLOCKS, stats  # indexed blocks count as free
            return tokens
        finally:
            await engine.stop()
    return asyncio.run(run())


def _speculating(model: Transformer, k: int, make: Callable[[DecodeSeq], Scripted],
                 is_adaptive: bool = False) -> DecodeEngine:
    """An engine verifying `make`'s drafts: k every step unless `is_adaptive` (the
    controller then chooses, decode_worker/spec/control.py)."""
    engine = _engine(model, SpeculativeConfig("ngram", k, is_adaptive=is_adaptive))
    assert engine.steps.drafting is not None
    engine.steps.drafting.make_proposer = make
    return engine


@pytest.mark.parametrize("right", [None, 0, 2], ids=["right", "wrong", "right-then-wrong"])
@pytest.mark.parametrize("k", [3, 6])
def test_drafts_never_change_the_greedy_tokens(model: Transformer, right: int | None,
                                               k: int) -> None:
    greedy = SamplingParams(temperature=0.0)
    plain = _decode(_engine(model, None), greedy)
    proposers: dict[str, Scripted] = {}

    def make(seq: DecodeSeq) -> Scripted:
        proposers[seq.request_id] = Scripted(plain[seq.request_id], right,
                                             model.config.vocab_size)
        return proposers[seq.request_id]

    engine = _speculating(model, k, make)
    assert _decode(engine, greedy) == plain
    drafting = engine.steps.drafting
    assert drafting is not None and drafting.num_draft_tokens > 0
    if right is None:  # every draft right: k + 1 tokens a step, so few steps
        assert drafting.num_accepted_tokens == drafting.num_draft_tokens
        assert engine.steps.num_steps <= 2 * -(-(MAX_TOKENS - 1) // (k + 1)) + 2
    elif right == 0:  # every draft rolled back, one token a step as without drafts
        assert drafting.num_accepted_tokens == 0
        assert engine.steps.num_steps >= MAX_TOKENS - 1
    else:
        assert 0 < drafting.num_accepted_tokens < drafting.num_draft_tokens


def test_adaptive_drafting_pauses_wrong_drafts_and_keeps_right_ones(model: Transformer
                                                                    ) -> None:
    """With the controller on, a sequence whose drafts are all wrong soon stops drafting
    (pauses, then one-draft probes), while one whose drafts are right keeps k; tokens are
    the plain run's either way."""
    greedy = SamplingParams(temperature=0.0)
    plain = _decode(_engine(model, None), greedy)
    counts = {}
    for right, is_adaptive in ((None, True), (0, True), (0, False)):
        def make(seq: DecodeSeq, right: int | None = right) -> Scripted:
            return Scripted(plain[seq.request_id], right, model.config.vocab_size)

        engine = _speculating(model, 4, make, is_adaptive=is_adaptive)
        assert _decode(engine, greedy) == plain
        assert engine.steps.drafting is not None
        counts[right, is_adaptive] = (engine.steps.drafting.num_draft_tokens,
                                      engine.steps.drafting.num_accepted_tokens)
    wrong, fixed = counts[0, True], counts[0, False]
    assert wrong[1] == fixed[1] == 0 and wrong[0] < fixed[0] // 3, counts
    right = counts[None, True]
    assert right[0] == right[1] > 0, counts  # right drafts: every one verified and accepted
    assert right[0] >= 3 * len(REQUESTS) * (MAX_TOKENS - 2) // 5, counts  # at k near 4


def test_seeded_sampling_with_drafts_is_draw_for_draw_the_same(model: Transformer) -> None:
    sampled = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    plain = _decode(_engine(model, None), sampled)
    engine = _speculating(model, 4, lambda seq: Scripted(plain[seq.request_id], 2,
                                                         model.config.vocab_size))
    assert _decode(engine, sampled) == plain
    assert engine.steps.drafting is not None
    assert engine.steps.drafting.num_accepted_tokens > 0


def test_a_stop_token_among_accepted_drafts_ends_the_request_there(model: Transformer) -> None:
    greedy = SamplingParams(temperature=0.0)
    plain = _decode(_engine(model, None), greedy)
    generated = plain["A"][1:]
    # a token first generated mid-way, so right drafts run past it
    first = next(i for i, t in enumerate(generated) if i >= 2 and t not in generated[:i])
    stop = generated[first]
    expected = _decode(_engine(model, None), greedy, [stop])
    engine = _speculating(model, 6, lambda seq: Scripted(plain[seq.request_id], None,
                                                         model.config.vocab_size))
    assert _decode(engine, greedy, [stop]) == expected
    assert expected["A"] == plain["A"][:first + 2]  # the first token, then up to the stop


def test_rejected_drafts_blocks_are_freed_before_the_next_step(model: Transformer) -> None:
    """With wrong drafts a table never holds more than the next step's slots: the blocks
    past them (written by rejected drafts) go back to the pool."""
    greedy = SamplingParams(temperature=0.0)
    plain = _decode(_engine(model, None), greedy)
    engine = _speculating(model, 6, lambda seq: Scripted(plain[seq.request_id], 0,
                                                         model.config.vocab_size))
    steps = engine.steps
    grow = steps._grow
    most: list[int] = []

    def spy_grow() -> None:
        grow()
        assert steps.drafting is not None
        for seq in steps.running:
            # the next step's slots: next_position .. next_position + lookahead
            lookahead = steps.drafting.lookahead(seq)
            want = blocks_for_tokens(seq.next_position + 1 + lookahead, BLOCK_SIZE)
            most.append(len(seq.block_table) - want)

    steps._grow = spy_grow  # type: ignore[method-assign]
    assert _decode(engine, greedy) == plain
    assert most and max(most) <= 0


def test_speculation_refuses_a_dense_stage(model: Transformer) -> None:
    with pytest.raises(ValueError, match="no dense K/V stage"):
        cpu_engine(model, BLOCK_SIZE, POOL_BLOCKS, stage_bytes=1 << 20,
                   speculative=SpeculativeConfig("ngram", 2))
