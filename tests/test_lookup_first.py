"""Prompt lookup in front of a draft model (proposers/lookup_first.py): per request and step,
a long context repeat drafts its continuation, else the draft model drafts; greedy output stays
plain greedy whichever drafted, both proposers' state stays in step, nothing leaks."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor.proposers.lookup_first import LookupFirstProposer  # noqa: E402
from specdec_inductor.proposers.ngram import NgramProposer  # noqa: E402
from specdec_inductor.proposers.registry import (  # noqa: E402
    ProposerConfig, ProposerConfigError, make_proposer, make_target_engine)
from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats  # noqa: E402
from specdec_inductor.speculative.tree import DraftTree  # noqa: E402
from specdec_inductor.testing import write_random_eagle3_checkpoint  # noqa: E402

VOCAB = 96


def tiny_llama(seed, layers=4):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def repetitive_prompts(count, seed=2):
    """Prompts that restate a block of tokens (as structured output restates its input), of
    different lengths so the batch is ragged."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        block = torch.randint(0, VOCAB, (5 + i,), generator=gen).tolist()
        out.append(block * 3 + block[:2 + i])
    return out


def _free(*engines):
    for e in engines:
        e.pool.check_consistent()
        assert e.pool.num_free_slots == e.pool.num_slots and not e.pool.live_requests


@pytest.fixture(scope="module")
def eagle3_head(tmp_path_factory):
    root = tmp_path_factory.mktemp("lookup")
    write_random_eagle3_checkpoint(str(root / "eagle3"), tiny_llama(0).config, seed=3,
                                   layer_ids=[0, 1, 2])
    return str(root / "eagle3")


def _generators(method, head, batch, compile=False, **config_kwargs):
    """(lookup-first generator, its proposer, the target engine)."""
    target = tiny_llama(0)
    config = ProposerConfig(method=method, num_draft_tokens=6, draft_model=head, lookup=True,
                            **config_kwargs)
    engine = make_target_engine(config, target, max_batch=batch, max_len=160, compile=compile,
                                prefill_chunk=16)
    draft = tiny_llama(7, layers=1) if method == "standalone" else None
    lines = []
    proposer = make_proposer(config, engine, draft=draft, log=lines.append)
    assert isinstance(proposer, LookupFirstProposer) and "lookup" in lines[-1]
    return SpeculativeGenerator(engine, proposer, min_accepted=0.0), proposer, engine


@pytest.mark.parametrize("method,batch", [("eagle3", 1), ("eagle3", 4), ("standalone", 1),
                                          ("standalone", 3)])
def test_lookup_first_is_exact_greedy_and_drafts_both_ways(eagle3_head, method, batch):
    head = eagle3_head if method == "eagle3" else None
    spec, proposer, engine = _generators(method, head, batch)
    ps = repetitive_prompts(batch)
    stats = SpeculativeStats()
    assert spec.generate(ps, 28, stats=stats) == engine.generate(ps, 28)
    # Both sources drafted (the prompts' repeats for lookup, the random model's own text for
    # the draft model), so the catch-up after lookup steps was exercised.
    assert proposer.drafts["lookup"] > 0 and proposer.drafts["model"] > 0
    assert stats.verify_steps > 0
    _free(engine, proposer.engine)
    assert proposer.lookup.num_requests() == 0


def test_lookup_first_over_a_standalone_draft_vocabulary_is_exact_greedy():
    """The STANDALONE draft's LM head kept to 48 ids (proposers/draft_vocab.py): the lookup
    drafts any id, the model only its own, and the output stays plain greedy."""
    from specdec_inductor.proposers.draft_vocab import restrict_lm_head
    config = ProposerConfig(method="standalone", num_draft_tokens=6, lookup=True)
    engine = make_target_engine(config, tiny_llama(0), max_batch=3, max_len=160, compile=False,
                                prefill_chunk=16)
    draft = tiny_llama(7, layers=1)
    restrict_lm_head(draft, torch.arange(0, VOCAB, 2))
    proposer = make_proposer(config, engine, draft=draft)
    assert proposer.model.engine.vocab_size == VOCAB // 2
    ps = repetitive_prompts(3)
    spec = SpeculativeGenerator(engine, proposer, min_accepted=0.0)
    assert spec.generate(ps, 28) == engine.generate(ps, 28)
    assert proposer.drafts["lookup"] > 0 and proposer.drafts["model"] > 0
    _free(engine, proposer.engine)


