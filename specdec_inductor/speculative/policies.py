"""Draft-budget policies: how large a verify each step runs, so that a poor draft does not
cost more than it brings. A policy plans a step from the drafts offered (`plan`) and learns
from what the target accepted (`observe`); per-request state joins and leaves with its
request (`new_request`). Neither policy changes which tokens come out, only the step sizes.

- AdaptiveVerifySize (proposers with `cheap_drafts`, i.e. NGRAM): each request keeps a running
  mean of the drafts it accepted (halved each step, updated only by drafts offered with more
  than one node); while it is below grow_at, the request's drafts are cut to the smallest
  verify size > 1 (the probe), else they keep all N nodes. A probe verify of 2 tokens costs
  about a decode step on a CPU (`benchmarks/bench_spec.py --verify-costs`), so a cut draft is
  a nearly free try. Where the probe costs more (StepCosts.probe_cost, in decode steps), a
  probe runs only while its first drafts are accepted at a rate above probe_cost - 1;
  otherwise the step is a plain decode and the dropped first drafts are scored against the
  decoded tokens, so the rate keeps being measured at no cost.
- AcceptanceGate (other proposers, whose drafting runs a draft model and is not free): when
  the mean of accepted drafts over the batch's draft steps (judged from the min_steps-th on:
  one step's count is mostly noise) falls below threshold(), the next steps are plain decodes
  without drafting, backoff_steps at first and twice as many after each further failed probe
  (at most MAX_REST); a probe that brings the mean back up resets the backoff. The threshold is
  min_accepted, raised (from_costs) to the break-even point of the measured costs,
  verify_cost + draft / decode - 1 accepted drafts per step, at the step's bucket: every row
  of a bucket pays for a verify's N rows, and a verify's extra rows cost more the more rows a
  step already has (the SmolLM2 Q4_1 file with INT8 activations: verify(8) / decode 1.73x at
  batch 1, 4.32x at 4, 5.13x at 16; `benchmarks/bench_quant_e2e.py --step-costs --batches`).
  In a bucket above 1 the mean so far is held against the bucket's break-even before every
  step: below it the step does not draft, and does not probe either (acceptance does not
  depend on the bucket, and a probe there costs several decode steps: the mean is measured at
  bucket 1, where the cooldowns and probes above run). Drafts are priced per step
  and per bucket: the first draft, and the first after a cooldown or a join, catch up on tokens
  the draft model has not seen and are not timed. A proposer that gates its own drafts per
  request (lookup first) has the gate judge from bucket 2 on (judge_from): at bucket 1 its
  request is the batch, and its own gate prices it.
- CostAwareVerifySize (proposers with `cheap_drafts`, opt-in: SpeculativeGenerator's
  cost_aware; the server's lanes): each step of the batch verifies the compiled size (1: a
  plain decode step of the whole batch) with the most expected emitted tokens per second of
  step at the batch's bucket (VerifySizePlanner: step costs per (bucket, size) from
  compile_verify's measurements, refined by the steps' own times). A request's expected
  accepted drafts at a size come from its running rate of first drafts the target agreed
  with (known after every step with a draft, a decode step too: the decoded token is the
  target's) as a chain (rate + rate^2 + ... to the depth of its draft cut to that size), or,
  at a size above 2 it verified, from the running mean of what it accepted there with a
  draft as deep (pulled back towards the chain estimate while that size is not run, so a
  size that stopped paying is tried again once first drafts hit again). Under concurrency a
  verify's rows grow with the bucket, and where the drafts do not pay for them every step
  is a plain decode; while no verify comes near paying, steps rest from drafting too (1, 2,
  4, ... at most 8 between drafted steps), so speculation then costs little more than plain
  decoding.
- StartPolicy (wraps either; opt-in): when a request starts paying for full drafts. After an
  admission the first plain_steps steps are plain decodes. Then, while a request has fewer
  than probe_hits accepted first drafts, its drafts are cut to the probe size (the smallest
  compiled verify size > 1, about a decode step): a draft model's full tree verify costs more
  than a decode step, and a short answer ends before the acceptance gate (min_steps full
  drafts) can judge it. When every probing request has missed probe_misses first drafts in a
  row, the next backoff_steps steps are plain decodes (twice as many after each further such
  round, at most MAX_REST). Probe steps are not shown to the inner policy, whose rules judge full
  drafts.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from specdec_inductor.speculative.tree import DraftTree


MAX_REST = 64  # the longest rest from drafting after failed probes, in steps


def fails_to_pay(accepted_sum: float, steps: int, min_steps: int, threshold: float) -> bool:
    """Whether drafts judged so far do not pay: from the min_steps-th draft step on (one step's
    count is mostly noise), a mean of accepted drafts per step below threshold."""
    return steps >= min_steps and accepted_sum / steps < threshold


def rest_after(first_rest: int, failures: int) -> int:
    """Steps without drafting after the (failures + 1)-th failed probe in a row: first_rest,
    twice as many after each further one, at most MAX_REST."""
    return min(MAX_REST, first_rest << failures)


@dataclass
class StepCosts:
    """Step costs the policies weigh drafts against (measured by
    SpeculativeGenerator.compile_verify on a compiled engine; unknown until then)."""
    decode_s: Optional[float] = None  # a plain decode step's seconds
    verify_cost: Optional[float] = None  # verify(N) / decode step
    probe_cost: float = 1.0  # probe-size verify / decode step (1.0: free, until measured)
    # (bucket, tree size) -> seconds of a greedy step program (compile_verify; the
    # cost-aware policy refines them online)
    step_s: Dict[Tuple[int, int], float] = field(default_factory=dict)
    # bucket -> (verify(N) / decode step, a decode step's seconds) at that bucket, where
    # compile_verify measured it (decode_s and verify_cost: the bucket it measured last)
    by_bucket: Dict[int, Tuple[float, float]] = field(default_factory=dict)
    # bucket -> running mean of a priced draft's seconds at that bucket
    draft_s_at: Dict[int, float] = field(default_factory=dict)

    @property
    def draft_s(self) -> Optional[float]:
        """Running mean of a priced draft's seconds at bucket 1."""
        return self.draft_s_at.get(1)

    @draft_s.setter
    def draft_s(self, value: Optional[float]) -> None:
        if value is None:
            self.draft_s_at.pop(1, None)
        else:
            self.draft_s_at[1] = value

    def at(self, bucket: int) -> Tuple[Optional[float], Optional[float]]:
        """(verify(N) / decode step, a decode step's seconds) at a bucket: as measured there,
        else verify_cost and decode_s."""
        return self.by_bucket.get(bucket, (self.verify_cost, self.decode_s))

    def draft_price(self, bucket: int) -> Optional[float]:
        """The running mean of a draft's seconds at a bucket; where none was priced yet,
        bucket 1's (a draft of more rows costs no less)."""
        return self.draft_s_at.get(bucket, self.draft_s_at.get(1))

    def draft_in_step(self, step_s: float, bucket: int = 1) -> Optional[float]:
        """The draft's seconds in a step of `bucket` that drafted inside its verify program
        (step_s seconds): what it took beyond a verify(N) there; None until the costs are
        measured."""
        verify_cost, decode_s = self.at(bucket)
        if verify_cost is None or decode_s is None:
            return None
        return max(0.0, step_s - verify_cost * decode_s)


