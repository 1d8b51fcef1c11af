"""A checkpoint's weights as the model runs them: safetensors loaded onto the device in the
serving dtype, the LM head tied where the config says so, q/k/v and gate/up fused."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from kvferry.model.config import ModelConfig


def load_weights(checkpoint: Path, config: ModelConfig, device: torch.device,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
    if config.load_format == "dummy":
        return dummy_weights(config, device, dtype)
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors in {checkpoint}")
    weights: dict[str, torch.Tensor] = {}
    for path in files:
        for name, tensor in load_file(str(path)).items():
            weights[name] = tensor.to(device=device, dtype=dtype)
    if "lm_head.weight" not in weights:
        if not config.tie_word_embeddings:
            raise ValueError("model: lm_head.weight missing and embeddings are not tied")
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    _fuse_projections(weights, config.num_layers)
    return weights


def _fuse(weights: dict[str, torch.Tensor], parts: list[str], fused: str) -> None:
    """Replace the `parts` projections (weight and, when every part has one, bias) by one
    projection `fused` whose output rows are theirs, in order: one GEMM instead of several."""
    for kind in ("weight", "bias"):
        names = [f"{part}.{kind}" for part in parts]
        if all(name in weights for name in names):
            weights[f"{fused}.{kind}"] = torch.cat([weights.pop(name) for name in names])
        elif kind == "bias" and any(name in weights for name in names):
            raise ValueError(f"model: only some of {names} exist; expected all or none")


def _fuse_projections(weights: dict[str, torch.Tensor], num_layers: int) -> None:
    """q/k/v into qkv_proj and gate/up into gate_up_proj, as vLLM and SGLang load them."""
    for layer in range(num_layers):
        p = f"model.layers.{layer}"
        _fuse(weights, [f"{p}.self_attn.{x}_proj" for x in "qkv"], f"{p}.self_attn.qkv_proj")
        _fuse(weights, [f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"], f"{p}.mlp.gate_up_proj")


def dummy_weights(config: ModelConfig, device: torch.device, dtype: torch.dtype,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of `config`'s shapes, made on `device` (nothing read from disk; vLLM's
    `--load-format dummy`), already fused. Seeded: every worker of a deployment on the same
    kind of device makes the same weights, so prefill's K/V suits decode's model. Linear
    weights are normal with std 1/sqrt(fan-in) and norms are ones, which keeps activations
    finite in bf16; what the tokens are means nothing, how long a step takes is the model's."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden, inter, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_size, kv_size = config.num_heads * head_dim, config.num_kv_heads * head_dim

    def normal(rows: int, cols: int, std: float) -> torch.Tensor:
        out = torch.empty(rows, cols, device=device, dtype=dtype)
        return out.normal_(0.0, std, generator=gen)

    def ones(size: int) -> torch.Tensor:
        return torch.ones(size, device=device, dtype=dtype)

    weights = {"model.embed_tokens.weight": normal(config.vocab_size, hidden, 1.0),
               "model.norm.weight": ones(hidden)}
    for layer in range(config.num_layers):
        p = f"model.layers.{layer}"
        weights |= {
            f"{p}.input_layernorm.weight": ones(hidden),
            f"{p}.post_attention_layernorm.weight": ones(hidden),
            f"{p}.self_attn.qkv_proj.weight": normal(q_size + 2 * kv_size, hidden, hidden**-0.5),
            f"{p}.self_attn.o_proj.weight": normal(hidden, q_size, q_size**-0.5),
            f"{p}.mlp.gate_up_proj.weight": normal(2 * inter, hidden, hidden**-0.5),
            f"{p}.mlp.down_proj.weight": normal(hidden, inter, inter**-0.5)}
        if config.has_qk_norm:
            weights[f"{p}.self_attn.q_norm.weight"] = ones(head_dim)
            weights[f"{p}.self_attn.k_norm.weight"] = ones(head_dim)
        if config.attention_bias:
            weights[f"{p}.self_attn.qkv_proj.bias"] = torch.zeros(
                q_size + 2 * kv_size, device=device, dtype=dtype)
            weights[f"{p}.self_attn.o_proj.bias"] = torch.zeros(hidden, device=device,
                                                                dtype=dtype)
        if config.mlp_bias:
            weights[f"{p}.mlp.gate_up_proj.bias"] = torch.zeros(2 * inter, device=device,
                                                                dtype=dtype)
            weights[f"{p}.mlp.down_proj.bias"] = torch.zeros(hidden, device=device, dtype=dtype)
    weights["lm_head.weight"] = (weights["model.embed_tokens.weight"]
                                 if config.tie_word_embeddings
                                 else normal(config.vocab_size, hidden, hidden**-0.5))
    return weights
