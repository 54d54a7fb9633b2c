"""The one speculative loop every method shares: propose -> verify -> accept -> commit.

Only the proposer differs between methods (proposers/, one file per method, behind the
`Proposer` protocol); this file never branches on the method. Greedy acceptance emits exactly
the tokens plain greedy decoding of the same engine emits: at each tree level the draft child
whose token equals the target's argmax is accepted, and the target's argmax after the last
accepted node is the bonus token, so every emitted token is the target's own greedy choice.

KV commit: verify writes node i's KV at row position seq_len + i. After acceptance the row's
slots for positions [seq_len, seq_len + N) are permuted so that the accepted path's slots come
first, in path order; the rejected nodes' slots follow and are overwritten by the next verify.
Only req_to_token entries move (gather_extend_cache_locs + assign_req_to_token), never K/V rows.

Numeric policy: verify runs N tokens through GEMMs while plain decode runs one through a GEMV,
so near-tied logits can flip the argmax. The baseline in tests is this engine's own greedy
decoding in fp32; a mismatch is reported with the logit margin, never hidden by a looser test.
"""
import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Protocol, Sequence, Union

import torch
from torch import Tensor

from specdec_inductor import ops
from specdec_inductor.sampler import Sampler, SamplingParams


@dataclass
class DraftTree:
    """A proposer's draft for the real requests of a batch (padding rows are added here)."""
    tokens: Tensor  # [B, N] int64, node 0 = the root (the last emitted, not yet cached token)
    tree_mask: Tensor  # [B*N*N] bool QLEN_ONLY ancestor mask
    positions: Tensor  # [B*N] int64, seq_len + depth
    retrieve_index: Tensor  # [B, N]
    retrieve_next_token: Tensor  # [B, N]
    retrieve_next_sibling: Tensor  # [B, N]
    num_drafts: Optional[Tensor] = None  # [B] real (unpadded) drafts, for metrics


@torch.inference_mode()
def step_times(engine, sizes: Sequence[int], context: int = 0, rounds: int = 16,
               batch_size: int = 1) -> Dict[int, float]:
    """Median seconds of one step of each tree size (1: a plain decode step, else a verify of
    a star tree) over a `context`-token prefix, after one untimed call each (which compiles
    what has not been). The sizes take turns within every round, so a drift of the machine's
    speed hits them alike. Runs on a scratch request, admitted and released here (its slots
    are written, then freed); the other rows of batch_size's bucket are padding."""
    bucket = engine.bucket_for(batch_size)
    (scratch,) = engine.pool.admit([max(context, 1)], max(sizes))
    times: Dict[int, List[float]] = {z: [] for z in sizes}
    try:
        rows = torch.tensor([scratch.row] + [engine.pool.padding_row] * (bucket - 1))  # [B]
        seq_lens = torch.tensor([context] + [0] * (bucket - 1))  # [B]

        def step(z):
            if z == 1:
                engine.decode(torch.zeros(bucket, dtype=torch.int64), rows, seq_lens)
            else:
                mask, depth = star_tree(z)
                engine.verify(torch.zeros(bucket, z, dtype=torch.int64),
                              seq_lens.view(bucket, 1) + depth.view(1, z), rows, seq_lens,
                              mask.repeat(bucket))

        for z in sizes:
            step(z)
        for _ in range(rounds):
            for z in sizes:
                t0 = time.perf_counter()
                step(z)
                times[z].append(time.perf_counter() - t0)
    finally:
        engine.pool.release(scratch)
    return {z: statistics.median(t) for z, t in times.items() if t}


def star_tree(n: int):
    """A tree of n nodes that are all children of the root: (QLEN_ONLY mask [n*n] bool,
    depth [n] int64). Padding requests and compile warm-ups verify it."""
    mask = torch.eye(n, dtype=torch.bool)
    mask[:, 0] = True
    depth = torch.ones(n, dtype=torch.int64)
    depth[0] = 0
    return mask.flatten(), depth


