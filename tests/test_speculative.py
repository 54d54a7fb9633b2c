"""The shared speculative loop with the NGRAM proposer: greedy speculative output equals the
same engine's plain greedy output token for token (tiny random models of each family, batch 1
and ragged batches, eager and compiled), edge cases of length and EOS, and a fully free pool
afterwards."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor.engine.engine import Engine  # noqa: E402
from specdec_inductor.proposers.ngram import NgramProposer  # noqa: E402
from specdec_inductor.speculative import Proposer, SpeculativeGenerator, SpeculativeStats  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
FAMILIES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "mistral": transformers.MistralConfig,
}


def tiny_model(family="llama", seed=0):
    torch.manual_seed(seed)
    extra = dict(head_dim=8) if family == "qwen3" else {}
    config = FAMILIES[family](**TINY, **extra)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def repetitive_prompts(count, seed=1, shapes=None):
    """Prompts with repeated phrases, so n-gram drafts are often right (and sometimes wrong);
    prompt i is shaped like prompt i % shapes (default: all differ, growing with i)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(count):
        k = i if shapes is None else i % shapes
        phrase = torch.randint(0, 96, (4 + k,), generator=gen).tolist()
        noise = torch.randint(0, 96, (3 * k + 1,), generator=gen).tolist()
        prompts.append(phrase + noise + phrase + phrase[:2])
    return prompts


def _check(model, prompts, max_new, *, compiled, n=6, eos=None, breadth=(2, 1), tree_sizes=None):
    engine = Engine(model, max_batch=max(1, len(prompts)), max_len=128, compile=compiled,
                    prefill_chunk=16)
    plain = engine.generate(prompts, max_new, eos_token_id=eos)
    stats = SpeculativeStats()
    spec = SpeculativeGenerator(engine, NgramProposer(num_draft_tokens=n, breadth=breadth),
                                tree_sizes=tree_sizes)
    got = spec.generate(prompts, max_new, eos_token_id=eos, stats=stats)
    assert got == plain
    engine.pool.check_consistent()
    assert engine.pool.num_free_slots == engine.pool.num_slots
    return got, stats


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ngram_greedy_equals_plain_greedy_eager(family):
    _, stats = _check(tiny_model(family), repetitive_prompts(1), 40, compiled=False)
    assert stats.verify_steps < 40  # speculation really skipped steps
    # A random model repeats itself, so the n-gram drafts get accepted at depth > 1.
    assert stats.mean_accepted_length > 1.2, stats.summary()


def test_ngram_ragged_batch_ragged_acceptance_eager():
    _, stats = _check(tiny_model("llama", seed=5), repetitive_prompts(5), 30, compiled=False)
    assert stats.request_steps > stats.verify_steps  # several requests per step
    assert 0 < stats.acceptance_by_position[0] < 1  # ragged: some accept, some reject


def test_ngram_compiled_batch_no_recompiles_between_steps():
    model = tiny_model("llama", seed=7)
    _, stats = _check(model, repetitive_prompts(3), 24, compiled=True)
    # One prefill graph, one verify graph for this bucket (and the plain decode graph).
    assert stats.recompiles == 0, stats.summary()


@pytest.mark.parametrize("max_new", [1, 2, 3])
def test_short_generations(max_new):
    _check(tiny_model("llama", seed=2), repetitive_prompts(2), max_new, compiled=False)


def test_eos_inside_an_accepted_run_stops_the_request():
    model = tiny_model("llama", seed=4)
    prompts = repetitive_prompts(2)
    engine = Engine(model, max_batch=2, max_len=128, compile=False, prefill_chunk=16)
    plain = engine.generate(prompts, 30)
    eos = plain[0][6]  # a token that request 0 emits mid-generation
    got, stats = _check(model, prompts, 30, compiled=False, eos=eos)
    assert got[0][-1] == eos and got[0].index(eos) == len(got[0]) - 1 and len(got[0]) < 30
    assert stats.new_tokens == sum(len(o) for o in got)


def test_chain_and_empty_matches():
    model = tiny_model("mistral", seed=6)
    _check(model, repetitive_prompts(2), 20, compiled=False, breadth=(1,))
    # A prompt without repeats: no n-gram match at first, so those steps are plain decodes.
    _, stats = _check(model, [list(range(10, 40))], 12, compiled=False)
    assert stats.decode_steps > 0, stats.summary()