def test_the_loops_batch_gate_judges_lookup_first_from_bucket_2_on():
    """Lookup first gates per request (gates_own_drafts): at bucket 1, where its request is the
    batch, the loop verifies whatever it offers, and with a gate threshold no step can reach
    its repeats keep drafting. In a batch of 2 every row pays for a verify's rows, and the
    loop's gate judges the batch's drafts at that bucket: the same threshold stops drafting
    after the gate's first min_steps drafted steps (and no probe follows at that bucket)."""
    from specdec_inductor.speculative.policies import AcceptanceGate
    spec, proposer, engine = _generators("standalone", None, 2)
    spec.min_accepted = 100.0  # no step reaches it
    ps = repetitive_prompts(2)
    want = engine.generate(ps, 28)
    policy = spec.new_policy()
    assert type(policy) is AcceptanceGate and policy.judge_from == 2
    alone = SpeculativeStats()
    for p, w in zip(ps, want):
        assert spec.generate([p], 28, stats=alone) == [w]
    drafted_alone = sum(k for z, k in alone.steps_by_size.items() if z > 1)
    lookup_alone = proposer.drafts["lookup"]
    assert drafted_alone > 2 * spec.gate_min_steps, alone.steps_by_size
    proposer.drafts = {k: 0 for k in proposer.drafts}
    batched = SpeculativeStats()
    assert spec.generate(ps, 28, stats=batched) == want
    assert sum(k for z, k in batched.steps_by_size.items() if z > 1) == spec.gate_min_steps
    assert lookup_alone > proposer.drafts["lookup"], (lookup_alone, proposer.drafts)
    _free(engine, proposer.engine)


def test_compiled_lookup_first_equals_eager_without_recompiles(eagle3_head):
    """Steps where the model drafts every request run its draft inside the step program, as
    the model alone would; the others draft first (lookup, or both merged)."""
    spec, proposer, engine = _generators("eagle3", eagle3_head, 2, compile=True)
    ps = repetitive_prompts(2)
    want = engine.generate(ps, 16)
    first = SpeculativeStats()
    assert spec.generate(ps, 16, stats=first) == want
    assert 0 < first.drafted_in_program < first.verify_steps, first
    _second_run_compiles_nothing(spec, engine)
    _free(engine, proposer.engine)


def _second_run_compiles_nothing(spec, engine, count=2):
    """`count` other prompts through the same compiled generator: plain greedy's tokens, no
    recompile."""
    with torch.compiler.set_stance("fail_on_recompile"):
        ps = repetitive_prompts(count, seed=9)
        stats = SpeculativeStats()
        assert spec.generate(ps, 16, stats=stats) == engine.generate(ps, 16)
        assert stats.recompiles == 0


def test_grafts_run_inside_the_step_program_and_equal_eager(eagle3_head, monkeypatch):
    """Every match drafting with both (the graft's thresholds opened wide, the model never
    resting): every step drafts with the model, with or without a graft, as one program (the
    graft as tensor ops after the model's tree); tokens equal plain greedy, compiled and eager
    alike, and a second run compiles nothing."""
    from specdec_inductor.proposers import lookup_first
    monkeypatch.setattr(lookup_first, "GRAFT_BELOW", 99)
    monkeypatch.setattr(lookup_first, "GRAFT_MARGIN", 99.0)
    ps = repetitive_prompts(2)
    runs = {}
    for compile in (False, True):
        spec, proposer, engine = _generators("eagle3", eagle3_head, 2, compile=compile)
        proposer.model_min_accepted = 0.0  # the model never rests: no lookup-only steps
        stats = SpeculativeStats()
        assert spec.generate(ps, 16, stats=stats) == engine.generate(ps, 16)
        assert proposer.grafts_in_program > 0 and proposer.drafts["lookup"] == 0, proposer.drafts
        assert stats.drafted_in_program >= proposer.grafts_in_program
        runs[compile] = (dict(proposer.drafts), dict(proposer.accepted),
                         proposer.grafts_in_program)
        if compile:
            _second_run_compiles_nothing(spec, engine)
        _free(engine, proposer.engine)
    assert runs[True] == runs[False]


def test_batches_mixing_sources_draft_inside_the_step_program_as_before_it(eagle3_head):
    """A ragged batch whose requests draft with the lookup, the model, both, or rest in the
    same step: those steps run as one program (the lookup's trees and the rests applied to
    the model's trees as tensor ops, MixedDrafter) and choose, draft and accept exactly as the
    same steps drafted before the program (mixed_in_program False); tokens equal plain
    greedy, compiled and eager, and a second run compiles nothing."""
    ps = repetitive_prompts(3)
    runs = {}
    for compile, in_program in ((False, True), (True, True), (True, False)):
        spec, proposer, engine = _generators("eagle3", eagle3_head, 3, compile=compile)
        proposer.mixed_in_program = in_program
        stats = SpeculativeStats()
        assert spec.generate(ps, 24, stats=stats) == engine.generate(ps, 24)
        assert (proposer.mixed_in_program_steps > 0) == in_program, proposer.drafts
        assert min(proposer.drafts.values()) > 0, proposer.drafts  # every source drafted
        runs[compile, in_program] = (dict(proposer.drafts), dict(proposer.accepted),
                                     stats.steps_by_size, stats.accepted_at_depth,
                                     proposer.mixed_in_program_steps)
        if compile and in_program:
            _second_run_compiles_nothing(spec, engine, 3)
        _free(engine, proposer.engine)
    assert runs[True, True] == runs[False, True]
    assert runs[True, True][:4] == runs[True, False][:4]