def root_only_draft(roots: Tensor, seq_lens: Tensor) -> DraftTree:
    """Trees of the root alone (roots [B]): verifying them is a plain decode step."""
    bs = roots.shape[0]
    row = torch.arange(bs, dtype=torch.int64).view(bs, 1)  # [B, 1] flat node rows
    none = torch.full((bs, 1), -1, dtype=torch.int64)  # [B, 1]
    return DraftTree(roots.view(bs, 1).long(), torch.ones(bs, dtype=torch.bool), seq_lens.clone(),
                     row, none, none.clone(), torch.zeros(bs, dtype=torch.int64))


class Proposer(Protocol):
    """What a speculative method provides. Request ids are the engine's request rows."""

    num_draft_tokens: int  # N, nodes per tree including the root
    num_spec_steps: int  # S, longest root-to-leaf path + 1

    def start(self, request_ids: List[int], contexts: List[List[int]]) -> None:
        """New requests: their prompt followed by their first emitted token."""

    def propose(self, request_ids: List[int], seq_lens: Tensor) -> DraftTree:
        """Draft trees rooted at each request's last emitted token; seq_lens [B] = cached tokens."""

    def commit(self, request_ids: List[int], emitted: List[List[int]]) -> None:
        """Tokens each request emitted in the last step (accepted drafts + bonus). A step may
        run without a propose call (the acceptance gate's plain decode steps): then emitted
        holds just the next token."""

    def finish(self, request_ids: List[int]) -> None:
        """Requests that left the batch."""

    # A proposer whose drafts cost next to nothing next to a target step (NGRAM: a host-side
    # trie lookup) sets the class attribute `cheap_drafts = True`; the loop then cuts poorly
    # accepted drafts to a small verify instead of gating drafting off (SpeculativeGenerator).

    # A proposer that drafts from the target's hidden states (EAGLE-style) sets the class
    # attribute `needs_target_hidden = True`; the loop then passes, as a third argument,
    # start(..., hidden) with each prompt's captured target hidden [P, k*H], and
    # commit(..., hidden) with the hidden rows of each request's accepted path (root first,
    # [accepted + 1, k*H]): row i belongs to the position of emitted[i]'s predecessor.


@dataclass
class SpeculativeStats:
    """The metrics of algorithms.md: tokens/s, mean accepted length, per-position acceptance,
    verify steps, draft / verify time shares, compiled graphs and recompiles."""
    new_tokens: int = 0
    verify_steps: int = 0  # speculative steps, decode fallbacks included
    decode_steps: int = 0  # steps that fell back to plain decode (no request had a draft)
    request_steps: int = 0  # verify steps summed over requests
    accepted_drafts: int = 0
    accepted_at_depth: List[int] = field(default_factory=list)  # [S-1] requests accepting >= k
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0
    decode_s: float = 0.0
    graphs: int = 0
    recompiles: int = 0
    steps_by_size: Dict[int, int] = field(default_factory=dict)  # tree size -> steps (1: decode)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per request per verify step (accepted drafts + the bonus)."""
        return 1.0 + self.accepted_drafts / self.request_steps if self.request_steps else float("nan")

    @property
    def acceptance_by_position(self) -> List[float]:
        return [n / self.request_steps for n in self.accepted_at_depth] if self.request_steps else []

    def summary(self) -> str:
        busy = self.draft_s + self.verify_s + self.commit_s
        share = (lambda s: 100.0 * s / busy) if busy > 0 else (lambda s: float("nan"))
        accept = " ".join(f"{a:.2f}" for a in self.acceptance_by_position)
        sizes = " ".join(f"{k}:{v}" for k, v in sorted(self.steps_by_size.items()))
        return (f"{self.new_tokens} tokens, {self.tokens_per_s:.1f} tok/s; {self.verify_steps} steps "
                f"({self.decode_steps} plain decode; by tree size {sizes}), mean accepted length {self.mean_accepted_length:.2f}; acceptance by position "
                f"[{accept}]; time: draft {share(self.draft_s):.0f}% verify {share(self.verify_s):.0f}% "
                f"commit {share(self.commit_s):.0f}%; graphs {self.graphs}, recompiles {self.recompiles}")


def _draft_pool(proposer):
    """The KV pool of a proposer's draft Engine, if it has one."""
    return getattr(getattr(proposer, "engine", None), "pool", None)


