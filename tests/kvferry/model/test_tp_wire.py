"""The calls to a tensor-parallel worker's ranks on the wire (kvferry/model/tp_wire.py): every
argument kind of the real call sites survives encode -> parse -> fill; rank 0 refuses what
the schema does not take before sending; a receiving rank refuses every malformed header
with ProtocolError; and no product code pickles a call (broadcast_object_list) or starts a
TCPStore."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from kvferry.model import tp_wire
from kvferry.model.tp_rendezvous import Rendezvous, loopback_interface
from kvferry.model.tp_wire import Kind, ProtocolError

REPO = Path(__file__).resolve().parents[3]
PRODUCT = ("kvferry", "router", "prefill_worker", "decode_worker", "deploy", "kernels",
           "bench")
POOL = object()  # stands for rank 0's pool; a rank fills in its own


def _round_trip(method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
                ) -> dict[str, Any]:
    """What a receiving rank calls `method` with (its pool: "rank pool")."""
    wire = tp_wire.encode(method, tp_wire.bind(method, args, kwargs), POOL)
    got_method, length = tp_wire.header_length(wire.preamble)
    assert (got_method, length) == (method, wire.header.numel())
    call = tp_wire.parse(method, wire.header)
    buffers = tp_wire.receive_buffers(call, "cpu")
    assert [(b.dtype, b.shape) for b in buffers] == [(t.dtype, t.shape) for t in wire.tensors]
    for buffer, sent in zip(buffers, wire.tensors):
        buffer.copy_(sent)  # as dist.broadcast would
    return call.fill(buffers, "rank pool")


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def test_a_prefill_as_the_prefill_batch_calls_it() -> None:
    """kvferry/model/prefill_batch.py: positional tensors and lengths, the pool, keyword
    lists, a layer callback (rank 0's: sent as none) and per-chunk attention mass."""
    ids, slots = torch.arange(7), torch.arange(100, 107)
    mass = [torch.zeros(32), None]
    got = _round_trip("prefill", (ids, [4, 3], slots, POOL),
                      {"context_lens": [0, 16], "block_tables": [[1, 2], [3, 4, 5]],
                       "on_layer_done": lambda layer: None, "rope_offsets": [0, -2],
                       "mass": mass})
    want = {"token_ids": ids, "seq_lens": [4, 3], "slot_mapping": slots, "pool": "rank pool",
            "context_lens": [0, 16], "block_tables": [[1, 2], [3, 4, 5]],
            "on_layer_done": None, "rope_offsets": [0, -2], "mass": mass}
    assert got.keys() == want.keys()
    assert all(_equal(got[k], want[k]) for k in want), got


def test_a_decode_step_as_the_step_loop_calls_it() -> None:
    """decode_worker/steps.py: five positional, the stage (none on a split worker), and
    int32 tables and lengths by keyword."""
    tables = torch.tensor([[0, 1, 2], [3, 0, 0]], dtype=torch.int32)
    args = (torch.tensor([5, 6]), torch.tensor([40, 3]), torch.tensor([42, 51]), tables, POOL,
            None)
    got = _round_trip("decode", args, {"seq_lens": torch.tensor([41, 4], dtype=torch.int32),
                                       "mass": None})
    assert _equal(got["block_tables"], tables) and got["stage"] is None
    assert got["pool"] == "rank pool" and got["mass"] is None
    assert _equal(got["seq_lens"], torch.tensor([41, 4], dtype=torch.int32))


@pytest.mark.parametrize("layers", [slice(None), slice(1, 3), slice(0, 4, 2)])
def test_the_pool_operations(layers: slice) -> None:
    pages = torch.randint(0, 255, (2, 2, 3, 16, 2, 8), dtype=torch.uint8)  # quantized bytes
    assert _round_trip("gather_pages", ([4, 7, 9], layers), {}) == {
        "block_ids": [4, 7, 9], "layers": layers}
    got = _round_trip("scatter_pages", ([1], pages, layers), {})
    assert _equal(got["pages"], pages) and got["layers"] == layers
    assert _round_trip("copy_blocks", ([], []), {}) == {"src": [], "dst": []}
    assert _round_trip("stop", (), {}) == {}


@pytest.mark.parametrize(("method", "args", "kwargs", "match"), [
    ("eval", (), {}, "unknown method"),
    ("copy_blocks", ([1],), {"dst": [2], "evil": 1}, "unexpected argument 'evil'"),
    ("copy_blocks", ([1], [2]), {"src": [3]}, "unexpected argument 'src'"),
    ("copy_blocks", ([1],), {}, "dst missing"),
    ("decode", (torch.ones(1),) * 4 + (POOL, object()), {}, "stage"),
    ("gather_pages", ([1], torch.ones(1)), {}, "layers cannot be TENSOR"),
    ("scatter_pages", ([1], torch.ones(2, dtype=torch.float64)), {}, "float64"),
    ("prefill", (torch.ones(1), [1], torch.ones(1), "not the pool"), {}, "pool"),
])
def test_rank_zero_refuses_what_the_schema_does_not_take(
        method: str, args: tuple[Any, ...], kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tp_wire.encode(method, tp_wire.bind(method, args, kwargs), POOL)


def _preamble(**changes: int) -> torch.Tensor:
    fields = {"magic": tp_wire.MAGIC, "version": tp_wire.VERSION, "code": 0, "length": 0}
    fields.update(changes)
    return torch.tensor(list(fields.values()), dtype=torch.int64)


@pytest.mark.parametrize(("changes", "match"), [
    ({"magic": 0x70696B6C65}, "magic"),
    ({"version": 2}, "version"),
    ({"code": len(tp_wire.METHODS)}, "unknown method"),
    ({"code": -1}, "unknown method"),
    ({"length": tp_wire.MAX_HEADER_INTS + 1}, "header length"),
    ({"length": -5}, "header length"),
])
def test_a_bad_preamble_is_refused(changes: dict[str, int], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        tp_wire.header_length(_preamble(**changes))


GOOD_COPY = [0, Kind.INTS, 1, 5, 1, Kind.INTS, 1, 6]  # copy_blocks([5], [6])
TENSOR = [5, 2, 3, 16, 2]  # uint8 [3, 16, 2]


@pytest.mark.parametrize(("method", "header", "match"), [
    ("copy_blocks", [2, Kind.INTS, 0, *GOOD_COPY[2:]], "unknown parameter 2"),
    ("copy_blocks", [0, Kind.TENSOR, *TENSOR, *GOOD_COPY[4:]], "cannot be kind"),
    ("copy_blocks", [0, 99, 0, *GOOD_COPY[4:]], "cannot be kind 99"),
    ("copy_blocks", [*GOOD_COPY, 0, Kind.INTS, 0], "src given twice"),
    ("copy_blocks", GOOD_COPY[:4], "missing dst"),
    ("copy_blocks", GOOD_COPY[:-1], "past the header's end"),
    ("copy_blocks", [0, Kind.INTS, 1 << 40, 1], "past the header's end"),
    ("copy_blocks", [0, Kind.INTS, -1, *GOOD_COPY[4:]], "count -1"),
    ("copy_blocks", [*GOOD_COPY, 1], "truncated"),
    ("scatter_pages", [0, Kind.INTS, 0, 1, Kind.TENSOR, 99, 1, 4], "dtype code 99"),
    ("scatter_pages", [0, Kind.INTS, 0, 1, Kind.TENSOR, 0, 9, *[1] * 9], "9 dimensions"),
    ("scatter_pages", [0, Kind.INTS, 0, 1, Kind.TENSOR, 0, 2, 4, -1], "shape"),
    ("scatter_pages", [0, Kind.INTS, 0, 1, Kind.TENSOR, 0, 3, 1 << 20, 1 << 20, 1 << 20],
     "more than"),
    ("gather_pages", [0, Kind.INTS, 0, 1, Kind.SLICE, 0, 0, 0, 0, 1, 0], "slice step 0"),
    ("gather_pages", [0, Kind.INTS, 0, 1, Kind.SLICE, 7, 0, 0, 0, 0, 0], "slice flag 7"),
    ("prefill", [8, Kind.OPT_TENSORS, 1, 2, *TENSOR], "presence flag 2"),
    ("decode", [5, Kind.TENSOR, *TENSOR], "cannot be kind"),  # a stage
    ("stop", [0, Kind.NONE], "unknown parameter 0"),
])
def test_a_bad_header_is_refused(method: str, header: list[int], match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        tp_wire.parse(method, torch.tensor(header, dtype=torch.int64))


def test_the_good_header_of_the_refusal_table_parses() -> None:
    """The refusals above differ from a header that parses by the part they break."""
    assert tp_wire.parse("copy_blocks", torch.tensor(GOOD_COPY)).fill([], None) == {
        "src": [5], "dst": [6]}


def test_the_rendezvous_is_a_private_directory_removed_with_the_group() -> None:
    rendezvous = Rendezvous.fresh()
    path = Path(rendezvous.directory)
    assert path.stat().st_mode & 0o777 == 0o700
    assert rendezvous.init_method == f"file://{path / 'store'}"
    rendezvous.remove()
    assert not path.exists()


def test_the_loopback_interface_is_found() -> None:
    name = loopback_interface()
    assert name in {n for _, n in __import__("socket").if_nameindex()}


def test_no_product_code_pickles_a_call_to_ranks_or_starts_a_tcp_store() -> None:
    """Calls to ranks are tp_wire's schema, and ranks meet in a file store: nothing in the
    product unpickles what a rank receives or listens for a rendezvous on a port."""
    pattern = re.compile(r"broadcast_object_list|TCPStore\(|init_method=f?[\"']tcp://")
    found = [f"{path.relative_to(REPO)}:{n}"
             for folder in PRODUCT for path in (REPO / folder).rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if pattern.search(line)]
    assert found == []
