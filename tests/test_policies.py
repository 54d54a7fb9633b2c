"""Draft-budget policies (speculative/policies.py) on their own, fed hand-made observations:
the verify size each step gets, when the acceptance gate switches drafting off and back on,
how the adaptive size cuts and regrows drafts, which draft timings the gate prices, and the
cost-aware size's choice from synthetic step costs and acceptance. The
expected decisions are those the loop made before the policies became objects."""
import pytest
import torch

from specdec_inductor.speculative import (AcceptanceGate, AdaptiveVerifySize, DraftPolicy,
                                          DraftTree, StepCosts, StepPlan)
from specdec_inductor.speculative.policies import (CostAwareVerifySize, StartPolicy,
                                                   VerifySizePlanner, chain_accepted)


def _draft(first_tokens):
    """A stand-in draft: only tokens[:, 1] (the first drafts) is read by the policies."""
    tokens = torch.tensor([[0, t, 0] for t in first_tokens])  # [B, 3]
    return DraftTree(tokens, None, None, None, None, None, None)


def _gate(min_accepted=1.0, from_costs=False, costs=None, **kw):
    return AcceptanceGate([1, 6], costs or StepCosts(), min_accepted, from_costs, **kw)


def test_size_is_the_smallest_compiled_size_holding_the_largest_live_draft():
    policy = DraftPolicy([1, 3, 5, 8])
    assert policy.size_for([1, 3], [True, True], [8, 8]) == 5  # 1 + 3 nodes -> 5
    assert policy.size_for([7, 1], [False, True], [8, 8]) == 3  # a done request's draft: ignored
    assert policy.size_for([0, 0], [True, True], [8, 8]) == 1  # nothing drafted: a decode step
    assert policy.size_for([7], [True], [3]) == 3  # cut to the request's cap
    plan = policy.plan([2, 6], [True, True], [None, None], _draft([4, 5]))
    assert (plan.size, plan.drafted) == (8, [True, True])


def test_gate_backs_off_doubling_and_resets_after_a_good_probe():
    gate = _gate(min_accepted=1.0, backoff_steps=4, min_steps=4)
    cooldowns = []
    for step in range(40):
        if not gate.wants_draft():
            cooldowns[-1] += 1
            continue
        accepted = [5] if step >= 30 else [0]  # drafts start being right at step 30
        plan = gate.plan([5], [True], [None], _draft([1]))
        assert plan.size == 6
        gate.observe(plan, [True], [None], accepted, [0])
        cooldowns.append(0)
    # Judged from the 4th draft step on: 4 decode steps, then 8, 16 (each failed probe doubles)
    assert cooldowns[:6] == [0, 0, 0, 4, 8, 16], cooldowns
    gate = _gate(min_accepted=1.0, backoff_steps=4, min_steps=4)
    for accepted in ([0], [0], [0], [0]):  # the mean 0 < 1: back off
        gate.observe(StepPlan(6), [True], [None], accepted, [0])
    assert (gate.cooldown, gate.failures) == (4, 1)
    gate.cooldown = 0
    gate.observe(StepPlan(6), [True], [None], [5], [0])  # the mean 1.0 is back at the threshold
    assert (gate.cooldown, gate.failures) == (0, 0)
    for _ in range(8):  # failed probes: 4, 8, ... at most 64 decode steps
        gate.observe(StepPlan(6), [True], [None], [0], [0])
    assert gate.cooldown == 64


def test_gate_ignores_decode_steps_and_finished_requests():
    gate = _gate(min_accepted=1.0, min_steps=1)
    gate.observe(StepPlan(1), [True], [None], [0], [0])  # a decode step: nothing to judge
    assert gate.draft_steps == 0
    gate.observe(StepPlan(6), [True, False], [None, None], [2, 0], [0, 0])  # done: not counted
    assert (gate.draft_steps, gate.accepted_sum, gate.cooldown) == (1, 2.0, 0)