def test_tree_sizes_pick_the_smallest_verify_that_holds_the_drafts():
    _, stats = _check(tiny_model("qwen2", seed=8), repetitive_prompts(3), 30, compiled=False,
                      n=8, tree_sizes=(1, 3, 5))
    assert stats.verify_steps > stats.decode_steps  # some real verify steps ran too
    with pytest.raises(ValueError, match="tree_sizes"):
        SpeculativeGenerator(None, NgramProposer(num_draft_tokens=4), tree_sizes=(0, 4))


class _WrongChainProposer(Proposer):
    """Always drafts a full chain of tokens the target (almost) never picks."""

    num_draft_tokens = 5
    num_spec_steps = 5

    def start(self, request_ids, contexts):
        self.last = {r: c[-1] for r, c in zip(request_ids, contexts)}

    def propose(self, request_ids, seq_lens):
        from specdec_inductor import ops
        from specdec_inductor.speculative import DraftTree
        n, bs = self.num_draft_tokens, len(request_ids)
        tokens = torch.tensor([[self.last[r]] + [95] * (n - 1) for r in request_ids])  # [B, N]
        mask = torch.ones(n, n, dtype=torch.bool).tril().flatten().repeat(bs)  # chains
        positions, ridx, nxt, sib = ops.reconstruct_tree_from_mask(mask, seq_lens, n)
        return DraftTree(tokens, mask, positions, ridx, nxt, sib, torch.full((bs,), n - 1))

    def commit(self, request_ids, emitted):
        for r, e in zip(request_ids, emitted):
            if e:
                self.last[r] = e[-1]

    def finish(self, request_ids):
        pass


def test_acceptance_gate_backs_off_to_decode_and_stays_exact():
    model = tiny_model("llama", seed=9)
    prompts = repetitive_prompts(2)
    engine = Engine(model, max_batch=2, max_len=128, compile=False, prefill_chunk=16)
    plain = engine.generate(prompts, 24)
    gated, ungated = SpeculativeStats(), SpeculativeStats()
    assert SpeculativeGenerator(engine, _WrongChainProposer()).generate(prompts, 24, stats=gated) == plain
    assert SpeculativeGenerator(engine, _WrongChainProposer(), min_accepted=0.0).generate(
        prompts, 24, stats=ungated) == plain
    assert ungated.decode_steps == 0 and gated.decode_steps >= gated.verify_steps // 2, gated.summary()
    assert engine.pool.num_free_slots == engine.pool.num_slots


def test_gated_decode_steps_do_not_call_the_proposer():
    """While the gate forces plain decode steps the (possibly expensive) proposer is not run,
    and the commits it still receives keep it in step."""
    model = tiny_model("llama", seed=9)
    prompts = repetitive_prompts(2)
    engine = Engine(model, max_batch=2, max_len=128, compile=False, prefill_chunk=16)
    proposer = _WrongChainProposer()
    calls = []
    propose = proposer.propose
    proposer.propose = lambda ids, lens: (calls.append(1), propose(ids, lens))[1]
    stats = SpeculativeStats()
    assert SpeculativeGenerator(engine, proposer).generate(prompts, 32, stats=stats) == \
        engine.generate(prompts, 32)
    assert stats.decode_steps > 0
    assert len(calls) == stats.verify_steps - stats.decode_steps, (len(calls), stats.summary())


def test_gate_does_not_probe_in_a_bucket_whose_break_even_the_drafts_miss():
    """Drafts that miss: at bucket 1 the gate that switched drafting off probes again after
    each cooldown; in a batch of 2, whose every row pays for a probe's verify, the mean so far
    (acceptance does not depend on the bucket) keeps the steps from drafting once it has
    judged them (gate_min_steps drafted steps)."""
    model = tiny_model("llama", seed=9)
    prompts = repetitive_prompts(2)
    engine = Engine(model, max_batch=2, max_len=128, compile=False, prefill_chunk=16)
    drafted = {}
    for batch in (prompts[:1], prompts):
        spec = SpeculativeGenerator(engine, _WrongChainProposer())
        stats = SpeculativeStats()
        assert spec.generate(batch, 40, stats=stats) == engine.generate(batch, 40)
        drafted[len(batch)] = stats.verify_steps - stats.decode_steps
    assert drafted == {1: drafted[1], 2: spec.gate_min_steps}, drafted
    assert drafted[1] > spec.gate_min_steps + 1  # the probes after 4 and 8 cooldown steps
    engine.pool.check_consistent()


