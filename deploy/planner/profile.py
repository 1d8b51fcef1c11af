"""A deployment's measured costs, kept per model, dtype, device and K/V transport, and the cost
model the simulator reads from them.

`kvferry profile` (deploy/planner/profiler.py) measures a running 1 prefill + 1 decode
deployment from the outside, as a client sees it, so every cost below already holds the
router hop, the streams and the step loop's own overhead:

- prefill: the time to first token of one prompt alone (or of a few sent together), against
  the prompt tokens of the batch and the attention work of its chunks;
- decode: the inter-token gap with `batch` sequences running, against the batch and the
  context tokens the batch holds;
- transfer: the gap between the first and the second token of a request alone, less one
  decode step, against prompt tokens: the K/V push and the attach;
- colocated: prefill and decode again, on one colocated worker placed on the cores the decode
  worker had, the router and the client beside it on them (as deploy/placement.py places a
  colocated layout on few cores): a colocated worker's steps share its cores with the
  router's and the client's turns, which a decode worker's did not.

The file keeps the measured points; `CostModel` fits them (least squares, coefficients kept
non-negative) each time it is built, so a profile stays readable and refittable.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvferry.cache.budget import KvBudget
from kvferry.settings import KVFERRY_HOME

PROFILE_VERSION = 1
PROFILES_DIR = KVFERRY_HOME / "profiles"


@dataclass(frozen=True)
class PrefillPoint:
    """One prefill batch: its prompt tokens, its attention work (the sum over its chunks of
    chunk tokens x the tokens they attend over) and the measured time to first token."""

    tokens: int
    attention_tokens: int
    seconds: float


JITTER_QUANTILES = 20  # a decode point keeps its gaps' distribution at this many quantiles


@dataclass(frozen=True)
class DecodePoint:
    """A decode step with `batch` sequences holding `context_tokens` in all: the median gap
    between tokens, and the gaps' distribution as ratios to it (their quantiles at (i + 0.5)
    / JITTER_QUANTILES; () for none): a client sees tokens late and then early, from the
    router's and its own turns on the CPU and the collector's passes, even with the batch
    steady."""

    batch: int
    context_tokens: int
    seconds: float
    jitter: tuple[float, ...] = ()


@dataclass(frozen=True)
class TransferPoint:
    """A prompt's K/V moved to the decode worker and attached there."""

    prompt_tokens: int
    seconds: float


