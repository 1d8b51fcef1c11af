"""`kvferry make-model`: small seeded checkpoints in standard Hugging Face format.

Nothing can be downloaded at run time, so tests and the default deployment serve checkpoints
made here: a byte-level BPE tokenizer trained on a built-in corpus and deterministic weights.
Linear weights use std 1/sqrt(fan_in) so attention is far from uniform: a wrong K/V cache
changes the tokens, which is what makes the token-exact tests meaningful.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Disaggregated serving splits prefill and decode onto different workers, "
    "so long prompts do not stall the tokens of running requests.",
    "Each layer keeps its own keys and values; the cache grows by one slot per token.",
    "Paged attention stores the cache in fixed-size blocks and a block table per request.",
    "Time to first token and inter-token latency are the two numbers users feel.",
    "def generate(prompt, max_tokens=16):\n    return model(prompt)[:max_tokens]\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828",
    "Café, naïve, über, façade, résumé. Ελληνικά, русский, 日本語のテキスト, 中文, 한국어. 🚀✨🙂",
]


# A ChatML template (Qwen's format) over the special tokens above, for chat tests.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a generated checkpoint."""

    architecture: str = "Qwen3ForCausalLM"
    vocab_size: int = 512
    hidden_size: int = 256
    intermediate_size: int = 512
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = True
    seed: int = 0
    # Jinja chat template saved with the tokenizer; None (the default) writes none, and the
    # files are byte-identical to a checkpoint made before this field existed. With one,
    # generation_config.json also lists <|im_end|> as end-of-sequence (the end of a turn).
    chat_template: str | None = None


LLAMA_SPEC = ModelSpec(
    architecture="LlamaForCausalLM", hidden_size=192, intermediate_size=384, num_layers=3,
    num_heads=6, num_kv_heads=2, head_dim=32, tie_word_embeddings=False, seed=1,
)
SPECS = {"qwen3": ModelSpec(), "llama": LLAMA_SPEC}


def build_tokenizer(vocab_size: int):
    """Byte-level BPE (GPT-2 style byte alphabet) trained on the built-in corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[0]
    )


def _hf_config(spec: ModelSpec, vocab_size: int, eos_id: int):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings, eos_token_id=eos_id,
        bos_token_id=None, pad_token_id=eos_id, rms_norm_eps=1e-6,
    )
    if spec.architecture == "Qwen3ForCausalLM":
        config = Qwen3Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **common)
    elif spec.architecture == "LlamaForCausalLM":
        rope = {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 512,
        }
        config = LlamaConfig(rope_parameters=rope, **common)
    else:
        raise ValueError(f"architecture: unsupported {spec.architecture!r}")
    config.architectures = [spec.architecture]
    return config


def _seeded_init(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.zero_()
            elif "embed_tokens" in name:
                std = 2.0 / math.sqrt(param.shape[-1])
                param.copy_(torch.randn(param.shape, generator=gen) * std)
            else:
                std = 1.0 / math.sqrt(param.shape[-1])
                param.copy_(torch.randn(param.shape, generator=gen) * std)


def make_model(out_dir: str | Path, spec: ModelSpec = ModelSpec()) -> Path:
    """Write config.json, generation_config.json, model.safetensors and tokenizer files."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size)
    vocab_size = len(tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[0])
    config = _hf_config(spec, vocab_size, eos_id)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _seeded_init(model, spec.seed)
    gen_eos: int | list[int] = eos_id
    if spec.chat_template is not None:
        tokenizer.chat_template = spec.chat_template
        gen_eos = [eos_id, tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[2])]
    model.generation_config = GenerationConfig(eos_token_id=gen_eos, pad_token_id=eos_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
