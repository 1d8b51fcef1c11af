"""A text completion of several prompts (`prompt` a list of strings or of token-id lists):
each prompt is a request of its own through the router engine, all at once, and their events
make one answer whose choices are numbered as the OpenAI API numbers them, prompt by prompt:
prompt i's sample j is choice i * n + j."""

from __future__ import annotations

from collections.abc import AsyncIterator

from router.engine import Router
from router.events import ChunkEvent, DoneEvent
from router.identity import Caller
from router.request import Admitted
from router.sample_group import merge

Event = ChunkEvent | DoneEvent


async def _numbered(events: AsyncIterator[str | Event], first_choice: int
                    ) -> AsyncIterator[Event]:
    """One prompt's events past its request id, each with its choice's number."""
    try:
        async for event in events:
            if not isinstance(event, str):
                yield event._replace(sample_index=first_choice + event.sample_index)
    finally:
        await events.aclose()  # type: ignore[attr-defined]


async def relay_all(router: Router, jobs: list[Admitted], caller: Caller, request_id: str,
                    n: int) -> AsyncIterator[str | Event]:
    """`Router.relay` of every prompt's record as one stream: `request_id` first, then the
    events of all of them as they come (a failure of one ends the whole answer, releasing
    the others)."""
    yield request_id
    streams = [_numbered(router.relay(job, caller), i * n) for i, job in enumerate(jobs)]
    async for event in merge(streams):
        yield event
