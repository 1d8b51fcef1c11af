"""Draft proposers for speculative decoding (docs/spec-decode-design.md).

`NgramProposer` is prompt lookup: the drafts are the tokens that followed the latest earlier
occurrence of the sequence's last n tokens, trying n from `max_n` down to `min_n`. Answers
that copy spans of their prompts (editing code, quoting a document, repeating a list) get
long right drafts; elsewhere it finds no match and proposes nothing, which costs nothing.
One proposer per sequence, fed every token (prompt, then each accepted one), so a proposal
is a dict lookup per n and never a scan of the context.
"""

from __future__ import annotations

from collections.abc import Iterable

DEFAULT_MIN_N = 2
DEFAULT_MAX_N = 4


class NgramProposer:
    def __init__(self, min_n: int = DEFAULT_MIN_N, max_n: int = DEFAULT_MAX_N) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # n-gram -> the position after its latest occurrence that ends before the last
        # token (so the sequence's own suffix is never its match).
        self._after: dict[tuple[int, ...], int] = {}

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens) - 1  # n-grams ending just before the new token
            for n in range(self.min_n, self.max_n + 1):
                if end >= n:
                    self._after[tuple(self.tokens[end - n: end])] = end

    def truncate(self, num_tokens: int) -> None:
        """Forget tokens past `num_tokens` (rolled back), rebuilding the index."""
        if num_tokens < len(self.tokens):
            kept = self.tokens[:num_tokens]
            self.tokens, self._after = [], {}
            self.extend(kept)

    def propose(self, k: int) -> list[int]:
        """Up to `k` drafts: what followed the latest earlier occurrence of the longest
        suffix n-gram that occurred before ([] when none did)."""
        if k <= 0:
            return []
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(self.tokens) < n:
                continue
            start = self._after.get(tuple(self.tokens[-n:]))
            if start is not None:
                return self.tokens[start: start + k]
        return []
