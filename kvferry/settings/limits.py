"""The router's public input limits: what one public request may carry, and how many
requests and HTTP connections may be open at once. One frozen record; each field is a router
flag of the same name, with its help in LIMIT_HELP (docs/security.md lists them all)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublicLimits:
    """What one public request may carry, and how many requests (both fronts together) and
    HTTP connections may be open at once. Past a limit a request gets INVALID_ARGUMENT naming
    the field (RESOURCE_EXHAUSTED for open requests) before anything is tokenized or sent
    downstream. Each is a router flag of the
    same name (--max-request-id-bytes, ...), documented in LIMIT_HELP."""

    max_request_id_bytes: int = 128
    max_stop_strings: int = 16
    max_stop_bytes: int = 4096  # all stop strings together, UTF-8
    max_prompt_bytes: int = 1 << 20  # prompt text, or all chat messages' content, UTF-8
    max_streams: int = 1024  # open requests, gRPC streams and HTTP together
    max_chat_messages: int = 1024  # messages of one chat conversation
    max_samples: int = 16  # SamplingParams.n, OpenAI's n
    # The HTTP front's connections (router/http/conn.py): bytes of a request head, seconds to
    # receive one (and the longest gap inside a body), connections open at once (fewer where
    # the file-descriptor limit could not hold them), seconds an idle keep-alive one stays.
    http_max_header_bytes: int = 64 << 10
    http_header_timeout_s: int = 10
    http_max_connections: int = 4096
    http_keep_alive_s: int = 5

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")

    @classmethod
    def flags(cls) -> list[tuple[str, int, str]]:
        """(flag, default, help) of each limit, for the router's command line."""
        defaults = cls()
        return [("--" + name.replace("_", "-"), getattr(defaults, name), LIMIT_HELP[name])
                for name in cls.__dataclass_fields__]

    @classmethod
    def from_flags(cls, args: object) -> PublicLimits:
        """From parsed flags (an argparse.Namespace) named as in `flags()`."""
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})


LIMIT_HELP = {
    "max_request_id_bytes": "longest request_id a client may choose (UTF-8 bytes)",
    "max_stop_strings": "most stop strings per request",
    "max_stop_bytes": "most UTF-8 bytes of all stop strings of a request together",
    "max_prompt_bytes": "most UTF-8 bytes of prompt text (or of all chat messages' content)",
    "max_streams": "most requests open at once, both public ports together (gRPC Generate "
                   "streams and HTTP requests); more get RESOURCE_EXHAUSTED (HTTP: 429)",
    "max_samples": "most samples of one request (gRPC sampling.n, OpenAI n): each decodes "
                   "as a sequence of its own, sharing the prompt's K/V",
    "max_chat_messages": "most messages in one chat conversation (gRPC messages input, HTTP "
                         "chat completions: checked before the body is validated)",
    "http_max_header_bytes": "HTTP: most bytes of a request line and headers; past it 431 and "
                             "the connection is closed",
    "http_header_timeout_s": "HTTP: seconds a connection has to send a whole request head "
                             "(and the longest pause inside a body) before it is closed",
    "http_max_connections": "HTTP: most connections open at once (lowered to what the "
                            "file-descriptor limit holds); more are closed when accepted",
    "http_keep_alive_s": "HTTP: seconds an idle keep-alive connection stays open",
}
