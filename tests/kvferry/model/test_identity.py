"""A checkpoint's identity (kvferry.model.identity): two checkpoints that differ in one weight
in the middle of a tensor, where the old header-and-edges hash saw none of it, get different
fingerprints; the second one misses the compile cache; the router refuses to mix them. The
weight files' hashes are remembered across starts and forgotten when a file changes."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import struct
from pathlib import Path
from typing import NamedTuple

import pytest

from kvferry.cache.layout import KvLayout
from kvferry.cache.stats import PoolStats
from kvferry.model import identity
from kvferry.model.checkpoint import ModelSpec, make_model
from kvferry.model.compiled import PACKAGE, CompiledDecode, compile_decode
from kvferry.model.config import load_model_config
from kvferry.model.transformer import Transformer
from kvferry_kernels import artifact_cache
from kvferry_kernels.dispatch import get_attention_backend
from router.records import WorkerStats
from router.workers import registry as router_workers
from router.workers.registry import WorkerSet
from router.workers.worker import Worker
from tests.kvferry.model.test_compiled import copying

EDGE_BYTES = 1 << 16  # what the old fingerprint read at each end of a weight file


class Twins(NamedTuple):
    original: Path
    changed: Path  # a copy with one float32 in the middle of its largest tensor changed


def _change_one_weight_in_the_middle(weights: Path) -> int:
    """Add 1 to the middle element of the largest tensor, in place; returns its file offset."""
    data = bytearray(weights.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    start, end = max((v["data_offsets"] for k, v in header.items() if k != "__metadata__"),
                     key=lambda offsets: offsets[1] - offsets[0])
    offset = 8 + header_len + start + (end - start) // 8 * 4  # float32 aligned, mid-tensor
    (value,) = struct.unpack_from("<f", data, offset)
    struct.pack_into("<f", data, offset, value + 1.0)
    weights.write_bytes(bytes(data))
    return offset


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> Twins:
    original = make_model(tmp_path_factory.mktemp("original"), ModelSpec(seed=3))
    changed = tmp_path_factory.mktemp("changed") / "checkpoint"
    shutil.copytree(original, changed)
    weights = changed / "model.safetensors"
    offset = _change_one_weight_in_the_middle(weights)
    header_end = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    # Where the change lies: past the header and the first 64 KiB of data, before the last
    # 64 KiB, and the file size is the same: the old fingerprint could not tell them apart.
    assert header_end + EDGE_BYTES <= offset < weights.stat().st_size - EDGE_BYTES
    assert weights.stat().st_size == (original / "model.safetensors").stat().st_size
    return Twins(original, changed)


def test_one_changed_weight_changes_the_fingerprint(twins: Twins, tmp_path: Path) -> None:
    first = load_model_config(twins.original).fingerprint
    second = load_model_config(twins.changed).fingerprint
    assert first != second and len(first) == len(second) == identity.FINGERPRINT_HEX_CHARS
    same = tmp_path / "same"
    shutil.copytree(twins.original, same)
    assert identity.checkpoint_fingerprint(same, None) == first  # content, not place


def test_tokenizer_and_generation_config_are_part_of_the_identity(twins: Twins,
                                                                  tmp_path: Path) -> None:
    base = identity.checkpoint_fingerprint(twins.original, None)
    for name in ("tokenizer.json", "generation_config.json"):
        copy = tmp_path / name
        shutil.copytree(twins.original, copy)
        (copy / name).write_text((copy / name).read_text() + "\n")
        assert identity.checkpoint_fingerprint(copy, None) != base, name


@pytest.mark.slow  # two real AOTInductor builds, about two minutes here
def test_the_second_checkpoint_misses_the_compile_cache(
        twins: Twins, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    models = [Transformer(load_model_config(path), get_attention_backend("torch"))
              for path in twins]
    first = compile_decode(models[0], "default", (1,), cache)
    assert first is not None
    package = next((cache / "aoti").glob(f"decode-*/{PACKAGE}"))
    # The cache's key is under test, not inductor: the second build copies the first's.
    monkeypatch.setattr(CompiledDecode, "_build", copying(package))
    second = compile_decode(models[1], "default", (1,), cache)
    assert first is not None and (first.num_builds, first.num_cache_hits) == (1, 0)
    assert second is not None and (second.num_builds, second.num_cache_hits) == (1, 0)
    assert len(list((cache / "aoti").iterdir())) == 2  # a package each


def test_the_router_refuses_to_mix_them(twins: Twins, monkeypatch: pytest.MonkeyPatch) -> None:
    served, other = (load_model_config(path).fingerprint for path in twins)

    async def serving(channel: object, timeout_s: float, wait_for_ready: bool) -> bool:
        return True

    class Client:
        def __init__(self, fingerprint: str) -> None:
            self.layout = KvLayout(4, 2, 64, 16, "float32", fingerprint)

        async def get_stats(self, timeout_s: float, cache_events_after: int) -> WorkerStats:
            return WorkerStats(PoolStats(64, 64, 0, 0, 0, True, ""), self.layout)

    monkeypatch.setattr(router_workers.worker_client, "is_serving", serving)
    deployment = WorkerSet(served)
    for address, fingerprint in (("same", served), ("twin", other)):
        deployment.workers.append(Worker(address, "decode", channel=object(),  # type: ignore
                                         decode_client=Client(fingerprint)))  # type: ignore
    asyncio.run(deployment.refresh_all())
    same, twin = deployment.workers
    assert same.is_healthy and same.refuse_reason == ""
    assert not twin.is_healthy
    assert twin.refuse_reason == f"model fingerprint {other} != served {served}"


def test_weight_hashes_are_remembered_until_the_file_changes(
        twins: Twins, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = tmp_path / "model.safetensors"
    shutil.copy(twins.original / "model.safetensors", weights)
    memo = tmp_path / "memo"
    want = artifact_cache.sha256_file(weights)
    assert identity.file_sha256(weights, memo) == want
    hashed: list[Path] = []

    def counting(path: Path) -> str:
        hashed.append(path)
        return want

    monkeypatch.setattr(artifact_cache, "sha256_file", counting)
    assert identity.file_sha256(weights, memo) == want and hashed == []  # a restart: the memo
    _change_one_weight_in_the_middle(weights)  # written in place: new mtime and ctime
    identity.file_sha256(weights, memo)
    assert hashed == [weights]


def test_a_memo_others_may_write_is_refused_with_one_line(
        twins: Twins, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    memo = tmp_path / "memo"
    memo.mkdir()
    memo.chmod(0o777)  # anyone could plant a hash for a file they changed
    weights = twins.changed / "model.safetensors"
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            assert identity.file_sha256(weights, memo) == artifact_cache.sha256_file(weights)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and f"refusing {memo} " in warnings[0], warnings
    assert list(memo.iterdir()) == []  # neither read nor written