@dataclass(frozen=True)
class Profile:
    """What one worker of this shape costs on this machine (see the module docstring)."""

    model: str  # the model's name, as GetModelInfo says it
    dtype: str
    device: str
    kv_transport: str
    torch_threads: int  # per worker, as measured
    block_size: int
    kv_bytes_per_token: int  # every layer's K and V, as the pool stores them
    num_blocks: int  # one decode worker's pool
    prefill_token_budget: int  # prompt tokens per prefill forward
    prefill_chunk_size: int  # a longer prompt is prefilled a chunk per forward
    batch_buckets: tuple[int, ...]  # the compiled decode batch sizes (a batch runs as the next)
    max_model_len: int
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    transfer: tuple[TransferPoint, ...]
    measured_at: str = ""  # ISO date and time
    version: int = PROFILE_VERSION
    # CPU the router, and apart the load generator beside it, spend per streamed token and
    # per request (deploy/planner/cpu_share.py shares it with the workers on their cores)
    relay_s_per_token: float = 0.0
    router_s_per_request: float = 0.0
    router_s_per_update: float = 0.0  # per update from a decode worker (one per step)
    client_s_per_token: float = 0.0
    client_s_per_request: float = 0.0
    num_cores: int = 0  # cores the deployment was placed on (0: unknown, the router's own)
    # the decode worker's CPU to take a prompt's K/V in (and reserve, attach), which its
    # steps wait for; none: free
    receive: tuple[TransferPoint, ...] = ()
    # a colocated worker's prefill and decode points (none: priced as the workers above)
    colocated_prefill: tuple[PrefillPoint, ...] = ()
    colocated_decode: tuple[DecodePoint, ...] = ()

    @property
    def has_colocated(self) -> bool:
        """Whether a colocated worker's own points were measured."""
        return bool(self.colocated_prefill and self.colocated_decode)

    @property
    def key(self) -> str:
        """The name a profile is kept under: model, dtype, device and transport."""
        text = f"{self.model}-{self.dtype}-{self.device}-{self.kv_transport}"
        return re.sub(r"[^A-Za-z0-9._-]+", "_", text)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    def save(self, path: Path | None = None) -> Path:
        path = path or PROFILES_DIR / f"{self.key}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n")
        return path

    @staticmethod
    def load(path: Path) -> Profile:
        """Read a profile file; ValueError naming what is wrong with it."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"profile {path}: {exc}") from None
        return Profile.from_dict(data, str(path))

    @staticmethod
    def from_dict(data: object, source: str = "profile") -> Profile:
        """A profile from its JSON object (`source` names it in errors)."""
        if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile {source}: not a version {PROFILE_VERSION} profile")
        try:
            return Profile(**{
                **data,
                "batch_buckets": tuple(data["batch_buckets"]),
                "prefill": tuple(PrefillPoint(**p) for p in data["prefill"]),
                "decode": tuple(_decode_point(p) for p in data["decode"]),
                "transfer": tuple(TransferPoint(**p) for p in data["transfer"]),
                "receive": tuple(TransferPoint(**p) for p in data.get("receive", ())),
                "colocated_prefill": tuple(PrefillPoint(**p)
                                           for p in data.get("colocated_prefill", ())),
                "colocated_decode": tuple(_decode_point(p)
                                          for p in data.get("colocated_decode", ())),
            })
        except KeyError as exc:
            raise ValueError(f"profile {source}: missing field {exc}") from None
        except TypeError as exc:
            raise ValueError(f"profile {source}: {exc}") from None


def _decode_point(data: dict) -> DecodePoint:
    return DecodePoint(**{**data, "jitter": tuple(data.get("jitter", ()))})


def attention_tokens(chunks: Sequence[tuple[int, int]]) -> int:
    """Attention work of a prefill batch: for each (cached, new) chunk, new x (cached + new)."""
    return sum(new * (cached + new) for cached, new in chunks)


def nonneg_lstsq(features: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: a negative one is dropped and the rest
    refitted (the few features here make this exact enough)."""
    keep = list(range(features.shape[1]))
    while True:
        coef = np.zeros(features.shape[1])
        if keep:
            fit, *_ = np.linalg.lstsq(features[:, keep], targets, rcond=None)
            coef[keep] = fit
        negative = [i for i in keep if coef[i] < 0]
        if not negative:
            return coef
        keep.remove(min(negative, key=lambda i: coef[i]))


class DecodeFit:
    """A decode step's time: one base per measured batch size and one slope per context token,
    fitted together; a batch runs as the next compiled size (`buckets`, none: as it is), its
    base linear between the measured sizes and past the last."""

    def __init__(self, points: Sequence[DecodePoint], buckets: Sequence[int] = ()) -> None:
        if not points:
            raise ValueError("profile: needs decode points")
        self.batches = sorted({p.batch for p in points})
        self.buckets = sorted(buckets)
        rows = [[float(p.batch == b) for b in self.batches] + [p.context_tokens] for p in points]
        coef = nonneg_lstsq(np.array(rows), np.array([p.seconds for p in points]))
        self.base = coef[:-1]
        self.per_context_token = float(coef[-1])
        self.points = list(points)

    def jitter_at(self, batch: int, context_tokens: int = 0) -> tuple[float, ...]:
        """The spread of the measured point nearest this batch (by size), then nearest its
        context per sequence (by ratio); empty: no spread measured."""
        per_seq = max(context_tokens / max(batch, 1), 1.0)
        nearest = min(self.points, key=lambda p: (
            abs(p.batch - batch), abs(math.log(max(p.context_tokens / p.batch, 1.0) / per_seq))))
        return nearest.jitter

    def step_s(self, batch: int, context_tokens: int) -> float:
        size = next((b for b in self.buckets if b >= batch), batch)
        base = float(np.interp(size, self.batches, self.base))
        if size > self.batches[-1] and len(self.batches) > 1:  # the last slope goes on
            slope = (self.base[-1] - self.base[-2]) / (self.batches[-1] - self.batches[-2])
            base = float(self.base[-1] + max(slope, 0.0) * (size - self.batches[-1]))
        return base + self.per_context_token * context_tokens


def _linear(points: Sequence[TransferPoint]) -> np.ndarray:
    """t0 + t1 * prompt_tokens through the points (zeros for none)."""
    if not points:
        return np.zeros(2)
    rows = np.array([[1.0, p.prompt_tokens] for p in points])
    return nonneg_lstsq(rows, np.array([p.seconds for p in points]))


