from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from router.detok import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(qwen3_checkpoint: Path):
    return AutoTokenizer.from_pretrained(qwen3_checkpoint)


def _stream(tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces = []
    for token in ids:
        step = detok.add([token])
        pieces.append(step.text)
        if step.is_stopped:
            return pieces, True
    pieces.append(detok.finish())
    return pieces, False


def test_multibyte_characters_are_never_split(tokenizer) -> None:
    text = "naïve 日本語 🚀 ok"
    ids = tokenizer.encode(text)
    # Make sure the test exercises tokens that end mid-character.
    partial = [tokenizer.decode(ids[:i]) for i in range(1, len(ids))]
    assert any(p.endswith("\ufffd") for p in partial)
    pieces, stopped = _stream(tokenizer, ids)
    assert not stopped
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_invalid_bytes_are_flushed_at_the_end(tokenizer) -> None:
    ids = tokenizer.encode("日本")
    truncated = ids[:-1] if len(ids) > 1 else ids
    pieces, _ = _stream(tokenizer, truncated)
    assert "".join(pieces) == tokenizer.decode(truncated)


def test_stop_string_cuts_text_and_holds_back_prefixes(tokenizer) -> None:
    ids = tokenizer.encode("The quick brown fox jumps")
    pieces, stopped = _stream(tokenizer, ids, stop=("brown",))
    assert stopped
    assert "".join(pieces) == "The quick "
    assert all("bro" not in piece for piece in pieces)


def test_stop_string_absent_releases_everything(tokenizer) -> None:
    ids = tokenizer.encode("The quick brown fox")
    pieces, stopped = _stream(tokenizer, ids, stop=("zebra", "xy"))
    assert not stopped and "".join(pieces) == "The quick brown fox"
