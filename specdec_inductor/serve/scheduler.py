"""Continuous batching for `specdec serve`: one thread owns the SpeculativeGenerator(s) and
their open batches and drives the step API (speculative/loop.py); HTTP handlers only submit
requests and cancel them, and receive each request's tokens through its `on_delta` callback.

Between two steps the thread runs, in this order: the test hooks (`inspect`), the retirement of
cancelled requests (their KV slots are free before anything else is admitted), then admission
of queued requests while rows, KV slots and the batch capacity allow (first come, first
served; requests that arrived together are prefilled together). A full queue refuses new
requests (QueueFullError -> 429).

A request that opts out of speculation (`speculative=False`) decodes in a second lane: a
SpeculativeGenerator without a proposer over the same Engine (same KV pool, same compiled
decode graph, its own batch). The step API drafts for every request of a batch or for none
of them, so a draft-less row cannot share the speculative batch; the two lanes step one after
the other. Greedy tokens do not depend on the lane, the batch or its other requests (fp32:
the loop's guarantee); a sampled request keeps the target's distribution, but its random
stream depends on the tree sizes its batch verifies, so a seed repeats a request's text only
under the same load.

A batch keeps one bucket (its capacity's) for its whole life, and every step and prefill
costs that bucket's rows. So each lane holds a ladder of batches (capacities 1, 4, 16, ...
up to max_batch: LADDER) and admits a request into the smallest one that holds the lane's
whole demand (running + waiting) and has room: one client decodes at bucket 1, four at
bucket 4, and as the load settles its requests gather in the batch that fits it (the smaller
ones drain as their requests end). While several batches hold requests an iteration steps
each of them (a burst that starts small pays that until its first requests end). A bucket
that follows the live count needs the step API to resize a batch between steps (it owns
the bucket-sized step state).

The step API admits a group with one max_new_tokens: a group shares its largest request's
budget and the scheduler ends each request at its own max_tokens (it retires the request
right after the step that reached it, and never hands out tokens past it).
"""
import contextlib
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Deque, Dict, List, Optional, Sequence, Tuple

from specdec_inductor.engine.kv_pool import PoolExhaustedError
from specdec_inductor.sampler import SamplingParams
from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats
from specdec_inductor.speculative.loop import ActiveRequest

log = logging.getLogger("specdec.serve")

# Each lane's batch capacities grow by this factor from 1 up to max_batch (module docstring).
LADDER = 4

# finish_reason of a Delta that ends a request
STOP, LENGTH, CANCELLED, ERROR = "stop", "length", "cancelled", "error"


class QueueFullError(RuntimeError):
    """The waiting queue holds max_queue requests already."""


class ContextLengthError(ValueError):
    """prompt + max_tokens (+ the draft tree's positions) exceed the context; `param` is the
    request field to reduce ("prompt" when the prompt alone does not fit)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Delta:
    """What a request emitted in one step; `finish_reason` set on its last one."""
    tokens: List[int]
    finish_reason: Optional[str] = None
    error: Optional[str] = None


@dataclass(eq=False)
class ServeRequest:
    """One request as the scheduler sees it. `on_delta` is called from the scheduler thread
    (it must only hand the Delta over, e.g. to an event loop)."""
    prompt: List[int]
    max_tokens: int
    sampling: SamplingParams
    on_delta: Callable[[Delta], None]
    speculative: bool = True
    arrival: float = field(default_factory=time.perf_counter)
    sent: int = 0  # tokens handed out
    cancelled: bool = False  # set by cancel(): retired (or dropped from the queue) at the boundary
    finished: bool = False
    active: Optional[ActiveRequest] = None
    first_token_at: Optional[float] = None
    last_token_at: Optional[float] = None


class Cohort:
    """One open batch of a lane and the requests running in it."""

    def __init__(self, lane: "Lane", capacity: int):
        self.lane, self.capacity = lane, capacity
        self.batch = None  # open while the scheduler runs
        self.running: Dict[ActiveRequest, ServeRequest] = {}

    def room(self) -> int:
        # Every admitted, unretired request (a prompt still prefilling in chunks too).
        return self.capacity - len(self.running)


class Lane:
    """A SpeculativeGenerator, its queue and its cohorts (batches of capacities 1, LADDER,
    LADDER**2, ... and max_batch). `extra`: KV positions admission reserves past
    max_new_tokens (the draft tree)."""

    def __init__(self, method: str, generator: SpeculativeGenerator, max_batch: int):
        self.method, self.generator = method, generator
        self.extra = generator.num_draft_tokens
        self.stats = SpeculativeStats()
        self.waiting: Deque[ServeRequest] = deque()
        capacities, c = [], 1
        while c < max_batch:
            capacities.append(c)
            c *= LADDER
        self.cohorts = [Cohort(self, c) for c in capacities + [max_batch]]

    @property
    def running(self) -> Dict[ActiveRequest, ServeRequest]:
        """The scheduler thread's view (other threads: running_count)."""
        return {a: r for c in self.cohorts for a, r in c.running.items()}

    @property
    def running_count(self) -> int:
        return sum(len(c.running) for c in self.cohorts)  # no iteration over a changing dict

    def cohort_for_admission(self) -> Optional[Cohort]:
        """The smallest batch that holds the lane's whole demand (running + waiting) and has
        room, else the largest with room."""
        demand = self.running_count + len(self.waiting)
        fits = [c for c in self.cohorts if c.capacity >= demand and c.room() > 0]
        return fits[0] if fits else next((c for c in reversed(self.cohorts) if c.room() > 0),
                                         None)


