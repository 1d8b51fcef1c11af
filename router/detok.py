"""Incremental detokenization with stop strings.

Text is released only once it is final: a byte-level token may end mid-character (the decoded
tail is U+FFFD until the rest arrives), and with stop strings the last len(longest stop) - 1
characters are held back, since they might begin a stop string. Concatenating every released
piece equals the decoded completion (cut before the stop string, when one matched).
"""

from __future__ import annotations

from typing import NamedTuple

from tokenizers.decoders import DecodeStream


class DetokStep(NamedTuple):
    text: str  # newly released text
    is_stopped: bool  # a stop string matched; generation must end


class IncrementalDetokenizer:
    """Per request. Token by token through `tokenizers`' DecodeStream (Rust; it holds back
    bytes of an incomplete character), and one full decode at the end, so the released text
    always equals `tokenizer.decode(all ids)` even when the stream ends mid-character."""

    def __init__(self, tokenizer: object, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer  # type: ignore[attr-defined]
        self._stream = DecodeStream(skip_special_tokens=True)
        self._stop = stop
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self.text = ""  # final text so far (after any stop cut)
        self._released = 0

    def _advance(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            piece = self._stream.step(self._backend, token_id)
            if piece:
                self.text += piece

    def _find_stop(self, search_from: int) -> int | None:
        hits = [i for s in self._stop if (i := self.text.find(s, search_from)) >= 0]
        return min(hits) if hits else None

    def add(self, token_ids: list[int]) -> DetokStep:
        """Feed generated tokens; release what is final."""
        before = len(self.text)
        self._ids.extend(token_ids)
        self._advance(token_ids)
        if self._stop:
            cut = self._find_stop(max(0, before - self._holdback))
            if cut is not None:
                self.text = self.text[:cut]
                return DetokStep(self._release(len(self.text)), True)
        return DetokStep(self._release(len(self.text) - self._holdback), False)

    def finish(self) -> str:
        """The stream is ending: release everything, incomplete characters included."""
        before = len(self.text)
        full = self._tokenizer.decode(self._ids, skip_special_tokens=True)  # type: ignore[attr-defined]
        if full.startswith(self.text):  # adds what the stream held back (a cut character)
            self.text = full
        if self._stop:
            cut = self._find_stop(max(0, before - self._holdback))
            if cut is not None:
                self.text = self.text[:cut]
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        upto = max(upto, self._released)
        piece = self.text[self._released:upto]
        self._released = upto
        return piece
