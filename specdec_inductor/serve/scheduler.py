"""Continuous batching for `specdec serve`: one thread (run's caller: the process's main
thread; or start's own) owns the SpeculativeGenerator(s) and their open batches and drives the
step API (speculative/loop.py); HTTP handlers only submit requests and cancel them, and
receive each request's tokens through its `on_delta` callback.

Between two steps the thread runs, in this order: the test hooks (`inspect`), the retirement of
cancelled requests (their KV slots are free before anything else is admitted), then admission
of queued requests while rows, KV slots and the batch capacity allow (first come, first
served; each request reserves its own prompt + max_tokens; requests admitted at one boundary
prefill in the next step). A full queue refuses new requests (QueueFullError -> 429).

A request that opts out of speculation (`speculative=False`) decodes in a second lane: a
SpeculativeGenerator without a proposer over the same Engine (same KV pool, same compiled
decode graph, its own batch). The step API drafts for every request of a batch or for none
of them, so a draft-less row cannot share the speculative batch; the two lanes step one after
the other. Greedy tokens do not depend on the lane, the batch or its other requests (fp32:
the loop's guarantee); a sampled request keeps the target's distribution, but its random
stream depends on the tree sizes its batch verifies, so a seed repeats a request's text only
under the same load.

Each lane has one batch of capacity max_batch, and before every step the batch takes the
smallest of the engine's buckets that holds its requests (Batch.fit_bucket): one client
decodes in bucket 1, sixteen in bucket 16, and requests that arrive one after another share
one step whatever their count (every bucket's graphs compile in the warm-up).

A prompt prefills in chunks of the smallest of `prefill_sizes` (multiples of PREFILL_STEP up
to the engine's prefill_chunk) that holds it: a prefill chunk costs about its row count (a
short prompt padded to the engine's chunk pays for the padding rows, and prompts prefilled
together in one step of several rows cost what they cost one after the other), so each
request's chunk is a one-row step of its own size (SpeculativeGenerator._prefill_chunks):
one graph per size, whatever the bucket, each compiled in the warm-up.

The scheduler ends each request at its own max_tokens (it retires the request right after
the step that reached it, and never hands out tokens past it).

Tokens leave through each request's `on_delta` (called in this thread, once per request and
step), then one call of `flush` per step: on_delta may only buffer the Delta, and flush hands
the step's Deltas to the HTTP side together (one event-loop wake-up per step, not per
request).
"""
import contextlib
import functools
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
from specdec_inductor.speculative.stats import dynamo_counts
from specdec_inductor.serve.trace import ADMITTED, PICKED, QUEUED, STEPPED, TOKEN

log = logging.getLogger("specdec.serve")

# finish_reason of a Delta that ends a request
STOP, LENGTH, CANCELLED, ERROR = "stop", "length", "cancelled", "error"
PREFILL_STEP = 16  # prefill chunk sizes: multiples of this, up to the engine's prefill_chunk
SIGNAL_POLL_S = 0.25  # how often an idle scheduler in the main thread lets signal handlers run


def prefill_sizes(prefill_chunk: int, step: int = PREFILL_STEP) -> List[int]:
    """The prefill chunk sizes a scheduler uses: step, 2 * step, ... below prefill_chunk, and
    prefill_chunk itself."""
    return list(range(step, prefill_chunk, step)) + [prefill_chunk]


def _draft_engine(proposer):
    """The draft model's Engine of a lane's proposer (Proposer.engine), None for a lane without
    a proposer or a proposer without a model."""
    return None if proposer is None else proposer.engine


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
    last_token_at: Optional[float] = None
    # perf_counter time of each phase the request passed first (trace.PHASES; `specdec serve
    # --trace` writes them per request), and the steps it took part in and their seconds
    marks: Dict[str, float] = field(default_factory=dict)
    steps: int = 0
    step_s: float = 0.0

    def mark(self, phase: str, now: Optional[float] = None) -> None:
        """Note when the request first reached `phase`."""
        if phase not in self.marks:
            self.marks[phase] = time.perf_counter() if now is None else now

    @property
    def first_token_at(self) -> Optional[float]:
        """When its first tokens were handed out (its TOKEN mark), None before."""
        return self.marks.get(TOKEN)


class Lane:
    """A SpeculativeGenerator, its queue, its open batch (capacity max_batch) and the requests
    running in it. `extra`: KV positions admission reserves past max_new_tokens
    (SpeculativeGenerator.extra_positions)."""

    def __init__(self, method: str, generator: SpeculativeGenerator, max_batch: int):
        self.method, self.generator, self.capacity = method, generator, max_batch
        self.extra = generator.extra_positions
        self.stats = SpeculativeStats()
        self.waiting: Deque[ServeRequest] = deque()
        self.batch = None  # open while the scheduler runs
        self.running: Dict[ActiveRequest, ServeRequest] = {}  # the scheduler thread's

    @property
    def running_count(self) -> int:
        return len(self.running)  # other threads read the count only

    def room(self) -> int:
        # Every admitted, unretired request (a prompt still prefilling in chunks too).
        return self.capacity - len(self.running)


