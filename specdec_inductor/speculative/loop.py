"""The one speculative loop every method shares, as a step API over a batch that requests
join and leave: `admit` (prefill, whole or in chunks interleaved with the others' steps) and
`retire` between steps, `step` = propose -> verify -> accept -> commit for every request of the
batch. `generate` is a short loop over them.

Only the proposer differs between methods (proposers/, one file per method, behind the
`Proposer` interface); this file never branches on the method. Greedy acceptance emits exactly
the tokens plain greedy decoding of the same engine emits: at each tree level the draft child
whose token equals the target's argmax is accepted, and the target's argmax after the last
accepted node is the bonus token, so every emitted token is the target's own greedy choice.
Without a proposer (or with one whose trees are the root alone) every step is a plain decode
step, and the proposer is not asked for drafts: plain greedy decoding (Engine.generate,
plain.py) is this loop without a proposer, one autoregressive path.

A batch has a fixed bucket (Engine.bucket_for of its capacity): requests take its first rows
in admission order and padding rows fill the rest, so admitting and retiring change values,
never shapes, and no step recompiles. A step of a greedy batch is one program per (bucket,
tree size) (commit.GreedyStep: the target's decode or verify pass, greedy acceptance and the
commit -- accepted-path KV compaction, next roots and lengths -- one compiled graph on a
compiled engine); the host drafts, plans the step's size (policies.py), reads the step's
accepted tokens once and handles stops. A draft-model proposer's trees and fixed-length chains
are drafted inside that program (commit.DraftedStep: draft, verify, accept, commit as one
graph) when the policy plans before drafting; the host then only prepares the draft's inputs. A batch with sampled
requests runs the same step with tree rejection sampling in place of greedy acceptance
(commit.SampledStep, greedy rows as one-hot targets), its uniforms drawn on the host from each
request's generator and passed in.
Requests admitted with a prefill_chunk run one chunk of their prompt per step
(Engine.prefill_chunk_step, the prefill graph) before that step's decode, and join the
decoding rows after their last chunk.

Numeric policy: verify runs N tokens through GEMMs while plain decode runs one through a GEMV,
so near-tied logits can flip the argmax. The baseline in tests is this engine's own greedy
decoding in fp32; a mismatch is reported with the logit margin, never hidden by a looser test.
"""
import contextlib
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from specdec_inductor import ops
from specdec_inductor.engine.kv_pool import Request
from specdec_inductor.sampler import Sampler, SamplingParams, request_generator, request_params
from specdec_inductor.speculative.commit import (DraftedStep, GreedyStep, SampledStep, StepResult,
                                                 commit_step, sampling_inputs, step_result)
from specdec_inductor.speculative.policies import (NO_DRAFT, AcceptanceGate, AdaptiveVerifySize,
                                                   CostAwareVerifySize, DraftPolicy, StartPolicy,
                                                   StepCosts, StepPlan, VerifySizePlanner)
from specdec_inductor.speculative.proposer import Proposer
from specdec_inductor.speculative.stats import (SpeculativeStats, dynamo_counts, graphs_compiled,
                                                step_times)
from specdec_inductor.speculative.tree import DraftProgram, DraftTree, VerifyInputs, truncate_draft


@dataclass(eq=False)
class ActiveRequest:
    """A request of a Batch: its pool row, what it emitted so far and when it stops."""
    pool_request: Request
    prompt: List[int]
    max_new_tokens: int
    eos_token_id: Optional[int]
    sampling: SamplingParams
    generator: Optional[torch.Generator]  # its uniform stream (sampled requests)
    policy_state: object  # its draft policy's state (DraftPolicy.new_request)
    tokens: List[int] = field(default_factory=list)  # emitted so far
    done: bool = False
    # Chunked prefill (admit's prefill_chunk): at most this many prompt tokens per step,
    # `prefilled` of them cached so far, and their captured target hidden rows.
    prefill_chunk: Optional[int] = None
    prefilled: int = 0
    prompt_hidden: List[Tensor] = field(default_factory=list)

    @property
    def prefilling(self) -> bool:
        """Still prefilling its prompt in chunks (it has no decode row yet)."""
        return self.prefilled < len(self.prompt)

    @property
    def row(self) -> int:
        """The request's row in the target's req_to_token (the proposer's request id)."""
        return self.pool_request.row

    def emit(self, tokens: Sequence[int]) -> List[int]:
        """Append `tokens` up to the stop (eos, included, or max_new_tokens); those kept."""
        kept = []
        for tok in tokens:
            self.tokens.append(tok)
            kept.append(tok)
            if tok == self.eos_token_id or len(self.tokens) >= self.max_new_tokens:
                self.done = True
                break
        return kept


