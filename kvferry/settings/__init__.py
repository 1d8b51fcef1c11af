"""Per-process configuration: one frozen object per process, built from flags."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from kvferry.settings.limits import PublicLimits
from kvferry.settings.sampling import SamplingDefaults
from kvferry.settings.tiers import TierSettings

# Where kvferry keeps what it makes: converted and seeded models, demo logs.
KVFERRY_HOME = Path(os.environ.get("KVFERRY_HOME", Path.home() / ".cache" / "kvferry"))
DEFAULT_MODEL_DIR = KVFERRY_HOME / "models" / "qwen3-tiny"
COMPILE_CACHE_DIR = Path(os.environ.get("KVFERRY_COMPILE_CACHE",  # --compile's packages
                                        KVFERRY_HOME / "compile-cache"))
KERNEL_CACHE_DIR = KVFERRY_HOME / "kernels"  # the C attention kernel, built once per machine

# The one place for defaults and names shared by settings, flags and launchers.
DEFAULT_BLOCK_SIZE = 16  # tokens per K/V block
DEFAULT_KV_POOL_SIZE = "auto"  # sized from the device (kvferry/cache/pool_budget.py)
# Deployments the tests and benchmarks launch: fixed, so that several fit on one machine
LAUNCHED_KV_POOL_SIZE = "256MiB"
# --kv-pool-size auto: the share of a GPU a worker takes unless told (vLLM's
# gpu_memory_utilization default)
CUDA_UTILIZATION = 0.9
# On CPU a share of RAM is taken only when --memory-utilization is given; without it the pool
# is this size, as vLLM's CPU backend takes a fixed KV space (VLLM_CPU_KVCACHE_SPACE): the
# pool is zeroed, so resident, from the start, and RAM is shared with everything else on the
# machine. (A first measurement put a RAM-sized decode pool at 7-18x the loaded p99 ITL of
# this size; that was the dense stage's copies, which decode no longer makes by default, and
# is not re-measured; the current figure is in docs/performance.md.)
CPU_POOL_BYTES = 256 << 20
DEFAULT_PREFILL_TOKEN_BUDGET = 2048  # prompt tokens per prefill forward
CPU_PREFILL_TOKEN_BUDGET = 512  # the same on CPU (kvferry/model/prefill_batch.py says why)
DEFAULT_PREFILL_CHUNK_SIZE = 512
DEFAULT_MAX_WAITING = 256
DEFAULT_DRAIN_TIMEOUT_S = 30.0
# None: none where the C kernel reads the pages in place, else as much K/V as the pool holds
DEFAULT_DECODE_STAGE_MIB: int | None = None
DEFAULT_KV_MAX_RESENDS = 2
DEFAULT_LEASE_S = 30.0  # a decode reservation waits this long for its K/V
DEFAULT_DNS_INTERVAL_S = 5.0
# The router's OpenAI-compatible HTTP API (router/http/front.py): off in library use and for
# `kvferry router` unless --http-port is given; `kvferry serve` opens it here (vLLM's port).
DEFAULT_HTTP_PORT = 8000
DEFAULT_TORCH_THREADS = 0  # 0: torch's default (every core)
# A deployment starts several workers on one machine; one thread each keeps them from
# oversubscribing the cores (torch's default would give every worker all of them).
DEPLOYMENT_TORCH_THREADS = 1
# Name tuples: the first one is the default, where the setting has one.
ROLES = ("prefill", "decode", "colocated")
# The pool dtypes of kvferry/cache/layout.py (those with a torch dtype; a test keeps them
# equal), plus auto: see WorkerSettings.dtype.
DTYPES = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # auto: triton on CUDA, torch on CPU
# Every K/V transport (kvferry/transfer/<name>/ holds both of its ends) and its package, one
# line each: what `--kv-transport` offers, the first the default (docs/contributing.md).
KV_TRANSPORTS = {
    "grpc": "kvferry.transfer.grpc",  # client-streaming PushKv of ~1 MiB chunks
    "ray": "kvferry.transfer.ray",  # Ray object refs between actors
    "nixl": "kvferry.transfer.nixl",  # the decode worker READs the pages with NIXL
}
DEFAULT_KV_TRANSPORT = next(iter(KV_TRANSPORTS))
# K/V pages as the model computes them (auto) or quantized (kernels/kvferry_kernels/kv_quant.py,
# whose KV_CACHE_DTYPES this equals: kept here too so that flags parse without importing torch).
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3")
TRANSFER_THREAD = "kvferry-xfer"  # OS name of the threads that move and check K/V bytes
# Forwards: eager ("off"); ONE AOTInductor package with a dynamic row count serving the prefill
# forward and the decode step of every batch ("dynamic", the default); or the decode step alone,
# one package per batch-size bucket (the rest; kvferry/model/compiled.py).
COMPILE_MODES = ("off", "dynamic", "default", "max-autotune", "auto")
# $KVFERRY_COMPILE sets --compile's default everywhere (the test suite runs eager by it, but
# where a test compiles); a value outside COMPILE_MODES is refused naming the field.
COMPILE_ENV = "KVFERRY_COMPILE"
DEFAULT_COMPILE_MODE = os.environ.get(COMPILE_ENV, "dynamic")
BUCKET_COMPILE_MODES = COMPILE_MODES[2:]
DEFAULT_COMPILE_BATCH_SIZES = "1,2,4,8,16,32"
# Decode step on CUDA with Triton attention: replayed from CUDA graphs per bucket (the same
# buckets), or eager ("off", vLLM's --enforce-eager); kvferry/model/cuda_graphs.py.
CUDA_GRAPH_MODES = ("on", "off")
# auto: the checkpoint's safetensors; dummy: seeded random weights of the config's shapes made
# on the device (vLLM's --load-format dummy), to measure a model whose weights are not here
LOAD_FORMATS = ("auto", "dummy")
POLICIES = ("prefix", "headroom", "round_robin", "least_requests",  # router/policies/routing.py
            "priced")  # router/policies/priced.py
# The prefix policy's cost weights (router/policies/routing.py, which says how each was
# measured): per prompt block not cached on a decode worker (a block pushed) or on a prefill
# worker (a block computed), and per block of load there; headroom for the request stays a
# hard constraint.
DEFAULT_PREFIX_WEIGHT = 16.0
DEFAULT_PREFILL_PREFIX_WEIGHT = 4.0
DEFAULT_LOAD_WEIGHT = 1.0
DEFAULT_DEMAND_WEIGHT = 0.25  # per block of recent demand on decode, decaying over:
DEMAND_TAU_S = 10.0

def parse_http_port(value: str) -> int | None:
    """An --http-port value: a port (0: any free one), or "off" for none."""
    if value.strip().lower() == "off":
        return None
    if not value.strip().isdigit() or int(value) > 65535:
        raise ValueError(f"http_port: expected a port number or off, got {value!r}")
    return int(value)


def _check_common(drain_timeout_s: float, metrics_port: int | None) -> None:
    if drain_timeout_s < 0:
        raise ValueError(f"drain_timeout_s: must be >= 0, got {drain_timeout_s}")
    if metrics_port is not None and not 0 <= metrics_port < 65536:
        raise ValueError(f"metrics_port: out of range: {metrics_port}")


@dataclass(frozen=True)
class SecuritySettings:
    """TLS and the cluster token of one process (kvferry/rpc/security.py builds the credentials).
    All None: plaintext and no token, for tests and local development."""

    tls_cert: str | None = None  # this server's certificate (PEM); also the client certificate
    tls_key: str | None = None  # of its internal calls; give both or neither
    tls_ca: str | None = None  # CA bundle to verify peers; worker servers then require client
    # certificates (mTLS)
    tls_server_name: str | None = None  # name expected in peers' certificates (default: the
    # address's host); Kubernetes pods are dialled by IP, so name the certificate's DNS SAN
    cluster_token_file: str | None = None  # shared secret every internal RPC must carry
    health_port: int | None = None  # plaintext grpc.health.v1 only, for probes that cannot
    # speak TLS (Kubernetes gRPC probes); None: health on the main port only

    def __post_init__(self) -> None:
        if self.health_port is not None and not 0 <= self.health_port < 65536:
            raise ValueError(f"health_port: out of range: {self.health_port}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert/tls_key: give both or neither")
        if self.tls_ca is not None and self.tls_cert is None:
            raise ValueError("tls_ca: needs tls_cert and tls_key (the server speaks TLS)")
        for name in ("tls_cert", "tls_key", "tls_ca", "cluster_token_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no such file {path!r}")

    @property
    def is_tls(self) -> bool:
        return self.tls_cert is not None


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    """"1,2,4,8" -> (1, 2, 4, 8), sorted, distinct; ValueError naming the flag otherwise."""
    try:
        sizes = tuple(sorted({int(part) for part in text.split(",") if part.strip()}))
    except ValueError:
        raise ValueError("compile_batch_sizes: expected comma-separated integers, "
                         f"got {text!r}") from None
    if not sizes or sizes[0] < 1 or sizes[-1] > 4096:
        raise ValueError(f"compile_batch_sizes: expected integers in [1, 4096], got {text!r}")
    return sizes


SPECULATIVE_METHODS = ("off", "ngram", "draft")
# Where a draft model's prompt K/V comes from: the decode worker prefills the draft itself, or
# the prefill worker does and ships it with the model's pages (gRPC transport); auto: ship
# where the transport carries it (grpc), recompute elsewhere. Shipping cut the decode streams'
# p99 ITL to 0.34x for 1.09x the arrivals' TTFT (bench/bench_draft_kv.py, docs/performance.md).
DRAFT_KV_MODES = ("auto", "recompute", "ship")
DEFAULT_NUM_SPECULATIVE_TOKENS = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding on decode and colocated workers (docs/spec-decode-design.md).
    ngram: prompt lookup, the drafts are the `num_tokens` tokens that followed the latest
    earlier occurrence of the sequence's last n tokens, n from `prompt_lookup_max` down to
    `prompt_lookup_min` (vLLM's flags of those names). draft: the argmax of `model` (a
    checkpoint sharing the model's tokenizer), its prompt K/V recomputed on the decode worker
    or (`draft_kv` ship) built by the prefill worker and shipped with the model's. Adaptive:
    each sequence verifies the drafts worth their cost (docs/spec-decode-design.md 3.7)."""

    method: str = SPECULATIVE_METHODS[0]
    num_tokens: int = DEFAULT_NUM_SPECULATIVE_TOKENS
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    is_adaptive: bool = True  # k per sequence from its acceptance and the step cost
    model: str = ""  # draft: the draft model's checkpoint
    draft_kv: str = DRAFT_KV_MODES[0]  # draft: its prompt K/V shipped (auto: on grpc) or not

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method: expected one of "
                             f"{', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if (self.method == "draft") != bool(self.model):
            raise ValueError("speculative_model: needed with --speculative-method draft, and "
                             "only then")
        if self.draft_kv not in DRAFT_KV_MODES:
            raise ValueError(f"speculative_draft_kv: expected one of "
                             f"{', '.join(DRAFT_KV_MODES)}, got {self.draft_kv!r}")
        if self.draft_kv == "ship" and self.method != "draft":
            raise ValueError("speculative_draft_kv: ship needs --speculative-method draft")
        if self.num_tokens < 1:
            raise ValueError(f"num_speculative_tokens: must be >= 1, got {self.num_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min/max: need 1 <= min <= max, got "
                             f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")

    @property
    def is_on(self) -> bool:
        return self.method != "off"



EVICTION_POLICIES = ("none", "streaming", "h2o")


@dataclass(frozen=True)
class KvEvictionConfig:
    """A K/V budget per sequence on decode and colocated workers
    (docs/kv-eviction-design.md). none: every token kept. streaming (StreamingLLM): the
    first `sink_tokens` (attention sinks) and the last `window_tokens`, both rounded up to
    whole blocks; the blocks between are freed as the window moves, and distances are those
    of positions within the cache, so a sequence may run past the model's context. h2o
    (heavy hitters): the last `recent_tokens` and the `heavy_tokens` whose blocks drew the
    most attention so far, both rounded up to whole blocks; positions stay those of the
    text."""

    policy: str = EVICTION_POLICIES[0]
    sink_tokens: int = 4
    window_tokens: int = 1020
    heavy_tokens: int = 512
    recent_tokens: int = 512

    def __post_init__(self) -> None:
        if self.policy not in EVICTION_POLICIES:
            raise ValueError(f"kv_eviction: expected one of {', '.join(EVICTION_POLICIES)}, "
                             f"got {self.policy!r}")
        if self.sink_tokens < 0:
            raise ValueError(f"kv_sink_tokens: must be >= 0, got {self.sink_tokens}")
        if self.window_tokens < 1:
            raise ValueError(f"kv_window_tokens: must be >= 1, got {self.window_tokens}")
        if self.heavy_tokens < 0:
            raise ValueError(f"kv_heavy_tokens: must be >= 0, got {self.heavy_tokens}")
        if self.recent_tokens < 1:
            raise ValueError(f"kv_recent_tokens: must be >= 1, got {self.recent_tokens}")

    @property
    def is_on(self) -> bool:
        return self.policy != "none"

    def sink_blocks(self, block_size: int) -> int:
        """The leading blocks kept whatever comes (streaming's sinks; none under h2o)."""
        return -(-self.sink_tokens // block_size) if self.policy == "streaming" else 0

    def recent_blocks(self, block_size: int) -> int:
        """The newest blocks kept (the block being filled among them)."""
        tokens = self.recent_tokens if self.policy == "h2o" else self.window_tokens
        return max(1, -(-tokens // block_size))

    def budget_blocks(self, block_size: int) -> int:
        """Blocks a sequence holds at most: the sinks' (or heavy hitters') and the window's
        (the block being filled is the window's newest)."""
        kept = (-(-self.heavy_tokens // block_size) if self.policy == "h2o"
                else self.sink_blocks(block_size))
        return kept + self.recent_blocks(block_size)

    def describe(self) -> str:
        """The policy and its sizes, as `kvferry plan` and logs print them."""
        if self.policy == "h2o":
            return (f"h2o (heavy {self.heavy_tokens} and recent {self.recent_tokens} "
                    f"tokens")
        return (f"{self.policy} (sinks {self.sink_tokens} and window {self.window_tokens} "
                f"tokens")


def _check_eviction(settings: WorkerSettings) -> None:
    """What eviction does not combine with (each refusal names both flags;
    docs/combinations.md says why)."""
    speculative = settings.speculative
    if speculative.method == "draft":
        raise ValueError("kv_eviction: the draft model's own pages are not evicted with the "
                         "model's; use --speculative-method ngram or off with --kv-eviction")
    if speculative.is_on and settings.kv_eviction.policy == "h2o":
        raise ValueError("kv_eviction: h2o with --speculative-method: a verification's "
                         "attention mass would count its rejected drafts, so h2o would evict "
                         "other blocks than decoding without drafts; use --kv-eviction "
                         "streaming or --speculative-method off")
    if settings.decode_stage_mib and settings.kv_eviction.policy == "h2o":
        raise ValueError("kv_eviction: h2o reads every step's attention mass, which the "
                         "dense K/V stage (--decode-stage-mib) does not report; give "
                         "--decode-stage-mib 0, leave it unset, or use --kv-eviction streaming")


def _check_tensor_parallel(settings: WorkerSettings) -> None:
    """What a tensor-parallel worker does not do yet: what would move K/V outside the
    operations every rank mirrors, or run a forward other than the group's (each refusal
    names the flag; docs/tensor-parallel.md). --cuda-graphs and --compile dynamic, on by
    default, are not refused: a split worker's forwards run eager (deploy/worker_model.py
    says so in its log)."""
    size = settings.tensor_parallel_size
    if size < 1:
        raise ValueError(f"tensor_parallel_size: must be >= 1, got {size}")
    refused = [
        ("compile", settings.compile in BUCKET_COMPILE_MODES, "--compile dynamic or off"),
        ("decode_stage_mib", bool(settings.decode_stage_mib), "--decode-stage-mib 0"),
        ("core_lending", settings.core_lending is not None, "no --core-lending"),
    ]
    for name, is_set, instead in refused:
        if is_set:
            raise ValueError(f"{name}: not with tensor_parallel_size {size} yet; use "
                             f"{instead}, or --tensor-parallel-size 1")


@dataclass(frozen=True)
class WorkerSettings:
    """A prefill or decode worker process."""

    role: str  # "prefill", "decode" or "colocated" (both roles in one step loop)
    model: str
    host: str = "127.0.0.1"
    port: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    kv_pool_size: str = DEFAULT_KV_POOL_SIZE
    # kv_pool_size auto: the share of the device this worker may use (None: the device's
    # default, kvferry/cache/pool_budget.py)
    memory_utilization: float | None = None
    dtype: str = DTYPES[0]  # auto: float32 on CPU, the checkpoint's dtype (or bfloat16) on CUDA
    device: str = "auto"
    attention_backend: str = ATTENTION_BACKENDS[0]  # auto: triton on CUDA, torch on CPU
    torch_threads: int = DEFAULT_TORCH_THREADS
    # Reservations that may wait for blocks before RESOURCE_EXHAUSTED.
    max_waiting: int = DEFAULT_MAX_WAITING
    prefill_token_budget: int | None = None  # None: the device's (token_budget_for)
    # Longer prompts are prefilled in chunks of this many tokens.
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK_SIZE
    # Torch attention backend: MiB for the running batch's K/V mirrored densely beside the
    # pages (decode_worker/kv_stage.py); 0: gather pages every step; None: the whole pool.
    decode_stage_mib: int | None = DEFAULT_DECODE_STAGE_MIB
    compile: str = DEFAULT_COMPILE_MODE  # compile the forwards (a split model's: eager)
    compile_batch_sizes: str = DEFAULT_COMPILE_BATCH_SIZES  # buckets; larger batches: eager
    cuda_graphs: str = CUDA_GRAPH_MODES[0]  # decode/colocated, CUDA + Triton only; else moot
    # Keep finished requests' full K/V blocks indexed for reuse (kvferry/cache/prefix.py).
    prefix_caching: bool = True
    kv_cache_dtype: str = KV_CACHE_DTYPES[0]  # auto: K/V stored as the model computes them
    load_format: str = LOAD_FORMATS[0]  # dummy: random weights (model/weights.py)
    # Resend a K/V push corrupted in flight this many times; 0: fail with DATA_LOSS.
    kv_max_resends: int = DEFAULT_KV_MAX_RESENDS
    kv_transport: str = DEFAULT_KV_TRANSPORT  # how pages move (ray: Ray actors; nixl: NIXL reads)
    max_model_len: int | None = None  # decode: longest prompt + max_tokens (max_model_len_for)
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # SIGTERM: to finish in-flight requests
    metrics_port: int | None = None  # Prometheus /metrics on this HTTP port (0: any free)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    tiers: TierSettings = field(default_factory=TierSettings)  # K/V tiers below the pool
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    kv_eviction: KvEvictionConfig = field(default_factory=KvEvictionConfig)
    # Ranks the model is split over (docs/tensor-parallel.md); 1: the whole model here.
    tensor_parallel_size: int = 1
    # FILE:SLOT:PARTNER:CPUS: threads on the partner's cores while it is idle (kvferry/cores.py;
    # serve sets it); None: this worker's own threads only.
    core_lending: str | None = None

    @property
    def ships_draft_kv(self) -> bool:
        """Prefill workers build the draft model's prompt K/V and push it with the model's
        (--speculative-draft-kv ship, or auto over the grpc transport)."""
        mode = self.speculative.draft_kv
        return self.speculative.method == "draft" and (
            mode == "ship" or (mode == "auto" and self.kv_transport == "grpc"))

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role: expected prefill, decode or colocated, got {self.role!r}")
        _check_common(self.drain_timeout_s, self.metrics_port)
        if self.memory_utilization is not None and not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization: expected a fraction in (0, 1], got "
                             f"{self.memory_utilization}")
        check_load_format(self.load_format)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: expected one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise ValueError(f"kv_transport: expected {', '.join(KV_TRANSPORTS)}, got "
                             f"{self.kv_transport!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"compile: expected one of {', '.join(COMPILE_MODES)}, "
                             f"got {self.compile!r}")
        parse_batch_sizes(self.compile_batch_sizes)
        if self.cuda_graphs not in CUDA_GRAPH_MODES:
            raise ValueError(f"cuda_graphs: expected on or off, got {self.cuda_graphs!r}")
        if self.speculative.draft_kv == "ship" and self.kv_transport != "grpc":
            raise ValueError(f"speculative_draft_kv: ship sends the draft's pages over "
                             f"--kv-transport grpc, not {self.kv_transport}; use recompute")
        if self.kv_eviction.is_on:
            _check_eviction(self)
        if self.tensor_parallel_size != 1:
            _check_tensor_parallel(self)
        if self.speculative.is_on and self.decode_stage_mib:
            raise ValueError("decode_stage_mib: speculative decoding (--speculative-method) "
                             "reads the pages; give 0 or leave it unset")
        if self.decode_stage_mib is not None and self.decode_stage_mib < 0:
            raise ValueError(f"decode_stage_mib: must be >= 0, got {self.decode_stage_mib}")
        if self.kv_max_resends < 0:
            raise ValueError(f"kv_max_resends: must be >= 0, got {self.kv_max_resends}")
        for name in ("max_waiting", "prefill_token_budget", "prefill_chunk_size", "max_model_len"):
            if (value := getattr(self, name)) is not None and value < 1:
                raise ValueError(f"{name}: must be >= 1, got {value}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size: must be a power of two, got {self.block_size}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: out of range: {self.port}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: unknown {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: unknown {self.attention_backend!r}")
        if self.core_lending is not None:
            from kvferry.settings.cpus import parse_spec

            parse_spec(self.core_lending)


@dataclass(frozen=True)
class RouterSettings:
    """The router process."""

    model: str
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    colocated: tuple[str, ...] = ()  # workers serving both roles
    prefill_dns: str = ""  # HOST:PORT of a headless Service: one prefill worker per address
    decode_dns: str = ""  # likewise for decode workers
    dns_interval_s: float = DEFAULT_DNS_INTERVAL_S
    host: str = "127.0.0.1"
    port: int = 0
    lease_s: float = DEFAULT_LEASE_S
    policy: str = POLICIES[0]
    prefix_weight: float = DEFAULT_PREFIX_WEIGHT  # the prefix policy's cost weights (decode,
    prefill_prefix_weight: float = DEFAULT_PREFILL_PREFIX_WEIGHT  # prefill, load: both)
    load_weight: float = DEFAULT_LOAD_WEIGHT
    demand_weight: float = DEFAULT_DEMAND_WEIGHT  # the prefix policy's, decode only
    local_prefill_threshold: int = 0  # prompts shorter than this prefill on the decode worker
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S  # SIGTERM: to finish in-flight streams
    metrics_port: int | None = None  # Prometheus /metrics on this HTTP port (0: any free)
    security: SecuritySettings = field(default_factory=SecuritySettings)
    is_public_client_auth: bool = False  # the public port also requires client certificates
    limits: PublicLimits = field(default_factory=PublicLimits)
    # The OpenAI-compatible HTTP API on this port (0: any free one; None: not served); TLS
    # and client-certificate settings apply to it as to the public gRPC port.
    http_port: int | None = None
    # Bearer keys of the public APIs, each a tenant (router/identity.py); () : none asked.
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    is_prompt_tokens_details: bool = False  # report cached prompt tokens to clients
    served_model_name: str | None = None  # the API's model id; None: the checkpoint's name
    override_generation_config: str | None = None  # JSON over the checkpoint's sampling
    # defaults (kvferry/settings/sampling.py), as vLLM's flag of that name
    load_format: str = LOAD_FORMATS[0]  # the workers' (it is part of the model's fingerprint)
    # The decode workers' --kv-eviction and its sizes: under a policy a sequence's K/V is
    # bounded, so prompt + max_tokens may pass the pool and the model's context (the prompt
    # itself must fit them); admission counts the policy's budget (kvferry/cache/budget.py).
    kv_eviction: KvEvictionConfig = field(default_factory=KvEvictionConfig)

    def __post_init__(self) -> None:
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name: must not be empty")
        SamplingDefaults().overridden(self.override_generation_config)  # ValueError naming it
        check_load_format(self.load_format)
        if self.is_public_client_auth and self.security.tls_ca is None:
            raise ValueError("is_public_client_auth: needs tls_ca to verify client certificates")
        if self.policy not in POLICIES:
            raise ValueError(f"policy: unknown {self.policy!r}")
        for name in ("prefix_weight", "prefill_prefix_weight", "load_weight",
                     "demand_weight"):
            weight = getattr(self, name)
            if not weight >= 0:  # NaN too
                raise ValueError(f"{name}: must be >= 0, got {weight}")
        _check_common(self.drain_timeout_s, self.metrics_port)
        if self.http_port is not None and not 0 <= self.http_port < 65536:
            raise ValueError(f"http_port: out of range: {self.http_port}")
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold: must be >= 0")
        if not self.colocated and not ((self.prefill or self.prefill_dns)
                                       and (self.decode or self.decode_dns)):
            raise ValueError("prefill/decode: give prefill and decode workers, or colocated ones")
        if self.lease_s <= 0:
            raise ValueError(f"lease_s: must be > 0, got {self.lease_s}")


def check_load_format(load_format: str) -> None:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: expected one of {', '.join(LOAD_FORMATS)}, got "
                         f"{load_format!r}")