# A priced draft counts at most this many times the running mean: drafts timed far above the
# rest (preempted, or a graph's first run) held the mean, and the break-even with it, above
# what drafts cost for the rest of a prompt, resting drafts that paid (bench_styles printed a
# gate threshold of 16 accepted drafts a step on one prompt; docs/decisions.md).
DRAFT_S_OUTLIER = 3.0


def running_draft_s(mean: Optional[float], seconds: float) -> float:
    """The running mean of a priced draft's seconds after one more draft (counted at most
    DRAFT_S_OUTLIER times the mean)."""
    if mean is None:
        return seconds
    return 0.8 * mean + 0.2 * min(seconds, DRAFT_S_OUTLIER * mean)


def break_even(floor: float, costs: StepCosts, draft_s: Optional[float],
               bucket: int = 1) -> float:
    """Accepted drafts per step below which a step of `bucket` that drafts (draft_s seconds)
    and verifies N nodes brings fewer tokens than plain decode steps in its time, verify_cost
    + draft_s / decode_s - 1 at that bucket (StepCosts.at), and at least `floor`; the floor
    alone while a cost is not measured yet."""
    verify_cost, decode_s = costs.at(bucket)
    if verify_cost is None or decode_s is None or draft_s is None:
        return floor
    return max(floor, verify_cost + draft_s / decode_s - 1.0)