class Scheduler:
    """Owns `engine` (and `proposer`) from start() to stop(). method: the proposer's name (the
    metrics label); max_batch: requests decoding at once per lane (the full batch's capacity);
    warmup_prompt: token ids of a scratch request run through every lane before serving (a
    compiled engine compiles its graphs there, an eager one pays its first-call costs)."""

    def __init__(self, engine, proposer, *, method: str, max_batch: int, max_queue: int,
                 eos_token_id: Optional[int], metrics=None,
                 warmup_prompt: Optional[Sequence[int]] = None, warmup_tokens: int = 4):
        self.engine, self.eos_token_id, self.max_queue = engine, eos_token_id, max_queue
        self.metrics = metrics
        self.lanes = [Lane(method if proposer is not None else "none",
                           SpeculativeGenerator(engine, proposer), max_batch)]
        if proposer is not None:
            self.lanes.append(Lane("none", SpeculativeGenerator(engine, None), max_batch))
        self._warmup = (list(warmup_prompt), warmup_tokens) if warmup_prompt else None
        self._cond = threading.Condition()
        self._inbox: List[ServeRequest] = []
        self._calls: List[Tuple[Callable[[], object], Future]] = []
        self._queued = 0  # inbox + waiting
        self._wake = False
        self._stopping = False
        self.ready = threading.Event()  # set once serving (or failed: see `failed`)
        self.failed: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="specdec-scheduler", daemon=True)

    # -- the handlers' side (any thread) -------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: Optional[float] = None) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    def lane_for(self, speculative: bool) -> Lane:
        return self.lanes[0] if speculative or len(self.lanes) == 1 else self.lanes[1]

    def check(self, prompt: Sequence[int], max_tokens: int, speculative: bool = True) -> None:
        """Raise ContextLengthError unless the request fits the context, and what
        Engine.check_request raises (ValueError naming the argument) for bad token ids."""
        extra, limit = self.lane_for(speculative).extra, self.engine.max_len
        if len(prompt) + 1 + extra > limit:
            raise ContextLengthError(
                f"the prompt has {len(prompt)} tokens: with the {extra} positions the decoder "
                f"reserves past the answer it leaves no room for a token in the context of "
                f"{limit} tokens (--max-len)", "prompt")
        if len(prompt) + max_tokens + extra > limit:
            raise ContextLengthError(
                f"this model's context holds {limit} tokens (--max-len); the request needs "
                f"{len(prompt) + max_tokens + extra} ({len(prompt)} in the prompt, {max_tokens} "
                f"max_tokens and {extra} reserved by the decoder): reduce max_tokens to at most "
                f"{limit - len(prompt) - extra}", "max_tokens")
        self.engine.check_request([prompt], max_tokens)

    def submit(self, request: ServeRequest) -> None:
        """Queue a checked request; QueueFullError when max_queue requests already wait."""
        with self._cond:
            if self._stopping or self.failed is not None:
                raise RuntimeError("the scheduler is not running")
            if self._queued >= self.max_queue:
                raise QueueFullError(f"{self._queued} requests are queued already (--max-queue "
                                     f"{self.max_queue}); retry later")
            self._queued += 1
            self._inbox.append(request)
            self._notify()

    def cancel(self, request: ServeRequest) -> None:
        """Cancel a request (its client left or its text hit a stop string): it leaves its batch
        at the next step boundary; nothing more is delivered after its final Delta."""
        with self._cond:
            request.cancelled = True
            self._notify()

    def inspect(self, fn: Callable[[], object]) -> Future:
        """Run fn in the scheduler thread between two steps (tests read the engine's state
        there without racing a step); its result or exception lands in the Future."""
        future: Future = Future()
        with self._cond:
            if not self._thread.is_alive():
                future.set_exception(RuntimeError("the scheduler is not running"))
                return future
            self._calls.append((fn, future))
            self._notify()
        return future

    def _notify(self) -> None:
        self._wake = True
        self._cond.notify()

    # -- gauges (read from any thread; plain reads of numbers) ---------------------------------
    @property
    def queue_depth(self) -> int:
        return self._queued

    def kv_pools(self):
        """The KV pools requests take slots in: the target's, and a draft model's if any."""
        draft = getattr(self.lanes[0].generator.proposer, "engine", None)
        return [self.engine.pool] + ([draft.pool] if draft is not None else [])

    def assert_idle(self) -> None:
        """Between steps, with nothing queued or running: every pool consistent and fully free.
        The test hook for inspect()."""
        assert self._queued == 0 and not self._busy(), "not idle"
        for pool in self.kv_pools():
            pool.check_consistent()
            assert pool.num_free_slots == pool.num_slots, (
                f"{pool.num_slots - pool.num_free_slots} KV slots still taken")
            assert not pool.live_requests, "requests still hold rows"

    # -- the scheduler thread ------------------------------------------------------------------
    @property
    def _cohorts(self) -> List[Cohort]:
        return [c for lane in self.lanes for c in lane.cohorts]

    def _run(self) -> None:
        try:
            self._warm_up()
            with contextlib.ExitStack() as scopes:
                for cohort in self._cohorts:
                    lane = cohort.lane
                    cohort.batch = scopes.enter_context(lane.generator.batch(cohort.capacity,
                                                                             lane.stats))
                self.ready.set()
                while self._wait_for_work():
                    self._boundary()
                    for cohort in self._cohorts:
                        if cohort.running:
                            self._step(cohort)
        except BaseException as exc:  # noqa: BLE001 -- reported to every waiting client
            log.exception("the scheduler stopped")
            self.failed = exc
        finally:
            self._fail_all("the server is shutting down" if self.failed is None
                           else f"the scheduler failed: {self.failed}")
            self.ready.set()

    def _warm_up(self) -> None:
        """Scratch requests through every batch of every lane, so their graphs compile before
        serving: on a compiled engine in groups of every bucket size up to the batch's
        capacity too (a draft model's steps take the bucket of the live requests' count)."""
        if self._warmup is None:
            return
        prompt, tokens = self._warmup
        for cohort in self._cohorts:
            gen = cohort.lane.generator
            gen.compile_verify(batch_size=cohort.capacity)
            sizes = ([b for b in self.engine.buckets if b <= cohort.capacity]
                     if self.engine.compiled else [1])
            for size in sizes:
                with gen.batch(cohort.capacity) as batch:
                    gen.admit(batch, [prompt] * size, tokens + gen.num_draft_tokens)
                    while batch.live:
                        gen.step(batch)

    def _busy(self) -> bool:
        return any(c.running for c in self._cohorts)

    def _wait_for_work(self) -> bool:
        """Block until there is something to do; move new requests into their lanes and run
        the test hooks. False once stopping."""
        with self._cond:
            while not (self._wake or self._stopping or self._busy()):
                self._cond.wait()
            self._wake = False
            if self._stopping:
                return False
            inbox, self._inbox = self._inbox, []
            calls, self._calls = self._calls, []
        for request in inbox:
            self.lane_for(request.speculative).waiting.append(request)
        for fn, future in calls:
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller
                future.set_exception(exc)
        return True

    def _boundary(self) -> None:
        for cohort in self._cohorts:
            cancelled = [a for a, r in cohort.running.items() if r.cancelled]
            if cancelled:
                self._retire(cohort, cancelled)
                for a in cancelled:
                    self._end(cohort.running.pop(a), CANCELLED)
        for lane in self.lanes:
            for request in [r for r in lane.waiting if r.cancelled]:
                lane.waiting.remove(request)
                self._dequeued(1)
                self._end(request, CANCELLED)
            self._admit_waiting(lane)

    def _next_group(self, lane: Lane, cohort: Cohort) -> Tuple[List[ServeRequest], int]:
        """The longest head of the lane's queue that fits the cohort now, and its shared
        max_new_tokens (the loop reserves prompt + max_new_tokens + extra slots per request)."""
        pool = self.engine.pool
        rows = min(pool.num_free_rows, cohort.room())
        group: List[ServeRequest] = []
        longest = most = prompt_slots = 0
        for request in lane.waiting:
            n = len(request.prompt)
            l_, m_ = max(longest, n), max(most, request.max_tokens)
            slots = prompt_slots + n + (len(group) + 1) * (m_ + lane.extra)
            if (len(group) + 1 > rows or l_ + m_ + lane.extra > self.engine.max_len
                    or slots > pool.num_free_slots):
                break
            group.append(request)
            longest, most, prompt_slots = l_, m_, prompt_slots + n
        return group, most

    def _admit_waiting(self, lane: Lane) -> None:
        while lane.waiting:
            cohort = lane.cohort_for_admission()
            group, most = self._next_group(lane, cohort) if cohort is not None else ([], 0)
            if not group:
                return
            try:
                # Prompts prefill one engine chunk per step, between the other requests'
                # steps, so a long prompt does not stall the batch (the prefill graph's T).
                actives = lane.generator.admit(cohort.batch, [r.prompt for r in group], most,
                                               [r.sampling for r in group], self.eos_token_id,
                                               prefill_chunk=self.engine.prefill_chunk)
            except PoolExhaustedError:
                if self._busy():
                    return  # a draft model's pool is full: retried after the next retire
                self._fail_group(lane, group, "no KV room for the request")
                continue
            except Exception as exc:  # noqa: BLE001 -- this group fails, the server serves on
                log.exception("admission failed")
                self._fail_group(lane, group, f"admission failed: {exc}")
                continue
            now = time.perf_counter()
            for request, active in zip(group, actives):
                lane.waiting.popleft()
                request.active = active
                cohort.running[active] = request
            self._dequeued(len(group))
            for request, active in zip(group, actives):
                self._deliver(request, active.tokens, now)
            self._retire_finished(cohort)

    def _step(self, cohort: Cohort) -> None:
        try:
            emitted = cohort.lane.generator.step(cohort.batch)
        except Exception as exc:  # noqa: BLE001 -- its requests fail, the server serves on
            log.exception("a step failed")
            failed = list(cohort.running)
            with contextlib.suppress(Exception):
                self._retire(cohort, failed)
            for a in failed:
                self._end(cohort.running.pop(a), ERROR, f"decoding failed: {exc}")
            return
        now = time.perf_counter()
        for active, tokens in emitted.items():
            self._deliver(cohort.running[active], tokens, now)
        self._retire_finished(cohort)

    def _deliver(self, request: ServeRequest, tokens: List[int], now: float) -> None:
        """Hand out a step's tokens, cut at the request's own max_tokens."""
        tokens = tokens[:request.max_tokens - request.sent]
        request.sent += len(tokens)
        if tokens and tokens[-1] == self.eos_token_id:
            reason = STOP
        elif request.sent >= request.max_tokens or request.active.done:
            reason = LENGTH
        else:
            reason = None
        if not tokens and reason is None:
            return  # nothing yet (a prompt still being prefilled in chunks)
        if self.metrics is not None and tokens:
            self.metrics.tokens_delivered(request, len(tokens), now)
        if request.first_token_at is None:
            request.first_token_at = now
        request.last_token_at = now
        request.finished = reason is not None
        request.on_delta(Delta(tokens, reason))
        if reason is not None and self.metrics is not None:
            self.metrics.request_ended(reason)

    def _retire_finished(self, cohort: Cohort) -> None:
        done = [a for a, r in cohort.running.items() if r.finished]
        if done:
            self._retire(cohort, done)
            for a in done:
                del cohort.running[a]

    @staticmethod
    def _retire(cohort: Cohort, actives: List[ActiveRequest]) -> None:
        cohort.lane.generator.retire(cohort.batch, *actives)

    def _fail_group(self, lane: Lane, group: List[ServeRequest], message: str) -> None:
        for request in group:
            lane.waiting.remove(request)
            self._end(request, ERROR, message)
        self._dequeued(len(group))

    def _dequeued(self, n: int) -> None:
        with self._cond:
            self._queued -= n

    def _end(self, request: ServeRequest, reason: str, error: Optional[str] = None) -> None:
        """A request that ends without tokens (cancelled, failed)."""
        request.finished = True
        request.on_delta(Delta([], reason, error))
        if self.metrics is not None:
            self.metrics.request_ended(reason)

    def _fail_all(self, message: str) -> None:
        with self._cond:
            inbox, self._inbox = self._inbox, []
            calls, self._calls = self._calls, []
            self._stopping = True
        for _, future in calls:
            future.set_exception(RuntimeError(message))
        pending = inbox + [r for lane in self.lanes
                           for r in list(lane.waiting) + list(lane.running.values())]
        for lane in self.lanes:
            lane.waiting.clear()
            for cohort in lane.cohorts:
                cohort.running.clear()
        for request in pending:
            if not request.finished:
                self._end(request, ERROR, message)