class _FixedTrees:
    """A program drafter (DraftProgram.drafter) whose trees are `tokens` / `mask` whatever its
    inputs."""

    def __init__(self, tokens, mask):
        self.tokens, self.mask = tokens, mask

    def tree_program(self, roots, seq_lens):
        from specdec_inductor import ops
        positions, ridx, nxt, sib = ops.reconstruct_tree_from_mask(self.mask, seq_lens,
                                                                   self.tokens.shape[1])
        return self.tokens, self.mask, positions, ridx, nxt, sib


def test_mixed_drafter_applies_each_rows_source_to_the_models_trees():
    """Row by row: a model row keeps the model's tree, a lookup row takes the lookup's, a
    resting row keeps a tree it never accepts from (the root's linkage cut: a decode row), a
    row drafting with both gets the lookup's path grafted in (graft_paths); the model's own
    trees come back after the step's."""
    from specdec_inductor import ops
    from specdec_inductor.proposers.lookup_first import MixedDrafter, graft_paths
    n, bs = 5, 4
    chain = torch.tril(torch.ones(n, n, dtype=torch.bool))
    star = torch.eye(n, dtype=torch.bool)
    star[:, 0] = True
    model_tokens = torch.tensor([[1, 11, 12, 13, 14]] * bs)
    model_mask = chain.repeat(bs, 1, 1).reshape(-1)
    found_tokens = torch.tensor([[1, 21, 22, 23, 24]] * bs)
    found_mask = star.repeat(bs, 1, 1).reshape(-1)
    path = torch.tensor([[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [11, 31, 32, 0]])
    path_len = torch.tensor([0, 0, 0, 3])
    M, L, R = MixedDrafter.MODEL_ROW, MixedDrafter.LOOKUP_ROW, MixedDrafter.RESTING_ROW
    source = torch.tensor([M, L, R, M])
    seq_lens = torch.tensor([7, 8, 9, 10])
    drafter = MixedDrafter(_FixedTrees(model_tokens, model_mask), cap=3)
    tokens, mask, positions, ridx, nxt, sib, own, own_nxt, own_sib = drafter.tree_program(
        torch.ones(bs, dtype=torch.int64), seq_lens, path, path_len, found_tokens, found_mask,
        source)
    grafted, grafted_mask, _ = graft_paths(model_tokens, model_mask, path, path_len, 3)
    assert grafted[3].tolist() == [1, 11, 12, 31, 32]  # followed 11, then the new chain
    want_mask = torch.stack([chain, star, chain, grafted_mask.view(bs, n, n)[3]]).reshape(-1)
    assert tokens.tolist() == [model_tokens[0].tolist(), found_tokens[1].tolist(),
                               model_tokens[2].tolist(), grafted[3].tolist()]
    assert torch.equal(mask, want_mask)
    want = ops.reconstruct_tree_from_mask(want_mask, seq_lens, n)
    assert torch.equal(positions, want[0]) and torch.equal(ridx, want[1])
    for got, full in ((nxt, want[2]), (sib, want[3])):
        assert got[2].tolist() == [-1] * n  # the resting row: nothing past its root
        assert torch.equal(got[[0, 1, 3]], full[[0, 1, 3]])
    model_linkage = ops.reconstruct_tree_from_mask(model_mask, seq_lens, n)
    assert torch.equal(own, model_tokens) and torch.equal(own_nxt, model_linkage[2])
    assert torch.equal(own_sib, model_linkage[3])


def _graft_by_walk(tokens, parent, path, cap, offered):
    """graft_paths of one tree, written as the walk it describes: follow the path from the root
    among the nodes kept, graft the rest in place of the last nodes, again while that cuts a
    followed node. Returns (tokens, parent list, nodes grafted)."""
    n = len(tokens)
    new, keep = 0, n
    while True:
        node, along = 0, 0
        for tok in path:
            child = next((c for c in range(1, min(keep, offered + 1)) if parent[c] == node
                          and tokens[c] == tok), None)
            if child is None:
                break
            node, along = child, along + 1
        want = min(cap, n - 2, len(path) - along)
        if want <= new:
            break
        new, keep = want, n - want
    tokens, parent = list(tokens), list(parent)
    for j in range(keep, n):
        tokens[j], parent[j] = path[along + j - keep], (node if j == keep else j - 1)
    return tokens, parent, new


def test_graft_paths_matches_the_walk_it_describes():
    """Random trees (distinct tokens among siblings, parents numbered first), paths that follow
    them for a while then leave, every cap and offered count: graft_paths as tensors over a
    batch equals the walk row by row, and its mask is the ancestor mask of the walk's tree."""
    from specdec_inductor import ops
    from specdec_inductor.proposers.lookup_first import graft_paths
    gen = torch.Generator().manual_seed(5)
    n, bs = 8, 16
    for trial in range(12):
        parents, toks, paths, offered = [], [], [], []
        for b in range(bs):
            par = [-1] + [int(torch.randint(0, j, (1,), generator=gen)) for j in range(1, n)]
            tk = [0] * n
            for j in range(1, n):
                taken = {tk[c] for c in range(1, j) if par[c] == par[j]}
                tk[j] = next(t for t in torch.randperm(6, generator=gen).tolist()
                             if t not in taken)
            node, path = 0, []
            for _ in range(int(torch.randint(0, n, (1,), generator=gen))):
                kids = [c for c in range(1, n) if par[c] == node]
                if kids and bool(torch.rand(1, generator=gen) < 0.7):
                    node = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
                    path.append(tk[node])
                else:
                    path.append(int(torch.randint(0, 6, (1,), generator=gen)))
            parents.append(par), toks.append(tk), paths.append(path)
            offered.append(int(torch.randint(1, n, (1,), generator=gen)))
        cap = trial % (n + 1)
        mask = torch.zeros(bs, n, n, dtype=torch.bool)
        for b, par in enumerate(parents):
            for j in range(n):
                a = j
                while a != -1:
                    mask[b, j, a], a = True, par[a]
        path_t = torch.zeros(bs, n - 1, dtype=torch.int64)
        for b, path in enumerate(paths):
            path_t[b, :len(path)] = torch.tensor(path, dtype=torch.int64)
        lens = torch.tensor([len(p) for p in paths])
        out, out_mask, grafted = graft_paths(torch.tensor(toks), mask.flatten(), path_t, lens, cap,
                                             torch.tensor(offered))
        for b in range(bs):
            want_tokens, want_parent, new = _graft_by_walk(toks[b], parents[b], paths[b], cap,
                                                           offered[b])
            assert out[b].tolist() == want_tokens, (trial, b)
            assert bool(grafted[b]) == (new > 0)
            rows = out_mask.view(bs, n, n)[b]
            for j in range(n):
                a, want = j, set()
                while a != -1:
                    want.add(a)
                    a = want_parent[a]
                assert set(torch.nonzero(rows[j]).flatten().tolist()) == want, (trial, b, j)
        ops.reconstruct_tree_from_mask(out_mask, torch.zeros(bs, dtype=torch.int64), n)


class _Fixed:
    """A stand-in draft model: always drafts `tokens` as a chain."""

    needs_target_hidden = False
    engine = None

    def __init__(self, n):
        self.num_draft_tokens, self.num_spec_steps = n, n
        self.calls, self.discarded = [], []

    def start(self, request_ids, contexts, hidden=None):
        pass

    def discard_drafts(self, request_ids):
        self.discarded.append(list(request_ids))

    def commit(self, request_ids, emitted, hidden=None):
        pass

    def finish(self, request_ids):
        pass

    def propose(self, request_ids, seq_lens):
        from specdec_inductor import ops
        n, bs = self.num_draft_tokens, len(request_ids)
        self.calls.append(list(request_ids))
        mask = torch.tril(torch.ones(n, n, dtype=torch.bool)).flatten().repeat(bs)
        tokens = torch.arange(50, 50 + n).repeat(bs, 1)
        pos, ridx, nxt, sib = ops.reconstruct_tree_from_mask(mask, seq_lens, n)
        return DraftTree(tokens, mask, pos, ridx, nxt, sib, torch.full((bs,), n - 1))


def test_merge_takes_each_row_from_its_source():
    n = 4
    model, lookup = _Fixed(n), NgramProposer(n, min_window=1, max_window=4, breadth=(1,))
    p = LookupFirstProposer(model, lookup, min_match=2, min_drafts=2)
    repeat, plain = [1, 2, 3, 4, 5, 1, 2, 3], [9, 8, 7, 6]
    p.start([0, 1, 2], [plain, repeat, plain])
    seq_lens = torch.tensor([3, 7, 3])
    tree = p.propose([0, 1, 2], seq_lens)
    # The model drafts the whole batch (its graphs keep the batch's bucket); request 1's row
    # is lookup's, and the model is told its draft there goes unverified.
    assert model.calls == [[0, 1, 2]] and model.discarded == [[1]]
    assert tree.tokens[1].tolist() == [3, 4, 5, 1]  # "1 2 3" seen before: 4 5 1 follow
    assert tree.tokens[0].tolist() == tree.tokens[2].tolist() == [50, 51, 52, 53]
    assert p.drafts == {"lookup": 1, "model": 2, "both": 0}
    p.commit([0, 1, 2], [[50, 7], [4, 5, 1, 9], [11]])  # 1, 3 and 0 drafts accepted
    assert p.accepted == {"lookup": 3, "model": 1, "both": 0}
    # The merged linkage is each row's own: a chain of 4 at every row, flat indices b*n + i.
    assert tree.retrieve_index.tolist() == [[b * n + i for i in range(n)] for b in range(3)]
    assert tree.positions.view(3, n).tolist() == [[s + i for i in range(n)]
                                                  for s in seq_lens.tolist()]
    p.finish([0, 1, 2])
    assert lookup.num_requests() == 0


def test_a_discarded_draft_keeps_none_of_the_emitted_tokens_as_cached():
    """A draft-model proposer whose chain was not verified (lookup drafted that row instead)
    must not count emitted tokens equal to its chain as drafts whose KV it already holds: its
    next catch-up extends them all."""
    config = ProposerConfig(method="standalone", num_draft_tokens=4)
    engine = make_target_engine(config, tiny_llama(0), max_batch=1, max_len=64, compile=False,
                                prefill_chunk=16)
    results = []
    for discard in (False, True):
        model = make_proposer(config, engine, draft=tiny_llama(7, layers=1))
        model.start([0], [[5, 6, 7, 8]])
        tree = model.propose([0], torch.tensor([4]))
        chain = tree.tokens[0, 1:].tolist()
        st = model._requests[0]
        cached = st.cached
        if discard:
            model.discard_drafts([0])
        model.commit([0], [chain + [1]])  # every draft "accepted", then a bonus
        results.append((st.cached - cached, len(st.pending)))
        model.finish([0])
    # Not discarded: the KV the chain wrote (its drafts but the last) kept, the rest pending.
    assert results[0] == (2, 2)
    assert results[1] == (0, 4)  # discarded: every emitted token pending


def test_model_drafts_rest_per_request_while_they_miss_and_probe_again():
    """From min_steps model drafts on, a request whose model drafts accept a mean below the
    threshold over all of them rests its model for probe_every steps, twice as long after each
    probe that leaves the mean below; a probe that brings it back resets the rest."""
    n = 4
    model = _Fixed(n)
    p = LookupFirstProposer(model, NgramProposer(n), model_min_accepted=0.5, min_steps=2,
                            probe_every=3)
    p.start([0, 1], [[9, 8, 7], [6, 5, 4]])
    seq_lens = torch.tensor([3, 3])
    fresh = iter(range(10, 1000))  # tokens never repeated: lookup never matches

    def step(accepted_by_request):
        tree = p.propose([0, 1], seq_lens)
        p.commit([0, 1], [[next(fresh) for _ in range(a + 1)] for a in accepted_by_request])
        return tree

    def resting(steps, accepted=2):
        for _ in range(steps):
            tree = step([0, accepted])
            assert tree.num_drafts.tolist() == [0, n - 1]  # request 0 offers nothing (a decode)

    # The model drafts the whole batch whenever it drafts (lookup_first.propose); a resting
    # request's row offers nothing and its model draft is discarded.
    step([0, 2])  # one model draft each: too few to judge
    step([0, 2])  # request 0: a mean of 0 over 2 < 0.5, rests 3 steps
    assert model.discarded == []
    resting(3)
    assert model.discarded == [[0]] * 3
    step([0, 2])  # the probe misses (0 over 3): twice as long
    assert model.discarded == [[0]] * 3
    resting(6)
    step([4, 2])  # the probe is accepted (a mean of 4 over 4): back to drafting
    step([0, 2])  # 4 over 5 still pays
    assert model.discarded == [[0]] * 9
    step([0, 0])  # 4 over 6 pays for request 0; request 1 keeps drafting at 10 over 6
    assert model.discarded == [[0]] * 9 and len(model.calls) == 15
    p.finish([0, 1])


@pytest.mark.parametrize("priced", [False, True])
def test_the_model_gate_rises_to_the_break_even_of_the_measured_costs(priced):
    """With the loop's step costs (a verify(N) of 1.5 decode steps) and the model's drafts
    timed at 0.5 decode steps, a model-drafted step pays from 1.0 accepted drafts on: a mean of
    0.5 rests the model. Without costs the gate keeps its floor (0.3), where 0.5 pays. The
    first draft, which also catches the model up over the prompt, is not priced."""
    from specdec_inductor.speculative.policies import StepCosts
    n = 4
    p = LookupFirstProposer(_Fixed(n), NgramProposer(n), min_steps=4)
    ticks = iter(range(10 ** 6))
    p.clock = lambda: 0.5 * next(ticks)  # every model draft takes 0.5 s
    if priced:
        p.use_step_costs(StepCosts(decode_s=1.0, verify_cost=1.5))
    p.start([0], [[9, 8, 7]])
    fresh = iter(range(10, 1000))  # tokens never repeated: lookup never matches
    assert p.threshold() == pytest.approx(0.3)
    for step, accepted in enumerate([1, 0, 1, 0]):
        assert p.propose([0], torch.tensor([3])).num_drafts.tolist() == [n - 1]
        assert p.draft_s == (None if step == 0 else pytest.approx(0.5))
        p.commit([0], [[next(fresh) for _ in range(accepted + 1)]])
    assert p.threshold() == pytest.approx(1.0 if priced else 0.3)
    # A mean of 0.5 accepted drafts over the 4: below 1.0, above 0.3.
    want = [0] if priced else [n - 1]
    assert p.propose([0], torch.tensor([3])).num_drafts.tolist() == want
    p.finish([0])


def test_a_model_draft_during_which_a_graph_compiled_is_not_priced(monkeypatch):
    """A model draft whose step compiled a graph (its time the compiler's) leaves the running
    price of a draft as it was, on the host path and inside the step program alike; the
    drafts after it are priced again. Scripted clock and graph count."""
    from specdec_inductor.proposers import lookup_first
    from specdec_inductor.speculative.policies import StepCosts
    n = 4
    model = _Fixed(n)
    graphs, now = [0], [0.0]
    monkeypatch.setattr(lookup_first, "graphs_compiled", lambda: graphs[0])
    p = LookupFirstProposer(model, NgramProposer(n), min_steps=4)
    p.clock = lambda: now[0]
    p.use_step_costs(StepCosts(decode_s=1.0, verify_cost=1.5))
    p.start([0], [[9, 8, 7]])
    fresh = iter(range(10, 1000))  # tokens never repeated: lookup never matches

    def step(seconds, compiles=False, in_program=False, bucket=1):
        if in_program:  # as draft_program marks a step drafted inside its program
            p._program_t0 = (p.clock(), lookup_first.graphs_compiled(), bucket)
            p._sources[0].last = lookup_first.MODEL
        else:
            p.propose([0], torch.tensor([3]))
        now[0] += seconds
        graphs[0] += int(compiles)
        p.commit([0], [[next(fresh) for _ in range(3)]])

    # The host path times propose alone: the seconds are spent inside the model's propose.
    model_propose = model.propose
    spent = []

    def timed_propose(request_ids, seq_lens):
        seconds, compiles = spent.pop(0)
        now[0] += seconds
        graphs[0] += int(compiles)
        return model_propose(request_ids, seq_lens)

    model.propose = timed_propose
    for seconds, compiles in [(0.5, False), (0.5, False), (90.0, True), (0.5, False)]:
        spent.append((seconds, compiles))
        step(0.0)
    assert p.draft_s == pytest.approx(0.5)  # the first (a catch-up) and the compiling one left
    # Inside the program: the step's seconds beyond a verify(N) of 1.5.
    step(2.0, in_program=True)
    assert p.draft_s == pytest.approx(0.5)
    step(400.0, compiles=True, in_program=True)
    assert p.draft_s == pytest.approx(0.5)
    step(2.5, in_program=True)
    assert p.draft_s == pytest.approx(0.8 * 0.5 + 0.2 * 1.0)
    # A step of bucket 4, where a verify(N) costs 3 decode steps of 1.2 s: beyond its 3.6 s.
    p.costs.by_bucket[4] = (3.0, 1.2)
    mean = p.draft_s
    step(4.2, in_program=True, bucket=4)
    assert p.draft_s == pytest.approx(0.8 * mean + 0.2 * 0.6)
    p.finish([0])


def test_a_request_drafts_with_the_source_accepted_more_scoring_undrafted_matches():
    n = 4
    model = _Fixed(n)  # drafts 51 52 53, which the steps below never accept
    p = LookupFirstProposer(model, NgramProposer(n, min_window=1, max_window=4, breadth=(1,)),
                            min_match=2, min_drafts=2, graft=0)  # one source a step
    p.start([0], [[3, 5, 6, 7, 1, 2, 3, 4, 5, 1, 2, 3]])
    tree = p.propose([0], torch.tensor([11]))  # "1 2 3" repeats: the lookup drafts 4 5 1
    assert model.calls == [] and tree.tokens[0].tolist() == [3, 4, 5, 1]
    p.commit([0], [[5]])  # the lookup missed: its mean 0.5 falls below the model's 1.0
    tree = p.propose([0], torch.tensor([12]))  # "3 5" repeats (6 7 1), but the model drafts
    assert model.calls == [[0]] and tree.tokens[0].tolist() == [50, 51, 52, 53]
    # The model missed too; the lookup's undrafted 6 7 1 predicted the emitted 6: scored 1.
    p.commit([0], [[6]])
    tree = p.propose([0], torch.tensor([13]))  # lookup 0.75 >= model 0.5: "5 6" repeats
    assert model.calls == [[0]] and tree.tokens[0].tolist() == [6, 7, 1, 2]
    assert p.drafts == {"lookup": 2, "model": 1, "both": 0}
    p.commit([0], [[7, 1, 2, 9]])
    assert p.accepted == {"lookup": 3, "model": 0, "both": 0}
    p.finish([0])


def test_where_neither_source_leads_the_lookups_path_is_grafted_into_the_models_tree():
    """A fresh request (both running means level) with a match drafts with both: the lookup's
    path follows the model's tree while the tree holds its tokens, then goes on as at most
    `graft` new nodes in place of the tree's last ones. Each source is then scored on what its
    own tree predicted: here the lookup's, which takes the next matched step alone."""
    from specdec_inductor.proposers.lookup_first import _path_table
    n = 6
    model = _Fixed(n)  # the chain 51 52 53 54 55 under the root
    p = LookupFirstProposer(model, NgramProposer(n, min_window=1, max_window=4, breadth=(1,)),
                            min_match=2, min_drafts=2, graft=2)
    # "1 2" repeats: the lookup's path is 51 52 7 8 3, the model's tree holds 51 52.
    p.start([0], [[1, 2, 51, 52, 7, 8, 3, 1, 2]])
    tree = p.propose([0], torch.tensor([8]))
    assert model.calls == [[0]] and model.discarded == []  # its drafts are verified
    assert p.drafts == {"lookup": 0, "model": 0, "both": 1}
    tokens, first, sibling, offered = _path_table(tree, 0)
    # Nodes 0-3 the model's chain cut to 51 52 53; 4 and 5 the graft: 7 under 52, 8 under 7.
    assert tokens == [50, 51, 52, 53, 7, 8] and offered == n - 1
    assert first == [1, 2, 3, -1, 5, -1] and sibling == [-1, -1, -1, 4, -1, -1]
    assert tree.positions.tolist() == [8, 9, 10, 11, 11, 12]
    p.commit([0], [[51, 52, 7, 8, 3]])  # 4 drafts accepted along the graft, then 3
    assert p.accepted == {"lookup": 0, "model": 0, "both": 4}
    s = p._sources[0]  # the model's own tree predicted 51 52, the lookup's all 4
    assert (s.model_mean, s.lookup_mean) == (1.5, 2.5)
    # The lookup now leads by a whole draft: "8 3" (seen before) drafts alone.
    tree = p.propose([0], torch.tensor([13]))
    assert tree.tokens[0].tolist() == [3, 1, 2, 51, 52, 7] and model.calls == [[0]]
    assert p.drafts == {"lookup": 1, "model": 0, "both": 1}
    p.finish([0])
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="argument 'graft'"):
            LookupFirstProposer(_Fixed(4), NgramProposer(4), graft=bad)