def test_gate_prices_drafts_but_not_catch_ups():
    costs = StepCosts(decode_s=0.01, verify_cost=1.2)
    gate = _gate(min_accepted=0.1, from_costs=True, costs=costs)
    assert gate.threshold() == 0.1  # no draft priced yet
    gate.drafted(5.0)  # the first draft runs the draft model's prompt: not priced
    assert costs.draft_s is None
    gate.drafted(0.01)
    gate.drafted(0.02)
    assert costs.draft_s == pytest.approx(0.8 * 0.01 + 0.2 * 0.02)
    assert gate.threshold() == pytest.approx(1.2 + costs.draft_s / 0.01 - 1.0)
    gate.cooldown = 1
    assert not gate.wants_draft()  # a cooldown step: the next draft catches up
    gate.drafted(5.0)
    assert costs.draft_s == pytest.approx(0.012)
    gate.admitted()  # a request joined: its first draft runs its prompt
    gate.drafted(5.0)
    assert costs.draft_s == pytest.approx(0.012)
    fixed = _gate(min_accepted=0.5, from_costs=False, costs=costs)
    assert fixed.threshold() == 0.5  # a threshold given by hand is used as it is
    assert AcceptanceGate.threshold_for(3.0, True, costs) == 3.0  # never below min_accepted


def test_gate_prices_each_bucket_by_its_own_costs():
    """The break-even at a bucket reads that bucket's verify(N) / decode and its own drafts'
    running price (bucket 1's until a draft there is priced); a step drafted inside its
    program is priced beyond its bucket's verify."""
    costs = StepCosts(decode_s=0.01, verify_cost=1.5, by_bucket={4: (4.0, 0.012)})
    gate = _gate(min_accepted=0.1, from_costs=True, costs=costs)
    assert gate.wants_draft(1)
    gate.drafted(5.0)  # the first draft catches up: not priced
    gate.wants_draft(1)
    gate.drafted(0.01)
    assert costs.draft_s_at == {1: 0.01}
    assert gate.threshold(1) == pytest.approx(1.5 + 1.0 - 1.0)
    assert gate.threshold(4) == pytest.approx(4.0 + 0.01 / 0.012 - 1.0)  # bucket 1's draft
    gate.wants_draft(4)
    gate.drafted(0.03)
    assert costs.draft_s_at == {1: 0.01, 4: 0.03}
    assert gate.threshold(4) == pytest.approx(4.0 + 0.03 / 0.012 - 1.0)
    assert gate.threshold(2) == pytest.approx(1.5 + 0.01 / 0.01 - 1.0)  # not measured there
    assert costs.draft_in_step(0.06, 4) == pytest.approx(0.06 - 4.0 * 0.012)
    assert costs.draft_in_step(0.02, 1) == pytest.approx(0.02 - 1.5 * 0.01)


def test_gate_does_not_draft_in_a_bucket_whose_break_even_the_mean_misses():
    """A mean of 1.5 accepted drafts pays at bucket 1 (break-even 0.5) and not at bucket 4
    (3.0): steps of bucket 4 neither draft nor probe, and leave the cooldown and backoff as
    they are; back at bucket 1 drafting goes on."""
    costs = StepCosts(decode_s=1.0, verify_cost=1.5, by_bucket={4: (4.0, 1.0)})
    gate = _gate(min_accepted=0.1, from_costs=True, costs=costs, min_steps=4)
    costs.draft_s = 0.0  # drafts priced at nothing: the verify alone sets the break-even
    for _ in range(4):
        assert gate.wants_draft(4)  # fewer than min_steps drafted steps: not judged yet
        gate.observe(StepPlan(6), [True, True], [None, None], [1, 2], [0, 0])
    assert [gate.wants_draft(4) for _ in range(70)] == [False] * 70
    assert (gate.cooldown, gate.failures) == (0, 0)
    assert gate.wants_draft(1) and gate.wants_draft(2)  # bucket 2: bucket 1's costs, 0.5
    gate.observe(StepPlan(6), [True], [None], [1], [0])  # a mean of 7/5 pays at bucket 1
    assert gate.cooldown == 0