@dataclass
class StepPlan:
    """One step's decision: verify `size` nodes per request (1: a plain decode step)."""
    size: int
    offered: List[int] = field(default_factory=list)  # real drafts per request before any cut
    drafted: List[bool] = field(default_factory=list)  # live requests that had a draft
    # Each request's first draft, scored in observe against the first token the step emits
    # (the target's answer to it, whatever the size): set by AdaptiveVerifySize when it drops a
    # probe for a decode step, by CostAwareVerifySize on every step with drafts.
    first_drafts: Optional[List[int]] = None


NO_DRAFT = StepPlan(1)


class DraftPolicy:
    """Every draft verified whole, at the smallest compiled size that holds the largest.
    Subclasses cut or skip drafts; the lists they get are in the batch's request order."""

    # Whether plan reads nothing of the draft but what each request offers: the loop may then
    # plan before drafting and, for full trees, draft inside the step program.
    plans_before_draft = True

    def __init__(self, tree_sizes: Sequence[int]):
        self.tree_sizes = sorted(tree_sizes)

    def new_request(self):
        """A joining request's policy state."""
        return None

    def admitted(self) -> None:
        """Requests joined the batch (their first draft catches up on their prompt)."""

    def wants_draft(self, bucket: int = 1) -> bool:
        """Whether the next step (of `bucket` rows) drafts at all (asked before the proposer
        runs)."""
        return True

    def drafted(self, seconds: float) -> None:
        """The proposer took `seconds` to draft this step."""

    def plan(self, offered: List[int], live: List[bool], states: list,
             draft: DraftTree, bucket: int = 1) -> StepPlan:
        """This step's verify size from the drafts each request offered; bucket: the rows
        the step runs (the batch's bucket)."""
        return StepPlan(self.size_for(offered, live, [self.tree_sizes[-1]] * len(offered)),
                        offered, [k > 0 and a for k, a in zip(offered, live)])

    def observe(self, plan: StepPlan, live: List[bool], states: list, accepted: List[int],
                first_tokens: List[int], seconds: Optional[float] = None) -> None:
        """The step's outcome per request: drafts accepted, and the first token emitted;
        seconds: the step's target pass, acceptance and commit (None: not timed)."""

    def size_for(self, offered: List[int], live: List[bool], caps: List[int]) -> int:
        """The smallest compiled size that holds every live request's draft (offered: its
        real drafts), each cut to its cap."""
        need = max((min(1 + k, c) for k, c, a in zip(offered, caps, live) if a), default=1)
        return next(s for s in self.tree_sizes if s >= need)