def test_a_graft_leaves_the_model_its_first_draft():
    from specdec_inductor.proposers.lookup_first import _path_table
    n = 6
    p = LookupFirstProposer(_Fixed(n), NgramProposer(n, min_window=1, max_window=4,
                                                     breadth=(1,)), graft=10)
    p.start([0], [[1, 2, 7, 8, 9, 10, 11, 1, 2]])  # the path 7 8 9 10 11, none the model's
    tokens, first, sibling, _ = _path_table(p.propose([0], torch.tensor([8])), 0)
    assert tokens == [50, 51, 7, 8, 9, 10]  # at most N - 2 = 4 grafted
    assert first == [1, -1, 3, 4, 5, -1] and sibling == [-1, 2, -1, -1, -1, -1]
    p.finish([0])


def test_a_graft_past_a_short_model_draft_counts_every_node_up_to_its_last():
    """A model chain that stopped after one draft (its other nodes padding): the grafted nodes
    come last, so the row offers N - 1 drafts, and a verify cut to the offered size keeps
    them."""
    from specdec_inductor.speculative.tree import truncate_draft

    class Short(_Fixed):
        def propose(self, request_ids, seq_lens):
            tree = super().propose(request_ids, seq_lens)
            tree.num_drafts = torch.ones(len(request_ids), dtype=torch.int64)
            return tree

    n = 6
    p = LookupFirstProposer(Short(n), NgramProposer(n, min_window=1, max_window=4,
                                                    breadth=(1,)), graft=2)
    p.start([0], [[1, 2, 7, 8, 9, 1, 2]])
    tree = p.propose([0], torch.tensor([6]))
    assert tree.tokens[0].tolist() == [50, 51, 52, 53, 7, 8]
    assert tree.num_drafts.tolist() == [n - 1]
    cut = truncate_draft(tree, int(tree.num_drafts.max()) + 1, torch.tensor([6]))
    assert cut.tokens[0, -2:].tolist() == [7, 8]
    p.finish([0])