def test_compile_verify_compiles_every_verify_size_before_the_first_draft():
    torch._dynamo.reset()
    engine = Engine(tiny_model(), max_batch=1, max_len=128, compile=True, prefill_chunk=16)
    spec = SpeculativeGenerator(engine, NgramProposer(num_draft_tokens=6, breadth=(1,)),
                                tree_sizes=(1, 3, 6))
    engine.generate([[5, 6, 7]], 3)  # the prefill graph and the loop's decode program
    (req,) = engine.pool.admit([3], 1)
    engine.decode(torch.tensor([8]), torch.tensor([req.row]), torch.tensor([3]))  # its own graph
    engine.pool.release(req)
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    spec.compile_verify(sampled=False)
    # The greedy verify programs (GreedyStep: verify(3), verify(6), each with its acceptance
    # and commit) and nothing else: the decode program is the one Engine.generate ran (plain
    # decoding is the same loop and step) and the loop's prefill reuses its graph (the public
    # steps hand every graph inference tensors, whatever the caller passed).
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2
    assert spec.probe_cost > 0 and spec.probe_cost != 1.0  # measured: verify(3) vs decode
    assert spec.verify_cost is None  # NGRAM's cheap drafts: the adaptive size, no gate costs
    gated = SpeculativeGenerator(engine, _CostlyScriptedChainProposer([5] * 40, 0.0, _ScriptedClock()))
    gated.compile_verify(sampled=False)  # verify(6) is compiled already: this only measures it
    assert gated.verify_cost is not None and gated.verify_cost > 0 and gated._decode_s > 0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 2
    assert engine.pool.num_free_slots == engine.pool.num_slots  # the scratch request is freed
    # A warm-up that never drafts (no suffix recurs) leaves nothing to compile later.
    assert spec.generate([[1, 2, 3, 4]], 2) is not None
    stats = SpeculativeStats()
    with torch.compiler.set_stance("fail_on_recompile"):
        got = spec.generate(repetitive_prompts(1), 30, stats=stats)
        assert got == engine.generate(repetitive_prompts(1), 30)
        # A caller's own (non-inference) step inputs reach the same graph too.
        (req,) = engine.pool.admit([3], 1)
        engine.prefill([[5, 6, 7]], torch.tensor([req.row]))
        engine.decode(torch.tensor([8]), torch.tensor([req.row]), torch.tensor([3]))
        engine.pool.release(req)
    assert stats.verify_steps > stats.decode_steps  # some steps verified drafts, none compiled
    engine.pool.check_consistent()


class _ScriptedChainProposer(Proposer):
    """Cheap drafts of one request's known greedy continuation: right, except during the
    proposals numbered in `wrong`, whose chains hold tokens the target does not pick."""

    num_draft_tokens = 6
    num_spec_steps = 6
    cheap_drafts = True

    def __init__(self, truth, wrong):
        self.truth, self.wrong, self.calls = truth, set(wrong), 0

    def start(self, request_ids, contexts):
        self.emitted = 1  # the prefill's token

    def propose(self, request_ids, seq_lens):
        from specdec_inductor import ops
        from specdec_inductor.speculative import DraftTree
        n, e = self.num_draft_tokens, self.emitted
        chain = self.truth[e:e + n - 1]
        chain = chain + [0] * (n - 1 - len(chain))
        if self.calls in self.wrong:
            chain = [(t + 1) % 96 for t in chain]
        self.calls += 1
        tokens = torch.tensor([[self.truth[e - 1]] + chain])  # [1, N]
        mask = torch.ones(n, n, dtype=torch.bool).tril().flatten()  # a chain
        positions, ridx, nxt, sib = ops.reconstruct_tree_from_mask(mask, seq_lens, n)
        return DraftTree(tokens, mask, positions, ridx, nxt, sib, torch.tensor([n - 1]))

    def commit(self, request_ids, emitted):
        self.emitted += len(emitted[0])

    def finish(self, request_ids):
        pass


