"""A discrete-event simulator of a kvferry deployment: the router and its prefill, decode or
colocated workers, charged the times a profile measured (deploy/planner/profile.py).

What it models, as the code it stands for does:
- the router reserves the decode blocks of prompt + 1 token on the decode worker with the most
  free blocks before the prefill; with none free it prefills anyway and the push waits for
  room (router/downstream.py, reserve_leg), first come first served;
- it sends the prompt to the prefill worker with the fewest tokens queued, or to the decode
  worker itself below the local-prefill threshold (router/prefill_leg.py);
- a worker prefills as kvferry/model/prefill_batch.py does: waiting prompts packed FIFO into
  one forward up to the token budget, a prompt longer than the chunk size a chunk per forward,
  its first token out when its last chunk is done;
- the K/V push takes the profile's transfer time after the prompt's last forward; the decode
  worker spends the profile's receive time from that forward's start (the push streams as
  layers are written), beside its steps (the event loop and the step thread share a core);
  the sequence joins the running batch at the next step boundary;
- a decode worker steps its whole batch, one token each per step, a step taking the
  profile's median time for its batch and context times a ratio drawn (seeded) from the
  spread the profile measured around it (a colocated worker's own points where the profile
  has them); a colocated worker (or a
  decode worker prefilling locally) runs prefill forwards and decode steps on one thread,
  alternately while both have work (decode_worker/steps.py shares its executor);
- a sequence takes a block more whenever one fills; with none free the newest running one
  is swapped out and comes back, oldest first, before any new reservation is granted.

- the router and the client beside it each spend the profile's CPU per request and per
  streamed token, in order, on the cores deploy/placement.py gives them
  (deploy/planner/cpu_share.py): a token reaches the client when both have handled it.

What it leaves out: prefix caching (every prompt is computed in full), failures and
migration, speculative decoding, K/V eviction and the time a swap takes.
The results are loadgen RequestRecords, so its TTFT, ITL and goodput are the load tester's.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from deploy.loadgen.metrics import RequestRecord
from deploy.planner.cpu_share import SharedCores
from deploy.planner.profile import CostModel, attention_tokens

# While a step runs, the K/V a decode worker takes in (its event loop, beside the step thread
# on the same core) delays that step by at most this share of it; the rest waits for the
# next. Calibrated on the tiny model's 1+1 runs (docs/planning.md): on two measurements a
# receive stalls the step after it by up to a whole step (1.0 put ITL p90 within 14% on both,
# where 0.25 left it 17-28% low); the real model's figures do not move with it.
RECEIVE_SHARE = 1.0


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_len: int
    output_len: int
    tag: str = ""


@dataclass(frozen=True)
class Layout:
    """The deployment simulated: prefill and decode workers, or colocated ones."""

    num_prefill: int = 1
    num_decode: int = 1  # colocated workers, when is_colocated
    is_colocated: bool = False
    local_prefill_threshold: int = 0  # prompts shorter than this prefill on the decode worker

    def __post_init__(self) -> None:
        if self.num_decode < 1:
            raise ValueError(f"num_decode: must be >= 1, got {self.num_decode}")
        if not self.is_colocated and self.num_prefill < 1:
            raise ValueError(f"num_prefill: must be >= 1 when disaggregated, got "
                             f"{self.num_prefill}")

    @property
    def num_workers(self) -> int:
        return self.num_decode + (0 if self.is_colocated else self.num_prefill)

    def __str__(self) -> str:
        if self.is_colocated:
            return f"{self.num_decode} colocated"
        local = (f", local prefill < {self.local_prefill_threshold}"
                 if self.local_prefill_threshold else "")
        return f"{self.num_prefill}P+{self.num_decode}D{local}"


@dataclass(slots=True, eq=False)
class _Seq:
    """One request's state in the simulation."""

    req: SimRequest
    prefilled: int = 0  # prompt tokens computed
    context: int = 0  # tokens whose K/V the decode worker holds
    num_blocks: int = 0  # held on its decode worker
    token_times: list[float] = field(default_factory=list)  # as the client got them
    num_generated: int = 0  # by the workers (the router may not have relayed them yet)
    decode: _Worker | None = None
    prefilled_on: _Worker | None = None
    is_reserved: bool = False
    is_refused: bool = False
    is_receive_charged: bool = False

    @property
    def is_done(self) -> bool:
        return self.num_generated >= self.req.output_len


