"""A GGUF file served as a Hugging Face checkpoint directory, converted once and cached.

transformers dequantizes GGUF weights at load time (~20 s for a 135M model on two cores), so a
worker that read the GGUF at every start would pay that every time. Instead the first process
that needs it writes an fp32 safetensors checkpoint under KVFERRY_HOME/models/, keyed by the
file's content (its full SHA-256, remembered per inode, size and times by
`kvferry.model.identity.file_sha256`), and every process afterwards loads that directory.

The directory is an entry of `kvferry_kernels.artifact_cache`. Concurrency: a deployment starts its
router and workers at once, so several processes may find the cache empty together. Each
converts into a private scratch directory, fsyncs it with a manifest (every file's SHA-256) and
renames it into place; a rename is atomic, so a reader sees either no directory or a complete
one. The loser of the race deletes its copy and uses the winner's. Every load first verifies
the directory against its manifest: a truncated, stubbed or altered file means one warning and
a fresh conversion. A models directory another user owns, or group or others may write, is
refused with one warning and the conversion written to a private temporary directory instead
(this process converts at every start until the directory is fixed).
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvferry.model.identity import file_sha256
from kvferry.settings import KVFERRY_HOME
from kvferry_kernels import artifact_cache

log = logging.getLogger(__name__)

# Converted checkpoints live beside the tiny default one.
MODELS_DIR = KVFERRY_HOME / "models"
GGUF_SUFFIX = ".gguf"
GGUF_MAGIC = b"GGUF"


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (rather than a checkpoint directory)."""
    candidate = Path(path)
    return candidate.suffix.lower() == GGUF_SUFFIX and candidate.is_file()


def gguf_cache_key(path: str | Path) -> str:
    """The file's content: 32 hex characters of its SHA-256."""
    return file_sha256(Path(path).resolve())[:32]


def converted_dir(path: str | Path, models_dir: Path | None = None) -> Path:
    """Where the converted checkpoint of GGUF file `path` lives (it may not exist yet)."""
    source = Path(path)
    return (models_dir or MODELS_DIR) / f"{source.stem}-{gguf_cache_key(source)}"


def cached_conversion(path: str | Path, models_dir: Path | None = None) -> Path | None:
    """The converted checkpoint of GGUF file `path` if one is cached (None otherwise): its
    config.json reads in milliseconds, where the GGUF's metadata (a whole tokenizer's
    vocabulary) takes seconds to parse. A directory there is complete (renamed into place
    whole); its weights are verified by whoever loads them."""
    directory = converted_dir(path, models_dir)
    return directory if (directory / "config.json").is_file() else None


def is_converted(directory: Path) -> bool:
    """Whether `directory` is a complete conversion that matches its manifest byte for byte."""
    return artifact_cache.verify(directory) is None and (directory / "config.json").exists()


def ensure_converted(path: str | Path, models_dir: Path | None = None) -> Path:
    """The checkpoint directory of GGUF file `path`, converted first if not cached."""
    source = Path(path)
    if not is_gguf(source):
        raise ValueError(f"model: {source} is not a GGUF file")
    with source.open("rb") as f:
        if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise ValueError(f"model: {source} does not start with the GGUF magic bytes")
    # A refused models directory (one warning) means a private temporary one instead.
    root = artifact_cache.cache_root(models_dir or MODELS_DIR, log, "kvferry-models-")
    target = converted_dir(source, root)

    def convert(scratch: Path) -> None:
        log.info("converting %s into %s (once)", source, target)
        try:
            convert_gguf(source, scratch)
        except (ValueError, OSError, KeyError) as exc:  # what transformers/gguf raise on a bad file
            raise ValueError(f"model: cannot convert GGUF file {source}: {exc}") from exc

    return artifact_cache.get_or_build(target, convert, log).path


def convert_gguf(source: Path, out_dir: Path) -> Path:
    """Dequantize GGUF `source` into an fp32 Hugging Face checkpoint in `out_dir`.

    Writes config.json, generation_config.json, model.safetensors and the tokenizer files
    (with the chat template the GGUF carries)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    where, name = str(source.parent), source.name
    loaded = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    # A GGUF-loaded model carries a quantization config and refuses save_pretrained: build a
    # plain model of the same class from a config without it, and give it the weights.
    config = AutoConfig.from_pretrained(where, gguf_file=name)
    config.__dict__.pop("quantization_config", None)
    config.dtype = torch.float32
    config.architectures = [type(loaded).__name__]
    plain = type(loaded)(config)
    plain.load_state_dict(loaded.state_dict())
    plain.eval()
    plain.generation_config = _generation_config(loaded, tokenizer, GenerationConfig)
    out_dir.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _generation_config(loaded, tokenizer, generation_config_cls):
    """The GGUF's generation settings; eos always includes the tokenizer's eos token
    (`<|im_end|>` for chat models), so generation stops where the model means to stop."""
    config = loaded.generation_config
    eos = config.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    merged = generation_config_cls.from_dict(config.to_dict())
    merged.eos_token_id = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if merged.pad_token_id is None and tokenizer.pad_token_id is not None:
        merged.pad_token_id = tokenizer.pad_token_id
    return merged
