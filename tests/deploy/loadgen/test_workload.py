"""Workloads: exact token lengths, shared prefixes, files, seeded reproducibility."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.loadgen.workload import (
    BenchRequest,
    Conversation,
    JsonlWorkload,
    MixedWorkload,
    MultiTurnWorkload,
    RandomWorkload,
    SharedPrefixWorkload,
    ShareGptWorkload,
)


def test_random_lengths_and_vocab_range() -> None:
    requests = RandomWorkload(input_len=100, output_len=20, range_ratio=0.5).build(200, 50, 0)
    assert len(requests) == 200
    for r in requests:
        assert isinstance(r.prompt, tuple) and r.prompt_len == len(r.prompt)
        assert 50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30
        assert all(0 <= t < 50 for t in r.prompt)
    assert len({r.prompt_len for r in requests}) > 20  # lengths do vary
    assert RandomWorkload(100, 20, 0.5).build(200, 50, 0) == requests  # same seed
    assert RandomWorkload(100, 20, 0.5).build(200, 50, 1) != requests


def test_random_fixed_lengths_and_prefix() -> None:
    requests = RandomWorkload(input_len=8, output_len=4, prefix_len=5).build(3, 1000, 0)
    assert [(r.prompt_len, r.output_len) for r in requests] == [(13, 4)] * 3
    assert len({r.prompt[:5] for r in requests}) == 1
    assert len({r.prompt[5:] for r in requests}) == 3


def test_shared_prefix_cycles_prefixes() -> None:
    workload = SharedPrefixWorkload(num_prefixes=3, prefix_len=16, suffix_len=4, output_len=2)
    requests = workload.build(9, 1000, seed=7)
    prefixes = [r.prompt[:16] for r in requests]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 3 for p in set(prefixes))
    assert {r.prompt_len for r in requests} == {20}
    assert workload.build(9, 1000, seed=7) == requests


def test_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there", "output_len": 5}\n\n'
                    '{"prompt_token_ids": [1, 2, 3]}\n')
    requests = JsonlWorkload(path, output_len=7, count_tokens=lambda s: len(s.split())
                             ).build(4, 1000, seed=0)
    expected = {BenchRequest("hello there", 5, 2), BenchRequest((1, 2, 3), 7, 3)}
    assert set(requests) == expected
    assert len(requests) == 4 and requests[:2] == requests[2:]  # cycles through the file
    path.write_text('{"text": "no"}\n')
    with pytest.raises(ValueError, match="prompt"):
        JsonlWorkload(path).build(1, 1000, 0)


def test_sharegpt(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "one two three four five"},
                           {"from": "gpt", "value": "a b c d e f"}]},
        {"conversations": [{"from": "human", "value": "too short"},
                           {"from": "gpt", "value": "a b c d"}]},
        {"conversations": [{"from": "human", "value": "only one turn"}]},
    ]))
    words = ShareGptWorkload(path, count_tokens=lambda s: len(s.split())).build(2, 1000, 0)
    assert words == [BenchRequest("one two three four five", 6, 5)] * 2  # vLLM's filters
    fixed = ShareGptWorkload(path, output_len=9).build(2, 1000, 0)
    assert {r.prompt for r in fixed} == {"one two three four five", "too short"}
    assert {r.output_len for r in fixed} == {9}
    with pytest.raises(ValueError, match="output_len"):
        ShareGptWorkload(path).build(1, 1000, 0)


def test_bad_random_arguments() -> None:
    with pytest.raises(ValueError, match="range_ratio"):
        RandomWorkload(range_ratio=1.0).build(1, 10, 0)
    with pytest.raises(ValueError, match="output_len"):
        RandomWorkload(output_len=0).build(1, 10, 0)


def test_mixed_workload_interleaves_tagged_parts() -> None:
    workload = MixedWorkload((("short", RandomWorkload(8, 4), 3.0),
                              ("long", RandomWorkload(200, 4), 1.0)))
    requests = workload.build(400, 1000, seed=2)
    tags = [r.tag for r in requests]
    assert set(tags) == {"short", "long"} and 0.65 < tags.count("short") / 400 < 0.85
    assert {r.prompt_len for r in requests if r.tag == "short"} == {8}
    assert {r.prompt_len for r in requests if r.tag == "long"} == {200}
    assert tags[:20] != sorted(tags[:20])  # interleaved, not in blocks
    assert workload.build(400, 1000, seed=2) == requests
    with pytest.raises(ValueError, match="parts"):
        MixedWorkload((("x", RandomWorkload(), 0.0),)).build(1, 10, 0)


def test_multi_turn_conversations_are_seeded() -> None:
    workload = MultiTurnWorkload(num_turns=3, input_len=20, turn_len=6, output_len=4,
                                 think_time_s=0.5)
    conversations = workload.build(5, 100, seed=3)
    assert len(conversations) == 5
    for c in conversations:
        assert [len(m) for m in c.messages] == [20, 6, 6]
        assert (c.num_turns, c.output_len, c.think_time_s) == (3, 4, 0.5)
        assert all(0 <= t < 100 for m in c.messages for t in m)
    assert len({c.messages[0] for c in conversations}) == 5  # every chat its own
    assert workload.build(5, 100, seed=3) == conversations
    assert workload.build(5, 100, seed=4) != conversations
    assert workload.build(2, 100, seed=3) == conversations[:2]  # more chats extend the list


def test_a_turn_extends_the_previous_prompt_and_answer() -> None:
    conversation = Conversation(((1, 2, 3), (8, 9), (5,)), output_len=2)
    first = conversation.next_prompt((), [], 0)
    second = conversation.next_prompt(first, [40, 41], 1)
    third = conversation.next_prompt(second, [50, 51], 2)
    assert first == (1, 2, 3)
    assert second == (1, 2, 3, 40, 41, 8, 9)
    assert third == (1, 2, 3, 40, 41, 8, 9, 50, 51, 5)


@pytest.mark.parametrize("field", ["num_turns", "input_len", "turn_len", "output_len"])
def test_bad_multi_turn_arguments(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MultiTurnWorkload(**{field: 0}).build(1, 10, 0)
    with pytest.raises(ValueError, match="think_time_s"):
        MultiTurnWorkload(think_time_s=-1.0).build(1, 10, 0)