class Clock:
    """The event queue: callbacks at times, in time order, ties in the order scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, when: float, callback: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (when, next(self._order), callback))

    def run(self) -> None:
        while self._heap:
            self.now, _, callback = heapq.heappop(self._heap)
            callback()


class _Worker:
    """A prefill, decode or colocated worker: a prefill queue and a running batch on one
    thread (a prefill worker's batch stays empty)."""

    def __init__(self, sim: Simulation, num_blocks: int) -> None:
        self.sim = sim
        self.prefill_queue: deque[_Seq] = deque()
        self.joining: list[_Seq] = []
        self.running: list[_Seq] = []
        self.swapped: deque[_Seq] = deque()
        self.free_blocks = num_blocks
        self.is_busy = False
        self.was_prefill = False  # the last thing run: alternate while both have work
        self.receive_s = 0.0  # K/V to take in before the next step

    @property
    def queued_tokens(self) -> int:
        return sum(s.req.prompt_len - s.prefilled for s in self.prefill_queue)

    def wake(self) -> None:
        """Look for work at the end of this instant: what arrives at the same time (prompts,
        K/V of one forward) joins the same forward or step."""
        self.sim.clock.at(self.sim.clock.now, self.poke)

    def poke(self) -> None:
        if self.is_busy:
            return
        if self.receive_s > 0 and not (self.running or self.joining):  # alone: all of it
            work, self.receive_s = self.receive_s, 0.0
            self._finish(work, lambda: None)
            return
        has_decode = bool(self.running or self.joining)
        if self.prefill_queue and not (self.was_prefill and has_decode):
            self._run_prefill()
        elif has_decode:
            self._run_step()

    def _finish(self, duration_s: float, then: Callable[[], None]) -> None:
        self.is_busy = True

        def done() -> None:
            then()  # may poke this worker: still busy until its effects are in
            self.is_busy = False
            self.poke()

        self.sim.cores.run_forward(self, duration_s, done)

    def _plan(self) -> list[tuple[_Seq, int]]:
        """kvferry/model/prefill_batch.py's plan: prompts in arrival order under the token
        budget, a chunk of an unfinished prompt leaving room (up to half the budget) for the
        prompts behind it, a later prompt still taken when it fits whole."""
        profile = self.sim.cost.profile
        budget = total = profile.prefill_token_budget
        remaining = [s.req.prompt_len - s.prefilled for s in self.prefill_queue]
        wants = [min(r, profile.prefill_chunk_size) for r in remaining]
        behind = sum(wants)
        batch = []
        for seq, left, want in zip(self.prefill_queue, remaining, wants):
            behind -= want
            new = min(want, budget)
            if new < left:
                new = min(new, budget - min(behind, total // 2))
            if new > 0:
                batch.append((seq, new))
                budget -= new
        return batch

    def _run_prefill(self) -> None:
        batch = self._plan()
        chunks = [(seq.prefilled, new) for seq, new in batch]
        for seq, new in batch:  # the push streams during the prompt's last forward
            if seq.prefilled + new >= seq.req.prompt_len and seq.is_reserved:
                self.sim.receive(seq, self)
        tokens = sum(new for _, new in chunks)
        self.was_prefill = True

        def done() -> None:
            for seq, new in batch:
                seq.prefilled += new
                if seq.prefilled >= seq.req.prompt_len:
                    self.prefill_queue.remove(seq)
                    self.sim.prefilled(seq, self)

        self._finish(self.sim.cost.prefill_s(tokens, attention_tokens(chunks)), done)

    def _run_step(self) -> None:
        self.running += self.joining
        self.joining = []
        self._grow()
        self.was_prefill = False
        batch = list(self.running)
        if not batch:
            if self.swapped:  # it swapped itself out: alone, it fits once all is free
                self.resume_swapped()
            return
        context = sum(min(s.context, s.num_blocks * self.sim.cost.profile.block_size)
                      for s in batch)  # what attention reads: the kept K/V under eviction
        duration = self.sim.step_s(len(batch), context)
        # K/V coming in runs on the event loop beside the step, on the same core: each
        # takes half of it until the smaller is done
        absorbed = min(self.receive_s, duration * RECEIVE_SHARE)
        self.receive_s -= absorbed

        def done() -> None:
            self.sim.stepped()
            for seq in batch:
                self.sim.generated(seq)
                seq.context += 1
                if seq.is_done:
                    self.running.remove(seq)
                    self.release(seq)

        self._finish(duration + absorbed, done)

    def _grow(self) -> None:
        """Every running sequence gets the block its next token needs; with none free the
        newest is swapped out (its blocks freed) until the rest fit."""
        for seq in list(self.running):
            need = self.sim.blocks_held(seq) - seq.num_blocks
            while need > self.free_blocks and self.running:
                victim = self.running.pop()
                self.free_blocks += victim.num_blocks
                victim.num_blocks = 0
                self.swapped.append(victim)
                if victim is seq:
                    break
            if seq in self.running and need > 0:
                self.free_blocks -= need
                seq.num_blocks += need

    def release(self, seq: _Seq) -> None:
        self.free_blocks += seq.num_blocks
        seq.num_blocks = 0
        self.sim.blocks_freed(self)

    def resume_swapped(self) -> None:
        """Swapped sequences come back (oldest first) before any new reservation."""
        while self.swapped:
            seq = self.swapped[0]
            need = self.sim.blocks_held(seq)
            if need > self.free_blocks:
                return
            self.swapped.popleft()
            self.free_blocks -= need
            seq.num_blocks = need
            self.joining.append(seq)
        self.poke()


class Simulation:
    """One run of a workload through a layout; `run` returns a record per request."""

    def __init__(self, cost: CostModel, layout: Layout, seed: int = 0) -> None:
        self.cost = cost.colocated() if layout.is_colocated else cost
        cost = self.cost
        self.layout = layout
        self.clock = Clock()
        self.rng = random.Random(seed)
        blocks = cost.profile.num_blocks
        self.decode = [_Worker(self, blocks) for _ in range(layout.num_decode)]
        self.prefill = ([] if layout.is_colocated
                        else [_Worker(self, 0) for _ in range(layout.num_prefill)])
        self.waiting: deque[_Seq] = deque()  # prefilled, their push waiting for blocks
        shared = self._router_cores()
        self.cores = SharedCores(self.clock.at, lambda: self.clock.now, shared,
                                 ("router", "client"),
                                 len(shared) * max(cost.profile.torch_threads, 1))

    def _router_cores(self) -> list[_Worker]:
        """The workers whose cores the router shares, as deploy/placement.py places them:
        none with more than two cores per worker, else the prefill workers (the colocated
        ones without them). None either for colocated workers priced from their own points:
        the router's and the client's turns on their cores are in those."""
        cores = self.cost.profile.num_cores
        if not cores or cores > 2 * self.layout.num_workers or self.cost.is_colocated:
            return []
        return self.prefill or self.decode

    def stepped(self) -> None:
        """A decode step's tokens reach the router in one update: its CPU for reading it."""
        update = self.cost.profile.router_s_per_update
        if update:
            self.cores.submit(update, lambda: None)

    def generated(self, seq: _Seq) -> None:
        """A worker made a token: the router relays it (its CPU), then the client has it.
        Their own times are in the profile's decode gaps already (they were measured at the
        client), so a token is late here only by what it waited for them: their queues, and
        their share of the cores they contend for."""
        seq.num_generated += 1
        profile = self.cost.profile
        relay, receive = profile.relay_s_per_token, profile.client_s_per_token

        def received() -> None:
            seq.token_times.append(self.clock.now - relay - receive)

        self.cores.submit(relay, lambda: self.cores.submit(receive, received, "client"))

    def step_s(self, batch: int, context: int) -> float:
        """A decode step: the profile's median, times a ratio drawn from its spread."""
        ratios = self.cost.decode.jitter_at(batch, context)
        factor = self.rng.choice(ratios) if ratios else 1.0
        return self.cost.decode_s(batch, context) * factor

    def run(self, requests: Sequence[SimRequest]) -> list[RequestRecord]:
        seqs = [_Seq(req) for req in requests]
        for seq in seqs:
            self.clock.at(seq.req.arrival_s, lambda s=seq: self.arrive(s))
        self.clock.run()
        return [_record(seq) for seq in seqs]

    def arrive(self, seq: _Seq) -> None:
        """The client sends the request, the router takes it in, then routes it."""
        profile = self.cost.profile
        self.cores.submit(profile.client_s_per_request, lambda: self.cores.submit(
            profile.router_s_per_request, lambda: self._route(seq)), "client")

    def _route(self, seq: _Seq) -> None:
        seq.decode = max(self.decode, key=lambda w: w.free_blocks)
        profile = self.cost.profile
        if (self.cost.kv_budget.blocks(seq.req.prompt_len, seq.req.output_len,
                                       profile.block_size) > profile.num_blocks):
            seq.is_refused = True  # too big even alone: refused at Reserve
            return
        if seq.req.output_len > 1:
            self._reserve(seq, seq.decode)
        local = (self.layout.is_colocated
                 or seq.req.prompt_len < self.layout.local_prefill_threshold)
        worker = seq.decode if local else min(self.prefill, key=lambda w: w.queued_tokens)
        worker.prefill_queue.append(seq)
        worker.wake()

    def blocks_held(self, seq: _Seq) -> int:
        """Blocks `seq` holds with its next token's slot: every token's, or under K/V
        eviction at most its policy's budget (kvferry/cache/budget.py, as the workers)."""
        return self.cost.kv_budget.blocks(seq.req.prompt_len,
                                          seq.context + 1 - seq.req.prompt_len,
                                          self.cost.profile.block_size)

    def _reserve(self, seq: _Seq, worker: _Worker) -> bool:
        need = math.ceil((seq.req.prompt_len + 1) / self.cost.profile.block_size)
        if worker.swapped or need > worker.free_blocks:
            return False
        worker.free_blocks -= need
        seq.num_blocks, seq.is_reserved = need, True
        return True

    def prefilled(self, seq: _Seq, worker: _Worker) -> None:
        """The first token is out; the K/V goes to the decode worker once it has room."""
        self.generated(seq)
        seq.context = seq.req.prompt_len
        seq.prefilled_on = worker
        if seq.is_done:
            if seq.is_reserved:
                seq.decode.release(seq)
            return
        if not seq.is_reserved:
            self.waiting.append(seq)
            for decode in sorted(self.decode, key=lambda w: -w.free_blocks):
                self.blocks_freed(decode)
            return
        self._ship(seq)

    def _ship(self, seq: _Seq) -> None:
        target = seq.decode
        delay = 0.0
        if seq.prefilled_on is not target:
            delay = self.cost.transfer_s(seq.req.prompt_len)
            self.receive(seq, seq.prefilled_on)

        def attach() -> None:
            target.joining.append(seq)
            target.wake()

        self.clock.at(self.clock.now + delay, attach)

    def receive(self, seq: _Seq, source: _Worker | None) -> None:
        """The decode worker takes the K/V in (once per request, as it streams: during the
        prompt's last forward, or once a deferred push is shipped); it works on it beside
        its steps."""
        if seq.is_receive_charged or source is seq.decode:
            return
        seq.is_receive_charged = True
        seq.decode.receive_s += self.cost.receive_s(seq.req.prompt_len)
        seq.decode.wake()

    def blocks_freed(self, worker: _Worker) -> None:
        worker.resume_swapped()
        while self.waiting and not worker.swapped:
            seq = self.waiting[0]
            if not self._reserve(seq, worker):
                return
            self.waiting.popleft()
            seq.decode = worker
            self._ship(seq)


def _record(seq: _Seq) -> RequestRecord:
    times = seq.token_times
    start = seq.req.arrival_s
    if seq.is_refused or not times:
        status = "RESOURCE_EXHAUSTED" if seq.is_refused else "INCOMPLETE"
        return RequestRecord(seq.req.prompt_len, 0, start, status=status, tag=seq.req.tag)
    itls = tuple(b - a for a, b in itertools.pairwise(times))
    return RequestRecord(prompt_len=seq.req.prompt_len, output_len=len(times), start_s=start,
                         ttft_s=times[0] - start, itls_s=itls, latency_s=times[-1] - start,
                         tag=seq.req.tag)


def simulate(cost: CostModel, layout: Layout, requests: Sequence[SimRequest],
             seed: int = 0) -> list[RequestRecord]:
    """Every request's record, as the load tester would have written it."""
    return Simulation(cost, layout, seed).run(requests)