def test_a_gate_judging_from_bucket_2_verifies_every_draft_at_bucket_1():
    """judge_from=2 (a proposer that gates its own drafts): at bucket 1 every step drafts and
    no cooldown starts however few drafts the target accepts; the mean so far still judges
    the steps of a larger bucket."""
    costs = StepCosts(decode_s=1.0, verify_cost=1.5, by_bucket={2: (2.0, 1.0)})
    gate = _gate(min_accepted=0.1, from_costs=True, costs=costs, min_steps=2, judge_from=2)
    costs.draft_s = 0.0
    for _ in range(6):
        assert gate.wants_draft(1)
        gate.observe(StepPlan(6), [True], [None], [0], [0])
    assert (gate.cooldown, gate.draft_steps) == (0, 6)
    assert not gate.wants_draft(2)  # a mean of 0 against the break-even 1.0
    for _ in range(6):
        assert gate.wants_draft(1)
        gate.observe(StepPlan(6), [True], [None], [5], [0])
    assert gate.wants_draft(2)  # a mean of 30 / 12 = 2.5 pays there


def test_a_draft_far_slower_than_the_mean_counts_as_a_bounded_outlier():
    """A draft timed far above the running mean counts at most DRAFT_S_OUTLIER times it: it
    nudges the break-even, it does not hold it up for dozens of drafts."""
    from specdec_inductor.speculative.policies import DRAFT_S_OUTLIER, running_draft_s
    assert running_draft_s(None, 0.5) == 0.5  # the first priced draft is the mean
    assert running_draft_s(0.01, 0.02) == pytest.approx(0.8 * 0.01 + 0.2 * 0.02)
    assert running_draft_s(0.01, 0.16) == pytest.approx(0.8 * 0.01 + 0.2 * DRAFT_S_OUTLIER * 0.01)
    mean = 0.01
    for seconds in [0.16] + [0.01] * 5:
        mean = running_draft_s(mean, seconds)
    assert mean < 0.0125  # five ordinary drafts later, within 25% of them


def test_adaptive_size_cuts_after_four_misses_and_regrows_on_a_hit():
    policy = AdaptiveVerifySize([1, 2, 6], StepCosts(), grow_at=0.5)
    state = policy.new_request()
    assert (state.ema, state.cap, policy.probe) == (6.0, 6, 2)
    sizes = []
    for accepted in (5, 5, 0, 0, 0, 0, 0, 0, 1):
        plan = policy.plan([5], [True], [state], _draft([7]))
        sizes.append(plan.size)
        policy.observe(plan, [True], [state], [min(accepted, plan.size - 1)], [7])
    # ema 6 -> 5.5 -> 5.25 -> 2.6 -> 1.3 -> 0.66 -> 0.33 (cut) -> 0.16 -> 0.08 -> 0.54 (grows)
    assert sizes == [6, 6, 6, 6, 6, 6, 2, 2, 2], sizes
    assert state.cap == 6
    # A draft the proposer offered as one node does not move the running mean.
    before = state.ema
    policy.observe(policy.plan([1], [True], [state], _draft([7])), [True], [state], [0], [7])
    assert state.ema == before