class AcceptanceGate(DraftPolicy):
    """Plain decode steps without drafting while drafts do not pay (module docstring).
    judge_from: the smallest bucket the gate judges (below it every draft is verified)."""

    def __init__(self, tree_sizes: Sequence[int], costs: StepCosts, min_accepted: float,
                 from_costs: bool, backoff_steps: int = 4, min_steps: int = 4,
                 judge_from: int = 1):
        super().__init__(tree_sizes)
        self.costs, self.min_accepted, self.from_costs = costs, min_accepted, from_costs
        self.backoff_steps, self.min_steps, self.judge_from = backoff_steps, min_steps, judge_from
        self.accepted_sum, self.draft_steps, self.cooldown, self.failures = 0.0, 0, 0, 0
        self.catch_up = True  # the first draft also runs the draft's prompt: not timed
        self.bucket = 1  # the bucket of the step asked about last (wants_draft)

    @staticmethod
    def threshold_for(min_accepted: float, from_costs: bool, costs: StepCosts,
                      bucket: int = 1) -> float:
        if not from_costs:
            return min_accepted
        return break_even(min_accepted, costs, costs.draft_price(bucket), bucket)

    def threshold(self, bucket: int = 1) -> float:
        """Accepted drafts per verify step of `bucket` below which drafting switches off."""
        return self.threshold_for(self.min_accepted, self.from_costs, self.costs, bucket)

    def admitted(self) -> None:
        self.catch_up = True

    def _fails(self, bucket: int) -> bool:
        return fails_to_pay(self.accepted_sum, self.draft_steps, self.min_steps,
                            self.threshold(bucket))

    def wants_draft(self, bucket: int = 1) -> bool:
        self.bucket = bucket
        if bucket < self.judge_from:
            return True
        if self.cooldown > 0 or (bucket > 1 and self._fails(bucket)):
            self.cooldown = max(0, self.cooldown - 1)
            # The next draft catches up on the tokens decoded meanwhile: a cost of the
            # cooldown, not of a step's draft, so it is not priced.
            self.catch_up = True
            return False
        return True

    def drafted(self, seconds: float) -> None:
        if self.from_costs and not self.catch_up:
            prices = self.costs.draft_s_at
            prices[self.bucket] = running_draft_s(prices.get(self.bucket), seconds)
        self.catch_up = False

    def observe(self, plan, live, states, accepted, first_tokens, seconds=None) -> None:
        if plan.size == 1:
            return
        live_accepted = torch.tensor([a for a, x in zip(accepted, live) if x], dtype=torch.float32)
        self.accepted_sum += float(live_accepted.mean())
        self.draft_steps += 1
        if self.bucket != 1 or self.judge_from > 1:  # judged by wants_draft at every step
            return
        if self._fails(1):
            self.cooldown = rest_after(self.backoff_steps, self.failures)
            self.failures += 1
        else:
            self.failures = 0


@dataclass
class _AdaptiveState:
    ema: float  # running mean of the drafts this request accepted
    cap: int  # its verify size
    hit_rate: float = 0.5  # running rate of its first drafts accepted at the probe size


class AdaptiveVerifySize(DraftPolicy):
    """Drafts cut to the probe size while a request's drafts miss (module docstring)."""

    plans_before_draft = False  # the probe rule reads the drafts' first tokens

    def __init__(self, tree_sizes: Sequence[int], costs: StepCosts, grow_at: float = 0.5):
        super().__init__(tree_sizes)
        self.costs, self.grow_at = costs, grow_at
        # The smallest verify size > 1 (where drafts are cut to).
        self.probe = next((s for s in self.tree_sizes if s > 1), self.tree_sizes[-1])

    def new_request(self) -> _AdaptiveState:
        n = self.tree_sizes[-1]
        return _AdaptiveState(float(n), n)

    def cap_for(self, accepted_ema: float) -> int:
        """All N nodes while drafts keep being accepted, else the probe size."""
        return self.tree_sizes[-1] if accepted_ema >= self.grow_at else self.probe

    def plan(self, offered, live, states, draft, bucket=1) -> StepPlan:
        size = self.size_for(offered, live, [s.cap for s in states])
        drafted = [k > 0 and a for k, a in zip(offered, live)]
        if size == self.probe and self._drop_probe(states, drafted):
            return StepPlan(1, offered, drafted, first_drafts=draft.tokens[:, 1].tolist())
        return StepPlan(size, offered, drafted)

    def _drop_probe(self, states, drafted) -> bool:
        """A probe pays when the rate at which its first draft is accepted beats its extra
        cost over a decode step (probe_cost - 1) for some request with a draft."""
        need = self.costs.probe_cost - 1.0
        return all(s.hit_rate < need for s, k in zip(states, drafted) if k)

    @staticmethod
    def _score_probe(states, hits: List[float], drafted: List[bool]) -> None:
        """Running rate (about the last ten probes) of first drafts the target agreed with."""
        for s, h, k in zip(states, hits, drafted):
            if k:
                s.hit_rate = 0.9 * s.hit_rate + 0.1 * h

    def observe(self, plan, live, states, accepted, first_tokens, seconds=None) -> None:
        if plan.first_drafts is not None:  # the dropped probe's first drafts against the decode
            hits = [float(s == t) for s, t in zip(plan.first_drafts, first_tokens)]
            self._score_probe(states, hits, plan.drafted)
            return
        if plan.size == 1:
            return
        # Only drafts the proposer offered in full (more than one node) say whether full
        # drafts pay; a proposer's own one-node probe does not.
        for s, a, k in zip(states, accepted, plan.offered):
            if k > 1:
                s.ema = 0.5 * (s.ema + a)
            s.cap = self.cap_for(s.ema)
        if plan.size == self.probe:
            self._score_probe(states, [float(a > 0) for a in accepted], plan.drafted)



