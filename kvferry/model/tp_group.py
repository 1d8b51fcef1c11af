"""A tensor-parallel worker's ranks (docs/tensor-parallel.md): the worker's process is rank 0
and starts ranks 1..N-1 as processes of its own, joined in a torch.distributed group (gloo on
CPU, NCCL on CUDA with one device per rank). Each rank holds its shard of the model
(kvferry/model/tensor_parallel.py) and a pool of its own K/V heads, with the same blocks:
block ids mean the same tokens on every rank, so only rank 0 allocates.

The ranks meet in a private `file://` store and talk on the loopback interface only
(kvferry/model/tp_rendezvous.py). `TensorParallelModel` stands where a `Transformer` does
for `prefill` and `decode`: each call is broadcast to the other ranks in a fixed schema,
never pickled (kvferry/model/tp_wire.py: its tensors and numbers; the pool named, each rank
using its own; callbacks are rank 0's alone), then run on rank 0's shard, the ranks meeting
in its all-reduces. The pool's data outside a forward moves the same way, through rank 0's pool
(`RankPool`): its `read_pages` gathers every K/V head of some blocks from the ranks (what a
push sends), `write_pages` gives each rank its heads of whole pages (what a receive writes),
`copy_blocks` copies on every rank. Engines and transports call these as on any pool, so
they need not know the model is split.

A rank that is gone fails the call with `RankLost`, at once where its connection closed, and
`on_lost` hears of it (also from a thread watching the ranks while idle): a worker then exits
(deploy/worker_model.py), and the router migrates its requests.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from kvferry.cache.pool import KvPool
from kvferry.model import tp_wire
from kvferry.model.config import ModelConfig, load_model_config
from kvferry.model.tensor_parallel import Shard
from kvferry.model.tp_rendezvous import Rendezvous, join
from kvferry.model.transformer import Transformer
from kvferry_kernels import kv_quant
from kvferry_kernels.dispatch import get_attention_backend

COLLECTIVE_TIMEOUT_S = 60.0  # a rank that stops answering (alive, stuck) fails a call then
EXIT_PROTOCOL_ERROR = 3  # a rank's exit status for a call outside the schema
_STOP = "stop"

log = logging.getLogger(__name__)


class RankLost(RuntimeError):
    """A rank of the worker's group is gone (or stuck past COLLECTIVE_TIMEOUT_S)."""


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to build its shard and its pool."""

    checkpoint: str
    load_format: str
    backend: str
    dtype: str  # torch dtype name: "float32"
    block_size: int
    num_blocks: int
    torch_threads: int = 1  # 0: torch's default
    kernel_dir: str | None = None  # the C attention kernel's build cache (CPU)
    device: str = "cpu"  # or rank 0's CUDA device: rank r runs on the r-th from it (NCCL)
    query_runs: bool = False  # decode steps verify speculated runs (Transformer.query_runs)
    kv_cache_dtype: str = "auto"  # pages as the model computes them, or quantized
    prefix_caching: bool = True  # rank 0's allocator indexes finished blocks


class RankProcess(Protocol):
    """What the group uses of a rank's process (a `multiprocessing.Process` is one)."""

    name: str
    pid: int | None

    @property
    def sentinel(self) -> int: ...  # readable once the process has exited

    @property
    def exitcode(self) -> int | None: ...

    def is_alive(self) -> bool: ...

    def join(self, timeout: float | None = None) -> None: ...

    def kill(self) -> None: ...


# Starts rank `rank` of `size` (running `follow`) and returns its process, started.
RankStarter = Callable[[int, int, Rendezvous, "RankSpec"], RankProcess]


def spawn_rank(rank: int, size: int, rendezvous: Rendezvous, spec: RankSpec) -> RankProcess:
    """A rank in a fresh interpreter (multiprocessing's spawn: it imports torch itself)."""
    proc = mp.get_context("spawn").Process(target=follow, args=(rank, size, rendezvous, spec),
                                           name=f"tp-rank-{rank}", daemon=True)
    proc.start()
    return proc


