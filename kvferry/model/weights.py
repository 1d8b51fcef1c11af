"""A checkpoint's weights as the model runs them: safetensors loaded onto the device in the
serving dtype, the LM head tied where the config says so, q/k/v and gate/up fused."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from kvferry.model.config import ModelConfig


def load_weights(checkpoint: Path, config: ModelConfig, device: torch.device,
                 dtype: torch.dtype) -> dict[str, torch.Tensor]:
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
