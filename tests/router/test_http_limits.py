"""The HTTP front's bounds, in-process over a fake router engine: an
unterminated request head is cut off at the header cap (431) without the router growing past
it, half-open connections are closed at the header timeout, connections past the cap are
closed at once, a conversation of too many messages is refused before anything is validated
or rendered, and a plain request succeeds meanwhile. The header timeout is never reached in
real time: a test that needs it moves the event loop's clock past it."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace

import httpx
import psutil
import pytest

from kvferry.errors import InvalidArgument, ResourceExhausted
from kvferry.model.checkpoint import CHATML_TEMPLATE
from kvferry.model.sampling import FinishReason, SamplingParams
from kvferry.settings import SecuritySettings
from kvferry.settings.limits import PublicLimits
from kvferry.settings.sampling import KVFERRY_DEFAULTS
from router.admission import PromptBounds, check_prompt_bounds
from router.events import ChunkEvent, DoneEvent, Timing
from router.http.body import BodyParser, BodyRefusal, count_roles, parse_json
from router.http.front import HttpFront
from router.request import ChatMessage, GenerateInput
from tests.waiting import DEADLINE_S, within

HEADER_TIMEOUT_S = 600  # beyond any test's real run: only a moved clock reaches it
ATTACK_MESSAGES = 262_000


class _Streams:
    """The open-request count, as the fronts' fake router keeps it."""

    def __init__(self, limit: int) -> None:
        self.limit, self.num_streams = limit, 0

    def open_stream(self) -> None:
        if self.num_streams >= self.limit:
            raise ResourceExhausted("too many open requests")
        self.num_streams += 1

    def close_stream(self) -> None:
        self.num_streams -= 1


class FakeRouter:
    """Answers every request with three tokens; records what reached it."""

    def __init__(self, limits: PublicLimits) -> None:
        self.config = SimpleNamespace(max_position_embeddings=4096,
                                      sampling_defaults=KVFERRY_DEFAULTS)
        self.limits = limits
        self.open = _Streams(limits.max_streams)
        self.inputs: list[GenerateInput] = []
        self.admission = self  # admits every input as it is: the record is the input

    async def admit(self, inp: GenerateInput, timeout_s: float | None,
                    caller: object = None) -> GenerateInput:
        self.inputs.append(inp)
        return inp

    async def relay(self, inp: GenerateInput, caller: object = None) -> AsyncIterator[object]:
        yield inp.request_id
        for i in range(3):
            yield ChunkEvent([i], f"t{i} ")
            await asyncio.sleep(0.01)  # paces: a token every 10 ms
        yield DoneEvent(FinishReason.LENGTH, 1, 3, Timing(0, 0, 0, 0, 0))


class MovableLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock a test moves forward: the timers due by then (the front's
    header deadlines) fire on its next pass, as if that much time had gone by."""

    moved_s = 0.0

    def time(self) -> float:
        return super().time() + self.moved_s


def _serve(limits: PublicLimits, test: Callable[[HttpFront, FakeRouter], Awaitable[None]]
           ) -> None:
    router = FakeRouter(limits)

    async def main() -> None:
        front = HttpFront(router, "/models/tiny", "127.0.0.1", 0,  # type: ignore[arg-type]
                          SecuritySettings(), False, None, 1.0)
        await front.start()
        try:
            await test(front, router)
        finally:
            await front.stop()

    with asyncio.Runner(loop_factory=MovableLoop) as runner:
        runner.run(main())


async def _plain_request(port: int) -> None:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        answer = await client.post("/v1/chat/completions",
                                   json={"messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "t0 t1 t2 "


async def _closed(reader: asyncio.StreamReader) -> None:
    """Until the server closes the connection (EOF or reset), after whatever it answered."""
    try:
        while await reader.read(65536):
            pass
    except ConnectionError:
        return


def test_an_unterminated_header_is_cut_off_at_the_cap() -> None:
    limits = PublicLimits(http_max_header_bytes=16 << 10, http_header_timeout_s=HEADER_TIMEOUT_S)
    process = psutil.Process()

    async def test(front: HttpFront, router: FakeRouter) -> None:
        before = process.memory_info().rss
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: ")
        chunk = b"a" * (1 << 20)
        sent = 0
        with pytest.raises(ConnectionError):  # the server closes: writes fail
            for _ in range(128):  # an unbounded server would take all 128 MiB
                writer.write(chunk)
                await writer.drain()
                sent += len(chunk)
        await within(_closed(reader), "the server closed the connection")
        writer.close()
        assert sent < 64 << 20
        assert process.memory_info().rss - before < 32 << 20
        # A head just past the cap, all of it read by the server: 431, then closed.
        reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
        writer.write(b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * (20 << 10))
        answer = await within(reader.read(), "the server's answer")
        writer.close()
        assert answer.startswith(b"HTTP/1.1 431 ") and b"connection: close" in answer
        await _plain_request(front.port)

    _serve(limits, test)


def test_half_open_connections_are_closed_and_the_cap_holds() -> None:
    num_half_open, cap = 1000, 1010
    limits = PublicLimits(http_header_timeout_s=HEADER_TIMEOUT_S, http_max_connections=cap)

    async def test(front: HttpFront, router: FakeRouter) -> None:
        connections = []
        for _ in range(num_half_open):
            reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
            connections.append((reader, writer))
        closing = [asyncio.ensure_future(_closed(r)) for r, _ in connections]
        await _plain_request(front.port)  # one of the connections under the cap
        # Past the cap: closed as soon as accepted (the plain request's may still count).
        extra = [await asyncio.open_connection("127.0.0.1", front.port) for _ in range(50)]
        await within(asyncio.gather(*(_closed(r) for r, _ in extra[cap - num_half_open:])),
                     "connections past the cap closed")
        # No header deadline has passed yet: every half-open connection is still open.
        assert not any(c.done() for c in closing)
        loop = asyncio.get_running_loop()
        assert isinstance(loop, MovableLoop)
        loop.moved_s += HEADER_TIMEOUT_S  # now it has
        await within(asyncio.gather(*closing), "half-open connections closed at the header "
                     "timeout")
        for _, writer in [*connections, *extra]:
            writer.close()
        await _plain_request(front.port)

    _serve(limits, test)


def _attack_body() -> bytes:
    return json.dumps({"messages": [{"role": "user"}] * ATTACK_MESSAGES},
                      separators=(",", ":")).encode()


def test_a_flood_of_messages_is_refused_before_validation_while_a_request_succeeds() -> None:
    limits = PublicLimits()

    async def test(front: HttpFront, router: FakeRouter) -> None:
        body = _attack_body()
        assert len(body) < 4 << 20  # under the body cap: only the message cap refuses it
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{front.port}",
                                     timeout=DEADLINE_S) as client:
            attacks = [asyncio.ensure_future(client.post(
                "/v1/chat/completions", content=body,
                headers={"content-type": "application/json"})) for _ in range(2)]
            await _plain_request(front.port)
            answers = await asyncio.gather(*attacks)
        for answer in answers:
            assert answer.status_code == 400
            error = answer.json()["error"]
            assert error["param"] == "messages"
            assert "more than 1024 messages" in error["message"]
            assert "--max-chat-messages" in error["message"]
        assert len(router.inputs) == 1  # only the plain request reached the engine

    _serve(limits, test)


def test_role_keys_are_counted_only_outside_strings_and_parse_workers_run_niced() -> None:
    quoted = json.dumps({"messages": [{"role": "user", "content": 'say "role" ' * 50}]})
    assert count_roles(quoted.encode()) == 1  # quotes inside a string are escaped
    assert count_roles(_attack_body()) == ATTACK_MESSAGES
    parser = BodyParser(max_messages=1024, max_values=1 << 16, num_slots=1)
    try:
        assert parser._pool.submit(os.nice, 0).result(timeout=60) >= 19  # lowest priority
    finally:
        parser.close()


def test_a_body_is_refused_as_soon_as_its_role_keys_pass_the_cap() -> None:
    body = json.dumps({"messages": [{"role": "user"}] * 3}).encode()

    class Chunked:  # 3 bytes at a time: every key split across chunks
        def __init__(self) -> None:
            self.num_read = 0

        async def stream(self) -> AsyncIterator[bytes]:
            for i in range(0, len(body), 3):
                self.num_read += 1
                yield body[i:i + 3]

    for cap, refused in ((2, True), (3, False)):
        parser = BodyParser(max_messages=cap, max_values=1 << 16, num_slots=1)
        request = Chunked()
        try:
            got = asyncio.run(parser._receive(request))  # type: ignore[arg-type]
        finally:
            parser.close()
        if refused:
            assert isinstance(got, BodyRefusal) and got.param == "messages"
            assert request.num_read < -(-len(body) // 3)  # the rest was never read
        else:
            assert got == body


@pytest.mark.parametrize("raw,param", [
    (b'{"messages": [', None),  # not JSON
    (b"[" * 100_000 + b"]" * 100_000, None),  # nested too deeply
    (json.dumps({"prompt": list(range(70_000))}).encode(), "prompt"),  # too many values
])
def test_bodies_refused_before_they_are_validated(raw: bytes, param: str | None) -> None:
    refusal = parse_json(raw, 1024, 1 << 16)
    assert isinstance(refusal, BodyRefusal) and refusal.status == 400
    assert refusal.param == param


class CountingTokenizer:
    """A ChatML tokenizer of single characters (one byte each), counting template calls."""

    chat_template = CHATML_TEMPLATE

    def __init__(self) -> None:
        self.num_rendered = 0

    def get_vocab(self) -> dict[str, int]:
        return {chr(c): c for c in range(32, 127)} | {"<|im_start|>": 200, "<|im_end|>": 201}

    def apply_chat_template(self, conversation: list[dict[str, str]], **_: object
                            ) -> list[int]:
        self.num_rendered += 1
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
                       for m in conversation) + "<|im_start|>assistant\n"
        return [ord(c) for c in text]


def _chat(messages: list[ChatMessage]) -> GenerateInput:
    return GenerateInput("r", None, None, SamplingParams(), False, tuple(messages))


def test_a_prompt_that_cannot_fit_is_refused_before_the_template() -> None:
    tokenizer = CountingTokenizer()
    bounds = PromptBounds.of(tokenizer)
    assert bounds.max_token_bytes == len("<|im_start|>")
    assert bounds.min_message_tokens > 0
    measured = tokenizer.num_rendered
    limits = PublicLimits()
    context = 4096
    # Fits, or might: passes (the template decides).
    fitting = "x" * (context // 2)
    check_prompt_bounds(_chat([ChatMessage("user", fitting)]), context, limits, bounds)
    check_prompt_bounds(_chat([ChatMessage("user", "")] * 100), context, limits, bounds)
    # Too many messages, too many to fit with the template's own tokens around each (26+ of
    # this template's per message), or too many bytes to fit however they tokenize: refused.
    with pytest.raises(InvalidArgument) as exc:
        check_prompt_bounds(_chat([ChatMessage("user", "")] * 1024), context, limits, bounds)
    assert exc.value.field == "input" and "1024 messages" in str(exc.value)
    with pytest.raises(InvalidArgument) as exc:
        check_prompt_bounds(_chat([ChatMessage("user", "")] * 1025), context, limits, bounds)
    assert exc.value.field == "input.messages"
    huge = "x" * (4 * bounds.max_token_bytes * context)
    with pytest.raises(InvalidArgument) as exc:
        check_prompt_bounds(_chat([ChatMessage("user", huge)]), context, limits, bounds)
    assert exc.value.field == "input"
    assert tokenizer.num_rendered == measured  # never rendered after the measurement
    # The estimate is a lower bound: what it lets through may be long, never what it refuses.
    small = [ChatMessage("user", "ab")] * 40
    assert bounds.min_tokens(80, 40) <= len(tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content} for m in small]))