class VerifySizePlanner:
    """The batch-level verify size: among the compiled sizes, the one with the most expected
    emitted tokens per second of step at the step's bucket (ties: the smaller size).

    seconds: (bucket, size) -> seconds of that step (shared: StepCosts.step_s, which
    compile_verify fills); observe refines an entry with each step's own time, a running mean
    whose sample is first clipped to [1/2, 2] times the entry (a step that a busy machine
    stalled moves it by at most `smoothing`). A size whose cost at a bucket is unknown is
    planned before any known one, once, so that it is measured (engines that compile_verify
    does not time: eager ones)."""

    def __init__(self, tree_sizes: Sequence[int],
                 seconds: Optional[Dict[Tuple[int, int], float]] = None,
                 smoothing: float = 0.2):
        self.tree_sizes = sorted(tree_sizes)
        self.seconds = {} if seconds is None else seconds
        self.smoothing = smoothing

    def plan(self, bucket: int, expected: Dict[int, float]) -> int:
        """expected: size -> tokens the step would emit in all (bonus tokens included)."""
        unknown = [z for z in self.tree_sizes if (bucket, z) not in self.seconds]
        if unknown:
            return unknown[0]
        rates = self.rates(bucket, expected)
        return max(self.tree_sizes, key=lambda z: (rates[z], -z))

    def rates(self, bucket: int, expected: Dict[int, float]) -> Dict[int, float]:
        """Expected tokens per second of each size whose cost at the bucket is known."""
        return {z: expected[z] / self.seconds[(bucket, z)] for z in self.tree_sizes
                if (bucket, z) in self.seconds}

    def observe(self, bucket: int, size: int, seconds: float) -> None:
        old = self.seconds.get((bucket, size))
        if old is None:
            self.seconds[(bucket, size)] = seconds
            return
        sample = min(max(seconds, 0.5 * old), 2.0 * old)
        self.seconds[(bucket, size)] = old + self.smoothing * (sample - old)


def chain_accepted(hit_rate: float, depth: int) -> float:
    """Expected accepted drafts of a chain `depth` drafts deep whose drafts are each accepted
    at hit_rate once their parent is: hit_rate + hit_rate^2 + ... + hit_rate^depth."""
    return sum(hit_rate ** d for d in range(1, depth + 1))


@dataclass
class _RateState:
    hit_rate: float  # running rate of its first drafts the target agreed with
    # (size, depth of the cut draft) -> running mean of drafts accepted at that size (> 2)
    accepted: Dict[Tuple[int, int], float] = field(default_factory=dict)