def test_a_match_of_three_tokens_or_more_drafts_alone_where_the_sources_are_level():
    """Longer repeats (a restated block) keep the plain rule: level running means let the
    lookup draft alone, its whole trie, with no model draft."""
    n = 6
    model = _Fixed(n)
    p = LookupFirstProposer(model, NgramProposer(n, min_window=1, max_window=4, breadth=(1,)),
                            min_match=2, min_drafts=2, graft=2)
    p.start([0], [[1, 2, 3, 4, 5, 1, 2, 3]])  # "1 2 3" repeats: a match of 3
    tree = p.propose([0], torch.tensor([7]))
    assert tree.tokens[0].tolist() == [3, 4, 5, 1, 2, 3] and model.calls == []
    assert p.drafts == {"lookup": 1, "model": 0, "both": 0}
    p.finish([0])


def test_a_graft_makes_no_new_node_where_the_models_tree_holds_the_lookups_path():
    from specdec_inductor.proposers.lookup_first import _path_table
    n = 6
    model = _Fixed(n)
    p = LookupFirstProposer(model, NgramProposer(n, min_window=1, max_window=4, breadth=(1,)),
                            min_match=2, min_drafts=2, graft=2)
    p.start([0], [[1, 2, 51, 52, 53, 54, 55, 1, 2]])  # the path 51 52 53 54 55: the chain's
    tree = p.propose([0], torch.tensor([8]))
    assert _path_table(tree, 0)[0] == list(range(50, 50 + n))
    p.finish([0])


