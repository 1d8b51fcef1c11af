"""Model configuration read from a Hugging Face checkpoint directory."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from kvferry.errors import missing_model
from kvferry.model.identity import checkpoint_fingerprint
from kvferry.settings import LOAD_FORMATS, check_load_format
from kvferry.settings.sampling import SamplingDefaults

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """What kvferry needs of a Llama-family checkpoint."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    has_qk_norm: bool  # Qwen3 normalizes each head of q and k before RoPE
    attention_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    fingerprint: str  # over every byte of weights, config and tokenizer (model/identity.py)
    load_format: str = LOAD_FORMATS[0]
    # unset sampling fields: generation_config.json's, then --override-generation-config's
    sampling_defaults: SamplingDefaults = SamplingDefaults()

    @property
    def num_kv_groups(self) -> int:
        return self.num_heads // self.num_kv_heads


def _generation_config(checkpoint: Path) -> dict:
    path = checkpoint / "generation_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


def _eos_ids(raw: dict, generation: dict) -> tuple[int, ...]:
    ids: list[int] = []
    sources = [raw.get("eos_token_id"), generation.get("eos_token_id")]
    for value in sources:
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(int(v) for v in value)
    return tuple(sorted(set(ids)))


def load_model_config(path: str | Path, override_generation_config: str | None = None,
                      load_format: str = LOAD_FORMATS[0]) -> ModelConfig:
    """Read a checkpoint directory's config through transformers' AutoConfig (local only);
    the sampling defaults from its generation_config.json, with the router's
    `--override-generation-config` JSON over them.

    A `.gguf` file is converted once into a cached checkpoint directory (kvferry.model.gguf),
    and the config's `path` names that directory: load weights and tokenizer from it.
    `load_format` dummy: the weights will be random (kvferry.model.weights.dummy_weights), so
    the fingerprint says so: no cache or compiled package is shared with the real weights."""
    check_load_format(load_format)
    from transformers import AutoConfig

    from kvferry.model.gguf import ensure_converted, is_gguf

    checkpoint = ensure_converted(path) if is_gguf(path) else Path(path)
    if not checkpoint.exists():
        raise ValueError(missing_model(path))
    if not (checkpoint / "config.json").exists():
        raise ValueError(f"model: no config.json in {checkpoint}")
    hf = AutoConfig.from_pretrained(checkpoint, local_files_only=True)
    architecture = (hf.architectures or [""])[0]
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model: architecture {architecture!r} is not one of {SUPPORTED_ARCHITECTURES}"
        )
    num_heads = hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    generation = _generation_config(checkpoint)  # eos ids and sampling defaults
    fingerprint = checkpoint_fingerprint(checkpoint)
    return ModelConfig(
        path=str(checkpoint),
        architecture=architecture,
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        has_qk_norm=architecture == "Qwen3ForCausalLM",
        attention_bias=bool(getattr(hf, "attention_bias", False)),
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        eos_token_ids=_eos_ids(hf.to_dict(), generation),
        fingerprint=fingerprint if load_format == "auto" else dummy_fingerprint(fingerprint),
        load_format=load_format,
        sampling_defaults=SamplingDefaults.from_generation_config(
            generation).overridden(override_generation_config),
    )


def dummy_fingerprint(fingerprint: str) -> str:
    """The fingerprint of a checkpoint's config served with dummy weights."""
    return hashlib.sha256(f"{fingerprint}:dummy".encode()).hexdigest()[:len(fingerprint)]