class Batch:
    """Requests decoding together and their bucket-sized step state (inference tensors).
    Row b < len(requests) holds requests[b] (the padding row once it is done); the others
    are padding. Requests admitted with a prefill_chunk wait in `prefilling` (no decode row)
    until their prompt is cached, then join `requests`."""

    def __init__(self, engine, capacity: int, policy: DraftPolicy, stats: SpeculativeStats):
        self.capacity, self.bucket = capacity, engine.bucket_for(capacity)
        self.padding_row = engine.pool.padding_row
        self.policy, self.stats = policy, stats
        self.requests: List[ActiveRequest] = []
        self.prefilling: List[ActiveRequest] = []  # chunked prefill in progress, oldest first
        self.req_rows = torch.full((self.bucket,), self.padding_row, dtype=torch.int64)  # [B]
        self.seq_lens = torch.ones(self.bucket, dtype=torch.int64)  # [B] cached tokens
        self.roots = torch.zeros(self.bucket, dtype=torch.int64)  # [B] last emitted tokens
        self.sampler: Optional[Sampler] = None  # bucket-sized; None when every row is greedy
        self.rows: List[int] = []  # requests[b].row: the proposer's request ids
        self._verify_inputs: Dict[int, VerifyInputs] = {}  # tree size -> its padded inputs

    def verify_inputs(self, draft: DraftTree) -> List[Tensor]:
        """The bucket's verify inputs for `draft` (VerifyInputs.fill; buffers per tree size)."""
        size = draft.tokens.shape[1]
        inputs = self._verify_inputs.get(size)
        if inputs is None:
            inputs = self._verify_inputs[size] = VerifyInputs(self.bucket, size, self.seq_lens)
        return inputs.fill(draft, self.seq_lens)

    @property
    def live(self) -> List[ActiveRequest]:
        """Requests not done: those decoding, then those still prefilling."""
        return [r for r in self.requests if not r.done] + self.prefilling

    @property
    def size(self) -> int:
        """Requests holding a place in the batch (decoding or prefilling)."""
        return len(self.requests) + len(self.prefilling)

    def _add(self, requests: List[ActiveRequest]) -> None:
        at = len(self.requests)
        self.requests += requests
        for b, r in enumerate(requests, start=at):
            self.req_rows[b] = self.padding_row if r.done else r.row
            self.seq_lens[b] = len(r.prompt)
            self.roots[b] = r.tokens[-1]
        self._membership_changed()

    def _remove(self, request: ActiveRequest) -> None:
        if request.prefilling:
            self.prefilling.remove(request)
            return
        b = self.requests.index(request)
        del self.requests[b]
        for t, fill in ((self.req_rows, self.padding_row), (self.seq_lens, 1), (self.roots, 0)):
            t[b:-1] = t[b + 1:].clone()
            t[-1] = fill
        self._membership_changed()

    def _membership_changed(self) -> None:
        self.rows = [r.row for r in self.requests]
        padding = self.bucket - len(self.requests)  # greedy rows without a generator
        self.sampler = Sampler.for_requests(
            [r.sampling for r in self.requests] + [SamplingParams()] * padding,
            [r.generator for r in self.requests] + [None] * padding)

    def finished(self, b: int) -> None:
        """Request b is done: its row becomes padding, so no later step writes its KV."""
        self.req_rows[b] = self.padding_row

    @torch.inference_mode()
    def fit_bucket(self, engine) -> None:
        """Between steps: step in the smallest of the engine's buckets that holds the batch's
        requests (decoding and prefilling), so a batch whose capacity is larger than its load
        does not pay for padding rows. Rows keep their requests; the step state is copied
        into tensors of the new bucket. Each bucket runs its own compiled graphs."""
        bucket = engine.bucket_for(max(1, self.size))
        if bucket == self.bucket:
            return
        n = len(self.requests)
        for name, fill in (("req_rows", self.padding_row), ("seq_lens", 1), ("roots", 0)):
            old = getattr(self, name)
            new = torch.full((bucket,), fill, dtype=old.dtype)
            new[:n] = old[:n]
            setattr(self, name, new)
        self.bucket = bucket
        self._verify_inputs = {}
        self._membership_changed()


def _cost(name: str, doc: str) -> property:
    """A StepCosts field read and set through the generator (benchmarks and tests do)."""
    return property(lambda self: getattr(self.costs, name),
                    lambda self, value: setattr(self.costs, name, value), doc=doc)


