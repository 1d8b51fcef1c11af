from kvferry.v1 import generation_pb2 as _generation_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KvTier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_DEVICE: _ClassVar[KvTier]
    KV_TIER_HOST: _ClassVar[KvTier]
    KV_TIER_DISK: _ClassVar[KvTier]
    KV_TIER_STORE: _ClassVar[KvTier]
KV_TIER_DEVICE: KvTier
KV_TIER_HOST: KvTier
KV_TIER_DISK: KvTier
KV_TIER_STORE: KvTier

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "model_fingerprint")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    model_fingerprint: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "decode_address", "is_local_decode", "num_generated", "defer_push", "cache_salt", "skip_blocks", "num_samples")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IS_LOCAL_DECODE_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    DEFER_PUSH_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _generation_pb2.SamplingParams
    decode_address: str
    is_local_decode: bool
    num_generated: int
    defer_push: bool
    cache_salt: str
    skip_blocks: int
    num_samples: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., decode_address: _Optional[str] = ..., is_local_decode: _Optional[bool] = ..., num_generated: _Optional[int] = ..., defer_push: _Optional[bool] = ..., cache_salt: _Optional[str] = ..., skip_blocks: _Optional[int] = ..., num_samples: _Optional[int] = ...) -> None: ...

class ShipRequest(_message.Message):
    __slots__ = ("request_id", "decode_address", "skip_blocks")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    decode_address: str
    skip_blocks: int
    def __init__(self, request_id: _Optional[str] = ..., decode_address: _Optional[str] = ..., skip_blocks: _Optional[int] = ...) -> None: ...

class ShipResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "prefill_s", "num_cached_tokens", "num_cached_host_tokens", "num_cached_disk_tokens", "num_cached_store_tokens", "sample_token_ids", "logprobs", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_HOST_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_DISK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_STORE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    prefill_s: float
    num_cached_tokens: int
    num_cached_host_tokens: int
    num_cached_disk_tokens: int
    num_cached_store_tokens: int
    sample_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., prefill_s: _Optional[float] = ..., num_cached_tokens: _Optional[int] = ..., num_cached_host_tokens: _Optional[int] = ..., num_cached_disk_tokens: _Optional[int] = ..., num_cached_store_tokens: _Optional[int] = ..., sample_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class PrefillDone(_message.Message):
    __slots__ = ("kv_transfer_s", "kv_bytes")
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    kv_transfer_s: float
    kv_bytes: int
    def __init__(self, kv_transfer_s: _Optional[float] = ..., kv_bytes: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "done")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    done: PrefillDone
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., done: _Optional[_Union[PrefillDone, _Mapping]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "max_tokens", "lease_s", "prompt_token_ids", "cache_salt", "num_samples", "computes_whole_prompt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    COMPUTES_WHOLE_PROMPT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    lease_s: float
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    num_samples: int
    computes_whole_prompt: bool
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., lease_s: _Optional[float] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ..., num_samples: _Optional[int] = ..., computes_whole_prompt: _Optional[bool] = ...) -> None: ...

class RenewLeasesRequest(_message.Message):
    __slots__ = ("request_ids", "lease_s")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    lease_s: float
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., lease_s: _Optional[float] = ...) -> None: ...

class RenewLeasesResponse(_message.Message):
    __slots__ = ("unknown_ids",)
    UNKNOWN_IDS_FIELD_NUMBER: _ClassVar[int]
    unknown_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, unknown_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("num_blocks", "num_cached_blocks")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    num_cached_blocks: int
    def __init__(self, num_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "first_token_id", "sampling", "max_new_tokens", "stop_token_ids", "num_generated", "sample_first_token_ids")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    sampling: _generation_pb2.SamplingParams
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_generated: int
    sample_first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., sampling: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., num_generated: _Optional[int] = ..., sample_first_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DecodeFinished(_message.Message):
    __slots__ = ("reason", "first_decode_step_s", "num_draft_tokens", "num_accepted_tokens")
    REASON_FIELD_NUMBER: _ClassVar[int]
    FIRST_DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    reason: _generation_pb2.FinishReason
    first_decode_step_s: float
    num_draft_tokens: int
    num_accepted_tokens: int
    def __init__(self, reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., first_decode_step_s: _Optional[float] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_tokens: _Optional[int] = ...) -> None: ...