def test_adaptive_probe_turns_into_a_decode_while_first_drafts_miss():
    costs = StepCosts(probe_cost=1.45)  # a probe pays above a 0.45 hit rate
    policy = AdaptiveVerifySize([1, 2, 6], costs)
    state = policy.new_request()
    state.ema, state.cap = 0.0, 2  # cut to the probe
    plan = policy.plan([5], [True], [state], _draft([7]))
    assert plan.size == 2  # the hit rate starts at 0.5
    policy.observe(plan, [True], [state], [0], [3])  # a miss: 0.45
    policy.observe(policy.plan([5], [True], [state], _draft([7])), [True], [state], [0], [3])
    assert state.hit_rate == pytest.approx(0.405)
    plan = policy.plan([5], [True], [state], _draft([7]))
    assert (plan.size, plan.first_drafts) == (1, [7])  # dropped: a decode step, the draft kept aside
    policy.observe(plan, [True], [state], [0], [7])  # the decoded token equals the first draft
    assert state.hit_rate == pytest.approx(0.9 * 0.405 + 0.1)
    assert policy.plan([5], [True], [state], _draft([7])).size == 2  # probing again
    # A request without a draft is not scored.
    other = policy.new_request()
    policy.observe(StepPlan(2, [5, 0], [True, False]), [True, True], [state, other], [1, 0], [0, 0])
    assert other.hit_rate == 0.5


def _start(sizes=(1, 2, 8), **kw):
    inner = AcceptanceGate(list(sizes), StepCosts(), 1.0, False, backoff_steps=4, min_steps=4)
    return StartPolicy(inner, **kw), inner


def _run_step(policy, states, accepted, offered=7):
    """One loop step of a batch of len(states) live requests; the plan's size (1: no draft)."""
    if not policy.wants_draft():
        plan = StepPlan(1)
    else:
        plan = policy.plan([offered] * len(states), [True] * len(states), states,
                           _draft([1] * len(states)))
    policy.observe(plan, [True] * len(states), states, accepted if plan.size > 1 else
                   [0] * len(states), [0] * len(states))
    return plan.size


def test_start_policy_plain_steps_after_each_admission():
    policy, _ = _start(plain_steps=3, probe_hits=0)
    policy.admitted()
    states = [policy.new_request()]
    assert [_run_step(policy, states, [5]) for _ in range(5)] == [1, 1, 1, 8, 8]
    policy.admitted()  # a new request joins: plain steps again
    assert [_run_step(policy, states, [5]) for _ in range(4)] == [1, 1, 1, 8]


def test_start_policy_probes_until_a_first_draft_is_accepted():
    policy, gate = _start(probe_hits=1, probe_misses=3)
    policy.admitted()
    states = [policy.new_request()]
    assert _run_step(policy, states, [0]) == 2  # a probe: the first draft only
    assert _run_step(policy, states, [1]) == 2  # accepted: probing ends
    assert gate.draft_steps == 0  # probes are not the gate's to judge
    assert _run_step(policy, states, [3]) == 8  # full drafts, judged by the gate
    assert gate.draft_steps == 1 and states[0].hits == 1 and states[0].probes == 2


def test_start_policy_backs_off_after_missed_probes_and_doubles():
    policy, gate = _start(probe_hits=1, probe_misses=2, backoff_steps=4)
    policy.admitted()
    states = [policy.new_request()]
    sizes = [_run_step(policy, states, [0]) for _ in range(2 + 4 + 2 + 8 + 1)]
    assert sizes == [2, 2] + [1] * 4 + [2, 2] + [1] * 8 + [2]
    assert gate.draft_steps == 0 and policy.failures == 2
    # a batch probes while every live request probes; once one has its hit, full drafts,
    # which score the other's first drafts; backing off needs every live request missing
    policy, gate = _start(probe_hits=1, probe_misses=2)
    policy.admitted()
    states = [policy.new_request(), policy.new_request()]
    assert _run_step(policy, states, [0, 0]) == 2
    assert _run_step(policy, states, [1, 0]) == 2 and policy.cooldown == 0  # request 1 missed 2
    assert [_run_step(policy, states, [0, 0]) for _ in range(3)] == [8] * 3
    assert policy.cooldown == 0 and gate.draft_steps == 3 and states[1].probes == 5
    assert _run_step(policy, states, [0, 1]) == 8 and not policy.probing(states[1])


