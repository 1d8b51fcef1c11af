"""Published models' shapes without their weights: `kvferry make-model --shape` writes one's
config.json and a placeholder tokenizer, served with `--load-format dummy` (random weights
made on the device, kvferry.model.weights.dummy_weights). What a step of such a model costs
does not depend on its weights' values, so this is how a GPU machine without the weights (and
without a network) measures a real architecture."""

from __future__ import annotations

from pathlib import Path

# From each model's published config.json.
_LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
PUBLISHED_SHAPES = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_parameters=_LLAMA31_ROPE,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001),
    "qwen3-8b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645),
}


def make_shape(out_dir: str | Path, shape: str, **overrides: object) -> Path:
    """Write a published model's config.json (with `overrides` of its fields, e.g. fewer
    layers for a quick check) and a word-level tokenizer naming each of its token ids (`t0`,
    `t1`, ...; the real tokenizer cannot be downloaded), without weights: serve it with
    `--load-format dummy`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    if shape not in PUBLISHED_SHAPES:
        raise ValueError(f"shape: expected one of {', '.join(PUBLISHED_SHAPES)}, got {shape!r}")
    fields = dict(PUBLISHED_SHAPES[shape]) | overrides
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(out)
    vocab = {f"t{i}": i for i in range(fields["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    eos = f"t{fields['eos_token_id']}"
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos
                            ).save_pretrained(out)
    return out