class CostAwareVerifySize(DraftPolicy):
    """The verify size of each step by expected tokens per second (module docstring).

    planner: the batch's VerifySizePlanner; prior_hit: a new request's first-draft hit rate;
    smoothing: weight of a step's outcome in a request's running rates; drift: how far a
    size's running mean moves towards the chain estimate in each step that does not run it.

    Resting: a decode step planned while the best verify was expected to bring less than
    rest_below times the decode's tokens per second is followed by steps without drafting
    (the proposer's lookup and the plan are not free either): 1, then twice as many after
    each further such plan, at most max_rest; a planned verify, or an admission, ends it."""

    plans_before_draft = False  # its plans score the drafts' first tokens

    def __init__(self, tree_sizes: Sequence[int], planner: VerifySizePlanner,
                 prior_hit: float = 0.5, smoothing: float = 0.3, drift: float = 0.05,
                 rest_below: float = 0.8, max_rest: int = 8):
        super().__init__(tree_sizes)
        self.planner, self.prior_hit = planner, prior_hit
        self.smoothing, self.drift = smoothing, drift
        self.rest_below, self.max_rest = rest_below, max_rest
        self.rest, self._next_rest = 0, 1  # steps left without drafting; the next rest's
        self._bucket = 1
        self._depths: List[Dict[int, int]] = []  # the planned step's per-request cut depths

    def admitted(self) -> None:
        self.rest, self._next_rest = 0, 1

    def wants_draft(self, bucket: int = 1) -> bool:
        if self.rest > 0:
            self.rest -= 1
            return False
        return True

    def _rest_after(self, size: int, rates: Dict[int, float]) -> None:
        """Start a rest after a decode plan whose best verify was far from paying."""
        if size > 1:
            self._next_rest = 1
            return
        verifies = [r for z, r in rates.items() if z > 1]
        if 1 in rates and verifies and max(verifies) < self.rest_below * rates[1]:
            self.rest, self._next_rest = self._next_rest, min(self.max_rest,
                                                               2 * self._next_rest)

    def new_request(self) -> _RateState:
        return _RateState(self.prior_hit)

    def cut_depths(self, offered: List[int], draft: DraftTree) -> List[Dict[int, int]]:
        """Per request: size -> depth of its draft cut to that size (0: no draft). Nodes are
        numbered parents first, so the cut keeps the first min(size, 1 + offered) nodes."""
        bs, n = draft.tokens.shape
        positions = draft.positions.view(bs, n)  # seq_len + depth; the root's is seq_len
        deepest = (positions - positions[:, :1]).cummax(dim=1).values.tolist()  # of nodes 0..i
        return [{z: deepest[b][min(z, 1 + k) - 1] for z in self.tree_sizes}
                for b, k in enumerate(offered)]

    def expected(self, state: _RateState, size: int, depth: int) -> float:
        """Accepted drafts a request whose draft is `depth` deep at `size` is expected to
        bring when verified at that size."""
        if depth == 0:
            return 0.0
        return state.accepted.get((size, depth), chain_accepted(state.hit_rate, depth))

    def plan(self, offered, live, states, draft, bucket=1) -> StepPlan:
        self._bucket = bucket
        self._depths = self.cut_depths(offered, draft)
        rows = [(st, d) for st, d, a in zip(states, self._depths, live) if a]
        expected = {z: sum(1.0 + self.expected(st, z, d[z]) for st, d in rows)
                    for z in self.tree_sizes}
        drafted = [k > 0 and a for k, a in zip(offered, live)]
        size = self.planner.plan(bucket, expected)
        self._rest_after(size, self.planner.rates(bucket, expected))
        return StepPlan(size, offered, drafted,
                        first_drafts=draft.tokens[:, 1].tolist() if draft.tokens.shape[1] > 1
                        else None)

    def observe(self, plan, live, states, accepted, first_tokens, seconds=None) -> None:
        if seconds is not None:
            self.planner.observe(self._bucket, plan.size, seconds)
        if plan.first_drafts is None:
            return
        w = self.smoothing
        for st, d, k, a, first, token in zip(states, self._depths, plan.drafted, accepted,
                                             plan.first_drafts, first_tokens):
            if not k:
                continue
            for z in self.tree_sizes:
                if z <= 2 or d[z] == 0:
                    continue
                key, chain = (z, d[z]), chain_accepted(st.hit_rate, d[z])
                if z == plan.size:  # from what the plan expected
                    mean = st.accepted.get(key, chain)
                    st.accepted[key] = mean + w * (a - mean)
                elif key in st.accepted:
                    st.accepted[key] += self.drift * (chain - st.accepted[key])
            # Whatever the size, the first emitted token is the target's answer to the
            # first draft: the outcome a verify of size 2 would have had.
            st.hit_rate += w * (float(first == token) - st.hit_rate)