def test_an_undrafted_match_scores_the_emitted_tokens_it_predicts_along_its_tree():
    from specdec_inductor import ops
    from specdec_inductor.proposers.lookup_first import _matched, _path_table
    n = 5  # root 0; 1 and 3 children of the root; 2 child of 1; 4 child of 3
    parents = [-1, 0, 1, 0, 3]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for t in range(n):
        node = t
        while node >= 0:
            mask[t, node] = True
            node = parents[node]
    tokens = torch.tensor([[0, 10, 11, 20, 21]])
    pos, ridx, nxt, sib = ops.reconstruct_tree_from_mask(mask.flatten(), torch.tensor([5]), n)
    tree = DraftTree(tokens, mask.flatten(), pos, ridx, nxt, sib, torch.tensor([4]))
    table = _path_table(tree, 0)
    assert table == ([0, 10, 11, 20, 21], [1, 2, -1, 4, -1], [-1, 3, -1, -1, -1], 4)
    assert _matched(*table, [20, 21, 7]) == 2  # the second branch, then no child
    assert _matched(*table, [10, 11]) == 2  # the whole emitted list (capped by it)
    assert _matched(*table, [11]) == 0  # 11 is no child of the root
    tree.num_drafts = torch.tensor([2])  # only nodes 1 and 2 offered
    assert _matched(*_path_table(tree, 0), [20, 21]) == 0