class _ScriptedClock:
    """A step clock that only moves when a proposer spends scripted time (units: decode steps),
    so the gate's prices do not depend on the machine's load."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _CostlyScriptedChainProposer(_ScriptedChainProposer):
    """Right drafts (5 per step) from a proposer that is not cheap: the acceptance gate, not
    the adaptive size, applies; each draft costs `delay` on `clock`."""

    cheap_drafts = False

    def __init__(self, truth, delay, clock):
        super().__init__(truth, wrong=())
        self.delay, self.clock = delay, clock

    def propose(self, request_ids, seq_lens):
        self.clock.now += self.delay
        return super().propose(request_ids, seq_lens)


def test_gate_threshold_follows_measured_costs():
    """With measured costs (compile_verify's verify_cost, the loop's draft timings) the gate
    switches drafting off once drafts cost more than their accepted tokens bring -- even
    drafts that are always right -- and leaves cheap right drafts alone; a threshold given by
    hand (or set later) is used as it is. Costs in decode steps, on a scripted clock."""
    model = tiny_model("llama", seed=4)
    engine = Engine(model, max_batch=1, max_len=128, compile=False, prefill_chunk=16)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    plain = engine.generate(prompt, 40)
    runs = {}
    for name, delay in (("cheap", 0.0), ("costly", 20.0)):
        clock = _ScriptedClock()
        spec = SpeculativeGenerator(engine, _CostlyScriptedChainProposer(plain[0], delay, clock))
        spec.clock = clock
        assert not spec.adaptive and spec.gate_threshold() == spec.min_accepted
        spec.verify_cost, spec._decode_s = 1.2, 1.0  # as compile_verify measures them
        stats = SpeculativeStats()
        assert spec.generate(prompt, 40, stats=stats) == plain
        runs[name] = (spec, stats)
    cheap, costly = runs["cheap"], runs["costly"]
    assert cheap[0].gate_threshold() < 5 and cheap[1].decode_steps == 0, cheap[1].summary()
    assert costly[0].gate_threshold() > 5  # 1.2 + 20 - 1 accepted drafts per step
    assert costly[1].decode_steps > 0, costly[1].summary()
    fixed = SpeculativeGenerator(engine, _CostlyScriptedChainProposer(plain[0], 0.0, _ScriptedClock()),
                                 min_accepted=0.5)
    fixed.verify_cost, fixed._decode_s, fixed._draft_s = 1.2, 1.0, 50.0
    assert fixed.gate_threshold() == 0.5
    costly[0].min_accepted = 0.0  # set by hand: the measured costs no longer raise it
    assert costly[0].gate_threshold() == 0.0
    engine.pool.check_consistent()


class _CatchUpCostProposer(_CostlyScriptedChainProposer):
    """Wrong drafts first (the gate backs off), right ones later; a draft after steps it did
    not draft (a cooldown) pays `catch_up` seconds instead of `delay`, as a draft model
    catching up on the decoded tokens does."""

    def __init__(self, truth, wrong, delay, catch_up, clock):
        super().__init__(truth, delay, clock)
        self.wrong, self.catch_up, self.commits, self.catch_ups = set(wrong), catch_up, 0, 0

    def propose(self, request_ids, seq_lens):
        if self.commits > 1:
            self.catch_ups += 1
            self.clock.now += self.catch_up - self.delay
        self.commits = 0
        return super().propose(request_ids, seq_lens)

    def commit(self, request_ids, emitted):
        self.commits += 1
        super().commit(request_ids, emitted)


def test_gate_does_not_price_the_catch_up_after_a_cooldown():
    """The first draft after a cooldown catches up on the decoded tokens; the gate's draft cost
    is a step's draft, so that one is not timed (else a cooldown would raise the threshold
    and lengthen the next one). Costs in decode steps, on a scripted clock."""
    model = tiny_model("llama", seed=4)
    engine = Engine(model, max_batch=1, max_len=128, compile=False, prefill_chunk=16)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    plain = engine.generate(prompt, 48)
    clock = _ScriptedClock()
    proposer = _CatchUpCostProposer(plain[0], wrong=range(0, 6), delay=0.2, catch_up=30.0,
                                    clock=clock)
    spec = SpeculativeGenerator(engine, proposer)
    spec.clock = clock
    spec.verify_cost, spec._decode_s = 1.2, 1.0  # as compile_verify measures them
    stats = SpeculativeStats()
    assert spec.generate(prompt, 48, stats=stats) == plain
    assert stats.decode_steps > 0 and proposer.catch_ups > 0, stats.summary()
    # Priced drafts cost 0.2 decode steps; one priced catch-up would put the average at >= 6.
    assert spec._draft_s < 3, spec._draft_s
    engine.pool.check_consistent()


class _CompilingProposer(_CostlyScriptedChainProposer):
    """Right drafts costing `delay`, but the `compiling`-th draft compiles a graph (Dynamo's
    count of compiled graphs, `graphs`, grows) and takes `compile_s` instead."""

    def __init__(self, truth, delay, clock, graphs, compiling, compile_s):
        super().__init__(truth, delay, clock)
        self.graphs, self.compiling, self.compile_s, self.drafts = graphs, compiling, compile_s, 0

    def propose(self, request_ids, seq_lens):
        self.drafts += 1
        if self.drafts == self.compiling:
            self.graphs[0] += 1
            self.clock.now += self.compile_s - self.delay
        return super().propose(request_ids, seq_lens)


@pytest.mark.parametrize("compiling", [2, 5])
def test_gate_does_not_price_a_draft_that_compiled_a_graph(monkeypatch, compiling):
    """A draft during which a graph compiled (a draft graph's first run, seconds where drafts
    take milliseconds) is not priced: the first priced draft would seed the running mean, a
    later one lift it, and the gate would rest drafts that pay. Scripted clock and graph
    count; the next drafts are priced again."""
    from specdec_inductor.speculative import loop
    graphs = [0]
    monkeypatch.setattr(loop, "graphs_compiled", lambda: graphs[0])
    model = tiny_model("llama", seed=4)
    engine = Engine(model, max_batch=1, max_len=128, compile=False, prefill_chunk=16)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    plain = engine.generate(prompt, 40)
    clock = _ScriptedClock()
    proposer = _CompilingProposer(plain[0], 0.2, clock, graphs, compiling, compile_s=500.0)
    spec = SpeculativeGenerator(engine, proposer)
    spec.clock = clock
    spec.verify_cost, spec._decode_s = 1.2, 1.0  # as compile_verify measures them
    stats = SpeculativeStats()
    assert spec.generate(prompt, 40, stats=stats) == plain
    assert graphs[0] == 1 and proposer.drafts > compiling
    assert spec._draft_s == pytest.approx(0.2) and stats.decode_steps == 0, stats.summary()
    engine.pool.check_consistent()


def test_adaptive_size_shrinks_verifies_after_misses_and_grows_back():
    """A proposer with cheap drafts gets no acceptance gate: after missing drafts its verifies
    drop to the smallest size (2 tokens, a decode step's cost) instead of plain decodes, and
    the first accepted draft there brings back full trees. Tokens stay the greedy ones."""
    model = tiny_model("llama", seed=4)
    engine = Engine(model, max_batch=1, max_len=128, compile=False, prefill_chunk=16)
    prompt = [[3, 1, 4, 1, 5, 9, 2, 6]]
    plain = engine.generate(prompt, 48)
    proposer = _ScriptedChainProposer(plain[0], wrong=range(2, 10))
    spec = SpeculativeGenerator(engine, proposer)
    assert spec.adaptive and spec.tree_sizes == [1, 2, 6]
    sizes = []
    greedy = spec._greedy  # greedy steps verify in one program (target, acceptance, commit)
    verify = greedy.verify
    greedy.verify = lambda tokens, *a, **k: (sizes.append(tokens.shape[1]), verify(tokens, *a, **k))[1]
    stats = SpeculativeStats()
    assert spec.generate(prompt, 48, stats=stats) == plain
    assert stats.decode_steps == 0, stats.summary()  # every step had a draft: no gate
    # Two full hits; the running mean of accepted drafts then halves through four misses at
    # full size before the drafts are cut to size 2 (four more misses); the first accepted
    # cut draft (proposal 10) grows them back.
    assert sizes[:6] == [6] * 6 and sizes[6:11] == [2] * 5 and sizes[11] == 6, sizes
    assert stats.steps_by_size == {2: sizes.count(2), 6: sizes.count(6)}
    engine.pool.check_consistent()
    assert engine.pool.num_free_slots == engine.pool.num_slots
    # A probe that costs more than a decode step (probe_cost; compile_verify measures it) runs
    # only while first drafts are accepted often enough: the misses turn the cut verifies into
    # plain decodes, and the dropped drafts, scored against the decoded tokens, turn the
    # probes back on once they are right again.
    proposer.calls, priced = 0, SpeculativeStats()
    sizes.clear()
    costly = SpeculativeGenerator(engine, proposer, probe_cost=1.45)
    assert costly.generate(prompt, 48, stats=priced) == plain
    assert priced.decode_steps > 0 and priced.steps_by_size.get(2, 0) < stats.steps_by_size[2]
    assert sizes[-1] == 6, (sizes, priced.summary())  # full drafts came back
    engine.pool.check_consistent()
    # adaptive=False restores the gate: drafts that keep missing turn into plain decode steps
    # (the gate judges the generation's mean, which two early hits would keep above it).
    wrong, gated = _ScriptedChainProposer(plain[0], wrong=range(100)), SpeculativeStats()
    assert SpeculativeGenerator(engine, wrong, adaptive=False).generate(prompt, 48, stats=gated) == plain
    assert gated.decode_steps > 0 and 2 not in gated.steps_by_size, gated.summary()
