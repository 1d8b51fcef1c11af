"""The `kvferry` commands the README and docs/ show, as argument lists: every fenced shell
line that runs kvferry, and every inline `kvferry ...` span. Usage placeholders become values:
`[...]` brackets and `...` go, `A \\| B` keeps A, `generate|chat` keeps the first, an all-caps
word (HOST:PORT, DIR, N) becomes a value, and a flag shown without its value gets one.
tests/test_doc_commands.py parses them all; the security tests run docs/security.md's TLS
commands as written."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCE = re.compile(r"```(?:bash|sh|console)?\n(.*?)```", re.S)
_INLINE = re.compile(r"`((?:\.venv/bin/)?kvferry [^`]+)`")


class DocCommand(NamedTuple):
    source: str  # file name
    text: str  # as the doc writes it

    def argv(self, parser: argparse.ArgumentParser | None = None) -> list[str]:
        """The arguments after `kvferry`, placeholders filled (see the module docstring);
        with `parser`, flags shown without a value get one where they take one."""
        text = self.text.split(" #")[0]
        text = re.sub(r"\s*\\\|[^\]]*", "", text)  # [A \| B] -> [A
        text = text.replace("[", " ").replace("]", " ").replace("...", " ")
        words = shlex.split(text)
        words = words[words.index("kvferry") + 1:] if "kvferry" in words else \
            words[next(i for i, w in enumerate(words) if w.endswith("/kvferry")) + 1:]
        if words and "|" in words[0]:
            words[0] = words[0].split("|")[0]
        filled = []
        for word in words:
            if word == "HOST:PORT":
                word = "127.0.0.1:1"
            elif re.fullmatch(r"[A-Z][A-Z0-9_]*", word) or word.endswith(":MS"):
                word = re.sub(r"[A-Z][A-Z0-9_]*$", "1", word)
            filled.append(word)
        return _give_values(filled, parser) if parser is not None else filled


def _give_values(words: list[str], parser: argparse.ArgumentParser) -> list[str]:
    commands = next((a.choices for a in parser._actions
                     if isinstance(a, argparse._SubParsersAction)), {})
    command = commands.get(words[0]) if words else None
    if command is None:
        return words
    takes = {flag: action.nargs != 0 for action in command._actions
             for flag in action.option_strings}
    out = []
    for i, word in enumerate(words):
        out.append(word)
        bare = i + 1 == len(words) or words[i + 1].startswith("--")
        if word.startswith("--") and "=" not in word and takes.get(word) and bare:
            out.append("1")
    return out


def doc_commands() -> list[DocCommand]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for block in _FENCE.findall(text):
            for line in block.replace("\\\n", " ").splitlines():
                if re.match(r"\s*(exec\s+)?(\.venv/bin/)?kvferry\s", line):
                    found.append(DocCommand(path.name, line.strip()))
        for span in _INLINE.findall(text):
            found.append(DocCommand(path.name, " ".join(span.split())))
    return found


def find(source: str, prefix: str) -> DocCommand:
    """The one command of `source` that starts with `prefix` (as written)."""
    hits = [c for c in doc_commands() if c.source == source and c.text.startswith(prefix)]
    if len(hits) != 1:
        raise LookupError(f"{source}: {len(hits)} commands start with {prefix!r}")
    return hits[0]
