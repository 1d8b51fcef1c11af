"""The calls rank 0 of a tensor-parallel worker makes to its other ranks, on the wire
(docs/tensor-parallel.md): a fixed schema, never pickled objects.

A call is a method from `METHODS` and its arguments, sent as int64 tensors with
`dist.broadcast`, then the argument tensors themselves:

    preamble  [4]: MAGIC, VERSION, method code, header length
    header    [header length]: per argument given
                  parameter index (in the method's fixed list), kind, payload
    tensors   each TENSOR (and each present tensor of OPT_TENSORS), in header order

Payloads by kind: NONE and POOL carry nothing (the pool is each rank's own; a callback is
rank 0's alone and travels as NONE); INT one value; INTS a count then the values;
INT_LISTS a count then each list as INTS; TENSOR dtype code, ndim, dims; OPT_TENSORS a count
then per item 0, or 1 and a TENSOR's payload; SLICE start, stop, step each as a presence
flag and a value.

The receiving rank checks everything before it allocates or runs anything (`parse`): magic
and version, a known method, known and distinct parameters, a kind each parameter allows,
the required ones present, dtypes from `DTYPES`, bounded header, ranks, dims and bytes. A
header that fails raises `ProtocolError`; the rank stops, which its worker sees as a lost
rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import torch

MAGIC = 0x6B76_6672_7470  # "kvfrtp"
VERSION = 1
PREAMBLE_LEN = 4
MAX_HEADER_INTS = 1 << 24  # 128 MiB of header: block tables of a very large batch fit
MAX_NDIM = 8
MAX_CALL_BYTES = 1 << 36  # every tensor of one call together (64 GiB): nothing sane nears it

# The dtypes a call's tensors may have; a tensor's code is its index here.
DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16, torch.int64,
                                   torch.int32, torch.uint8, torch.int8)


class Kind(IntEnum):
    NONE = 0
    POOL = 1
    TENSOR = 2
    INT = 3
    INTS = 4
    INT_LISTS = 5
    OPT_TENSORS = 6
    SLICE = 7


class ProtocolError(ValueError):
    """A call's header breaks the schema: the receiving rank stops."""


@dataclass(frozen=True)
class Param:
    name: str
    kinds: frozenset[Kind]
    is_required: bool = False


def _p(name: str, *kinds: Kind, is_required: bool = False) -> Param:
    return Param(name, frozenset(kinds), is_required)


_K = Kind
# Each method's parameters in the order of its signature (Transformer.prefill/decode, the
# pool operations of kvferry/model/tp_group.py); positional arguments bind in this order.
METHODS: dict[str, tuple[Param, ...]] = {
    "prefill": (
        _p("token_ids", _K.TENSOR, is_required=True),
        _p("seq_lens", _K.INTS, is_required=True),
        _p("slot_mapping", _K.TENSOR, is_required=True),
        _p("pool", _K.POOL, is_required=True),
        _p("context_lens", _K.NONE, _K.INTS),
        _p("block_tables", _K.NONE, _K.INT_LISTS),
        _p("on_layer_done", _K.NONE),  # rank 0's callback: never sent
        _p("rope_offsets", _K.NONE, _K.INTS),
        _p("mass", _K.NONE, _K.OPT_TENSORS),
        _p("logit_rows", _K.NONE, _K.INTS),
    ),
    "decode": (
        _p("token_ids", _K.TENSOR, is_required=True),
        _p("positions", _K.TENSOR, is_required=True),
        _p("slot_mapping", _K.TENSOR, is_required=True),
        _p("block_tables", _K.TENSOR, is_required=True),
        _p("pool", _K.POOL, is_required=True),
        _p("stage", _K.NONE),  # the dense stage is refused on split workers
        _p("seq_lens", _K.NONE, _K.TENSOR),
        _p("mass", _K.NONE, _K.TENSOR),
    ),
    "gather_pages": (
        _p("block_ids", _K.INTS, is_required=True),
        _p("layers", _K.SLICE),
    ),
    "scatter_pages": (
        _p("block_ids", _K.INTS, is_required=True),
        _p("pages", _K.TENSOR, is_required=True),
        _p("layers", _K.SLICE),
    ),
    "copy_blocks": (
        _p("src", _K.INTS, is_required=True),
        _p("dst", _K.INTS, is_required=True),
    ),
    "stop": (),
}
_CODES = {name: code for code, name in enumerate(METHODS)}
_KIND_CODES = frozenset(int(k) for k in Kind)
_LIST_KINDS = (Kind.INTS, Kind.INT_LISTS, Kind.OPT_TENSORS)


class TensorSpec(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]


class Wire(NamedTuple):
    """One call as sent: the preamble and header (int64, host memory) and the tensors that
    follow them, in order."""

    preamble: torch.Tensor  # [PREAMBLE_LEN] int64
    header: torch.Tensor  # [header length] int64
    tensors: list[torch.Tensor]