def test_start_policy_without_a_probe_size_starts_whole_and_refuses_bad_arguments():
    policy, gate = _start(sizes=(1, 8))
    policy.admitted()
    states = [policy.new_request()]
    assert _run_step(policy, states, [0]) == 8 and gate.draft_steps == 1
    for name in ("plain_steps", "probe_hits", "probe_misses", "backoff_steps"):
        with pytest.raises(ValueError, match=f"'{name}'"):
            _start(**{name: -1})


def test_start_policy_shows_the_inner_policys_own_probe_sized_steps_to_it():
    inner = AdaptiveVerifySize([1, 2, 8], StepCosts(probe_cost=1.0))
    policy = StartPolicy(inner, probe_hits=1)
    policy.admitted()
    states = [policy.new_request()]
    assert _run_step(policy, states, [1]) == 2  # the start probe hits: not shown to the inner
    assert states[0].inner.ema == 8.0
    states[0].inner.cap = 2  # the adaptive size cut this request's drafts to its probe size
    plan = policy.plan([7], [True], states, _draft([1]))
    assert plan.size == 2 and not policy.probe_step
    policy.observe(plan, [True], states, [1], [0])
    assert states[0].inner.hit_rate > 0.5  # the inner policy scored its own probe


# -- the cost-aware verify size (VerifySizePlanner, CostAwareVerifySize) ----------------------

def _costs(bucket, **by_size):
    """{(bucket, size): seconds} from size=seconds keywords (s1=..., s2=..., s8=...)."""
    return {(bucket, int(k[1:])): v for k, v in by_size.items()}


def test_planner_picks_the_most_tokens_per_second_at_the_bucket():
    seconds = {**_costs(1, s1=1.0, s2=1.1, s8=1.6), **_costs(16, s1=4.0, s2=7.0, s8=29.0)}
    planner = VerifySizePlanner([1, 2, 8], seconds)
    # One request: 1 token for a decode, 1.5 for verify(2), 3 for verify(8).
    assert planner.plan(1, {1: 1.0, 2: 1.5, 8: 3.0}) == 8  # 1.875 tokens/s beats 1.36 and 1
    assert planner.plan(1, {1: 1.0, 2: 1.5, 8: 1.7}) == 2  # 1.36 beats 1.06
    assert planner.plan(1, {1: 1.0, 2: 1.05, 8: 1.5}) == 1  # 1 beats 0.95 and 0.94
    # Sixteen requests with the same drafts: verify rows cost more at bucket 16.
    assert planner.plan(16, {1: 16.0, 2: 24.0, 8: 48.0}) == 1  # 4 tokens/s beats 3.4 and 1.7
    assert planner.plan(16, {1: 16.0, 2: 30.0, 8: 48.0}) == 2  # 4.3 beats 4
    assert planner.plan(1, {1: 1.0, 2: 1.1, 8: 1.6}) == 1  # ties: the smaller size


def test_planner_measures_an_unknown_size_first_and_learns_costs_online():
    planner = VerifySizePlanner([1, 2, 8], _costs(4, s1=1.0, s8=2.0))
    assert planner.plan(4, {1: 4.0, 2: 4.0, 8: 20.0}) == 2  # verify(2) at bucket 4: untimed
    planner.observe(4, 2, 1.2)
    assert planner.seconds[(4, 2)] == 1.2  # a first time is taken as it is
    assert planner.plan(4, {1: 4.0, 2: 4.0, 8: 20.0}) == 8
    planner.observe(4, 8, 2.5)  # a running mean: 2.0 + 0.2 * 0.5
    assert planner.seconds[(4, 8)] == pytest.approx(2.1)
    planner.observe(4, 8, 100.0)  # a stalled step moves it by at most 0.2 * (2 * old - old)
    assert planner.seconds[(4, 8)] == pytest.approx(2.1 + 0.2 * 2.1)
    for _ in range(40):  # verify(8) became expensive: its running mean follows
        planner.observe(4, 8, 12.0)
    assert planner.seconds[(4, 8)] == pytest.approx(12.0, rel=0.01)
    assert planner.plan(4, {1: 4.0, 2: 4.0, 8: 20.0}) == 1
    assert planner.plan(2, {1: 2.0, 2: 2.0, 8: 2.0}) == 1  # bucket 2: nothing known, decode first


