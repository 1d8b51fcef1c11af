"""Prompt-lookup drafts: the continuation of the latest earlier occurrence of the longest
suffix n-gram, kept incrementally and equal to a scan of the whole context."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from decode_worker.spec.ngram import NgramProposer


def _scan(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The same answer by brute force: for n = max..min, the last earlier occurrence."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # ends before the last token
            if tokens[start: start + n] == suffix:
                return tokens[start + n: start + n + k]
    return []


def test_an_answer_copying_its_prompt_gets_the_copy_as_drafts() -> None:
    proposer = NgramProposer(2, 3)
    prompt = [5, 9, 2, 7, 7, 1, 8, 3, 6]
    proposer.extend(prompt + [0, 2, 7])  # the answer starts quoting at "2 7"
    assert proposer.propose(4) == [7, 1, 8, 3]
    assert proposer.propose(0) == []
    proposer.extend([4])  # "7 4" never occurred; nor does "4" alone count (min_n 2)
    assert proposer.propose(4) == []


def test_the_longest_match_wins_and_the_latest_occurrence_of_it() -> None:
    proposer = NgramProposer(1, 3)
    proposer.extend([1, 2, 3, 10, 9, 2, 3, 11, 1, 2, 3])
    assert proposer.propose(1) == [10]  # "1 2 3" (n = 3) beats "2 3" (latest: 11)
    proposer.extend([12, 3])  # only "3" occurred before; its latest earlier one is at 10
    assert proposer.propose(2) == [12, 3]


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), max_size=60), k=st.integers(0, 5),
       sizes=st.tuples(st.integers(1, 3), st.integers(0, 2)), cut=st.integers(0, 60))
def test_incremental_equals_a_scan_and_rolls_back(tokens: list[int], k: int,
                                                  sizes: tuple[int, int], cut: int) -> None:
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    proposer = NgramProposer(min_n, max_n)
    for i, token in enumerate(tokens):
        proposer.extend([token])
        assert proposer.propose(k) == _scan(tokens[: i + 1], k, min_n, max_n)
    proposer.truncate(cut)
    assert proposer.propose(k) == _scan(tokens[:cut], k, min_n, max_n)
