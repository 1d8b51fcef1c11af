"""One Llama-family decoder (Llama, Qwen3) shared by prefill and decode workers.

Weights load from a Hugging Face checkpoint directory (safetensors). Attention reads and
writes the paged K/V pool through an attention backend from `kernels/kvferry_kernels/` (torch
reference on CPU, Triton on CUDA). The math mirrors transformers' implementation op for op, so
greedy decoding in fp32 is token-identical to `transformers` `generate`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F

from kvferry.cache.pool import KvPool
from kvferry.model.config import ModelConfig
from kvferry.model.tensor_parallel import Shard, shard_config, shard_weights
from kvferry.model.weights import load_weights
from kvferry_kernels.dispatch import AttentionBackend
from kvferry_kernels.kv_quant import fake_quantize
from kvferry_kernels.paged_attention_torch import summed_probs

Weights = Mapping[str, torch.Tensor]  # checkpoint names (q/k/v and gate/up fused) -> tensors


def _rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, as transformers computes them."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = AutoConfig.from_pretrained(config.path)
    params = hf_config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    if rope_type == "dynamic":
        raise ValueError("model: rope_type 'dynamic' depends on sequence length; unsupported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    return inv_freq.float(), float(scaling)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(dtype)


def _linear(w: Weights, x: torch.Tensor, prefix: str) -> torch.Tensor:
    return F.linear(x, w[prefix + ".weight"], w.get(prefix + ".bias"))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class DenseKv(Protocol):
    """The running batch's K/V kept densely beside the pages (decode_worker.kv_stage)."""

    def begin_step(self, positions: torch.Tensor) -> None: ...

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               seq_lens: torch.Tensor, sm_scale: float) -> torch.Tensor: ...

    def end_step(self) -> None: ...


# attend(layer, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> [T, Hq, D]
AttendFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# on_layer_done(layer): layer's K/V is in the pool (prefill ships it layer by layer)
LayerDoneFn = Callable[[int], None]


class CompiledStep(Protocol):
    """A compiled forward (kvferry.model.compiled) over T tokens: logits [R, vocab] of
    `logit_rows` [R] (None: every row, a decode step), or None where it does not cover the
    call (it then runs eagerly). `attend` writes each layer's K/V and attends, then
    `on_layer_done(layer)` is called, as `forward_tokens` does."""

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, attend: AttendFn,
                 logit_rows: torch.Tensor | None = None,
                 on_layer_done: LayerDoneFn | None = None) -> torch.Tensor | None: ...


class GraphStep(Protocol):
    """The decode step replayed from CUDA graphs (kvferry.model.cuda_graphs): logits
    [B, vocab], or None where no graph covers the step (it then runs compiled or eagerly)."""

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, pool: KvPool,
                 seq_lens: torch.Tensor) -> torch.Tensor | None: ...


class ForwardCores(Protocol):
    """Threads per forward (kvferry.cores.CoreLending): `begin` as a forward starts,
    `adjust` between its layers, `end` once it is done."""

    def begin(self) -> None: ...

    def adjust(self) -> None: ...

    def end(self) -> None: ...