class DecodeCommand(_message.Message):
    __slots__ = ("start", "abort", "abort_sample")
    START_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    ABORT_SAMPLE_FIELD_NUMBER: _ClassVar[int]
    start: DecodeRequest
    abort: _generation_pb2.AbortRequest
    abort_sample: AbortSample
    def __init__(self, start: _Optional[_Union[DecodeRequest, _Mapping]] = ..., abort: _Optional[_Union[_generation_pb2.AbortRequest, _Mapping]] = ..., abort_sample: _Optional[_Union[AbortSample, _Mapping]] = ...) -> None: ...

class AbortSample(_message.Message):
    __slots__ = ("request_id", "sample_index")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample_index: int
    def __init__(self, request_id: _Optional[str] = ..., sample_index: _Optional[int] = ...) -> None: ...

class DecodeUpdate(_message.Message):
    __slots__ = ("request_id", "token_ids", "finished", "error_code", "error_message", "sample_index", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finished: DecodeFinished
    error_code: int
    error_message: str
    sample_index: int
    logprobs: _containers.RepeatedCompositeFieldContainer[_generation_pb2.TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finished: _Optional[_Union[DecodeFinished, _Mapping]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., sample_index: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[_generation_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class DecodeBatch(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[DecodeUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[DecodeUpdate, _Mapping]]] = ...) -> None: ...

class KvChunk(_message.Message):
    __slots__ = ("request_id", "layout", "num_tokens", "layer_start", "layer_end", "block_start", "num_blocks", "data", "crc32", "is_draft", "num_evicted", "num_rebased")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BLOCK_START_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    IS_DRAFT_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTED_FIELD_NUMBER: _ClassVar[int]
    NUM_REBASED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: KvLayout
    num_tokens: int
    layer_start: int
    layer_end: int
    block_start: int
    num_blocks: int
    data: bytes
    crc32: int
    is_draft: bool
    num_evicted: int
    num_rebased: int
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., block_start: _Optional[int] = ..., num_blocks: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32: _Optional[int] = ..., is_draft: _Optional[bool] = ..., num_evicted: _Optional[int] = ..., num_rebased: _Optional[int] = ...) -> None: ...

class KvPullMessage(_message.Message):
    __slots__ = ("begin", "group", "checksum")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    begin: KvPullBegin
    group: KvPullGroup
    checksum: KvPullChecksum
    def __init__(self, begin: _Optional[_Union[KvPullBegin, _Mapping]] = ..., group: _Optional[_Union[KvPullGroup, _Mapping]] = ..., checksum: _Optional[_Union[KvPullChecksum, _Mapping]] = ...) -> None: ...

class KvPullBegin(_message.Message):
    __slots__ = ("request_id", "layout", "num_tokens", "agent_name", "agent_metadata", "pool_address", "pool_blocks", "memory_type", "device_id", "block_table")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    AGENT_METADATA_FIELD_NUMBER: _ClassVar[int]
    POOL_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    POOL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TABLE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    layout: KvLayout
    num_tokens: int
    agent_name: str
    agent_metadata: bytes
    pool_address: int
    pool_blocks: int
    memory_type: str
    device_id: int
    block_table: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., num_tokens: _Optional[int] = ..., agent_name: _Optional[str] = ..., agent_metadata: _Optional[bytes] = ..., pool_address: _Optional[int] = ..., pool_blocks: _Optional[int] = ..., memory_type: _Optional[str] = ..., device_id: _Optional[int] = ..., block_table: _Optional[_Iterable[int]] = ...) -> None: ...

class KvPullGroup(_message.Message):
    __slots__ = ("layer_start", "layer_end", "block_start", "num_blocks")
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    BLOCK_START_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    layer_start: int
    layer_end: int
    block_start: int
    num_blocks: int
    def __init__(self, layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., block_start: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class KvPullChecksum(_message.Message):
    __slots__ = ("group", "crc32")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    group: int
    crc32: int
    def __init__(self, group: _Optional[int] = ..., crc32: _Optional[int] = ...) -> None: ...

class PushKvResponse(_message.Message):
    __slots__ = ("bytes_written",)
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    bytes_written: int
    def __init__(self, bytes_written: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("check_integrity", "cache_events_after")
    CHECK_INTEGRITY_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVENTS_AFTER_FIELD_NUMBER: _ClassVar[int]
    check_integrity: bool
    cache_events_after: int
    def __init__(self, check_integrity: _Optional[bool] = ..., cache_events_after: _Optional[int] = ...) -> None: ...

class CacheEvent(_message.Message):
    __slots__ = ("stored", "removed", "tier")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    stored: _containers.RepeatedScalarFieldContainer[bytes]
    removed: _containers.RepeatedScalarFieldContainer[bytes]
    tier: KvTier
    def __init__(self, stored: _Optional[_Iterable[bytes]] = ..., removed: _Optional[_Iterable[bytes]] = ..., tier: _Optional[_Union[KvTier, str]] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("role", "total_blocks", "free_blocks", "reserved_blocks", "num_running", "num_waiting", "layout", "integrity_ok", "integrity_error", "num_preemptions", "num_pending_prefill_tokens", "num_decode_steps", "max_abort_delay_steps", "projected_blocks", "num_corrupt_pushes", "num_parked", "num_parked_evictions", "num_compiles", "cache_event_seq", "cache_events", "cache_snapshot", "prefix_cache_queries", "prefix_cache_hits", "cached_blocks", "tiers", "prefill_s_per_token", "tensor_parallel_size", "kv_evicted_blocks")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_OK_FIELD_NUMBER: _ClassVar[int]
    INTEGRITY_ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DECODE_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_ABORT_DELAY_STEPS_FIELD_NUMBER: _ClassVar[int]
    PROJECTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CORRUPT_PUSHES_FIELD_NUMBER: _ClassVar[int]
    NUM_PARKED_FIELD_NUMBER: _ClassVar[int]
    NUM_PARKED_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPILES_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVENT_SEQ_FIELD_NUMBER: _ClassVar[int]
    CACHE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    role: str
    total_blocks: int
    free_blocks: int
    reserved_blocks: int
    num_running: int
    num_waiting: int
    layout: KvLayout
    integrity_ok: bool
    integrity_error: str
    num_preemptions: int
    num_pending_prefill_tokens: int
    num_decode_steps: int
    max_abort_delay_steps: int
    projected_blocks: int
    num_corrupt_pushes: int
    num_parked: int
    num_parked_evictions: int
    num_compiles: int
    cache_event_seq: int
    cache_events: _containers.RepeatedCompositeFieldContainer[CacheEvent]
    cache_snapshot: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    cached_blocks: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    prefill_s_per_token: float
    tensor_parallel_size: int
    kv_evicted_blocks: int
    def __init__(self, role: _Optional[str] = ..., total_blocks: _Optional[int] = ..., free_blocks: _Optional[int] = ..., reserved_blocks: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., layout: _Optional[_Union[KvLayout, _Mapping]] = ..., integrity_ok: _Optional[bool] = ..., integrity_error: _Optional[str] = ..., num_preemptions: _Optional[int] = ..., num_pending_prefill_tokens: _Optional[int] = ..., num_decode_steps: _Optional[int] = ..., max_abort_delay_steps: _Optional[int] = ..., projected_blocks: _Optional[int] = ..., num_corrupt_pushes: _Optional[int] = ..., num_parked: _Optional[int] = ..., num_parked_evictions: _Optional[int] = ..., num_compiles: _Optional[int] = ..., cache_event_seq: _Optional[int] = ..., cache_events: _Optional[_Iterable[_Union[CacheEvent, _Mapping]]] = ..., cache_snapshot: _Optional[bool] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., cached_blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., prefill_s_per_token: _Optional[float] = ..., tensor_parallel_size: _Optional[int] = ..., kv_evicted_blocks: _Optional[int] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_blocks", "used_blocks", "hit_tokens", "bytes_in", "bytes_out", "evictions", "dropped_writes", "corrupt_blocks", "num_promotions", "promotion_s", "state")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_IN_FIELD_NUMBER: _ClassVar[int]
    BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_WRITES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTION_S_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    tier: KvTier
    capacity_blocks: int
    used_blocks: int
    hit_tokens: int
    bytes_in: int
    bytes_out: int
    evictions: int
    dropped_writes: int
    corrupt_blocks: int
    num_promotions: int
    promotion_s: float
    state: int
    def __init__(self, tier: _Optional[_Union[KvTier, str]] = ..., capacity_blocks: _Optional[int] = ..., used_blocks: _Optional[int] = ..., hit_tokens: _Optional[int] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., evictions: _Optional[int] = ..., dropped_writes: _Optional[int] = ..., corrupt_blocks: _Optional[int] = ..., num_promotions: _Optional[int] = ..., promotion_s: _Optional[float] = ..., state: _Optional[int] = ...) -> None: ...
