"""Prompt sizes bounded before any tokenizer work: a conversation of more messages than the
router takes, and a prompt that could not fit the model's context whatever the tokenizer makes
of it, are refused before the chat template renders it or the tokenizer encodes it (a 4 MiB
conversation used to render to 1.8 million tokens on the tokenizer thread before the context
check refused it).

The estimate is a lower bound, so that nothing that would fit is refused: a token never
stands for more UTF-8 bytes than its vocabulary entry takes (byte-level and SentencePiece
entries take at least as many bytes as they stand for), normalization shrinks text by at most
`NORMALIZE_SHRINK` (NFKC turns a 4-byte letter into a 1-byte one), and each message adds at
least the tokens the chat template puts around an empty message, measured once, less one
token at each end for merges with its content.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvferry.errors import InvalidArgument
from kvferry.settings.limits import PublicLimits
from router.validation import GenerateInput

log = logging.getLogger("kvferry.router")

NORMALIZE_SHRINK = 4  # input bytes per normalized byte, at most


@dataclass(frozen=True)
class PromptBounds:
    """What the tokenizer makes of text, at the least: one token per `max_token_bytes` UTF-8
    bytes (after normalization), `min_message_tokens` per chat message."""

    max_token_bytes: int
    min_message_tokens: int = 0

    @classmethod
    def of(cls, tokenizer: object) -> PromptBounds:
        """Measured on a Hugging Face tokenizer once; without a vocabulary, no bound (every
        prompt goes to the tokenizer)."""
        get_vocab = getattr(tokenizer, "get_vocab", None)
        vocab = get_vocab() if get_vocab is not None else {}
        if not vocab:
            return cls(max_token_bytes=0)
        longest = max(len(token.encode("utf-8", "surrogatepass")) for token in vocab)
        return cls(max(1, longest), _min_message_tokens(tokenizer))

    def min_tokens(self, num_bytes: int, num_messages: int) -> int:
        """The fewest tokens a prompt of `num_bytes` UTF-8 bytes (of content) in
        `num_messages` chat messages (0: text) can become."""
        if self.max_token_bytes == 0:
            return 0
        return (num_bytes // (NORMALIZE_SHRINK * self.max_token_bytes)
                + num_messages * self.min_message_tokens)


def _min_message_tokens(tokenizer: object) -> int:
    """Tokens the chat template adds per message at the least (0 when unmeasurable)."""
    if not getattr(tokenizer, "chat_template", None):
        return 0

    def rendered(*roles: str) -> int:
        conversation = [{"role": role, "content": ""} for role in roles]
        return len(tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False))

    try:
        user = rendered("user")
        pair = rendered("user", "assistant")
        added = (pair - user, rendered("user", "assistant", "user") - pair,
                 rendered("system", "user") - user)
    except Exception as exc:  # a template that refuses these: no per-message bound
        log.info("chat template: no per-message token bound (%s)", exc)
        return 0
    return max(0, min(added) - 2)


def check_prompt_bounds(inp: GenerateInput, context: int, limits: PublicLimits,
                        bounds: PromptBounds) -> None:
    """Refuses a conversation of more than --max-chat-messages messages, and a prompt (text
    or messages) that cannot fit `context` tokens by `bounds`' estimate, before tokenizing."""
    if inp.messages is not None:
        if len(inp.messages) > limits.max_chat_messages:
            raise InvalidArgument(
                f"input.messages: {len(inp.messages)} messages, more than the router's limit "
                f"of {limits.max_chat_messages} (--max-chat-messages)", "input.messages")
        num_bytes = sum(len(m.content.encode("utf-8", "surrogatepass")) for m in inp.messages)
        floor = bounds.min_tokens(num_bytes, len(inp.messages))
    elif inp.text is not None:
        num_bytes = len(inp.text.encode("utf-8", "surrogatepass"))
        floor = bounds.min_tokens(num_bytes, 0)
    else:
        return
    if floor >= context:
        raise InvalidArgument(
            f"input: the prompt is at least {floor} tokens ({num_bytes} UTF-8 bytes"
            f"{f' in {len(inp.messages)} messages' if inp.messages is not None else ''}), "
            f"more than fit the model's context of {context}", "input")