def _dynamo_counts():
    """(graphs compiled, recompiles) so far in this process, from Dynamo's counters."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())


class SpeculativeGenerator:
    """Greedy speculative decoding of an `Engine` with any `Proposer`.

    tree_sizes: the verify sizes N this generator may use (each compiles its own verify graph;
    1 means a plain decode step; default (1, N), or (1, 2, N) with the adaptive size). Each step
    uses the smallest size that holds the largest real draft of the batch, each draft cut to
    its request's adaptive size, so a step where no request has a draft costs a decode step,
    not a verify over padding. Truncating a draft keeps a valid tree because proposers number nodes
    parents-first with padding last (DraftTree.num_drafts says how many are real).
    """

    calibration_rounds = 16  # compile_verify: decode and probe-verify timings each

    def __init__(self, engine, proposer: Proposer, tree_sizes: Optional[Sequence[int]] = None,
                 min_accepted: Optional[float] = None, backoff_steps: int = 4,
                 verify_cost_per_node: float = 0.03, adaptive: Optional[bool] = None,
                 grow_at: float = 0.5, probe_cost: Optional[float] = None,
                 gate_min_steps: int = 4):
        self.engine = engine
        self.proposer = proposer
        n = proposer.num_draft_tokens
        # Two ways to keep a poor draft from costing more than it brings:
        # - Adaptive verify size (default for proposers with `cheap_drafts`, i.e. NGRAM): each
        #   request keeps a running mean of the drafts it accepted (halved each step, updated
        #   only by drafts offered with more than one node); while it is below grow_at, the
        #   request's drafts are cut to the smallest compiled verify size > 1, else they keep
        #   all N nodes. On SmolLM2 in fp32 with 2 cores a verify of 2 tokens costs about what
        #   a plain decode step costs (0.98-1.03x; 8 tokens 1.16-1.38x; measured by
        #   `benchmarks/bench_spec.py --verify-costs`), so a cut draft is a nearly free try.
        #   The default sizes (1, 2, N) add one verify graph to compile.
        #   Where the probe costs more (bf16 here: 1.10x), compile_verify measures that cost
        #   (probe_cost, in decode steps) and a probe runs only while its first drafts are
        #   accepted at a rate above probe_cost - 1; otherwise the step is a plain decode and
        #   the dropped first drafts are scored against the decoded tokens, so the rate keeps
        #   being measured at no cost.
        # - Acceptance gate (other proposers, whose drafting runs a draft model and is not
        #   free): when the mean of accepted drafts over this generation's draft steps (judged
        #   from the gate_min_steps-th on: one step's count is mostly noise) falls below
        #   gate_threshold(), the next steps are plain decodes without drafting, backoff_steps
        #   at first and twice as many after each further failed probe (at most 64); a probe
        #   that brings the mean back up resets the backoff. The threshold is min_accepted when
        #   given; else the break-even point of the measured costs, verify_cost + draft / decode
        #   - 1 accepted drafts per step (compile_verify times verify(N) against a decode step on
        #   compiled engines, the loop times the drafts), never below verify_cost_per_node *
        #   (N - 1) (a verify of N tokens costing about 1 + verify_cost_per_node * (N - 1)
        #   decode steps, the default until costs are measured). Drafts are priced per step:
        #   the first draft, and the first after a cooldown, catch up on tokens the draft model
        #   has not seen and are not timed.
        self.adaptive = bool(getattr(proposer, "cheap_drafts", False)) if adaptive is None else adaptive
        self._gate_from_costs = min_accepted is None and not self.adaptive
        if min_accepted is None:
            min_accepted = verify_cost_per_node * (n - 1)
        self._min_accepted, self.backoff_steps = min_accepted, backoff_steps
        self.gate_min_steps = gate_min_steps
        self.verify_cost: Optional[float] = None  # verify(N) / decode step, by compile_verify
        self._decode_s: Optional[float] = None  # a decode step's seconds, by compile_verify
        self._draft_s: Optional[float] = None  # running mean of a draft's seconds
        self.grow_at = grow_at
        # Cost of a probe-size verify in decode steps: measured by compile_verify (compiled
        # engines) unless given; 1.0 (free) until then.
        self.probe_cost = 1.0 if probe_cost is None else probe_cost
        self._calibrate = probe_cost is None
        if tree_sizes is None:
            tree_sizes = (1, 2, n) if self.adaptive else (1, n)
        sizes = sorted(set(tree_sizes) | {n})
        if sizes[0] < 1 or sizes[-1] > n:
            raise ValueError(f"tree_sizes must lie in [1, num_draft_tokens={n}], got {sizes}")
        self.tree_sizes = sizes
        # The tree rejection-sampling rule (an op; tests swap in a deliberately wrong one to
        # show the losslessness test catches it).
        self.tree_sampling = ops.tree_speculative_sampling

    @torch.inference_mode()
    def compile_verify(self, batch_size: int = 1) -> None:
        """Compile the target's verify graph of every tree size > 1 for batch_size's bucket now.
        A warm-up `generate` may never verify (NGRAM before any context suffix recurs), and the
        graph would then compile inside the first timed step. Runs one verify per size on a
        scratch request (step_times); with the adaptive size it also measures probe_cost, with
        the cost-based acceptance gate verify_cost (verify(N) against a decode step)."""
        engine = self.engine
        sizes = [s for s in self.tree_sizes if s > 1]
        if not sizes or not engine.compiled:
            return
        step_times(engine, sizes, rounds=0, batch_size=batch_size)
        if self._gate_from_costs:
            n = self.proposer.num_draft_tokens
            times = step_times(engine, [1, n], rounds=self.calibration_rounds, batch_size=batch_size)
            self.verify_cost, self._decode_s = times[n] / times[1], times[1]
        if self.adaptive and self._calibrate and self.tree_sizes[0] == 1:
            # The adaptive size's probe cost (a decode graph compiles here if none has yet).
            probe = self._probe_size()
            times = step_times(engine, [1, probe], rounds=self.calibration_rounds,
                               batch_size=batch_size)
            self.probe_cost = times[probe] / times[1]

    @property
    def min_accepted(self) -> float:
        return self._min_accepted

    @min_accepted.setter
    def min_accepted(self, value: float) -> None:
        """A threshold set by hand is used as it is (no cost-based raise)."""
        self._min_accepted = value
        self._gate_from_costs = False

    def gate_threshold(self) -> float:
        """Accepted drafts per verify step below which the acceptance gate switches drafting
        off: min_accepted, or (once compile_verify measured verify_cost and a draft has been
        timed) the break-even point of the measured costs if that is higher."""
        if not self._gate_from_costs or self.verify_cost is None or self._draft_s is None:
            return self.min_accepted
        return max(self.min_accepted, self.verify_cost + self._draft_s / self._decode_s - 1.0)

    def _size_for(self, offered: List[int], done: List[bool], caps: List[int]) -> int:
        """The verify size of a step: the smallest compiled size that holds every live
        request's draft (offered: its real drafts), each cut to its cap (the adaptive size;
        N otherwise)."""
        need = max((min(1 + k, c) for k, c, d in zip(offered, caps, done) if not d), default=1)
        return next(s for s in self.tree_sizes if s >= need)

    def _probe_size(self) -> int:
        """The smallest verify size > 1 (where the adaptive size cuts drafts to)."""
        return next((s for s in self.tree_sizes if s > 1), self.tree_sizes[-1])

    def _drop_probe(self, hit_rate: List[float], drafted: List[bool]) -> bool:
        """A probe-size verify pays when the rate at which its first draft is accepted beats
        its extra cost over a decode step (probe_cost - 1) for some request with a draft."""
        need = self.probe_cost - 1.0
        return all(r < need for r, k in zip(hit_rate, drafted) if k)

    @staticmethod
    def _update_hit_rate(rate: List[float], hits: List[float], drafted: List[bool]) -> List[float]:
        """Running rate (about the last ten probes) of first drafts the target agreed with."""
        return [0.9 * r + 0.1 * h if k else r for r, h, k in zip(rate, hits, drafted)]

    def _cap_for(self, accepted_ema: float) -> int:
        """Adaptive verify size of a request whose running mean of accepted drafts is
        accepted_ema: all N nodes while drafts keep being accepted, else the smallest verify."""
        return self.tree_sizes[-1] if accepted_ema >= self.grow_at else self._probe_size()

    @staticmethod
    def _truncate(draft: DraftTree, size: int, seq_lens: Tensor) -> DraftTree:
        """The first `size` nodes of every tree (a valid tree: parents come first)."""
        bs, n = draft.tokens.shape
        if size == n:
            return draft
        mask = draft.tree_mask.view(bs, n, n)[:, :size, :size].reshape(-1)  # [B*size*size]
        positions, ridx, nxt, sib = ops.reconstruct_tree_from_mask(mask, seq_lens, size)
        drafts = draft.num_drafts.clamp(max=size - 1) if draft.num_drafts is not None else None
        return DraftTree(draft.tokens[:, :size].contiguous(), mask, positions, ridx, nxt, sib, drafts)

    def _pad(self, draft: DraftTree, bucket: int, seq_lens: Tensor):
        """Bucket-sized verify inputs: padding rows get a root-only tree at position 0."""
        real, n = draft.tokens.shape
        pad = bucket - real
        tokens = torch.cat([draft.tokens, torch.zeros(pad, n, dtype=torch.int64)])  # [B, N]
        star, depth = star_tree(n)  # every padding node is a child of the root
        mask = torch.cat([draft.tree_mask, star.repeat(pad)])  # [B*N*N]
        positions = torch.cat([draft.positions.view(real, n),
                               seq_lens[real:].view(pad, 1) + depth.view(1, n)])  # [B, N]
        linkage = []
        for t in (draft.retrieve_index, draft.retrieve_next_token, draft.retrieve_next_sibling):
            linkage.append(t.to(torch.int64))
        return tokens, mask, positions, linkage

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
        stats = stats if stats is not None else SpeculativeStats()
        sampler = Sampler.for_batch(sampling, len(prompts))
        wants_hidden = getattr(self.proposer, "needs_target_hidden", False)
        captures = self.engine.capture_hidden is not None
        if wants_hidden and not captures:
            raise ValueError(f"{type(self.proposer).__name__} drafts from the target's hidden "
                             "states: make the target Engine with capture_hidden=...")
        out: List[List[int]] = [[] for _ in prompts]
        if max_new_tokens <= 0:
            return out
        steps = self.proposer.num_spec_steps
        if len(stats.accepted_at_depth) < steps - 1:
            stats.accepted_at_depth += [0] * (steps - 1 - len(stats.accepted_at_depth))
        self.engine.bucket_for(len(prompts))  # a batch over max_batch fails before anything
        # The pools' generation scopes: a request still held when this call ends (a cleanup
        # that failed) is a leak KVPool.check_consistent reports.
        pools = {id(p): p for p in (self.engine.pool, _draft_pool(self.proposer)) if p is not None}
        with contextlib.ExitStack() as scopes:
            for pool in pools.values():
                scopes.enter_context(pool.generation())
            return self._generate(prompts, max_new_tokens, eos_token_id, stats, sampler,
                                  wants_hidden, captures, out, _dynamo_counts())

    def _generate(self, prompts, max_new_tokens, eos_token_id, stats, sampler, wants_hidden,
                  captures, out, counts0):
        engine, proposer = self.engine, self.proposer
        n, steps = proposer.num_draft_tokens, proposer.num_spec_steps
        bs = len(prompts)
        bucket = engine.bucket_for(bs)
        graphs0, recompiles0 = counts0
        # The tree needs N positions past the last committed token: reserve them up front.
        requests = engine.pool.admit([len(p) for p in prompts], max_new_tokens + n)
        ids = [r.row for r in requests]
        started = False  # set before start is called: a start that fails midway is finished
        try:
            rows = ids + [engine.pool.padding_row] * (bucket - bs)
            req_rows = torch.tensor(rows, dtype=torch.int64)  # [B]
            t0 = time.perf_counter()
            _, first_logits, prompt_hidden = engine.prefill(prompts, req_rows)  # [B, V]
            first = (sampler.sample(first_logits[:bs]) if sampler is not None
                     else first_logits.argmax(-1))  # [bs]
            stats.prefill_s += time.perf_counter() - t0
            seq_lens = torch.tensor([len(p) for p in prompts] + [1] * (bucket - bs))  # [B] cached
            done = [False] * bs
            for b in range(bs):
                out[b].append(int(first[b]))
                done[b] = max_new_tokens == 1 or out[b][-1] == eos_token_id
            stats.new_tokens += bs
            contexts = [list(p) + [out[b][0]] for b, p in enumerate(prompts)]
            started = True
            if wants_hidden:
                proposer.start(ids, contexts, [prompt_hidden[b, :len(p)] for b, p in enumerate(prompts)])
            else:
                proposer.start(ids, contexts)
            t_loop = time.perf_counter()
            accepted_sum, draft_steps, cooldown, failures = 0.0, 0, 0, 0
            catch_up = True  # the first draft also runs the draft's prompt: not timed
            caps = [n] * bs  # adaptive verify size per request (stays N without adaptive)
            ema = [float(n)] * bs  # running mean of each request's accepted drafts
            probe = self._probe_size()
            hit_rate = [0.5] * bs  # running rate of accepted first drafts at the probe size
            shadow = None  # first drafts of a dropped probe, checked against the decode
            while not all(done):
                for b in range(bs):  # finished requests leave the batch: nothing is written
                    if done[b]:
                        req_rows[b] = engine.pool.padding_row
                t = time.perf_counter()
                if cooldown > 0:  # the gate says decode: do not pay for a draft either
                    size, cooldown = 1, cooldown - 1
                    # The next draft catches up on the tokens decoded meanwhile: a cost of the
                    # cooldown, not of a step's draft, so the gate does not price it.
                    catch_up = True
                else:
                    draft = proposer.propose(ids, seq_lens[:bs])
                    if self._gate_from_costs and not catch_up:  # the gate prices drafts
                        d = time.perf_counter() - t
                        self._draft_s = d if self._draft_s is None else 0.8 * self._draft_s + 0.2 * d
                    catch_up = False
                    offered = (draft.num_drafts.tolist() if draft.num_drafts is not None
                               else [n - 1] * bs)  # before the cut to the adaptive size
                    size = self._size_for(offered, done, caps)
                    drafted = [k > 0 and not d for k, d in zip(offered, done)]
                    if self.adaptive and size == probe and self._drop_probe(hit_rate, drafted):
                        # The probe costs more than its first drafts are worth: decode, and
                        # score the dropped first drafts against the decoded tokens for free.
                        shadow, size = draft.tokens[:, 1].tolist(), 1
                if size > 1:
                    draft = self._truncate(draft, size, seq_lens[:bs])
                    tokens, mask, positions, linkage = self._pad(draft, bucket, seq_lens)
                else:  # the roots alone (each request's last emitted token), no tree to build
                    tokens = torch.tensor([o[-1] for o in out] + [0] * (bucket - bs)).view(bucket, 1)
                t1 = time.perf_counter()
                if size == 1:  # nothing to verify: a plain decode step of the roots
                    predicts, logits, hidden = engine.decode(tokens[:, 0].contiguous(), req_rows,
                                                             seq_lens)
                    hidden = hidden.unsqueeze(1) if captures else None  # [B, 1, k*H]
                    predicts = (sampler.sample(logits[:bs]) if sampler is not None
                                else predicts[:bs])  # [bs]
                    accept_index = torch.arange(bs, dtype=torch.int32).view(bs, 1)  # [bs, 1]
                    stats.decode_steps += 1
                    if shadow is not None:
                        hits = [float(s == p) for s, p in zip(shadow, predicts.tolist())]
                        hit_rate = self._update_hit_rate(hit_rate, hits, drafted)
                        shadow = None
                else:
                    # [B, N] argmax (in the graph), [B, N, V], [B, N, k*H] or None
                    target, logits, hidden = engine.verify(tokens, positions, req_rows, seq_lens,
                                                           mask)
                    if sampler is None:
                        predicts, accept_index, accept_num = ops.verify_tree_greedy(
                            tokens[:bs], *linkage, target[:bs], min(steps, size))
                    else:
                        predicts, accept_index, accept_num = sampler.verify(
                            tokens[:bs], linkage, logits[:bs], min(steps, size),
                            self.tree_sampling)
                    if self.adaptive:
                        # Only drafts the proposer offered in full (more than one node) say
                        # whether full drafts pay; a proposer's own one-node probe does not.
                        accepted = accept_num.tolist()
                        ema = [0.5 * (e + a) if k > 1 else e
                               for e, a, k in zip(ema, accepted, offered)]
                        caps = [self._cap_for(e) for e in ema]
                        if size == probe:
                            hits = [float(a > 0) for a in accepted]
                            hit_rate = self._update_hit_rate(hit_rate, hits, drafted)
                    else:
                        live = torch.tensor([not d for d in done])
                        accepted_sum += float(accept_num[live].float().mean())
                        draft_steps += 1
                        if (draft_steps >= self.gate_min_steps
                                and accepted_sum / draft_steps < self.gate_threshold()):
                            cooldown = min(64, self.backoff_steps << failures)
                            failures += 1
                        else:
                            failures = 0
                t2 = time.perf_counter()
                emitted, paths = self._commit(req_rows, seq_lens, accept_index, predicts, done,
                                              out, max_new_tokens, eos_token_id, stats, size)
                if wants_hidden:
                    proposer.commit(ids, emitted, [hidden[b, paths[b]] for b in range(bs)])
                else:
                    proposer.commit(ids, emitted)
                t3 = time.perf_counter()
                stats.draft_s += t1 - t
                stats.verify_s += t2 - t1
                stats.commit_s += t3 - t2
                stats.verify_steps += 1
                stats.steps_by_size[size] = stats.steps_by_size.get(size, 0) + 1
            stats.decode_s += time.perf_counter() - t_loop
        finally:
            # The target's rows are released even when the proposer's cleanup raises.
            try:
                if started:
                    proposer.finish(ids)
            finally:
                for r in requests:
                    engine.pool.release(r)
        graphs1, recompiles1 = _dynamo_counts()
        stats.graphs += graphs1 - graphs0
        stats.recompiles += recompiles1 - recompiles0
        return out

    def _commit(self, req_rows, seq_lens, accept_index, predicts, done, out, max_new_tokens,
                eos_token_id, stats, n):
        """Emit each live request's accepted tokens + bonus, compact its accepted KV slots to
        the front of its tree positions, and advance seq_len past the root and the accepted
        drafts (their KV is cached now; the bonus becomes the next root). n: tree size.
        Returns (emitted tokens, accepted path as node indices root first) per request."""
        bs = len(out)
        if n > 1:  # a tree of the root alone is already in place: nothing to compact
            tree_start = seq_lens[:bs].clone()  # [bs] row position of each root
            perm = torch.arange(bs * n).view(bs, n)  # [bs, N] flat rows, identity when idle
        emitted: List[List[int]] = [[] for _ in range(bs)]
        local_paths: List[List[int]] = [[] for _ in range(bs)]
        paths = accept_index.tolist()
        flat_predicts = predicts.tolist()
        for b in range(bs):
            if done[b]:
                continue
            path = [i for i in paths[b] if i >= 0]  # flat rows, root first
            tokens = [flat_predicts[i] for i in path]  # accepted drafts, then the bonus
            accepted = len(path) - 1
            stats.request_steps += 1
            stats.accepted_drafts += accepted
            for k in range(accepted):
                stats.accepted_at_depth[k] += 1
            local = [i - b * n for i in path]
            local_paths[b] = local
            if n > 1:
                rest = [i for i in range(n) if i not in set(local)]
                perm[b] = torch.tensor(local + rest) + b * n
            for tok in tokens:
                out[b].append(tok)
                emitted[b].append(tok)
                stats.new_tokens += 1
                if tok == eos_token_id or len(out[b]) >= max_new_tokens:
                    done[b] = True
                    break
            seq_lens[b] += accepted + 1
        # Permute the slots of positions [seq_len, seq_len + N) (before the advance) of every
        # request that took a step; requests that just finished need no compaction.
        stepped = [b for b in range(bs) if emitted[b] and not done[b]] if n > 1 else []
        if stepped:
            idx = torch.tensor(stepped)
            rows = req_rows[idx]
            start = tree_start[idx]
            table = self.engine.pool.req_to_token
            locs = ops.gather_extend_cache_locs(table, rows, start, start + n, len(stepped) * n)
            local_perm = perm[idx] - (idx * n).view(-1, 1) + (torch.arange(len(stepped)) * n).view(-1, 1)
            ops.assign_req_to_token(table, rows, start, start + n, locs[local_perm.flatten()])
        return emitted, local_paths