class CostModel:
    """Times the simulator charges, fitted from a profile:

    prefill batch  a + b * tokens + c * attention_tokens
    decode step    DecodeFit
    transfer       t0 + t1 * prompt_tokens
    receive        r0 + r1 * prompt_tokens, of the decode worker's time
    """

    def __init__(self, profile: Profile, colocated: bool = False,
                 kv_budget: KvBudget | None = None) -> None:
        if not profile.prefill or not profile.transfer:
            raise ValueError("profile: needs prefill and transfer points")
        self.profile = profile
        # What a request holds in a decode pool at most: the deployment's --kv-eviction
        # policy (kvferry/cache/budget.py), as its router and workers count it.
        self.kv_budget = kv_budget or KvBudget()
        # a colocated worker's own points, where the profile has them
        self.is_colocated = colocated and profile.has_colocated
        prefill = profile.colocated_prefill if self.is_colocated else profile.prefill
        pre = np.array([[1.0, p.tokens, p.attention_tokens] for p in prefill])
        self.prefill_coef = nonneg_lstsq(pre, np.array([p.seconds for p in prefill]))
        self.decode = DecodeFit(profile.colocated_decode if self.is_colocated
                                else profile.decode, profile.batch_buckets)
        self.transfer_coef = _linear(profile.transfer)
        self.receive_coef = _linear(profile.receive)

    def colocated(self) -> CostModel:
        """The costs of a colocated worker: its own measured points (their router's and
        client's turns on its cores in them), else these."""
        if self.is_colocated or not self.profile.has_colocated:
            return self
        return CostModel(self.profile, colocated=True, kv_budget=self.kv_budget)

    def prefill_s(self, tokens: int, attention: int) -> float:
        a, b, c = self.prefill_coef
        return float(a + b * tokens + c * attention)

    def decode_s(self, batch: int, context_tokens: int) -> float:
        return self.decode.step_s(batch, context_tokens)

    def transfer_s(self, prompt_tokens: int) -> float:
        t0, t1 = self.transfer_coef
        return float(t0 + t1 * prompt_tokens)

    def receive_s(self, prompt_tokens: int) -> float:
        r0, r1 = self.receive_coef
        return float(r0 + r1 * prompt_tokens)

    def describe(self) -> str:
        """The fit, one line per cost, in ms (and a colocated worker's, where measured)."""
        text = self._describe()
        colocated = self.colocated()
        if colocated is not self:
            a, b, _ = colocated.prefill_coef * 1000
            text += (f"\ncolocated prefill {a:.2f} ms + {b * 1000:.3f} ms per 1k tokens; "
                     f"decode {colocated._decode_terms()}")
        return text

    def _decode_terms(self) -> str:
        """The decode fit: "base by batch {1: 2.31, ...} ms + x ms per 1k context tokens"."""
        bases = ", ".join(f"{n}: {v * 1000:.2f}" for n, v in zip(self.decode.batches,
                                                                   self.decode.base))
        return (f"base by batch {{{bases}}} ms + "
                f"{self.decode.per_context_token * 1e6:.3f} ms per 1k context tokens")

    def _describe(self) -> str:
        a, b, c = self.prefill_coef * 1000
        t0, t1 = self.transfer_coef * 1000
        return (f"prefill  {a:.2f} ms + {b * 1000:.3f} ms per 1k tokens + {c * 1e6:.3f} ms "
                f"per 1M attention tokens\n"
                f"decode   {self._decode_terms()}\n"
                f"transfer {t0:.2f} ms + {t1 * 1000:.3f} ms per 1k prompt tokens\n"
                f"receive  {self.receive_coef[0] * 1000:.2f} ms + "
                f"{self.receive_coef[1] * 1e6:.3f} ms per 1k prompt tokens of decode worker\n"
                f"router   {self.profile.router_s_per_request * 1000:.2f} ms per request + "
                f"{self.profile.router_s_per_update * 1000:.3f} ms per step + "
                f"{self.profile.relay_s_per_token * 1000:.3f} ms per token of CPU\n"
                f"client   {self.profile.client_s_per_request * 1000:.2f} ms per request + "
                f"{self.profile.client_s_per_token * 1000:.3f} ms per token of CPU, on "
                f"{self.profile.num_cores or '?'} cores")
