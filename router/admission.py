"""A public request admitted: validated once at the edge and turned into the one record its
legs read (`Admitted`, router/request.py): its prompt ids, sampling, stop ids, deadline and
cache namespace. Both fronts (router/server.py, router/http/front.py) call `Admission.admit`
and hand the record to the engine. Every bad field is refused here with InvalidArgument
naming it, before anything is reserved or sent downstream, in this order:

1. sizes, before any work (`check_limits`): the request id, cache salt, stop strings and
   prompt within the router's PublicLimits, text encodable as UTF-8, and a prompt that could
   not fit the model's context whatever the tokenizer makes of it (`check_prompt_bounds`);
2. the prompt's token ids (`prompt_ids`): given ones checked against the vocabulary, text
   encoded, chat messages rendered by the chat template, off the event loop;
3. sampling resolved against the prompt's length (`resolve_sampling`) and the stop ids.

Prompt bounds. The estimate is a lower bound, so that nothing that would fit is refused: a
token never stands for more UTF-8 bytes than its vocabulary entry takes (byte-level and
SentencePiece entries take at least as many bytes as they stand for), normalization shrinks
text by at most `NORMALIZE_SHRINK` (NFKC turns a 4-byte letter into a 1-byte one), and each
message adds at least the tokens the chat template puts around an empty message, measured
once, less one token at each end for merges with its content. (A 4 MiB conversation used to
render to 1.8 million tokens on the tokenizer thread before the context check refused it.)
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvferry.cache.budget import KvBudget
from kvferry.cache.prefix import MAX_CACHE_SALT_BYTES
from kvferry.errors import InvalidArgument
from kvferry.model.config import ModelConfig
from kvferry.model.grammar import check_constraint
from kvferry.model.sampling import SamplingParams
from kvferry.settings.limits import PublicLimits
from router.identity import Caller, tenant_salt
from router.request import CHAT_ROLES, Admitted, ChatMessage, GenerateInput

log = logging.getLogger("kvferry.router")

TOKENIZE_QUEUE = 2  # prompts queued on the tokenizer thread at once
NORMALIZE_SHRINK = 4  # input bytes per normalized byte, at most


class Admission:
    def __init__(self, config: ModelConfig, tokenizer: object, limits: PublicLimits,
                 kv_budget: KvBudget, max_model_len: Callable[[], int] | None = None) -> None:
        self.config, self.tokenizer, self.limits = config, tokenizer, limits
        self.kv_budget = kv_budget
        # the longest prompt + completion now (the context, or less: the largest decode
        # pool), which an unset max_tokens is clamped to
        self.max_model_len = max_model_len or (lambda: config.max_position_embeddings)
        self.prompt_bounds = PromptBounds.of(tokenizer)  # sizes refused before tokenizing
        # Tokenization and chat templates run here, one at a time, off the event loop.
        self._tokenize = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        # Prompts handed to that thread at once: the rest wait here, where a client that
        # leaves costs nothing, instead of in the executor's unbounded queue.
        self._tokenize_slots = asyncio.Semaphore(TOKENIZE_QUEUE)

    async def admit(self, inp: GenerateInput, timeout_s: float | None, caller: Caller
                    ) -> Admitted:
        """The request's record; InvalidArgument naming the first bad field."""
        received = time.perf_counter()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        config = self.config
        check_limits(inp, config, self.limits)
        check_prompt_bounds(inp, config.max_position_embeddings, self.limits,
                            self.prompt_bounds)
        if inp.token_ids is not None:  # no tokenizer work: checked right here
            prompt = prompt_ids(inp, config, self.tokenizer)
        else:
            async with self._tokenize_slots:
                prompt = await asyncio.get_running_loop().run_in_executor(
                    self._tokenize, prompt_ids, inp, config, self.tokenizer)
        stops = tuple(stop_ids(inp.params, config))
        params = resolve_sampling(inp, config, len(prompt), self.limits,
                                  self.kv_budget.is_bounded, self.max_model_len())
        if params.constraint is not None:  # a bad schema refused before any worker's time
            async with self._tokenize_slots:
                await asyncio.get_running_loop().run_in_executor(
                    self._tokenize, check_constraint, config, params.constraint)
        return Admitted(inp.request_id, prompt, params, stops, received, deadline,
                        tenant_salt(caller.tenant, inp.cache_salt))