class Scheduler:
    """Owns `engine` (and `proposer`) from start() or run() to stop(). method: the proposer's
    name (the metrics label); max_batch: requests decoding at once per lane (its batch's
    capacity); warmup_prompt: token ids of a scratch request run through every lane before
    serving (a compiled engine compiles its graphs there, an eager one pays its first-call
    costs); flush: called after each step's on_delta calls (module docstring)."""

    def __init__(self, engine, proposer, *, method: str, max_batch: int, max_queue: int,
                 eos_token_id: Optional[int], metrics=None,
                 warmup_prompt: Optional[Sequence[int]] = None, warmup_tokens: int = 4,
                 flush: Optional[Callable[[], None]] = None):
        self.engine, self.eos_token_id, self.max_queue = engine, eos_token_id, max_queue
        self.metrics, self.flush = metrics, flush
        # cost_aware: each step verifies the size with the most expected tokens per second at
        # the batch's bucket (policies.CostAwareVerifySize), a plain decode where drafts do
        # not pay for a verify's rows.
        self.lanes = [Lane(method if proposer is not None else "none",
                           SpeculativeGenerator(engine, proposer, cost_aware=True), max_batch)]
        if proposer is not None:
            self.lanes.append(Lane("none", SpeculativeGenerator(engine, None), max_batch))
        self._warmup = (list(warmup_prompt), warmup_tokens) if warmup_prompt else None
        self.warmup_graphs: Dict[str, int] = {}  # graphs each warm-up phase compiled
        self.serving_graphs = 0  # graphs compiled after the warm-up (each one logged)
        self._graphs_seen = 0
        self.prefill_sizes = prefill_sizes(engine.prefill_chunk)
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
        """Serve from a background thread (tests, embedding; see run)."""
        self._thread.start()

    def run(self) -> None:
        """Serve in the calling thread until stop() (or a failure: `failed`). `specdec serve`
        calls it from the process's main thread, the one that loaded the model: libgomp keeps
        a thread pool per thread that starts OpenMP regions, and once its pools hold more
        threads than there are cores every region's workers sleep between regions instead of
        spinning (a futex wake-up per region, hundreds per step: a compiled 1-row step in a
        second thread takes ~1.7x the main thread's time on 2 cores)."""
        self._run()

    def stop(self, timeout: Optional[float] = None) -> None:
        """End serving (from any thread, or a signal handler of the serving thread); waits
        for start()'s thread when there is one."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.ident is not None and self._thread is not threading.current_thread():
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
            request.mark(QUEUED)
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
        draft = _draft_engine(self.lanes[0].generator.proposer)
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
    def _run(self) -> None:
        try:
            self._warm_up()
            self._graphs_seen = dynamo_counts()[0]
            with contextlib.ExitStack() as scopes:
                for lane in self.lanes:
                    lane.batch = scopes.enter_context(lane.generator.batch(lane.capacity,
                                                                           lane.stats))
                self.ready.set()
                while self._wait_for_work():
                    self._boundary()
                    for lane in self.lanes:
                        if lane.running:
                            self._step(lane)
        except BaseException as exc:  # noqa: BLE001 -- reported to every waiting client
            if not isinstance(exc, KeyboardInterrupt):  # interrupted while warming up
                log.exception("the scheduler stopped")
            self.failed = exc
        finally:
            self._fail_all("the server is shutting down" if self.failed is None
                           else f"the scheduler failed: {self.failed}")
            self.ready.set()

    def _warm_up(self) -> None:
        """Compile before serving every graph serving steps through (an eager engine pays its
        first-call costs once), once each, and log what each phase compiled:
        - the step programs of every bucket: compile_verify of the first lane (the largest
          bucket first, so the single-bucket costs probe_cost and verify_cost stay those of
          bucket 1, as `specdec generate` measures them; the cost-aware verify size and the
          acceptance gate weigh every bucket's); a draft-less second lane runs the same
          engine's decode programs (GreedyStep.of shares them), so it has nothing of its own
          to compile;
        - one scratch request per prefill size: prefill chunks are one-row steps
          (SpeculativeGenerator._prefill_chunks), one graph per size whatever the bucket;
        - with a draft model (a proposer with an engine of its own, whose graphs take the live
          count's bucket), a scratch group of every other bucket size through the first lane,
          and a sampled one of every bucket size: its drafted steps are step programs that
          draft inside them (SpeculativeGenerator.draft_in_program), greedy or sampled;
        - where the proposer's drafted steps may take other step programs too (lookup first:
          a batch whose requests draft from different sources), a scratch group of every
          bucket size per other program (Proposer.program_variants).
        `warmup_graphs` keeps each phase's count."""
        if self._warmup is None:
            return
        lane, gen = self.lanes[0], self.lanes[0].generator
        prompt, tokens = self._warmup
        sizes = self.engine.buckets if self.engine.compiled else [1]
        start = time.perf_counter()
        self._warm_phase("step programs", f"buckets {sizes}",
                         lambda: [gen.compile_verify(batch_size=b) for b in reversed(sizes)])
        self._warm_phase("prefill chunks", f"sizes {self.prefill_sizes}", lambda: [
            self._scratch_group(lane, [prompt], tokens, c) for c in self.prefill_sizes])
        if _draft_engine(gen.proposer) is not None:
            self._warm_phase("draft model", f"buckets {sizes[1:]}", lambda: [
                self._scratch_group(lane, [prompt] * b, tokens) for b in sizes[1:]])
            self._warm_phase("draft model, sampled", f"buckets {sizes}", lambda: [
                self._scratch_group(lane, [prompt] * b, tokens, sampled=True) for b in sizes])
        for k in range(1, gen.proposer.program_variants if gen.proposer is not None else 1):
            self._warm_phase(f"draft program {k}", f"buckets {sizes}", functools.partial(
                self._program_variant, lane, k, [[prompt] * b for b in sizes], tokens))
        log.info(f"warm-up: {sum(self.warmup_graphs.values())} graphs in "
                 f"{time.perf_counter() - start:.1f} s")

    def _warm_phase(self, name: str, what: str, run: Callable[[], object]) -> None:
        """Run one warm-up phase; count and log the graphs it compiled."""
        graphs0, t0 = dynamo_counts()[0], time.perf_counter()
        run()
        self.warmup_graphs[name] = dynamo_counts()[0] - graphs0
        log.info(f"warm-up: {name} ({what}): {self.warmup_graphs[name]} graphs in "
                 f"{time.perf_counter() - t0:.1f} s")

    def _program_variant(self, lane: Lane, k: int, groups: List[List[List[int]]],
                         tokens: int) -> None:
        """Scratch groups (of prompts) whose steps take the proposer's k-th step program
        (Proposer.use_program_variant)."""
        proposer = lane.generator.proposer
        proposer.use_program_variant(k)
        try:
            for prompts in groups:
                self._scratch_group(lane, prompts, tokens)
        finally:
            proposer.use_program_variant(0)

    def _scratch_group(self, lane: Lane, prompts: List[List[int]], tokens: int,
                       prefill_chunk: Optional[int] = None, sampled: bool = False) -> None:
        """Scratch requests admitted together into a batch of the lane, stepped to their end
        (greedy, or sampled at temperature 1)."""
        gen = lane.generator
        with gen.batch(lane.capacity) as batch:
            gen.admit(batch, prompts, tokens + gen.num_draft_tokens,
                      SamplingParams(1.0, seed=0) if sampled else None,
                      prefill_chunk=prefill_chunk or self.prefill_sizes[-1])
            while batch.live:
                batch.fit_bucket(self.engine)
                gen.step(batch)

    def _busy(self) -> bool:
        return any(lane.running for lane in self.lanes)

    def _wait_for_work(self) -> bool:
        """Block until there is something to do; move new requests into their lanes and run
        the test hooks. False once stopping."""
        # In the main thread the wait wakes now and then: a signal the kernel hands to another
        # thread only sets a flag for the main thread's next bytecode, and a lock wait there
        # never ends on its own, so SIGTERM would go unheard while the server is idle.
        timeout = SIGNAL_POLL_S if threading.current_thread() is threading.main_thread() else None
        with self._cond:
            while not (self._wake or self._stopping or self._busy()):
                self._cond.wait(timeout)
            self._wake = False
            if self._stopping:
                return False
            inbox, self._inbox = self._inbox, []
            calls, self._calls = self._calls, []
        now = time.perf_counter()
        for request in inbox:
            request.mark(PICKED, now)
            self.lane_for(request.speculative).waiting.append(request)
        for fn, future in calls:
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 -- handed to the caller
                future.set_exception(exc)
        return True

    def _boundary(self) -> None:
        for lane in self.lanes:
            cancelled = [a for a, r in lane.running.items() if r.cancelled]
            if cancelled:
                self._retire(lane, cancelled)
                for a in cancelled:
                    self._end(lane.running.pop(a), CANCELLED)
            for request in [r for r in lane.waiting if r.cancelled]:
                lane.waiting.remove(request)
                self._dequeued(1)
                self._end(request, CANCELLED)
            self._admit_waiting(lane)
        self._flush()

    def _fits(self, lane: Lane, request: ServeRequest) -> bool:
        """Whether the request fits the lane's batch and the KV pool now (the loop reserves
        prompt + max_tokens + extra slots)."""
        pool = self.engine.pool
        return (min(pool.num_free_rows, lane.room()) > 0 and
                len(request.prompt) + request.max_tokens + lane.extra <= pool.num_free_slots)

    def prefill_chunk_for(self, prompt_len: int) -> int:
        """The smallest prefill size that holds a prompt of prompt_len tokens (else the
        largest: the prompt takes several chunks)."""
        return next((t for t in self.prefill_sizes if t >= prompt_len), self.prefill_sizes[-1])

    def _admit_waiting(self, lane: Lane) -> None:
        """Admit the head of the lane's queue while it fits, one request at a time (each with
        its own max_tokens and prefill size; those admitted at one boundary prefill in the
        same step)."""
        while lane.waiting and self._fits(lane, lane.waiting[0]):
            request = lane.waiting[0]
            try:
                # Prompts prefill one chunk per step, between the other requests' steps, so
                # a long prompt does not stall the batch (module docstring: the chunk's size).
                (active,) = lane.generator.admit(
                    lane.batch, [request.prompt], request.max_tokens, [request.sampling],
                    self.eos_token_id, prefill_chunk=self.prefill_chunk_for(len(request.prompt)))
            except PoolExhaustedError:
                if self._busy():
                    return  # a draft model's pool is full: retried after the next retire
                self._fail_admission(lane, request, "no KV room for the request")
                continue
            except Exception as exc:  # noqa: BLE001 -- this request fails, the server serves on
                log.exception("admission failed")
                self._fail_admission(lane, request, f"admission failed: {exc}")
                continue
            now = time.perf_counter()
            lane.waiting.popleft()
            request.mark(ADMITTED, now)
            request.active = active
            lane.running[active] = request
            self._dequeued(1)
            self._deliver(request, active.tokens, now)
            self._retire_finished(lane)

    def _step(self, lane: Lane) -> None:
        start = time.perf_counter()
        try:
            lane.batch.fit_bucket(self.engine)
            emitted = lane.generator.step(lane.batch)
        except Exception as exc:  # noqa: BLE001 -- its requests fail, the server serves on
            log.exception("a step failed")
            failed = list(lane.running)
            with contextlib.suppress(Exception):
                self._retire(lane, failed)
            for a in failed:
                self._end(lane.running.pop(a), ERROR, f"decoding failed: {exc}")
            self._flush()
            return
        now = time.perf_counter()
        self._count_compiles(lane)
        for request in lane.running.values():
            request.mark(STEPPED, start)
            request.steps += 1
            request.step_s += now - start
        for active, tokens in emitted.items():
            self._deliver(lane.running[active], tokens, now)
        self._flush()
        self._retire_finished(lane)

    def _count_compiles(self, lane: Lane) -> None:
        """Log a step that compiled graphs (a shape the warm-up did not cover: the request
        that met it waited for the compile), and count them in `serving_graphs`."""
        graphs = dynamo_counts()[0]
        if graphs > self._graphs_seen:
            self.serving_graphs += graphs - self._graphs_seen
            log.warning(f"compiled {graphs - self._graphs_seen} graphs while serving (lane "
                        f"{lane.method}, bucket {lane.batch.bucket}): a shape the warm-up did "
                        "not compile")
        self._graphs_seen = graphs

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
        request.mark(TOKEN, now)
        request.last_token_at = now
        request.finished = reason is not None
        request.on_delta(Delta(tokens, reason))
        if reason is not None and self.metrics is not None:
            self.metrics.request_ended(reason)

    def _flush(self) -> None:
        if self.flush is not None:
            self.flush()

    def _retire_finished(self, lane: Lane) -> None:
        done = [a for a, r in lane.running.items() if r.finished]
        if done:
            self._retire(lane, done)
            for a in done:
                del lane.running[a]

    @staticmethod
    def _retire(lane: Lane, actives: List[ActiveRequest]) -> None:
        lane.generator.retire(lane.batch, *actives)

    def _fail_admission(self, lane: Lane, request: ServeRequest, message: str) -> None:
        lane.waiting.remove(request)
        self._end(request, ERROR, message)
        self._dequeued(1)

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
            lane.running.clear()
        for request in pending:
            if not request.finished:
                self._end(request, ERROR, message)
        self._flush()