def _chain_draft(first_tokens, depth, n=8):
    """Drafts whose first `depth` nodes after the root form a chain and the rest are children
    of the root (a breadth of 1 then n - 1 - depth leaves), with positions seq_len + depth."""
    bs = len(first_tokens)
    tokens = torch.zeros(bs, n, dtype=torch.int64)
    tokens[:, 1] = torch.tensor(first_tokens)
    node_depth = [0] + list(range(1, depth + 1)) + [1] * (n - 1 - depth)
    positions = (torch.tensor(node_depth) + 100).repeat(bs)  # [B*N], seq_len 100
    return DraftTree(tokens, None, positions, None, None, None, None)


def test_cost_aware_policy_weighs_each_requests_hit_rate_against_the_bucket_costs():
    seconds = {**_costs(1, s1=1.0, s2=1.1, s8=1.6), **_costs(4, s1=1.5, s2=2.4, s8=7.0)}
    policy = CostAwareVerifySize([1, 2, 8], VerifySizePlanner([1, 2, 8], seconds))
    state = policy.new_request()
    assert state.hit_rate == 0.5
    draft = _chain_draft([7], depth=3)
    assert policy.cut_depths([7], draft) == [{1: 0, 2: 1, 8: 3}]
    assert policy.cut_depths([1], draft) == [{1: 0, 2: 1, 8: 1}]  # one real draft: 1 deep
    assert policy.cut_depths([0], draft) == [{1: 0, 2: 0, 8: 0}]
    # Expected tokens at bucket 1: decode 1, verify(2) 1.5, verify(8) 1 + .5 + .25 + .125:
    # per second 1, 1.36, 1.17.
    assert policy.plan([7], [True], [state], draft, bucket=1).size == 2
    # First drafts that keep missing: the rate falls, and the planner turns to plain decodes.
    for _ in range(6):
        plan = policy.plan([7], [True], [state], draft, bucket=1)
        policy.observe(plan, [True], [state], [0], [3])
    assert state.hit_rate < 0.1
    assert policy.plan([7], [True], [state], draft, bucket=1).size == 1
    # A decode step still scores the first draft: hits bring the verifies back.
    for _ in range(6):
        plan = policy.plan([7], [True], [state], draft, bucket=1)
        policy.observe(plan, [True], [state], [plan.size > 1 and 3 or 0], [7])
    assert state.hit_rate > 0.8  # verify(8): 1 + .8 + .64 + .51 tokens per 1.6 s beat 1.8 per 1.1
    assert policy.plan([7], [True], [state], draft, bucket=1).size == 8


def test_cost_aware_policy_decodes_a_bucket_whose_verify_rows_do_not_pay():
    seconds = {**_costs(1, s1=1.0, s2=1.1, s8=1.6), **_costs(4, s1=1.5, s2=2.4, s8=7.0)}
    policy = CostAwareVerifySize([1, 2, 8], VerifySizePlanner([1, 2, 8], seconds))
    states = [policy.new_request() for _ in range(4)]
    for st in states:
        st.hit_rate = 0.4
    draft = _chain_draft([7] * 4, depth=3)
    assert policy.plan([7], [True], states[:1], _chain_draft([7], 3), bucket=1).size == 2
    # Four requests at bucket 4: 4 tokens / 1.5 beats 5.6 / 2.4 and 6.5 / 7.
    assert policy.plan([7] * 4, [True] * 4, states, draft, bucket=4).size == 1
    # Requests that are done, or offered no draft, bring no drafts.
    for st in states:
        st.hit_rate = 0.9
    assert policy.plan([7] * 4, [True] * 4, states, draft, bucket=4).size == 2
    assert policy.plan([0, 0, 0, 7], [True] * 4, states, draft, bucket=4).size == 1
    # Three done: 1.9 tokens / 2.4 s beat 1 / 1.5 (their rows are padding either way).
    assert policy.plan([7] * 4, [False, False, False, True], states, draft, bucket=4).size == 2


