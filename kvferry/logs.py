"""Process logging: plain text or JSON lines, each record carrying the request id it is about.

Servers set `request_id` (a context variable) when a handler learns which request it serves;
asyncio tasks inherit it, so every record logged on that request's path through router,
prefill and decode carries the same id. Code that logs for a request outside its context
(a decode step loop finishing many requests) passes `extra={"request_id": ...}` instead.
"""

from __future__ import annotations

import contextvars
import logging

from pythonjsonlogger.json import JsonFormatter

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")

TEXT_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
JSON_FIELDS = "%(asctime)s %(name)s %(levelname)s %(process)d %(message)s %(request_id)s"


class RequestIdFilter(logging.Filter):
    """Give every record a `request_id` attribute (explicit `extra` wins over the context)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = request_id.get()
        return True


def setup(level: str = "INFO", fmt: str = "text") -> None:
    """Configure the root logger once per process: `fmt` is "text" or "json"."""
    if fmt not in ("text", "json"):
        raise ValueError(f"log_format: expected text or json, got {fmt!r}")
    handler = logging.StreamHandler()
    handler.addFilter(RequestIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter(JSON_FIELDS, rename_fields={
            "asctime": "time", "levelname": "level", "name": "logger"}))
    else:
        handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