class Transformer:
    """Inference-only decoder. Not an nn.Module: weights are a flat dict of tensors."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        shard: Shard | None = None,
    ) -> None:
        """`shard`: this rank's part of a tensor-parallel model (its heads, its MLP columns
        and its weights: kvferry/model/tensor_parallel.py); set `all_reduce` to sum the
        ranks' row-parallel outputs."""
        self.config = shard_config(config, shard) if shard is not None else config
        self.shard = shard
        self.backend = backend
        self.dtype = dtype
        self.device = torch.device(device)
        self.weights = load_weights(Path(config.path), config, self.device, dtype)
        if shard is not None:
            self.weights = shard_weights(self.weights, config, shard)
        # sums a row-parallel output over the ranks, in place (None: one rank, the whole model)
        self.all_reduce: Callable[[torch.Tensor], None] | None = None
        inv_freq, self.rope_scaling = _rope_inv_freq(config)
        self.inv_freq = inv_freq.to(self.device)
        self.sm_scale = config.head_dim**-0.5
        self.compiled: CompiledStep | None = None  # set by kvferry.model.compiled
        self.graphs: GraphStep | None = None  # set by kvferry.model.cuda_graphs
        # Steps may hold several query positions of one sequence (speculative verification):
        # a backend with `run_rows` then attends each sequence's rows with one K/V read.
        self.query_runs = False
        self.cores: ForwardCores | None = None  # set by a worker lending cores

    def _rope(self, positions: torch.Tensor, inv_freq: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos = (emb.cos() * self.rope_scaling).to(self.dtype)[:, None, :]  # [T, 1, D]
        sin = (emb.sin() * self.rope_scaling).to(self.dtype)[:, None, :]
        return cos, sin

    def rotate_keys(self, keys: torch.Tensor, shift: int) -> torch.Tensor:
        """Keys [..., Hkv, D] already rotated at some position p, rotated to p + `shift`
        (negative: back). RoPE's rotations compose (R(p) R(s) = R(p + s)), so this is the
        rotation applying RoPE at p + s gives, without the attention scaling `_rope` folds
        into cos and sin (the keys carry it already). Angles in float64: `shift` may be
        large. Used by K/V eviction (docs/kv-eviction-design.md 3.1)."""
        angles = shift * self.inv_freq.double()  # [D/2]
        emb = torch.cat((angles, angles))  # [D]
        cos = emb.cos().to(keys.device, torch.float32)
        sin = emb.sin().to(keys.device, torch.float32)
        x = keys.float()
        return (x * cos + _rotate_half(x) * sin).to(keys.dtype)

    def _attention_block(
        self, w: Weights, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        attend: AttendFn,
    ) -> torch.Tensor:
        cfg = self.config
        p = f"model.layers.{layer}.self_attn"
        num_tokens = x.shape[0]
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        qkv = _linear(w, x, p + ".qkv_proj")
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
        k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.has_qk_norm:
            q = _rms_norm(q, w[p + ".q_norm.weight"], cfg.rms_norm_eps)
            k = _rms_norm(k, w[p + ".k_norm.weight"], cfg.rms_norm_eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = attend(layer, q, k, v)  # writes k, v to the pool; [T, Hq, D]
        return self._summed(_linear(w, out.reshape(num_tokens, -1), p + ".o_proj"))

    def _mlp(self, w: Weights, layer: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{layer}.mlp"
        gate, up = _linear(w, x, p + ".gate_up_proj").chunk(2, dim=-1)
        return self._summed(_linear(w, F.silu(gate) * up, p + ".down_proj"))

    def _summed(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel output summed over the ranks (as it is with one rank)."""
        if self.all_reduce is not None:
            self.all_reduce(x)
        return x

    def forward_tokens(
        self, w: Weights, inv_freq: torch.Tensor, token_ids: torch.Tensor,
        positions: torch.Tensor, attend: AttendFn, logit_rows: torch.Tensor | None = None,
        on_layer_done: LayerDoneFn | None = None,
    ) -> torch.Tensor:
        """The whole decoder over `token_ids` at `positions`; `attend` writes each layer's K/V
        and attends. Logits [R, vocab] of `logit_rows` (None: every row). Pure in `w` and
        `inv_freq` (the compiled forward passes its own registered copies of the same tensors,
        kvferry.model.compiled)."""
        cfg = self.config
        x = w["model.embed_tokens.weight"][token_ids]  # [T, hidden]
        cos, sin = self._rope(positions, inv_freq)
        for layer in range(cfg.num_layers):
            p = f"model.layers.{layer}"
            h = _rms_norm(x, w[p + ".input_layernorm.weight"], cfg.rms_norm_eps)
            x = x + self._attention_block(w, layer, h, cos, sin, attend)
            if on_layer_done is not None:
                on_layer_done(layer)  # this layer's K/V is in the pool: it may ship now
            h = _rms_norm(x, w[p + ".post_attention_layernorm.weight"], cfg.rms_norm_eps)
            x = x + self._mlp(w, layer, h)
        if logit_rows is not None:
            x = x[logit_rows]
        x = _rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps)
        return F.linear(x, w["lm_head.weight"]).float()  # [rows, vocab]

    def _forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
        pool: KvPool, attend: AttendFn, logit_rows: torch.Tensor | None,
        on_layer_done: LayerDoneFn | None = None,
    ) -> torch.Tensor:
        """The forward compiled where `compiled` covers it, else eager (the same contract)."""
        cores = self.cores
        if cores is not None:
            cores.begin()
        try:
            return self._forward_on(token_ids, positions, slot_mapping, pool, attend,
                                    logit_rows, on_layer_done)
        finally:
            if cores is not None:
                cores.end()

    def _forward_on(
        self, token_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
        pool: KvPool, attend: AttendFn, logit_rows: torch.Tensor | None,
        on_layer_done: LayerDoneFn | None,
    ) -> torch.Tensor:
        writing = self.writing(attend, slot_mapping, pool)
        logits = None
        if self.compiled is not None and logit_rows is None and on_layer_done is None:
            logits = self.compiled(token_ids, positions, writing)  # a decode step: defaults
        elif self.compiled is not None:
            logits = self.compiled(token_ids, positions, writing, logit_rows, on_layer_done)
        if logits is None:  # eager, or rows no compiled package covers
            logits = self.forward_tokens(self.weights, self.inv_freq, token_ids, positions,
                                         writing, logit_rows, on_layer_done)
        return logits

    def writing(self, attend: AttendFn, slot_mapping: torch.Tensor, pool: KvPool) -> AttendFn:
        """`attend`, after writing the layer's new K/V to the pool slots `slot_mapping`."""
        def write_then_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                              ) -> torch.Tensor:
            if self.cores is not None:
                self.cores.adjust()
            self.backend.write_kv(k, v, pool.k_cache(layer), pool.v_cache(layer), slot_mapping)
            if pool.is_quantized:  # attend over what the pages hold, as later steps will
                k = fake_quantize(k, pool.kv_cache_dtype)
                v = fake_quantize(v, pool.kv_cache_dtype)
            return attend(layer, q, k, v)
        return write_then_attend

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: torch.Tensor,  # [T] prompt chunks packed back to back
        seq_lens: list[int],  # tokens of each chunk; sum == T
        slot_mapping: torch.Tensor,  # [T] pool slot of each token
        pool: KvPool,
        context_lens: list[int] | None = None,  # tokens of each prompt already in the pool
        block_tables: list[list[int]] | None = None,  # needed where context_lens > 0
        on_layer_done: LayerDoneFn | None = None,  # after each layer's K/V write
        rope_offsets: list[int] | None = None,  # rotary position - cache index, per chunk
        mass: list[torch.Tensor | None] | None = None,  # per chunk: fp32 [>= context + n]
        logit_rows: list[int] | None = None,  # rows of the T tokens whose logits to return
    ) -> torch.Tensor:  # [num_chunks, vocab] logits of each chunk's last token (or logit_rows)
        """Run prompt chunks (varlen, no padding), write their K/V, return last logits (or
        those of `logit_rows`: prompt logprobs need every position's).

        A chunk with context attends over its prompt's cached K/V too (chunked prefill).
        `context_lens` index the cache; where a prompt evicted K/V while prefilling
        (docs/kv-eviction-design.md), its tokens are rotated `rope_offsets` further. A chunk
        given a `mass` tensor has every layer add to it each attended position's
        probability, summed over query heads and the chunk's tokens (H2O's heavy hitters)."""
        contexts = context_lens or [0] * len(seq_lens)
        offsets = rope_offsets or [0] * len(seq_lens)
        positions = torch.cat(
            [torch.arange(c + o, c + o + n) for c, o, n in zip(contexts, offsets, seq_lens)]
        ).to(self.device)
        bounds = [0]
        for n in seq_lens:
            bounds.append(bounds[-1] + n)
        gqa = self.config.num_kv_groups > 1

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            outs = []
            for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
                qs = q[start:end].transpose(0, 1)[None]  # [1, Hq, n, D]
                if contexts[i] == 0:
                    ks = k[start:end].transpose(0, 1)[None]  # [1, Hkv, n, D]
                    vs = v[start:end].transpose(0, 1)[None]
                    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                       scale=self.sm_scale, enable_gqa=gqa)
                    mask = None
                else:
                    assert block_tables is not None  # noqa: S101 - caller contract
                    total = contexts[i] + end - start
                    ks, vs, mask = self._cached_kv(layer, pool, block_tables[i], contexts[i], total)
                    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                       scale=self.sm_scale, enable_gqa=gqa)
                if mass is not None and mass[i] is not None:
                    self._add_mass(qs, ks, mask, mass[i])
                outs.append(o[0].transpose(0, 1))  # [n, Hq, D]
            return torch.cat(outs, dim=0)

        rows = (torch.tensor(bounds[1:], dtype=torch.int64) - 1 if logit_rows is None
                else torch.tensor(logit_rows, dtype=torch.int64))
        return self._forward(token_ids, positions, slot_mapping, pool, attend, rows,
                             on_layer_done)

    def _add_mass(self, qs: torch.Tensor, ks: torch.Tensor, mask: torch.Tensor | None,
                  mass: torch.Tensor) -> None:
        """Add each key's attention probability, summed over heads and queries, to `mass`:
        qs [1, Hq, n, D], ks [1, Hkv, total, D], mask [n, total] (None: causal over n), as
        the decode kernels' torch path sums them (`summed_probs`)."""
        n, total = qs.shape[2], ks.shape[2]
        if mask is None:
            mask = torch.ones(n, n, dtype=torch.bool, device=qs.device).tril()
        probs = summed_probs(qs.transpose(1, 2).float(), ks.float(), ~mask[None],
                             self.sm_scale)  # [1, n, total]
        mass[:total] += probs[0].sum(dim=0)

    def _cached_kv(self, layer: int, pool: KvPool, table: list[int], context: int, total: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K/V of positions [0, total) from the pool, and the causal mask of the last
        total - context queries over them."""
        num_blocks = (total + pool.block_size - 1) // pool.block_size
        ids = torch.tensor(table[:num_blocks], device=self.device)
        shape = (-1, pool.num_kv_heads, pool.head_dim)
        pages = pool.dense(pool.cache[layer].index_select(1, ids))  # [2, blocks, bs, Hkv, D]
        ks = pages[0].reshape(shape)[:total].transpose(0, 1)[None]
        vs = pages[1].reshape(shape)[:total].transpose(0, 1)[None]
        q_pos = torch.arange(context, total, device=self.device)
        mask = torch.arange(total, device=self.device)[None, :] <= q_pos[:, None]  # [n, total]
        return ks, vs, mask

    @property
    def takes_run_rows(self) -> bool:
        """Whether decode steps hand the backend's decode_attention a `run_rows`."""
        return self.query_runs and self.backend.run_rows is not None

    def run_rows(self, block_tables: torch.Tensor, seq_lens: torch.Tensor
                 ) -> dict[str, torch.Tensor]:
        """decode_attention's run_rows for one step ({} where the backend finds runs itself
        or `query_runs` is off)."""
        if not self.takes_run_rows:
            return {}
        assert self.backend.run_rows is not None  # noqa: S101 - takes_run_rows checked it
        return {"run_rows": self.backend.run_rows(block_tables, seq_lens,
                                                  self.config.num_heads, self.config.num_kv_heads)}

    @torch.inference_mode()
    def decode(
        self,
        token_ids: torch.Tensor,  # [B] one new token per sequence
        positions: torch.Tensor,  # [B] its position (tokens already cached before it)
        slot_mapping: torch.Tensor,  # [B] slot the new token's K/V goes to
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        pool: KvPool,
        stage: DenseKv | None = None,
        seq_lens: torch.Tensor | None = None,  # [B] int32 tokens attended; positions + 1
        mass: torch.Tensor | None = None,  # [B, >= max seq_lens] fp32, added to
    ) -> torch.Tensor:  # [B, vocab]
        """One decode step for a ragged batch over the paged cache. With `stage` (the batch's
        K/V mirrored densely, rows in batch order) attention reads it instead of the pages;
        the pages are written all the same. `positions` rotate the new tokens; `seq_lens`
        (default positions + 1) are the tokens each row's table holds once its token is
        written: they differ where a sequence evicted K/V (docs/kv-eviction-design.md). With
        `mass`, every layer's attention adds each attended position's probability, summed over
        query heads, to it (H2O's heavy hitters; eager: never a CUDA graph, never the stage)."""
        if seq_lens is None:
            seq_lens = (positions + 1).to(torch.int32)
        if mass is not None and stage is not None:
            raise ValueError("attention mass: the dense K/V stage does not report it")
        if self.graphs is not None and stage is None and mass is None:
            logits = self.graphs(token_ids, positions, slot_mapping, block_tables, pool,
                                 seq_lens)
            if logits is not None:
                return logits
        runs = ({"mass": mass} if mass is not None
                else self.run_rows(block_tables, seq_lens) if stage is None else {})

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if stage is not None:
                return stage.attend(layer, q, k, v, seq_lens, self.sm_scale)
            return self.backend.decode_attention(
                q, pool.k_cache(layer), pool.v_cache(layer), block_tables, seq_lens,
                self.sm_scale, **runs,
            )

        if stage is not None:  # the rows are indexed by cache index, as the tables
            stage.begin_step((seq_lens - 1).long())
        logits = self._forward(token_ids, positions, slot_mapping, pool, attend, None)
        if stage is not None:
            stage.end_step()
        return logits