def test_cost_aware_policy_learns_what_a_size_brings_and_drifts_back_to_the_chain():
    seconds = _costs(1, s1=1.0, s2=1.1, s8=1.6)
    policy = CostAwareVerifySize([1, 2, 8], VerifySizePlanner([1, 2, 8], seconds))
    state = policy.new_request()
    state.hit_rate = 0.8  # verify(8): 2.95 tokens per 1.6 s beat 1.8 per 1.1
    draft = _chain_draft([7], depth=3)
    plan = policy.plan([7], [True], [state], draft, bucket=1)
    assert plan.size == 8
    policy.observe(plan, [True], [state], [3], [7], seconds=1.6)  # all three accepted
    # The running mean of verify(8) with a 3-deep draft starts at the chain estimate the
    # plan used (.8 + .64 + .512) and moves 0.3 towards 3; the hit rate 0.3 towards 1.
    assert state.accepted[(8, 3)] == pytest.approx(1.952 + 0.3 * (3 - 1.952))
    assert state.hit_rate == pytest.approx(0.86)
    assert policy.expected(state, 8, 3) == state.accepted[(8, 3)]
    assert policy.expected(state, 8, 2) == pytest.approx(state.hit_rate + state.hit_rate ** 2)
    before = state.accepted[(8, 3)]
    state.hit_rate = 0.0  # (as if first drafts had missed)
    policy.observe(StepPlan(1, [7], [True], first_drafts=[7]), [True], [state], [0], [3])
    assert state.accepted[(8, 3)] == pytest.approx(before * 0.95)  # drift towards 0


def test_chain_accepted():
    assert chain_accepted(0.5, 0) == 0.0
    assert chain_accepted(0.5, 3) == pytest.approx(0.875)
    assert chain_accepted(1.0, 7) == 7.0


def test_cost_aware_policy_rests_from_drafting_while_no_verify_comes_near_paying():
    seconds = _costs(1, s1=1.0, s2=1.5, s8=3.0)
    policy = CostAwareVerifySize([1, 2, 8], VerifySizePlanner([1, 2, 8], seconds))
    state = policy.new_request()
    draft = _chain_draft([7], depth=3)

    def run(steps, hit):
        """Steps of the loop (wants_draft, then plan and observe when drafting); returns
        which ones drafted."""
        drafted = []
        for _ in range(steps):
            drafted.append(policy.wants_draft())
            if drafted[-1]:
                plan = policy.plan([7], [True], [state], draft, bucket=1)
                policy.observe(plan, [True], [state], [0], [7 if hit else 3])
        return drafted

    state.hit_rate = 0.1  # verify(2): 1.1 tokens / 1.5 s = 0.73 of a decode's rate: rest
    assert run(16, hit=False) == [True, False, True] + [False] * 2 + [True] + [False] * 4 + [
        True] + [False] * 5
    state.hit_rate = 0.3  # 1.3 / 1.5 = 0.87 >= 0.8: a decode, but no rest after it
    policy.rest = 0
    assert run(3, hit=False) == [True, True, True] and state.hit_rate < 0.3
    policy.admitted()  # a new request: drafting at once, the rests start at 1 again
    state.hit_rate = 0.1
    assert run(4, hit=False) == [True, False, True, False]
    state.hit_rate = 1.0  # the drafts hit: verifies, no rest
    policy.rest = 0
    assert run(3, hit=True) == [True, True, True]