class SpeculativeGenerator:
    """Speculative decoding of an `Engine` with any `Proposer` (None: plain decoding).

    tree_sizes: the verify sizes N this generator may use (each compiles its own verify graph;
    1 means a plain decode step; default (1, N), or (1, 2, N) with the adaptive size, or every
    size 1..N for a proposer with `variable_drafts`). Each step uses the smallest size that
    holds the largest real draft of the batch, each draft cut to its request's adaptive size,
    so a step where no request has a draft costs a decode step, not a verify over padding.
    Truncating a draft keeps a valid tree because proposers number nodes parents-first with
    padding last (DraftTree.num_drafts says how many are real).

    Draft budgets (policies.py): the adaptive verify size (adaptive; default for proposers with
    `cheap_drafts`) with grow_at and probe_cost, else the acceptance gate with min_accepted
    (None: verify_cost_per_node * (N - 1), raised to the measured costs' break-even point once
    compile_verify measured them, at the step's bucket), backoff_steps and gate_min_steps; a
    proposer that `gates_own_drafts` has every draft it offers verified at bucket 1, the gate
    judging from bucket 2 on (its own gate gets the measured costs: Proposer.use_step_costs).
    start_policy: keyword
    arguments of a StartPolicy put in front of that policy (when a request starts paying for
    full drafts: probes of verify size 2 first; None: no start rule); it adds size 2 to the
    default tree_sizes. cost_aware: with the adaptive size, each step's size by expected
    tokens per second at the batch's bucket instead (CostAwareVerifySize; batches that change
    bucket, as the server's).
    """

    # The step's timer: the draft policies price drafts by it (tests swap in a scripted clock so
    # that what they assert does not depend on the machine's load).
    clock = staticmethod(time.perf_counter)
    calibration_rounds = 16  # compile_verify: decode and probe-verify timings each
    # Steps as one program (GreedyStep / SampledStep). False: the engine's decode / verify
    # graph, then acceptance and commit in eager (benchmarks A/B the two; a recorder of the
    # engine's public steps sees every verify).
    one_program = True
    # Draft inside the step program where the proposer can (Proposer.draft_program: the draft
    # trees and fixed-length chains of draft-model proposers) and the policy plans before
    # drafting: draft, verify, accept and commit as one program (DraftedStep). False: the
    # proposer's own drafting (a tree's graph, a chain's host loop), then the step program
    # (benchmarks A/B the two).
    draft_in_program = True

    def __init__(self, engine, proposer: Optional[Proposer],
                 tree_sizes: Optional[Sequence[int]] = None,
                 min_accepted: Optional[float] = None, backoff_steps: int = 4,
                 verify_cost_per_node: float = 0.03, adaptive: Optional[bool] = None,
                 grow_at: float = 0.5, probe_cost: Optional[float] = None,
                 gate_min_steps: int = 4, start_policy: Optional[Dict[str, int]] = None,
                 cost_aware: bool = False):
        self.engine = engine
        self.proposer = proposer
        n = proposer.num_draft_tokens if proposer is not None else 1
        self.num_draft_tokens = n
        if adaptive is None:
            adaptive = proposer is not None and proposer.cheap_drafts
        self.adaptive = adaptive
        self.cost_aware = cost_aware
        self._gate_from_costs = min_accepted is None and not self.adaptive
        if min_accepted is None:
            min_accepted = verify_cost_per_node * (n - 1)
        self._min_accepted, self.backoff_steps = min_accepted, backoff_steps
        self.gate_min_steps, self.grow_at = gate_min_steps, grow_at
        # Measured by compile_verify (compiled engines) unless probe_cost is given.
        self.costs = StepCosts(probe_cost=1.0 if probe_cost is None else probe_cost)
        self._calibrate = probe_cost is None
        if proposer is not None:
            proposer.use_step_costs(self.costs)
        if tree_sizes is None and proposer is not None and proposer.variable_drafts:
            tree_sizes = range(1, n + 1)
        elif tree_sizes is None:
            tree_sizes = (1, 2, n) if self.adaptive or start_policy is not None else (1, n)
        sizes = sorted(set(tree_sizes) | {n})
        if sizes[0] < 1 or sizes[-1] > n:
            raise ValueError(f"tree_sizes must lie in [1, num_draft_tokens={n}], got {sizes}")
        self.tree_sizes = sizes
        self.start_policy = dict(start_policy) if start_policy is not None else None
        if self.start_policy is not None:
            try:  # its checks (argument names and ranges) before anything runs
                StartPolicy(DraftPolicy(sizes), **self.start_policy)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"argument 'start_policy': {exc}") from None
        # Only a proposer that can offer more than the root drafts (an AutoregressiveProposer's
        # trees are the root alone: its steps are plain decodes without asking it).
        self._drafts = proposer is not None and sizes[-1] > 1
        self._spec_steps = proposer.num_spec_steps if proposer is not None else 1
        self._greedy = GreedyStep.of(engine, self._spec_steps)
        self._drafted_steps: Dict[tuple, DraftedStep] = {}  # _run_drafted's programs
        # The tree rejection-sampling rule (an op; tests swap in a deliberately wrong one to
        # show the losslessness test catches it).
        self.tree_sampling = ops.tree_speculative_sampling

    verify_cost = _cost("verify_cost", "verify(N) / decode step, by compile_verify")
    _decode_s = _cost("decode_s", "a decode step's seconds, by compile_verify")
    _draft_s = _cost("draft_s", "running mean of a priced draft's seconds")
    probe_cost = _cost("probe_cost", "probe-size verify / decode step")

    @property
    def min_accepted(self) -> float:
        return self._min_accepted

    @min_accepted.setter
    def min_accepted(self, value: float) -> None:
        """A threshold set by hand is used as it is (no cost-based raise)."""
        self._min_accepted = value
        self._gate_from_costs = False

    @property
    def extra_positions(self) -> int:
        """KV positions admit reserves per request past prompt + max_new_tokens. A step writes
        the KV of N positions from the request's length on, and a request steps only while it
        has emitted fewer than max_new_tokens (the last emitted one not cached): prompt +
        max_new_tokens + N - 2 positions at most, reserved with one to spare (N - 1; plain
        decoding, N = 1: none)."""
        return self.num_draft_tokens - 1

    def gate_threshold(self) -> float:
        """The acceptance gate's threshold (AcceptanceGate.threshold) with the current costs."""
        return AcceptanceGate.threshold_for(self._min_accepted, self._gate_from_costs, self.costs)

    def _probe_size(self) -> int:
        return AdaptiveVerifySize(self.tree_sizes, self.costs).probe

    def new_policy(self) -> DraftPolicy:
        """A fresh draft policy for one batch (its running state is the batch's)."""
        if self.proposer is None:
            return DraftPolicy(self.tree_sizes)
        if self.adaptive and self.cost_aware:
            policy = CostAwareVerifySize(self.tree_sizes,
                                         VerifySizePlanner(self.tree_sizes, self.costs.step_s))
        elif self.adaptive:
            policy = AdaptiveVerifySize(self.tree_sizes, self.costs, self.grow_at)
        else:  # a proposer that gates its own drafts is judged from bucket 2 on
            policy = AcceptanceGate(self.tree_sizes, self.costs, self._min_accepted,
                                    self._gate_from_costs, self.backoff_steps,
                                    self.gate_min_steps,
                                    judge_from=2 if self.proposer.gates_own_drafts else 1)
        if self.start_policy is not None:
            policy = StartPolicy(policy, **self.start_policy)
        return policy

    @torch.inference_mode()
    def compile_verify(self, batch_size: int = 1, sampled: bool = True) -> None:
        """Compile the step programs of batch_size's bucket now: the greedy decode and every
        verify size > 1 it drafts for (GreedyStep), and with `sampled` those of batches with
        sampled requests (SampledStep). A warm-up `generate` may never verify (NGRAM before any
        context suffix recurs), and the graph would then compile inside the first timed step.
        Runs one step per size on a scratch request (step_times); with the adaptive size it
        also measures every size's greedy program at batch_size's bucket (costs.step_s) and
        probe_cost, with the cost-based acceptance gate verify_cost (the greedy programs of
        verify(N) against a decode step), also kept as the bucket's (costs.by_bucket): the
        gate prices each step at its bucket."""
        engine = self.engine
        if not engine.compiled:
            return
        sizes = [s for s in self.tree_sizes if s > 1] if self._drafts else []
        if sampled:
            step_times(engine, [1] + sizes, rounds=0, batch_size=batch_size,
                       program=SampledStep.of(engine, self._spec_steps, self.tree_sampling))
        step_times(engine, [1] + sizes, rounds=0, batch_size=batch_size, program=self._greedy)
        if not sizes:
            return
        if self._gate_from_costs:
            n = self.num_draft_tokens
            times = step_times(engine, [1, n], rounds=self.calibration_rounds,
                               batch_size=batch_size, program=self._greedy)
            self.costs.verify_cost, self.costs.decode_s = times[n] / times[1], times[1]
            bucket = engine.bucket_for(batch_size)
            self.costs.by_bucket[bucket] = (self.costs.verify_cost, self.costs.decode_s)
        if self.adaptive and self._calibrate and self.tree_sizes[0] == 1:
            times = step_times(engine, [1] + sizes, rounds=self.calibration_rounds,
                               batch_size=batch_size, program=self._greedy)
            self.costs.probe_cost = times[self._probe_size()] / times[1]
            bucket = engine.bucket_for(batch_size)
            self.costs.step_s.update({(bucket, z): t for z, t in times.items()})

    # -- the step API --------------------------------------------------------------------------
    @contextlib.contextmanager
    def batch(self, capacity: int, stats: Optional[SpeculativeStats] = None) -> Iterator[Batch]:
        """A batch of at most `capacity` requests at a time, for admit / step / retire. When the
        scope ends, requests still in it are retired (their slots freed, also on errors) and
        stats gets the graphs compiled and recompiles counted meanwhile."""
        self.engine.bucket_for(capacity)  # a batch over max_batch fails before anything
        self._check_capture()
        stats = stats if stats is not None else SpeculativeStats()
        depth = (self.proposer.num_spec_steps if self.proposer is not None else 1) - 1
        stats.accepted_at_depth += [0] * max(0, depth - len(stats.accepted_at_depth))
        draft_engine = self.proposer.engine if self.proposer is not None else None
        draft_pool = draft_engine.pool if draft_engine is not None else None
        # The pools' generation scopes: a request still held when the batch ends (a cleanup
        # that failed) is a leak KVPool.check_consistent reports.
        pools = {id(p): p for p in (self.engine.pool, draft_pool) if p is not None}
        graphs0, recompiles0 = dynamo_counts()
        with contextlib.ExitStack() as scopes:
            for pool in pools.values():
                scopes.enter_context(pool.generation())
            with torch.inference_mode():  # its step state: inference tensors (Engine._inference)
                batch = Batch(self.engine, capacity, self.new_policy(), stats)
            try:
                yield batch
            finally:
                try:
                    if batch.size:
                        self.retire(batch, *batch.requests, *batch.prefilling)
                finally:
                    graphs1, recompiles1 = dynamo_counts()
                    stats.graphs += graphs1 - graphs0
                    stats.recompiles += recompiles1 - recompiles0

    @torch.inference_mode()
    def admit(self, batch: Batch, prompts: Sequence[Sequence[int]], max_new_tokens: int,
              sampling: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
              eos_token_id: Optional[int] = None,
              prefill_chunk: Optional[int] = None) -> List[ActiveRequest]:
        """New requests join the batch (between steps): their prompts are prefilled together in
        the batch's bucket, their first tokens emitted and the proposer started on them.
        All or nothing: on an error nothing joins and their slots are freed.

        prefill_chunk: prefill each prompt in chunks of at most this many tokens instead, one
        chunk per `step` while the other requests keep decoding (a long prompt then never
        stalls them for its whole prefill); the request emits its first token in the step of
        its last chunk, and that step's decode tokens after it. Each request's chunk is a one-row
        step (_prefill_chunks): T tokens run the engine's prefill graph of one row when T equals
        the engine's prefill_chunk, else a one-row graph of its own, whatever the bucket."""
        self.engine.check_request(prompts, max_new_tokens)
        if max_new_tokens < 1:
            raise ValueError(f"argument 'max_new_tokens' must be >= 1 to admit, got "
                             f"{max_new_tokens}")
        if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or
                                          not isinstance(prefill_chunk, int) or
                                          prefill_chunk < 1):
            raise ValueError(f"argument 'prefill_chunk' must be None or an int >= 1, got "
                             f"{prefill_chunk!r}")
        if batch.size + len(prompts) > batch.capacity:
            raise ValueError(f"argument 'prompts': {len(prompts)} more requests do not fit a batch "
                             f"of {batch.size} with capacity {batch.capacity}")
        params = request_params(sampling, len(prompts))
        engine = self.engine
        admitted = engine.pool.admit([len(p) for p in prompts],
                                     max_new_tokens + self.extra_positions)
        new = [ActiveRequest(r, [int(t) for t in p], max_new_tokens, eos_token_id, s,
                             request_generator(s), batch.policy.new_request(), prefill_chunk=c)
               for r, p, s, c in zip(admitted, prompts, params,
                                     [prefill_chunk] * len(prompts))]
        if prefill_chunk is not None:
            batch.prefilling += new
            return new
        try:
            rows = torch.tensor([r.row for r in new] +
                                [engine.pool.padding_row] * (batch.bucket - len(new)))
            t0 = time.perf_counter()
            first = engine.prefill(prompts, rows)
            batch.stats.prefill_s += time.perf_counter() - t0
        except BaseException:
            self._release(admitted, False)
            raise
        for b, r in enumerate(new):
            r.prefilled = len(r.prompt)
            if first.hidden is not None:
                r.prompt_hidden = [first.hidden[b, :len(r.prompt)]]
        self._join(batch, new, first.logits[:len(new)])
        return new

    def _join(self, batch: Batch, new: List[ActiveRequest], logits: Tensor) -> None:
        """Requests whose prompts are cached take decode rows: each emits its first token
        (from logits [n, V], its prompt's last row) and the proposer starts on it (with the
        prompt's target hidden rows, concatenated over its prefill chunks, where it drafts
        from them). On an error their slots are freed (the proposer finishes them)."""
        started = False  # set before start is called: a start that fails midway is finished
        try:
            sampler = Sampler.for_requests([r.sampling for r in new], [r.generator for r in new])
            first = (sampler.sample(logits) if sampler is not None else logits.argmax(-1))
            for r, tok in zip(new, first.tolist()):
                r.emit([tok])
            batch.stats.new_tokens += len(new)
            proposer = self.proposer
            if proposer is not None:
                ids, contexts = [r.row for r in new], [r.prompt + r.tokens for r in new]
                started = True
                if proposer.needs_target_hidden:
                    proposer.start(ids, contexts, [torch.cat(r.prompt_hidden) for r in new])
                else:
                    proposer.start(ids, contexts)
        except BaseException:
            self._release([r.pool_request for r in new], started)
            raise
        for r in new:
            r.prompt_hidden = []
        batch._add(new)
        batch.policy.admitted()

    def _prefill_chunks(self, batch: Batch) -> Dict[ActiveRequest, List[int]]:
        """One prefill chunk of every prefilling request, each as a one-row step of its own
        prefill_chunk (a chunk costs about its rows, so rows batched together save nothing,
        and a one-row graph per chunk size serves every batch bucket); those whose prompt is
        then cached join (_join). Returns their first tokens."""
        reqs, cached, last = batch.prefilling, [], []
        t0 = time.perf_counter()
        for r in reqs:
            logits = self._prefill_chunk(r)
            if not r.prefilling:
                cached.append(r)
                last.append(logits)
        batch.stats.prefill_s += time.perf_counter() - t0
        if not cached:
            return {}
        batch.prefilling = [r for r in reqs if r.prefilling]
        self._join(batch, cached, torch.cat(last))
        return {r: list(r.tokens) for r in cached}

    def _prefill_chunk(self, r: ActiveRequest) -> Tensor:
        """Request r's next prompt chunk as a one-row step; the logits of its last row [1, V]."""
        chunk = r.prompt[r.prefilled:r.prefilled + r.prefill_chunk]
        ids = torch.zeros(1, r.prefill_chunk, dtype=torch.int64)  # [1, T]
        ids[0, :len(chunk)] = torch.tensor(chunk, dtype=torch.int64)
        prefix = torch.tensor([r.prefilled])  # [1]
        positions = prefix.view(1, 1) + torch.arange(r.prefill_chunk).view(1, -1)  # [1, T]
        _, logits, hidden = self.engine.prefill_chunk_step(
            ids, positions, torch.tensor([r.row]), prefix, torch.tensor([len(chunk)]))
        r.prefilled += len(chunk)
        if hidden is not None and self.proposer is not None and self.proposer.needs_target_hidden:
            r.prompt_hidden.append(hidden[0, :len(chunk)])
        return logits

    def _check_capture(self) -> None:
        if (self.proposer is not None and self.proposer.needs_target_hidden
                and self.engine.capture_hidden is None):
            raise ValueError(f"{type(self.proposer).__name__} drafts from the target's hidden "
                             "states: make the target Engine with capture_hidden=...")

    @torch.inference_mode()
    def retire(self, batch: Batch, *requests: ActiveRequest) -> None:
        """Requests leave the batch (between steps; done or not): the proposer finishes them
        and their slots and rows are freed (even when the proposer's cleanup raises)."""
        for r in requests:
            if r not in batch.requests and r not in batch.prefilling:
                raise ValueError(f"argument 'requests': row {r.row} is not in this batch")
        started = [r.pool_request for r in requests if not r.prefilling]
        prefilling = [r.pool_request for r in requests if r.prefilling]
        for r in requests:
            batch._remove(r)
        try:
            self._release(started, self.proposer is not None)
        finally:
            self._release(prefilling, False)  # the proposer never saw them

    def _release(self, pool_requests: List[Request], started: bool) -> None:
        try:
            if started:
                self.proposer.finish([r.row for r in pool_requests])
        finally:
            for r in pool_requests:
                self.engine.pool.release(r)

    @torch.inference_mode()
    def step(self, batch: Batch) -> Dict[ActiveRequest, List[int]]:
        """One step of the batch: a prefill chunk of every request still prefilling (those it
        completes emit their first token and join the decoding rows), then for every live
        decoding request draft (as its policy plans), verify, accept, commit. Returns the
        tokens each live request emitted (accepted drafts + the bonus, cut at its stop); a
        request that stops is marked done and stays in the batch until retired."""
        joined = self._prefill_chunks(batch) if batch.prefilling else {}
        emitted = self._step(batch)
        for r, first in joined.items():  # their first token, then this step's
            emitted[r] = first + emitted.get(r, [])
        return emitted

    def _step(self, batch: Batch) -> Dict[ActiveRequest, List[int]]:
        """step's draft -> verify -> accept -> commit of the requests with decode rows."""
        reqs, stats, policy = batch.requests, batch.stats, batch.policy
        live = [not r.done for r in reqs]
        if not any(live):
            return {}
        bs = len(reqs)
        t0, graphs0 = self.clock(), graphs_compiled()
        plan, draft, in_program = NO_DRAFT, None, None
        if self._drafts and policy.wants_draft(batch.bucket):
            in_program = self._draft_in_program(batch, live)
            if in_program is None:
                draft = self.proposer.propose(batch.rows, batch.seq_lens[:bs])
                if graphs_compiled() == graphs0:  # else the time was the compiler's
                    policy.drafted(self.clock() - t0)
                # before the cut to the plan's size
                offered = (draft.num_drafts.tolist() if draft.num_drafts is not None
                           else [self.num_draft_tokens - 1] * bs)
                plan = policy.plan(offered, live, [r.policy_state for r in reqs], draft,
                                   batch.bucket)
            else:
                plan = in_program[0]
        if plan.size > 1 and in_program is None:
            draft = truncate_draft(draft, plan.size, batch.seq_lens[:bs])
        t1 = self.clock()
        if in_program is None:
            result = self._run(batch, plan.size, draft)
        else:
            result = self._run_drafted(batch, in_program[1])
            if in_program[1].read is not None:
                in_program[1].read(result.drafted)
        # The step's one host read: per request [accepted drafts, tokens...].
        host = result.host.tolist()[:bs]
        t2 = self.clock()
        timed = graphs_compiled() == graphs0  # a step that compiled a graph prices nothing
        if in_program is not None:
            stats.drafted_in_program += 1
            # The draft ran inside the step: price it as what the step took beyond a verify.
            draft_s = self.costs.draft_in_step(t2 - t1, batch.bucket) if timed else None
            if draft_s is not None:
                policy.drafted(draft_s)
        if plan is not NO_DRAFT:
            policy.observe(plan, live, [r.policy_state for r in reqs], [h[0] for h in host],
                           [h[1] for h in host], t2 - t1 if timed else None)
        emitted = self._emit(batch, live, host)
        if self.proposer is not None:
            lists = [emitted.get(r, []) for r in reqs]
            if self.proposer.needs_target_hidden:
                self.proposer.commit(batch.rows, lists,
                                     self._path_hidden(result.path_hidden, host, live))
            else:
                self.proposer.commit(batch.rows, lists)
        t3 = self.clock()
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.commit_s += t3 - t2
        stats.verify_steps += 1
        stats.decode_steps += int(plan.size == 1)
        stats.steps_by_size[plan.size] = stats.steps_by_size.get(plan.size, 0) + 1
        return emitted

    def _run(self, batch: Batch, size: int, draft: Optional[DraftTree]) -> StepResult:
        """The target's step of the whole bucket, accepted and committed: a plain decode of the
        roots (size 1) or a verify of the drafts, as one program (GreedyStep, or SampledStep
        when the batch has sampled requests); with one_program False the engine's step graph,
        then acceptance and the commit in eager."""
        inputs = batch.verify_inputs(draft) if size > 1 else None
        if not self.one_program:
            return self._run_pieces(batch, size, inputs)
        sampler = batch.sampler
        if sampler is None:
            program, acceptance = self._greedy, ()
        else:
            program = SampledStep.of(self.engine, self._spec_steps, self.tree_sampling)
            acceptance = sampling_inputs(sampler, size)
        if inputs is None:
            return program.decode(batch.roots, batch.req_rows, batch.seq_lens, *acceptance)
        tokens, positions, mask, *linkage = inputs
        return program.verify(tokens, positions, batch.req_rows, batch.seq_lens, mask, *linkage,
                              batch.roots, *acceptance)

    def _draft_in_program(self, batch: Batch,
                          live: List[bool]) -> Optional[Tuple[StepPlan, DraftProgram]]:
        """(the step's plan, the proposer's DraftProgram) when this step drafts inside its
        program (DraftedStep): the policy plans before drafting (plans_before_draft) and
        verifies full trees of N nodes, and the proposer has its drafts as a program this
        step (Proposer.draft_program); else None, and the step drafts with propose."""
        policy, reqs, n = batch.policy, batch.requests, self.num_draft_tokens
        if not (self.draft_in_program and self.one_program and policy.plans_before_draft):
            return None
        plan = policy.plan([n - 1] * len(reqs), live, [r.policy_state for r in reqs], None,
                           batch.bucket)
        if plan.size != n:
            return None
        program = self.proposer.draft_program(batch.rows, batch.seq_lens, batch.roots)
        return None if program is None else (plan, program)

    def _run_drafted(self, batch: Batch, program: DraftProgram) -> StepResult:
        """The step drafted inside its program: DraftedStep over the greedy or the sampled
        step program (one per drafter and acceptance rule, kept by this generator)."""
        sampler = batch.sampler
        key = (program.drafter, None if sampler is None else self.tree_sampling)
        step = self._drafted_steps.get(key)
        if step is None:
            inner = (self._greedy if sampler is None else
                     SampledStep.of(self.engine, self._spec_steps, self.tree_sampling))
            step = self._drafted_steps[key] = DraftedStep(inner, program.drafter)
        acceptance = (() if sampler is None else
                      sampling_inputs(sampler, self.num_draft_tokens))
        return step.run(program.inputs, batch.req_rows, batch.seq_lens, batch.roots, *acceptance)

    def _run_pieces(self, batch: Batch, size: int, inputs) -> StepResult:
        """_run with the engine's decode / verify graph, then acceptance (the same rules and
        uniforms as the programs) and the commit op by op."""
        sampler = batch.sampler
        if inputs is None:
            predicts, logits, hidden = self.engine.decode(batch.roots, batch.req_rows,
                                                          batch.seq_lens)
            bs = predicts.shape[0]
            predicts = sampler.sample(logits) if sampler is not None else predicts
            accept_index = torch.arange(bs, dtype=torch.int32).view(bs, 1)  # [B, 1]
            accepted = (predicts, accept_index, torch.zeros(bs, dtype=torch.int32))
            hidden = None if hidden is None else hidden.unsqueeze(1)
        else:
            tokens, positions, mask, *linkage = inputs
            target, logits, hidden = self.engine.verify(tokens, positions, batch.req_rows,
                                                        batch.seq_lens, mask)
            steps = min(self._spec_steps, size)
            accepted = (sampler.verify(tokens, linkage, logits, steps, self.tree_sampling)
                        if sampler is not None
                        else ops.verify_tree_greedy(tokens, *linkage, target, steps))
        done = commit_step(self.engine.pool.req_to_token, batch.req_rows, batch.seq_lens,
                           batch.roots, batch.padding_row, *accepted, size)
        return step_result(done, hidden)

    @staticmethod
    def _emit(batch: Batch, live: List[bool],
              host: List[List[int]]) -> Dict[ActiveRequest, List[int]]:
        """Hand each live request its step's tokens (cut at its stop) and count them."""
        stats, emitted = batch.stats, {}
        for b, (r, is_live, h) in enumerate(zip(batch.requests, live, host)):
            if not is_live:
                continue
            stats.count_accepted(h[0])
            emitted[r] = r.emit(h[1:h[0] + 2])
            stats.new_tokens += len(emitted[r])
            if r.done:
                batch.finished(b)
        return emitted

    @staticmethod
    def _path_hidden(rows: Tensor, host, live) -> List[Tensor]:
        """The target hidden rows of each request's accepted path, root first ([accepted + 1,
        k*H]; none for a request that had finished); rows [B, S, k*H] (path_rows)."""
        return [rows[b, :h[0] + 1] if x else rows[b, :0]
                for b, (h, x) in enumerate(zip(host, live))]

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                 eos_token_id: Optional[int] = None,
                 stats: Optional[SpeculativeStats] = None,
                 sampling: Union[None, SamplingParams, Sequence[SamplingParams]] = None
                 ) -> List[List[int]]:
        """New tokens per prompt; a request stops after eos or max_new_tokens.

        sampling: None (all greedy), one SamplingParams for every request, or one per prompt
        (greedy and sampled requests may be mixed). Sampled requests are verified by tree
        rejection sampling (sampler.py), which keeps each token's distribution exactly the
        target's; greedy ones emit exactly the engine's greedy tokens."""
        self.engine.check_request(prompts, max_new_tokens)
        request_params(sampling, len(prompts))  # a bad sampling argument fails before anything
        self._check_capture()
        if max_new_tokens <= 0:
            return [[] for _ in prompts]
        stats = stats if stats is not None else SpeculativeStats()
        with self.batch(len(prompts), stats) as batch:
            requests = self.admit(batch, prompts, max_new_tokens, sampling, eos_token_id)
            t0 = time.perf_counter()
            while batch.live:
                self.step(batch)
            stats.decode_s += time.perf_counter() - t0
            return [r.tokens for r in requests]