# ---- 1. sizes, before any work ---------------------------------------------------------------
def check_utf8(field: str, text: str) -> None:
    """Refuse text that UTF-8 cannot encode: a lone surrogate, which JSON's `"\\ud800"`
    escape makes (protobuf refuses it when parsing, kvferry.rpc.proto_utf8)."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        raise InvalidArgument(f"{field}: not valid Unicode text (a lone surrogate "
                              f"{text[exc.start]!a} at character {exc.start})", field) from None


def check_texts(inp: GenerateInput) -> None:
    """Every text field of a request is encodable UTF-8, each named when not."""
    check_utf8("request_id", inp.request_id)
    check_utf8("cache_salt", inp.cache_salt)
    for stop in inp.params.stop:
        check_utf8("sampling.stop", stop)
    if inp.text is not None:
        check_utf8("input.text", inp.text)
    for i, message in enumerate(inp.messages or ()):
        check_utf8(f"input.messages[{i}].role", message.role)
        check_utf8(f"input.messages[{i}].content", message.content)


def check_limits(inp: GenerateInput, config: ModelConfig, limits: PublicLimits) -> None:
    """Sizes only, before any work: the request id, stop strings and prompt are within the
    router's PublicLimits (and token ids within the context), each named when not. Text that
    is not encodable UTF-8 is refused first (`check_texts`)."""
    check_texts(inp)
    def refuse(field: str, what: str, size: int, limit: int, flag: str) -> None:
        if size > limit:
            raise InvalidArgument(f"{field}: {what} {size}, more than the router's limit of "
                                  f"{limit} ({flag})", field)

    refuse("request_id", "UTF-8 bytes", len(inp.request_id.encode()),
           limits.max_request_id_bytes, "--max-request-id-bytes")
    refuse("cache_salt", "UTF-8 bytes", len(inp.cache_salt.encode()), MAX_CACHE_SALT_BYTES,
           "the workers' limit")
    stop = inp.params.stop
    refuse("sampling.stop", "stop strings", len(stop), limits.max_stop_strings,
           "--max-stop-strings")
    refuse("sampling.stop", "UTF-8 bytes of stop strings", sum(len(x.encode()) for x in stop),
           limits.max_stop_bytes, "--max-stop-bytes")
    if inp.text is not None:
        refuse("input.text", "UTF-8 bytes", len(inp.text.encode()), limits.max_prompt_bytes,
               "--max-prompt-bytes")
    if inp.messages is not None:
        refuse("input.messages", "UTF-8 bytes of content",
               sum(len(m.content.encode()) + len(m.role.encode()) for m in inp.messages),
               limits.max_prompt_bytes, "--max-prompt-bytes")
    if inp.token_ids is not None:
        refuse("input.token_ids", "tokens", len(inp.token_ids),
               config.max_position_embeddings, "the model's context")


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


# ---- 2. the prompt's token ids --------------------------------------------------------------
def prompt_ids(inp: GenerateInput, config: ModelConfig, tokenizer: object) -> list[int]:
    """The prompt's token ids: given ones checked against the vocabulary, text encoded, or
    chat messages rendered by the chat template."""
    if inp.messages is not None:
        prompt = chat_prompt_ids(inp.messages, tokenizer)
    elif inp.token_ids is not None:
        prompt = list(inp.token_ids)
        vocab = config.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InvalidArgument(
                f"input.token_ids: {bad[0]} is outside the vocabulary [0, {vocab})",
                "input.token_ids",
            )
    elif inp.text:
        prompt = tokenizer.encode(inp.text)  # type: ignore[attr-defined]
    else:
        prompt = []
    if not prompt:
        raise InvalidArgument("input: the prompt is empty", "input")
    return prompt


def chat_prompt_ids(messages: tuple[ChatMessage, ...], tokenizer: object) -> list[int]:
    """The conversation rendered by the checkpoint's own chat template, with the generation
    prompt for the assistant's next turn, as token ids."""
    if not messages:
        raise InvalidArgument("input.messages: the conversation is empty", "input.messages")
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            field = f"input.messages[{i}].role"
            raise InvalidArgument(
                f"{field}: {message.role!r} is not one of {', '.join(CHAT_ROLES)}", field)
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("input.messages: the model has no chat template; send text or "
                              "token_ids", "input.messages")
    from jinja2 import TemplateError

    conversation = [{"role": "system" if m.role == "developer" else m.role,
                     "content": m.content} for m in messages]
    try:
        ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    except TemplateError as exc:  # the template itself refused the conversation
        raise InvalidArgument(f"input.messages: the chat template refused it: {exc}",
                              "input.messages") from exc
    return [int(t) for t in ids]


# ---- 3. sampling and stop ids ---------------------------------------------------------------
def resolve_sampling(inp: GenerateInput, config: ModelConfig, num_prompt: int,
                     limits: PublicLimits | None = None, is_generation_bounded: bool = False,
                     max_model_len: int | None = None) -> SamplingParams:
    """Validated sampling parameters; an unset max_tokens becomes min(the front's default,
    context left): the default is `params.max_tokens` (256, or 16 on /v1/completions, as
    OpenAI's). `is_generation_bounded` (the decode workers evict K/V): max_tokens may pass
    the context (unset, the default). `max_model_len`: the limit in force when less than
    the context (the largest decode pool), which clamps an unset max_tokens too, as vLLM
    clamps to its max_model_len."""
    params = inp.params
    if params.kv_eviction == "none":  # this request keeps every token: the context bounds it
        is_generation_bounded = False
    room = config.max_position_embeddings - num_prompt
    if room < 1:
        raise InvalidArgument(
            f"input: prompt of {num_prompt} tokens fills the model's context of "
            f"{config.max_position_embeddings}", "input",
        )
    if not inp.is_max_tokens_set:
        left = min(room, (max_model_len or room + num_prompt) - num_prompt)
        params = dataclasses.replace(params, max_tokens=(
            params.max_tokens if is_generation_bounded else min(params.max_tokens,
                                                                left if left > 0 else room)))
    params.validate(config.vocab_size)
    most = (limits or PublicLimits()).max_samples
    if params.n > most:
        raise InvalidArgument(f"sampling.n: at most {most} samples per request "
                              f"(--max-samples), got {params.n}", "sampling.n")
    if params.max_tokens > room and not is_generation_bounded:
        raise InvalidArgument(
            f"sampling.max_tokens: prompt {num_prompt} + max_tokens {params.max_tokens} "
            f"exceeds the context of {config.max_position_embeddings}",
            "sampling.max_tokens",
        )
    return params


def stop_ids(params: SamplingParams, config: ModelConfig) -> list[int]:
    """Token ids that end generation: the stop ids, plus end-of-sequence unless ignore_eos."""
    ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        ids.update(config.eos_token_ids)
    return sorted(ids)
