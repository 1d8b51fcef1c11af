"""One Llama-family decoder (Llama, Qwen3) shared by prefill and decode workers.

Weights load from a Hugging Face checkpoint directory (safetensors). Attention reads and
writes the paged K/V pool through an attention backend from `kernels/` (torch reference on
CPU, Triton on CUDA). The math mirrors transformers' implementation op for op, so greedy
decoding in fp32 is token-identical to `transformers` `generate`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kernels.dispatch import AttentionBackend
from kvferry.cache.pool import KvPool
from kvferry.model.config import ModelConfig


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


class Transformer:
    """Inference-only decoder. Not an nn.Module: weights are a flat dict of tensors."""

    def __init__(
        self,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.config = config
        self.backend = backend
        self.dtype = dtype
        self.device = torch.device(device)
        self.weights = self._load_weights(Path(config.path))
        inv_freq, self.rope_scaling = _rope_inv_freq(config)
        self.inv_freq = inv_freq.to(self.device)
        self.sm_scale = config.head_dim**-0.5

    def _load_weights(self, checkpoint: Path) -> dict[str, torch.Tensor]:
        files = sorted(checkpoint.glob("*.safetensors"))
        if not files:
            raise ValueError(f"model: no *.safetensors in {checkpoint}")
        weights: dict[str, torch.Tensor] = {}
        for path in files:
            for name, tensor in load_file(str(path)).items():
                weights[name] = tensor.to(device=self.device, dtype=self.dtype)
        if "lm_head.weight" not in weights:
            if not self.config.tie_word_embeddings:
                raise ValueError("model: lm_head.weight missing and embeddings are not tied")
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        return weights

    def _w(self, name: str) -> torch.Tensor:
        return self.weights[name]

    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return F.linear(x, self.weights[prefix + ".weight"], self.weights.get(prefix + ".bias"))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos = (emb.cos() * self.rope_scaling).to(self.dtype)[:, None, :]  # [T, 1, D]
        sin = (emb.sin() * self.rope_scaling).to(self.dtype)[:, None, :]
        return cos, sin

    def _attention_block(
        self, layer: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        slot_mapping: torch.Tensor, pool: KvPool, attend: AttendFn,
    ) -> torch.Tensor:
        cfg = self.config
        p = f"model.layers.{layer}.self_attn"
        num_tokens = x.shape[0]
        q = self._linear(x, p + ".q_proj").view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = self._linear(x, p + ".k_proj").view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = self._linear(x, p + ".v_proj").view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.has_qk_norm:
            q = _rms_norm(q, self._w(p + ".q_norm.weight"), cfg.rms_norm_eps)
            k = _rms_norm(k, self._w(p + ".k_norm.weight"), cfg.rms_norm_eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        self.backend.write_kv(k, v, pool.k_cache(layer), pool.v_cache(layer), slot_mapping)
        out = attend(layer, q, k, v)  # [T, Hq, D]
        return self._linear(out.reshape(num_tokens, -1), p + ".o_proj")

    def _mlp(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{layer}.mlp"
        gate = F.silu(self._linear(x, p + ".gate_proj"))
        return self._linear(gate * self._linear(x, p + ".up_proj"), p + ".down_proj")

    def _forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
        pool: KvPool, attend: AttendFn, logit_rows: torch.Tensor | None,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        cfg = self.config
        x = self._w("model.embed_tokens.weight")[token_ids]  # [T, hidden]
        cos, sin = self._rope(positions)
        for layer in range(cfg.num_layers):
            p = f"model.layers.{layer}"
            h = _rms_norm(x, self._w(p + ".input_layernorm.weight"), cfg.rms_norm_eps)
            x = x + self._attention_block(layer, h, cos, sin, slot_mapping, pool, attend)
            if on_layer_done is not None:
                on_layer_done(layer)  # this layer's K/V is in the pool: it may ship now
            h = _rms_norm(x, self._w(p + ".post_attention_layernorm.weight"), cfg.rms_norm_eps)
            x = x + self._mlp(layer, h)
        if logit_rows is not None:
            x = x[logit_rows]
        x = _rms_norm(x, self._w("model.norm.weight"), cfg.rms_norm_eps)
        return F.linear(x, self._w("lm_head.weight")).float()  # [rows, vocab]

    @torch.inference_mode()
    def prefill(
        self,
        token_ids: torch.Tensor,  # [T] prompt chunks packed back to back
        seq_lens: list[int],  # tokens of each chunk; sum == T
        slot_mapping: torch.Tensor,  # [T] pool slot of each token
        pool: KvPool,
        context_lens: list[int] | None = None,  # tokens of each prompt already in the pool
        block_tables: list[list[int]] | None = None,  # needed where context_lens > 0
        on_layer_done: Callable[[int], None] | None = None,  # after each layer's K/V write
    ) -> torch.Tensor:  # [num_chunks, vocab] logits of each chunk's last token
        """Run prompt chunks (varlen, no padding), write their K/V, return last logits.

        A chunk with context attends over its prompt's cached K/V too (chunked prefill)."""
        contexts = context_lens or [0] * len(seq_lens)
        positions = torch.cat(
            [torch.arange(c, c + n) for c, n in zip(contexts, seq_lens)]
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
                else:
                    assert block_tables is not None  # noqa: S101 - caller contract
                    total = contexts[i] + end - start
                    ks, vs, mask = self._cached_kv(layer, pool, block_tables[i], contexts[i], total)
                    o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask,
                                                       scale=self.sm_scale, enable_gqa=gqa)
                outs.append(o[0].transpose(0, 1))  # [n, Hq, D]
            return torch.cat(outs, dim=0)

        last_rows = torch.tensor(bounds[1:], dtype=torch.int64) - 1
        return self._forward(token_ids, positions, slot_mapping, pool, attend, last_rows,
                             on_layer_done)

    def _cached_kv(self, layer: int, pool: KvPool, table: list[int], context: int, total: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K/V of positions [0, total) from the pool, and the causal mask of the last
        total - context queries over them."""
        num_blocks = (total + pool.block_size - 1) // pool.block_size
        ids = torch.tensor(table[:num_blocks], device=self.device)
        shape = (-1, pool.num_kv_heads, pool.head_dim)
        ks = pool.k_cache(layer)[ids].reshape(shape)[:total].transpose(0, 1)[None]
        vs = pool.v_cache(layer)[ids].reshape(shape)[:total].transpose(0, 1)[None]
        q_pos = torch.arange(context, total, device=self.device)
        mask = torch.arange(total, device=self.device)[None, :] <= q_pos[:, None]  # [n, total]
        return ks, vs, mask

    @torch.inference_mode()
    def decode(
        self,
        token_ids: torch.Tensor,  # [B] one new token per sequence
        positions: torch.Tensor,  # [B] its position (tokens already cached before it)
        slot_mapping: torch.Tensor,  # [B] slot the new token's K/V goes to
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        pool: KvPool,
        stage: DenseKv | None = None,
    ) -> torch.Tensor:  # [B, vocab]
        """One decode step for a ragged batch over the paged cache. With `stage` (the batch's
        K/V mirrored densely, rows in batch order) attention reads it instead of the pages;
        the pages are written all the same."""
        seq_lens = (positions + 1).to(torch.int32)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if stage is not None:
                return stage.attend(layer, q, k, v, seq_lens, self.sm_scale)
            return self.backend.decode_attention(
                q, pool.k_cache(layer), pool.v_cache(layer), block_tables, seq_lens,
                self.sm_scale,
            )

        if stage is not None:
            stage.begin_step(positions)
        logits = self._forward(token_ids, positions, slot_mapping, pool, attend, None)
        if stage is not None:
            stage.end_step()
        return logits