class Call(NamedTuple):
    """A call as parsed, before its tensors arrive: `specs` are the tensors to receive, in
    order; `fill` turns them (and the rank's pool) into the method's keyword arguments."""

    method: str
    specs: list[TensorSpec]
    fill: Callable[[list[torch.Tensor], Any], dict[str, Any]]


# ---- rank 0: arguments -> wire -----------------------------------------------------------
def bind(method: str, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments by parameter name, as the method's signature binds them."""
    params = METHODS.get(method)
    if params is None:
        raise ValueError(f"tensor-parallel call: unknown method {method!r}")
    if len(args) > len(params):
        raise ValueError(f"tensor-parallel call {method}: {len(args)} positional arguments, "
                         f"at most {len(params)}")
    names = [p.name for p in params]
    values = dict(zip(names, args))
    for name, value in kwargs.items():
        if name not in names or name in values:
            raise ValueError(f"tensor-parallel call {method}: unexpected argument {name!r}")
        values[name] = value
    return values


def _kind_of(param: Param, value: Any, pool: Any) -> Kind:
    if value is pool:
        return Kind.POOL
    if value is None or callable(value):
        return Kind.NONE
    if isinstance(value, torch.Tensor):
        return Kind.TENSOR
    if isinstance(value, slice):
        return Kind.SLICE
    if isinstance(value, int):
        return Kind.INT
    if isinstance(value, (list, tuple)):
        if not value:  # empty: whichever list kind the parameter takes
            return next((k for k in _LIST_KINDS if k in param.kinds), Kind.INTS)
        if all(isinstance(v, int) for v in value):
            return Kind.INTS
        if all(isinstance(v, (list, tuple)) for v in value):
            return Kind.INT_LISTS
        if all(v is None or isinstance(v, torch.Tensor) for v in value):
            return Kind.OPT_TENSORS
    raise ValueError(f"tensor-parallel call: argument {param.name!r} of type "
                     f"{type(value).__name__} has no wire kind")


def _tensor_header(t: torch.Tensor) -> list[int]:
    if t.dtype not in DTYPES:
        raise ValueError(f"tensor-parallel call: dtype {t.dtype} is not sent to ranks")
    return [DTYPES.index(t.dtype), t.dim(), *t.shape]


def _ints(values: Sequence[int]) -> list[int]:
    return [len(values), *(int(v) for v in values)]


def encode(method: str, values: dict[str, Any], pool: Any, device: torch.device | str = "cpu"
           ) -> Wire:
    """The wire form of `method(**values)` (`bind` gives `values`); its tensors contiguous on
    `device` (the group's: host memory for gloo, the rank's GPU for NCCL). Raises ValueError,
    before anything is sent, for what the schema does not take."""
    params = METHODS.get(method)
    if params is None:
        raise ValueError(f"tensor-parallel call: unknown method {method!r}")
    header: list[int] = []
    tensors: list[torch.Tensor] = []
    for index, param in enumerate(params):
        if param.name not in values:
            if param.is_required:
                raise ValueError(f"tensor-parallel call {method}: {param.name} missing")
            continue
        value = values[param.name]
        kind = _kind_of(param, value, pool)
        if kind not in param.kinds:
            raise ValueError(f"tensor-parallel call {method}: {param.name} cannot be "
                             f"{kind.name} (takes {sorted(k.name for k in param.kinds)})")
        header += [index, kind]
        if kind == Kind.INT:
            header.append(int(value))
        elif kind == Kind.INTS:
            header += _ints(value)
        elif kind == Kind.INT_LISTS:
            header.append(len(value))
            for row in value:
                header += _ints(row)
        elif kind == Kind.TENSOR:
            header += _tensor_header(value)
            tensors.append(value)
        elif kind == Kind.OPT_TENSORS:
            header.append(len(value))
            for t in value:
                header += [0] if t is None else [1, *_tensor_header(t)]
                if t is not None:
                    tensors.append(t)
        elif kind == Kind.SLICE:
            for part in (value.start, value.stop, value.step):
                header += [0, 0] if part is None else [1, int(part)]
    if len(header) > MAX_HEADER_INTS:
        raise ValueError(f"tensor-parallel call {method}: header of {len(header)} ints")
    preamble = torch.tensor([MAGIC, VERSION, _CODES[method], len(header)], dtype=torch.int64)
    return Wire(preamble, torch.tensor(header, dtype=torch.int64),
                [t.detach().to(device).contiguous() for t in tensors])


# ---- the other ranks: wire -> arguments, checked ---------------------------------------
def header_length(preamble: torch.Tensor) -> tuple[str, int]:
    """The method a preamble names and the length of the header that follows it."""
    if preamble.dtype != torch.int64 or preamble.shape != (PREAMBLE_LEN,):
        raise ProtocolError(f"preamble: {preamble.dtype} {tuple(preamble.shape)}")
    magic, version, code, length = (int(v) for v in preamble)
    if magic != MAGIC or version != VERSION:
        raise ProtocolError(f"preamble: magic {magic:#x} version {version}, "
                            f"want {MAGIC:#x} version {VERSION}")
    if not 0 <= code < len(METHODS):
        raise ProtocolError(f"unknown method code {code}")
    if not 0 <= length <= MAX_HEADER_INTS:
        raise ProtocolError(f"header length {length} outside [0, {MAX_HEADER_INTS}]")
    return list(METHODS)[code], length


class _Reader:
    def __init__(self, header: list[int]) -> None:
        self.header = header
        self.at = 0

    def take(self) -> int:
        if self.at >= len(self.header):
            raise ProtocolError("header truncated")
        self.at += 1
        return self.header[self.at - 1]

    def count(self) -> int:
        """A count of items, each at least one int: never past what is left."""
        n = self.take()
        if not 0 <= n <= len(self.header) - self.at:
            raise ProtocolError(f"count {n} past the header's end")
        return n

    def ints(self) -> list[int]:
        n = self.count()
        self.at += n
        return self.header[self.at - n: self.at]

    def tensor(self) -> TensorSpec:
        code, ndim = self.take(), self.take()
        if not 0 <= code < len(DTYPES):
            raise ProtocolError(f"dtype code {code} not in the whitelist")
        if not 0 <= ndim <= MAX_NDIM:
            raise ProtocolError(f"tensor of {ndim} dimensions (at most {MAX_NDIM})")
        shape = tuple(self.take() for _ in range(ndim))
        if any(d < 0 or d > MAX_CALL_BYTES for d in shape):
            raise ProtocolError(f"tensor shape {shape}")
        return TensorSpec(DTYPES[code], shape)


def _nbytes(spec: TensorSpec) -> int:
    n = spec.dtype.itemsize
    for d in spec.shape:
        n *= d
    return n


def _payload(reader: _Reader, kind: Kind, specs: list[TensorSpec], where: str) -> Any:
    """An argument's payload; a tensor's spec goes to `specs`, and the payload holds its
    index there."""
    if kind == Kind.INT:
        return reader.take()
    if kind == Kind.INTS:
        return reader.ints()
    if kind == Kind.INT_LISTS:
        return [reader.ints() for _ in range(reader.count())]
    if kind == Kind.TENSOR:
        specs.append(reader.tensor())
        return len(specs) - 1
    if kind == Kind.OPT_TENSORS:
        items: list[int | None] = []
        for _ in range(reader.count()):
            present = reader.take()
            if present not in (0, 1):
                raise ProtocolError(f"{where}: presence flag {present}")
            if present:
                specs.append(reader.tensor())
            items.append(len(specs) - 1 if present else None)
        return items
    if kind == Kind.SLICE:
        parts: list[int | None] = []
        for _ in range(3):
            flag, value = reader.take(), reader.take()
            if flag not in (0, 1):
                raise ProtocolError(f"{where}: slice flag {flag}")
            parts.append(value if flag else None)
        if parts[2] == 0:
            raise ProtocolError(f"{where}: slice step 0")
        return slice(*parts)
    return None  # NONE, POOL: nothing on the wire


def parse(method: str, header: torch.Tensor) -> Call:
    """The call a header describes, every part checked (ProtocolError otherwise)."""
    params = METHODS[method]
    reader = _Reader(header.tolist())
    layout: dict[str, tuple[Kind, Any]] = {}
    specs: list[TensorSpec] = []
    while reader.at < len(reader.header):
        index, kind_code = reader.take(), reader.take()
        if not 0 <= index < len(params):
            raise ProtocolError(f"{method}: unknown parameter {index}")
        param = params[index]
        if param.name in layout:
            raise ProtocolError(f"{method}: {param.name} given twice")
        if kind_code not in _KIND_CODES or Kind(kind_code) not in param.kinds:
            raise ProtocolError(f"{method}: {param.name} cannot be kind {kind_code}")
        kind = Kind(kind_code)
        layout[param.name] = (kind, _payload(reader, kind, specs, f"{method}: {param.name}"))
    missing = [p.name for p in params if p.is_required and p.name not in layout]
    if missing:
        raise ProtocolError(f"{method}: missing {', '.join(missing)}")
    if sum(_nbytes(s) for s in specs) > MAX_CALL_BYTES:
        raise ProtocolError(f"{method}: tensors of more than {MAX_CALL_BYTES} bytes")

    def fill(tensors: list[torch.Tensor], pool: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, (kind, payload) in layout.items():
            if kind == Kind.POOL:
                out[name] = pool
            elif kind == Kind.TENSOR:
                out[name] = tensors[payload]
            elif kind == Kind.OPT_TENSORS:
                out[name] = [None if i is None else tensors[i] for i in payload]
            else:
                out[name] = payload
        return out

    return Call(method, specs, fill)


def receive_buffers(call: Call, device: torch.device | str) -> list[torch.Tensor]:
    """Empty tensors on `device` for the call's tensors to be broadcast into."""
    return [torch.empty(spec.shape, dtype=spec.dtype, device=device) for spec in call.specs]