@dataclass
class _StartState:
    inner: object  # the inner policy's state of the request
    hits: int = 0  # first drafts the target accepted so far
    probes: int = 0  # probe steps so far
    misses: int = 0  # probes in a row whose first draft the target rejected


class StartPolicy(DraftPolicy):
    """When a request starts paying for full drafts (module docstring): `inner` (the policy
    the loop would use) behind a start rule."""

    plans_before_draft = False  # probes cut drafts to a smaller size first

    def __init__(self, inner: DraftPolicy, plain_steps: int = 0, probe_hits: int = 1,
                 probe_misses: int = 2, backoff_steps: int = 4):
        super().__init__(inner.tree_sizes)
        for name, value, low in (("plain_steps", plain_steps, 0), ("probe_hits", probe_hits, 0),
                                 ("probe_misses", probe_misses, 1),
                                 ("backoff_steps", backoff_steps, 1)):
            if value < low:
                raise ValueError(f"argument '{name}' must be >= {low}, got {value}")
        self.inner, self.plain_steps, self.probe_hits = inner, plain_steps, probe_hits
        self.probe_misses, self.backoff_steps = probe_misses, backoff_steps
        self.cooldown, self.failures = 0, 0  # plain steps left, failed probe rounds so far
        # The smallest verify size > 1: the probe (none when the generator compiled no such
        # size below N: then drafts start whole).
        self.probe = next((z for z in self.tree_sizes if 1 < z < self.tree_sizes[-1]), None)
        self.plain_left = 0
        self.probe_step = False  # whether the step planned last is this policy's probe

    def new_request(self) -> _StartState:
        return _StartState(self.inner.new_request())

    def admitted(self) -> None:
        self.plain_left = self.plain_steps
        self.inner.admitted()

    def wants_draft(self, bucket: int = 1) -> bool:
        if self.plain_left > 0 or self.cooldown > 0:
            self.plain_left, self.cooldown = max(0, self.plain_left - 1), max(0, self.cooldown - 1)
            return False
        return self.inner.wants_draft(bucket)

    def drafted(self, seconds: float) -> None:
        self.inner.drafted(seconds)

    def probing(self, state: _StartState) -> bool:
        return self.probe is not None and state.hits < self.probe_hits

    def plan(self, offered, live, states, draft, bucket=1) -> StepPlan:
        # A batch probes while every live request probes; once one has its hits, full drafts
        # (which still score the others' first drafts).
        probing = [self.probing(s) for s, a in zip(states, live) if a]
        self.probe_step = bool(probing) and all(probing)
        if self.probe_step:
            drafted = [k > 0 and a for k, a in zip(offered, live)]
            return StepPlan(self.size_for(offered, live, [self.probe] * len(offered)), offered,
                            drafted)
        return self.inner.plan(offered, live, [s.inner for s in states], draft, bucket)

    def observe(self, plan, live, states, accepted, first_tokens, seconds=None) -> None:
        probed = [s for s, x in zip(states, live) if x and self.probing(s)]
        if plan.size > 1 and probed:
            for s, a, x in zip(states, accepted, live):
                if x and self.probing(s):
                    s.probes += 1
                    s.misses = 0 if a > 0 else s.misses + 1
                    s.hits += int(a > 0)
            still = [s for s in probed if self.probing(s)]
            if len(still) == sum(live) and all(s.misses >= self.probe_misses for s in still):
                # Every live request probes and missed probe_misses first drafts in a row:
                # plain steps before the next probe, twice as many after each further round.
                self.cooldown = rest_after(self.backoff_steps, self.failures)
                self.failures += 1
                for s in probed:
                    s.misses = 0
            if self.probe_step:
                return  # a probe says nothing about full drafts: the inner policy judges those
        self.inner.observe(plan, live, [s.inner for s in states], accepted, first_tokens,
                           seconds)
