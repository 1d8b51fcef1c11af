"""A request in the router: what a front hands it (`GenerateInput`); its record, built once
at the edge (`Admitted`, router/admission.py) and read by every leg; its state downstream,
shared by its legs (`RouterRequest`); the table of the router's open requests; and the
deadline arithmetic they use."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvferry.cache.prefix import TierTokens
from kvferry.errors import InvalidArgument, ResourceExhausted
from kvferry.model.sampling import SamplingParams
from router.workers.prefill_client import PrefillCall
from router.workers.worker import Worker

# "developer": newer OpenAI clients' name for the system's instructions, rendered as "system"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ChatMessage:
    """One turn of a conversation; `role` is one of CHAT_ROLES once validated."""

    role: str
    content: str


@dataclass(frozen=True)
class GenerateInput:
    """A Generate request as the router engine sees it: exactly one of text, token_ids and
    messages is set (or none, which is refused as an empty prompt)."""

    request_id: str
    text: str | None
    token_ids: list[int] | None
    params: SamplingParams
    is_max_tokens_set: bool
    messages: tuple[ChatMessage, ...] | None = None
    cache_salt: str = ""  # prefix-cache namespace (kvferry/cache/prefix.py)


@dataclass(frozen=True)
class Admitted:
    """A public request as its legs read it, validated (router/admission.py)."""

    public_id: str  # the client's request id ("": one is minted when it is opened)
    prompt: list[int]
    params: SamplingParams  # resolved: max_tokens set, checked against the prompt
    stop_ids: tuple[int, ...]  # token ids that end generation (eos unless ignore_eos)
    received: float  # time.perf_counter() at arrival: queue and TTFT count from it
    deadline: float | None  # time.monotonic() past which the request fails
    cache_salt: str  # the prefix-cache namespace (a tenant's keyed salt, router/identity.py)

    @property
    def keeps_all_kv(self) -> bool:
        """It opted out of the deployment's K/V eviction (kv_eviction "none")."""
        return self.params.kv_eviction == "none"

    @property
    def shares_cache(self) -> bool:
        """A cached prefix may serve its prompt: not when it asks for prompt logprobs (every
        position's logits are computed)."""
        return self.params.prompt_logprobs is None

    def sample(self, index: int) -> Admitted:
        """Sample `index` of a request of several, going on as a request of its own (seed
        + index, one sample)."""
        return dataclasses.replace(
            self, params=dataclasses.replace(self.params.for_sample(index), n=1))


@dataclass(slots=True)
class RouterRequest:
    request_id: str
    is_aborted: bool = False
    is_push_deferred: bool = False  # prefilled before its decode reservation (see Router.run_one)
    prefill_worker: Worker | None = None
    prefill_call: PrefillCall | None = None
    decode_worker: Worker | None = None
    holds_decode: bool = False  # the decode worker still holds this request's blocks
    failed_prefill: set[str] = field(default_factory=set)  # prefill workers that failed it
    num_push_retries: int = 0  # prefilled again after a push failed between healthy workers
    is_decoding: bool = False  # the Decode stream is open
    # A Reserve whose answer never came (cancelled, deadline): it may have landed all the
    # same, so the release sends an Abort there.
    unanswered_reserve: Worker | None = None
    cache_salt: str = ""  # prefix-cache namespace, from the public request
    decode_cached_blocks: int = 0  # leading prompt blocks the decode reservation shares
    # The leg's prompt block keys, up to `max_shared_blocks`, for a policy routing on the
    # workers' prefix caches ([] for the others); recomputed for each leg (migration).
    block_keys: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens the first prefill found cached (Usage)
    cached_by_tier: TierTokens = TierTokens()  # of those, from each tier below the pool
    kv_bytes_not_shipped: int = 0  # K/V bytes pushes skipped: the decode cache held them
    kv_bytes_shipped: int = 0  # K/V bytes pushed, every leg
    last_token_s: float = 0.0  # time.monotonic() its latest tokens reached the router
    num_samples: int = 1  # parallel sampling: samples decoded from the one prefill
    # Parallel sampling after a migration: each unfinished sample as a request of its own.
    sub_requests: list[RouterRequest] = field(default_factory=list)

    def drop_prefill_worker(self) -> None:
        """The prefill worker owes this request nothing more (its K/V is pushed, or it failed
        or lost it): the prompt leaves that worker's in-flight count now, and only once."""
        worker = self.prefill_worker
        if worker is not None and worker is not self.decode_worker:
            worker.done(self.request_id)
        self.prefill_worker = None


class OpenRequests:
    """The router's public requests: how many are open on both fronts together (against
    `--max-streams`), and the running ones by (caller scope, public id), so that an id is
    unique, and found, only within its caller's scope (router/identity.py). Downstream a
    request is `<id>@<instance>`, or `<id>@<instance>.<n>` while another scope runs the same
    id (`downstream_id`), so that no two running requests share a worker-side id."""

    def __init__(self, max_streams: int) -> None:
        self.max_streams = max_streams
        self.num_streams = 0
        self._running: dict[tuple[str, str], RouterRequest] = {}
        self._downstream: set[str] = set()  # request_id of every running state
        self._num_suffixed = 0

    def downstream_id(self, request_id: str, instance_id: str) -> str:
        """The worker-side id of a new request: unique among the running ones."""
        down = f"{request_id}@{instance_id}"
        while down in self._downstream:
            self._num_suffixed += 1
            down = f"{request_id}@{instance_id}.{self._num_suffixed:x}"
        return down

    def open_stream(self) -> None:
        """Count a request in, or refuse it (ResourceExhausted) at the cap."""
        if self.num_streams >= self.max_streams:
            raise ResourceExhausted(f"the router has {self.max_streams} requests open (its "
                                    "--max-streams); retry later")
        self.num_streams += 1

    def close_stream(self) -> None:
        self.num_streams -= 1

    def add(self, scope: str, request_id: str, state: RouterRequest) -> None:
        if (scope, request_id) in self._running:
            raise InvalidArgument(f"request_id {request_id!r} is already running",
                                  "request_id")
        self._running[(scope, request_id)] = state
        self._downstream.add(state.request_id)

    def find(self, scope: str, request_id: str) -> RouterRequest | None:
        return self._running.get((scope, request_id))

    def remove(self, scope: str, request_id: str) -> None:
        state = self._running.pop((scope, request_id), None)
        if state is not None:
            self._downstream.discard(state.request_id)

    def states(self) -> list[RouterRequest]:
        return list(self._running.values())