def rank_args(rank: int, size: int, rendezvous: Rendezvous, spec: RankSpec) -> str:
    """What `python -m kvferry.model.tp_rank` takes to run `follow` (one JSON argument)."""
    return json.dumps({"rank": rank, "size": size, "rendezvous": rendezvous.directory,
                       "spec": asdict(spec), "leader_pid": os.getpid()})


def follow_args(text: str) -> None:
    """`follow` as `rank_args` describes it; the rank exits once its leader (rank 0's
    process) is gone, even if no call is under way to tell it."""
    given = json.loads(text)
    _exit_with(given["leader_pid"])
    follow(given["rank"], given["size"], Rendezvous(given["rendezvous"]),
           RankSpec(**given["spec"]))


def _exit_with(pid: int) -> None:
    def watch() -> None:
        while True:
            time.sleep(1.0)  # paces the check of the leader; nothing else wakes this thread
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(0)
            except PermissionError:
                pass

    threading.Thread(target=watch, name="tp-leader-watch", daemon=True).start()


def rank_device(spec: RankSpec, rank: int) -> torch.device:
    """Where rank `rank` runs: the CPU, or the rank-th CUDA device from rank 0's."""
    base = torch.device(spec.device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


def _send(wire: tp_wire.Wire, control: dist.ProcessGroup | None) -> None:
    """Rank 0: a call to the other ranks (its header on `control`, host memory; its tensors
    on the default group, the ranks' devices)."""
    dist.broadcast(wire.preamble, src=0, group=control)
    if wire.header.numel():
        dist.broadcast(wire.header, src=0, group=control)
    for tensor in wire.tensors:
        if tensor.numel():
            dist.broadcast(tensor, src=0)


def _receive(control: dist.ProcessGroup | None, device: torch.device, pool: KvPool
             ) -> tuple[str, dict[str, Any]]:
    """Ranks 1..N-1: the next call and its arguments, checked before anything is allocated
    for it (tp_wire.ProtocolError otherwise)."""
    preamble = torch.empty(tp_wire.PREAMBLE_LEN, dtype=torch.int64)
    dist.broadcast(preamble, src=0, group=control)
    method, length = tp_wire.header_length(preamble)
    header = torch.empty(length, dtype=torch.int64)
    if length:
        dist.broadcast(header, src=0, group=control)
    call = tp_wire.parse(method, header)
    tensors = tp_wire.receive_buffers(call, device)
    for tensor in tensors:
        if tensor.numel():
            dist.broadcast(tensor, src=0)
    return method, call.fill(tensors, pool)


def _build(spec: RankSpec, rank: int, size: int, pool_type: type[KvPool] = KvPool
           ) -> tuple[Transformer, KvPool, ModelConfig]:
    """The rank's shard, its pool, and the whole model's config."""
    config = load_model_config(Path(spec.checkpoint), load_format=spec.load_format)
    dtype = getattr(torch, spec.dtype)
    kernel_dir = None if spec.kernel_dir is None else Path(spec.kernel_dir)
    device = rank_device(spec, rank)
    model = Transformer(config, get_attention_backend(spec.backend, kernel_dir), dtype, device,
                        shard=Shard.of(config, rank, size))
    model.all_reduce = dist.all_reduce
    model.query_runs = spec.query_runs
    cfg = model.config
    pool = pool_type(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, spec.block_size,
                     spec.num_blocks, dtype, device, prefix_caching=spec.prefix_caching,
                     kv_cache_dtype=spec.kv_cache_dtype)
    return model, pool, config


def follow(rank: int, size: int, rendezvous: Rendezvous, spec: RankSpec) -> None:
    """Ranks 1..N-1: run each call rank 0 broadcasts, on this rank's shard and pool, until
    told to stop or rank 0 is gone. A call outside the schema stops the rank (exit status
    EXIT_PROTOCOL_ERROR): its worker then exits as for a lost rank."""
    if spec.torch_threads > 0:
        torch.set_num_threads(spec.torch_threads)
    control = join(rank, size, rendezvous, rank_device(spec, rank), COLLECTIVE_TIMEOUT_S)
    try:
        model, pool, _ = _build(spec, rank, size)
        dist.barrier()  # built: rank 0 may call
        while True:
            method, kwargs = _receive(control, model.device, pool)
            if method == _STOP:
                return
            if method in _POOL_OPS:
                _POOL_OPS[method](pool, model.shard, **kwargs)
                continue
            mass = _mass_buffers(kwargs.get("mass"))
            for buffer in mass:  # this rank adds its heads' part only
                buffer.zero_()
            getattr(model, method)(**kwargs)
            _sum_mass(mass)
    except tp_wire.ProtocolError as exc:
        log.error("tensor-parallel rank %d: call refused (%s); stopping", rank, exc)
        raise SystemExit(EXIT_PROTOCOL_ERROR) from exc
    except RuntimeError:
        return  # rank 0 (or another rank) is gone: nothing to serve
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _mass_buffers(mass: torch.Tensor | list[torch.Tensor | None] | None
                  ) -> list[torch.Tensor]:
    """A forward's attention-mass buffers (H2O): decode's one, prefill's one per chunk."""
    if mass is None:
        return []
    if isinstance(mass, torch.Tensor):
        return [mass]
    return [buffer for buffer in mass if buffer is not None]


def _sum_mass(mass: list[torch.Tensor]) -> None:
    """Every rank's attention mass summed into rank 0's buffers: each rank's attention covers
    its own query heads, and H2O's mass is the sum over all of them."""
    for buffer in mass:
        dist.reduce(buffer, dst=0)


# ---- the pool's data outside a forward: every rank does its part --------------------------
def _with_heads(pool: KvPool, pages: torch.Tensor, num_heads: int
                ) -> tuple[torch.Tensor, ...]:
    """Pages of `num_heads` K/V heads as tensors whose heads are dimension -2 (values
    [..., bs, H, D]; quantized: their values [..., bs, H, D] and scales [..., bs, H, 1]),
    views into `pages`."""
    if not pool.is_quantized:
        return (pages,)
    q = pool._split(pages, num_heads)  # noqa: SLF001 - the pool's own page geometry
    return q.data, q.scale.unsqueeze(-1)


def _empty_pages(pool: KvPool, like: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Uninitialized pages shaped as `like` ([..., n, *page]) but holding `num_heads` heads."""
    if pool.is_quantized:
        nbytes = kv_quant.page_bytes(pool.block_size, num_heads, pool.head_dim,
                                     pool.kv_cache_dtype)
        return like.new_empty((*like.shape[:-1], nbytes))
    return like.new_empty((*like.shape[:-2], num_heads, like.shape[-1]))


def _gather_pages(pool: KvPool, shard: Shard, block_ids: list[int],
                  layers: slice = slice(None)) -> torch.Tensor:
    """This rank's heads of the blocks in `layers`, sent to rank 0 ([L, 2, n, bs, h, D])."""
    local = KvPool.read_pages(pool, block_ids, layers).contiguous()
    parts = ([torch.empty_like(local) for _ in range(dist.get_world_size())]
             if dist.get_rank() == 0 else None)
    dist.gather(local, parts, dst=0)
    return local if parts is None else torch.stack(parts)


def _scatter_pages(pool: KvPool, shard: Shard, block_ids: list[int],
                   pages: torch.Tensor, layers: slice = slice(None)) -> None:
    """Every K/V head of the blocks in `layers` ([L, 2, n, bs, Hkv, D], the whole model's):
    this rank keeps its own."""
    heads = list(shard.kv_heads)
    mine = _empty_pages(pool, pages, len(heads))
    for out, full in zip(_with_heads(pool, mine, len(heads)),
                         _with_heads(pool, pages, shard.num_kv_heads)):
        out.copy_(full[..., heads, :])
    KvPool.write_pages(pool, block_ids, mine, layers)


def _copy_blocks(pool: KvPool, shard: Shard, src: list[int], dst: list[int]) -> None:
    KvPool.copy_blocks(pool, src, dst)


# Their parameters after (pool, shard) are tp_wire.METHODS' for the same names.
_POOL_OPS: dict[str, Callable[..., Any]] = {
    "gather_pages": _gather_pages, "scatter_pages": _scatter_pages, "copy_blocks": _copy_blocks}


class RankPool(KvPool):
    """Rank 0's pool: its own K/V heads, as each rank's pool holds its own, with the same
    blocks. What engines and transports do to pages outside a forward goes through the group,
    so it happens on every rank: whole pages (every K/V head) read and written, blocks
    copied."""

    group: TensorParallelModel

    @property
    def tensor_parallel_size(self) -> int:
        return self.group.size

    @property
    def whole_kv_heads(self) -> int:
        return self.group.num_kv_heads

    @property
    def page_shape(self) -> tuple[int, ...]:
        if self.is_quantized:
            return (kv_quant.page_bytes(self.block_size, self.whole_kv_heads, self.head_dim,
                                        self.kv_cache_dtype),)
        return (self.block_size, self.whole_kv_heads, self.head_dim)

    def read_pages(self, block_ids: list[int], layers: slice = slice(None)) -> torch.Tensor:
        """Every K/V head of these blocks in `layers`, as one pool of the whole model holds
        them ([L, 2, n, *page_shape]): each head from the first rank holding it."""
        group = self.group
        parts = group._pool_op("gather_pages", list(block_ids), layers)  # noqa: SLF001
        out = _empty_pages(self, parts[0], self.whole_kv_heads)
        for shard in reversed(group.shards):  # the first holder's copy written last
            own = _with_heads(self, parts[shard.rank], shard.kv_heads_per_rank)
            for full, part in zip(_with_heads(self, out, self.whole_kv_heads), own):
                full[..., list(shard.kv_heads), :] = part
        return out

    def write_pages(self, block_ids: list[int], pages: torch.Tensor,
                    layers: slice = slice(None)) -> None:
        """Every K/V head of these blocks in `layers` (the whole model's pages) into the
        ranks' pools: each keeps its own heads."""
        self.group._pool_op("scatter_pages", list(block_ids), pages, layers)  # noqa: SLF001

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """`KvPool.copy_blocks` on every rank's pool."""
        self.group._pool_op("copy_blocks", list(src), list(dst))  # noqa: SLF001


class TensorParallelModel:
    """Rank 0 of a group of `size`: starts the other ranks, builds its own shard and pool,
    and runs `prefill` and `decode` on all of them. `close()` stops the ranks.

    Calls may come from several threads (a worker's step thread, its event loop writing
    received pages): each call's broadcast and run hold one lock, so every rank sees the
    calls in one order."""

    compiled = None  # a group's decode step is not compiled (--compile is refused)
    # Called with the RankLost before it is raised (a worker exits: its router migrates).
    on_lost: Callable[[RankLost], None] | None = None

    def __init__(self, spec: RankSpec, size: int, start_rank: RankStarter = spawn_rank
                 ) -> None:
        if size < 2:
            raise ValueError(f"tensor_parallel_size: a group needs >= 2 ranks, got {size}")
        self.size = size
        self.rendezvous = Rendezvous.fresh()  # a restarted worker's group meets elsewhere
        self.ranks: list[RankProcess] = [start_rank(rank, size, self.rendezvous, spec)
                                         for rank in range(1, size)]
        try:
            self._control = join(0, size, self.rendezvous, rank_device(spec, 0),
                                 COLLECTIVE_TIMEOUT_S)
        except BaseException:  # no group (a rank died starting, or a peer broke the mesh)
            for proc in self.ranks:
                proc.kill()
                proc.join()
            self.rendezvous.remove()
            raise
        self._lock = threading.Lock()
        self.model, pool, whole = _build(spec, 0, size, RankPool)
        assert isinstance(pool, RankPool)  # noqa: S101 - built as one
        pool.group = self
        self.pool: RankPool = pool
        self.num_kv_heads = whole.num_kv_heads  # the whole model's
        self.shards = [Shard.of(whole, rank, size) for rank in range(size)]
        self.config = self.model.config  # rank 0's shape: its heads, its pool's
        self._closed = False
        self._call(dist.barrier)
        if self.device.type != "cuda":  # every rank joined, and gloo needs the store no more
            self.rendezvous.remove()  # (NCCL makes communicators through it as it goes)
        threading.Thread(target=self._watch, name="tp-rank-watch", daemon=True).start()

    def _watch(self) -> None:
        """A rank that exits while the group is open is reported to `on_lost` at once, not
        at the next call: an idle worker leaves as promptly as a busy one."""
        mp.connection.wait([proc.sentinel for proc in self.ranks])
        if self._closed or self.on_lost is None:
            return
        lost = [p.name for p in self.ranks if not p.is_alive()]
        self._lost(RankLost(f"tensor-parallel rank lost ({', '.join(lost)}): it exited"))

    def _lost(self, error: RankLost) -> None:
        """Tell `on_lost` (which may end the process: the rendezvous goes first)."""
        self.rendezvous.remove()
        if self.on_lost is not None:
            self.on_lost(error)

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RuntimeError as exc:
            lost = [p.name for p in self.ranks if not p.is_alive()]
            error = RankLost(f"tensor-parallel rank lost ({', '.join(lost) or 'stuck'}): "
                             f"{exc}")
            self._lost(error)
            raise error from exc

    @property
    def device(self) -> torch.device:
        return self.model.device

    def rotate_keys(self, keys: torch.Tensor, shift: int) -> torch.Tensor:
        """`Transformer.rotate_keys` on rank 0 (keys of every head, as the pool's `read_keys`
        gathers them: every head rotates alike)."""
        return self.model.rotate_keys(keys, shift)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def backend(self) -> Any:
        return self.model.backend

    @property
    def query_runs(self) -> bool:
        return self.model.query_runs

    def _wire(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]
              ) -> tp_wire.Wire:
        """The call as the ranks receive it; ValueError, before anything is sent, for an
        argument the schema does not take."""
        return tp_wire.encode(method, tp_wire.bind(method, args, kwargs), self.pool,
                              self.model.device)

    def _run(self, method: str, *args: Any, **kwargs: Any) -> torch.Tensor:
        wire = self._wire(method, args, kwargs)
        mass = _mass_buffers(tp_wire.bind(method, args, kwargs).get("mass"))
        with self._lock:
            if self._closed:
                raise RankLost("tensor-parallel group closed")
            self._call(_send, wire, self._control)
            out = self._call(getattr(self.model, method), *args, **kwargs)
            self._call(_sum_mass, mass)
            return out

    def prefill(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """`Transformer.prefill` on every rank (the pool given must be this model's)."""
        return self._run("prefill", *args, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """`Transformer.decode` on every rank (the pool given must be this model's)."""
        return self._run("decode", *args, **kwargs)

    def _pool_op(self, op: str, *args: Any) -> Any:
        wire = self._wire(op, args, {})
        with self._lock:
            if self._closed:
                raise RankLost("tensor-parallel group closed")
            self._call(_send, wire, self._control)
            return self._call(_POOL_OPS[op], self.pool, self.model.shard, *args)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every rank and leave the group (also after a rank was lost)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if all(p.is_alive() for p in self.ranks):
            try:
                _send(self._wire(_STOP, (), {}), self._control)
            except RuntimeError:
                log.info("tensor-parallel group: a rank left before it was told to stop")
        for proc in self.ranks:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout_s)
        dist.destroy_process_group()
        self.rendezvous.remove()