def test_bad_arguments_are_refused_naming_them(eagle3_head):
    with pytest.raises(ValueError, match="argument 'lookup'.*N=5.*N=4"):
        LookupFirstProposer(_Fixed(4), NgramProposer(5))
    with pytest.raises(ValueError, match="argument 'min_match'"):
        LookupFirstProposer(_Fixed(4), NgramProposer(4), min_match=0)
    with pytest.raises(ValueError, match="argument 'min_drafts'"):
        LookupFirstProposer(_Fixed(4), NgramProposer(4), min_drafts=True)
    with pytest.raises(ValueError, match="argument 'probe_every'"):
        LookupFirstProposer(_Fixed(4), NgramProposer(4), probe_every=0)
    with pytest.raises(ValueError, match="argument 'min_steps'"):
        LookupFirstProposer(_Fixed(4), NgramProposer(4), min_steps=0)
    with pytest.raises(ValueError, match="argument 'model_min_accepted'"):
        LookupFirstProposer(_Fixed(4), NgramProposer(4), model_min_accepted=-1.0)
    for k in (2, -1, "1"):
        with pytest.raises(ValueError, match="argument 'k'"):
            LookupFirstProposer(_Fixed(4), NgramProposer(4)).use_program_variant(k)
    for kwargs in ({"method": "ngram", "lookup": True}, {"method": "none", "lookup": True},
                   {"method": "eagle3", "lookup": 1}):
        with pytest.raises(ProposerConfigError, match="argument 'lookup'") as info:
            ProposerConfig(**kwargs)
        assert info.value.field == "lookup"
