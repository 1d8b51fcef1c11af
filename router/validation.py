"""Public-request validation: every bad field is refused with InvalidArgument naming it,
before anything is reserved or sent downstream."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvferry.cache.prefix import check_cache_salt
from kvferry.errors import InvalidArgument
from kvferry.model.config import ModelConfig
from kvferry.model.sampling import DEFAULT_MAX_TOKENS, SamplingParams
from kvferry.settings.limits import PublicLimits

CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation; `role` is one of CHAT_ROLES once validated."""

    role: str
    content: str


@dataclass(frozen=True)
class GenerateInput:
    """A Generate request as the router engine sees it: exactly one of text, token_ids and
    messages is set (or none, which is refused as an empty prompt)."""

    request_id: str
    text: str | None
    token_ids: list[int] | None
    params: SamplingParams
    is_max_tokens_set: bool
    messages: tuple[ChatMessage, ...] | None = None
    cache_salt: str = ""  # prefix-cache namespace (kvferry/cache/prefix.py)


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

    conversation = [{"role": m.role, "content": m.content} for m in messages]
    try:
        ids = tokenizer.apply_chat_template(  # type: ignore[attr-defined]
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False)
    except TemplateError as exc:  # the template itself refused the conversation
        raise InvalidArgument(f"input.messages: the chat template refused it: {exc}",
                              "input.messages") from exc
    return [int(t) for t in ids]


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
    check_cache_salt(inp.cache_salt)
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


def resolve_sampling(inp: GenerateInput, config: ModelConfig, num_prompt: int,
                     limits: PublicLimits | None = None, is_generation_bounded: bool = False
                     ) -> SamplingParams:
    """Validated sampling parameters; an unset max_tokens becomes min(256, context left).
    `is_generation_bounded` (the decode workers evict K/V): max_tokens may pass the context
    (unset, 256)."""
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
        params = dataclasses.replace(params, max_tokens=(
            DEFAULT_MAX_TOKENS if is_generation_bounded else min(DEFAULT_MAX_TOKENS, room)))
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
