"""Top-k draft trees (proposers/tree_draft.py) for STANDALONE and EAGLE: the tree equals a
brute-force Python EAGLE-2 reference (over a path-keyed fake draft whose logits depend on every
token it reads through a beam's virtual row, so a wrong slot table changes the tree; and over
the real draft models recomputed from scratch with plain HF attention); -inf logits never give
NaN scores or -inf tokens; greedy speculative output equals plain greedy output for STANDALONE
and EAGLE trees (batch 1 and a ragged batch of 8); a self-draft tree accepts nearly depth + 1
tokens per step; compiled runs do not recompile; both pools end fully free."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor.engine.engine import Engine, StepOutput, batch_buckets  # noqa: E402
from specdec_inductor.engine.kv_pool import KVPool  # noqa: E402
from specdec_inductor.proposers.eagle import EagleProposer, load_eagle_head  # noqa: E402
from specdec_inductor.proposers.standalone import StandaloneProposer  # noqa: E402
from specdec_inductor.proposers.tree_draft import (  # noqa: E402
    TreeDrafter, check_tree_shape, draft_log_probs, top_children)
from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats  # noqa: E402
from specdec_inductor.testing import write_random_eagle_checkpoint  # noqa: E402

VOCAB, HIDDEN = 96, 32


# -- the brute-force reference -----------------------------------------------------------------
def eagle2_reference(logits_after, topk, depth, n):
    """The EAGLE-2 rule in plain Python: logits_after(path) gives the draft's logits after the
    root followed by the draft tokens `path` (a tuple). Returns the selected nodes' paths in
    node order (global id order). Ties rank the lower token / global id first."""
    def children(path, score):
        lp = torch.log_softmax(logits_after(path).double(), -1).tolist()
        order = sorted(range(len(lp)), key=lambda t: (-lp[t], t))[:topk]
        return [(path + (t,), score + lp[t]) for t in order]

    gid = 0
    nodes, beams = [], []
    for path, score in children((), 0.0):
        nodes.append((gid, path, score))
        beams.append((gid, path, score))
        gid += 1
    for _ in range(1, depth):
        cands = []
        for _, path, score in beams:  # beams in rank order
            for child, s in children(path, score):
                cands.append((gid, child, s))
                gid += 1
        nodes += cands
        beams = sorted(cands, key=lambda x: (-x[2], x[0]))[:topk]
    chosen = sorted(sorted(nodes, key=lambda x: (-x[2], x[0]))[:n - 1], key=lambda x: x[0])
    return [path for _, path, _ in chosen]


def tree_paths(tree, b):
    """Each non-root node's draft path (root excluded) from a DraftTree's tokens and mask."""
    n = tree.tokens.shape[1]
    mask = tree.tree_mask.view(-1, n, n)[b]
    tokens = tree.tokens[b].tolist()
    return [tuple(tokens[j] for j in range(1, i + 1) if mask[i, j]) for i in range(1, n)]


# -- a path-keyed fake draft engine -------------------------------------------------------------
def path_logits(seq, vocab, allowed=None):
    """Fixed logits [V] for a token sequence (a hash-seeded draw); -inf outside `allowed`."""
    seed = 0
    for t in seq:
        seed = (seed * 1000003 + t + 1) % (2 ** 61 - 1)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab, generator=gen) * 2
    if allowed is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[list(allowed)] = True
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits


def path_code(seq):
    """An exact float code of a sequence, the fake's stand-in for EAGLE's g."""
    weighted = sum((i + 1) * t for i, t in enumerate(seq)) % 4093
    return torch.tensor([float(len(seq)), float(weighted)])


class PathEngine:
    """Quacks like a draft Engine for TreeDrafter: decode stores each token at its row's slot,
    reads the row's whole sequence back through req_to_token and returns path_logits of it, so
    the logits depend on every slot of the virtual row. With aux, it checks that each beam
    gets its parent's code and returns its own (EAGLE's g)."""

    def __init__(self, vocab, max_batch, max_len, allowed=None):
        self.vocab, self.max_batch, self.allowed = vocab, max_batch, allowed
        self.pool = KVPool(1, 1, 1, max_batch * max_len, max_batch, max_len)
        self.buckets = batch_buckets(max_batch)
        self.slot_token = {}
        self.decodes = 0

    def bucket_for(self, n):
        return next(b for b in self.buckets if b >= n)

    def decode(self, tokens, rows, positions, aux=None):
        self.decodes += 1
        logits = torch.zeros(rows.shape[0], self.vocab)
        codes = torch.zeros(rows.shape[0], 2)
        for i, (row, pos) in enumerate(zip(rows.tolist(), positions.tolist())):
            if row == self.pool.padding_row:
                continue
            slots = self.pool.req_to_token[row, :pos + 1].tolist()
            assert min(slots) >= 0, "a virtual row reads an unset slot"
            self.slot_token[slots[-1]] = int(tokens[i])
            seq = [self.slot_token[s] for s in slots]
            if aux is not None:
                assert torch.equal(aux[i], path_code(seq[:-1])), "a beam got another node's g"
            logits[i] = path_logits(seq, self.vocab, self.allowed)
            codes[i] = path_code(seq)
        return StepOutput(logits.argmax(-1), logits, None if aux is None else codes)

    decode_step = decode  # what TreeDrafter calls (an eager fake: never compiled)


def _fake_trees(topk, depth, n, contexts, allowed=None, with_aux=False, vocab=40):
    eng = PathEngine(vocab, len(contexts) * (1 + topk), 64, allowed)
    drafter = TreeDrafter(eng, n, topk, depth)
    requests = eng.pool.admit([len(c) for c in contexts], 24)
    virtual = drafter.reserve_rows(len(contexts))
    for req, ctx in zip(requests, contexts):
        for pos, tok in enumerate(ctx):  # the committed prefix: its tokens sit in its slots
            eng.slot_token[int(req.slots[pos])] = tok
    roots = torch.tensor([c[-1] for c in contexts])
    seq_lens = torch.tensor([len(c) - 1 for c in contexts])
    root_logits = torch.stack([path_logits(c, vocab, allowed) for c in contexts])
    aux = torch.stack([path_code(c) for c in contexts]) if with_aux else None
    tree = drafter.draft(roots, seq_lens, root_logits, [r.row for r in requests],
                         [len(c) for c in contexts], virtual, aux)
    assert eng.decodes == depth - 1  # one batched decode per depth
    for rows in virtual:
        drafter.release_rows(rows)
    for r in requests:
        eng.pool.release(r)
    eng.pool.check_consistent()
    assert eng.pool.num_free_slots == eng.pool.num_slots
    return tree


@pytest.mark.parametrize("topk,depth,n", [(2, 1, 3), (2, 2, 4), (2, 3, 7), (3, 3, 10), (4, 4, 12),
                                          (3, 2, 13)])
@pytest.mark.parametrize("with_aux", [False, True])
def test_tree_equals_brute_force_eagle2_reference(topk, depth, n, with_aux):
    contexts = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7]]
    tree = _fake_trees(topk, depth, n, contexts, with_aux=with_aux)
    assert tree.tokens.shape == (3, n)
    for b, ctx in enumerate(contexts):
        ref = eagle2_reference(lambda path: path_logits(ctx + list(path), 40), topk, depth, n)
        assert tree_paths(tree, b) == ref, b
        assert tree.tokens[b, 0] == ctx[-1]
        depths = [len(p) for p in ref]
        assert tree.positions.view(3, n)[b].tolist() == [len(ctx) - 1 + d for d in [0] + depths]
    assert max(len(p) for p in tree_paths(tree, 0) + tree_paths(tree, 1)) <= depth


@pytest.mark.parametrize("allowed", [range(5, 13), [7]])
def test_inf_logits_give_no_nan_and_no_inf_token(allowed):
    """An EAGLE-3-style draft (logits -inf outside its draft vocabulary): every draft token is
    in the vocabulary, even when it has fewer than topk tokens (duplicate siblings then)."""
    contexts = [[3, 1, 4], [2, 7, 1, 8]]
    tree = _fake_trees(3, 3, 9, contexts, allowed=set(allowed), with_aux=True)
    assert set(tree.tokens[:, 1:].flatten().tolist()) <= set(allowed)
    for b, ctx in enumerate(contexts):
        ref = eagle2_reference(lambda p: path_logits(ctx + list(p), 40, set(allowed)), 3, 3, 9)
        if len(allowed) >= 3:  # enough finite candidates: exactly the reference tree
            assert tree_paths(tree, b) == ref
        else:  # one token: a chain of it, its -inf siblings are duplicates of it
            assert [len(p) for p in tree_paths(tree, b)][:3] == [1, 1, 1]


def test_log_probs_and_children_of_inf_logits():
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")],
                           [float("-inf")] * 4])  # [2, 4]; the second row has no finite logit
    logp = draft_log_probs(logits)
    assert not torch.isnan(logp).any()
    assert torch.isneginf(logp[0, [1, 3]]).all() and torch.isfinite(logp[0, [0, 2]]).all()
    assert torch.isneginf(logp[1]).all()
    scores, tokens = top_children(logp, 3)
    assert tokens[0].tolist() == [2, 0, 2]  # the -inf third child repeats the best token
    assert torch.isneginf(scores[0, 2]) and not torch.isnan(scores).any()


def test_bad_tree_shapes_name_the_argument():
    with pytest.raises(ValueError, match="'topk'"):
        check_tree_shape(4, 0, 2)
    with pytest.raises(ValueError, match="'depth'"):
        check_tree_shape(4, 2, 0)
    with pytest.raises(ValueError, match="'depth'"):
        check_tree_shape(4, 2, 4)
    with pytest.raises(ValueError, match="'num_draft_tokens'"):
        check_tree_shape(8, 2, 2)  # 2 + 4 = 6 candidates for 7 drafts
    with pytest.raises(ValueError, match="'num_draft_tokens'"):
        check_tree_shape(1, 2, 2)
    with pytest.raises(ValueError, match="'depth'"):
        StandaloneProposer(None, 5, topk=1, depth=3)  # a chain is N-1 deep
    eng = PathEngine(16, 4, 32)
    with pytest.raises(ValueError, match="max_batch"):
        TreeDrafter(eng, 5, 2, 2).reserve_rows(3)  # 6 beams > max_batch 4
    assert eng.pool.num_free_rows == 4


# -- real models --------------------------------------------------------------------------------
def tiny(seed, layers=2, hidden=HIDDEN):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=hidden,
                                      intermediate_size=2 * hidden, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def prompts(count, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (3 + (5 * i) % 17,), generator=gen).tolist()
            for i in range(count)]


def _free(*engines):
    for e in engines:
        e.pool.check_consistent()
        assert e.pool.num_free_slots == e.pool.num_slots and not e.pool.live_requests
        assert e.pool.num_free_rows == e.pool.max_reqs


def _standalone(target, draft, batch, n, topk, depth, compiled=False):
    engine = Engine(target, max_batch=batch, max_len=96, compile=compiled, prefill_chunk=16)
    draft_engine = Engine(draft, max_batch=batch * (1 + topk), max_len=96 + topk * depth,
                          compile=compiled, prefill_chunk=16)
    proposer = StandaloneProposer(draft_engine, n, topk=topk, depth=depth)
    assert proposer.num_spec_steps == depth + 1
    return engine, draft_engine, SpeculativeGenerator(engine, proposer, min_accepted=0.0)


@pytest.mark.parametrize("topk,depth,n,batch", [(2, 2, 4, 1), (3, 3, 8, 8), (4, 4, 12, 1),
                                                (2, 4, 6, 8)])
def test_standalone_tree_greedy_is_exact(topk, depth, n, batch):
    target = tiny(0)
    engine, draft_engine, spec = _standalone(target, tiny(7, layers=1, hidden=16), batch, n,
                                             topk, depth)
    ps = prompts(batch)
    stats = SpeculativeStats()
    assert spec.generate(ps, 20, stats=stats) == engine.generate(ps, 20)
    assert stats.verify_steps > stats.decode_steps
    assert spec.generate(ps, 9, eos_token_id=5) == engine.generate(ps, 9, eos_token_id=5)
    _free(engine, draft_engine)


def test_sampled_tree_repeats_with_seeds_and_greedy_rows_stay_exact():
    from specdec_inductor.sampler import SamplingParams
    target = tiny(0)
    engine, draft_engine, spec = _standalone(target, copy.deepcopy(target), 3, 6, 2, 3)
    ps = prompts(3)
    params = [SamplingParams(0.8, seed=1), SamplingParams(), SamplingParams(1.0, top_k=10, seed=2)]
    first = spec.generate(ps, 16, sampling=params)
    assert first == spec.generate(ps, 16, sampling=params)
    assert first[1] == engine.generate(ps, 16)[1]
    _free(engine, draft_engine)


def test_gated_steps_then_tree_catch_up():
    """A poor draft trips the acceptance gate: after plain decode steps the tree step catches
    the draft's KV up in prefill chunks, and the output stays exact."""
    engine, draft_engine, spec = _standalone(tiny(0), tiny(7, layers=1, hidden=16), 3, 6, 2, 3)
    spec.min_accepted = 0.5
    ps = prompts(3)
    stats = SpeculativeStats()
    assert spec.generate(ps, 40, stats=stats) == engine.generate(ps, 40)
    assert stats.decode_steps > 0 and stats.verify_steps > stats.decode_steps, stats.summary()
    _free(engine, draft_engine)


@pytest.mark.parametrize("topk,depth", [(2, 3), (3, 2)])
def test_standalone_self_draft_tree_accepts_nearly_depth_plus_one(topk, depth):
    """Draft = a copy of the target and N = every candidate (1 + topk + topk^2 (depth-1)), so
    the target's greedy path is always in the tree: only a wrong virtual-row table or draft KV
    can make it accept fewer than depth drafts per step."""
    target = tiny(0)
    n = 1 + topk + topk * topk * (depth - 1)
    engine, draft_engine, spec = _standalone(target, copy.deepcopy(target), 2, n, topk, depth)
    ps = prompts(2)
    stats = SpeculativeStats()
    assert spec.generate(ps, 30, stats=stats) == engine.generate(ps, 30)
    assert stats.mean_accepted_length > 0.9 * (depth + 1), stats.summary()
    _free(engine, draft_engine)


def _eagle(tmp_path, target, batch, n, topk, depth, compiled=False, seed=4):
    write_random_eagle_checkpoint(str(tmp_path), target.config, seed=seed)
    head = load_eagle_head(str(tmp_path), target)
    engine = Engine(target, max_batch=batch, max_len=96, compile=compiled, prefill_chunk=16,
                    capture_hidden=[-1])
    draft = Engine(head, max_batch=batch * (1 + topk), max_len=96 + topk * depth,
                   compile=compiled, prefill_chunk=8, capture_hidden=[-1])
    proposer = EagleProposer(draft, n, topk=topk, depth=depth)
    assert proposer.num_spec_steps == depth + 1
    return engine, draft, head, SpeculativeGenerator(engine, proposer, min_accepted=0.0)


@pytest.mark.parametrize("topk,depth,n,batch", [(2, 3, 5, 1), (4, 2, 10, 8), (3, 4, 12, 1),
                                                (2, 2, 4, 8)])
def test_eagle_tree_greedy_is_exact(tmp_path, topk, depth, n, batch):
    engine, draft, _, spec = _eagle(tmp_path, tiny(1), batch, n, topk, depth)
    ps = prompts(batch)
    stats = SpeculativeStats()
    assert spec.generate(ps, 20, stats=stats) == engine.generate(ps, 20)
    assert stats.verify_steps > stats.decode_steps
    assert spec.generate(ps, 7, eos_token_id=9) == engine.generate(ps, 7, eos_token_id=9)
    _free(engine, draft)


def _sdpa(*models):
    for m in models:
        m.config._attn_implementation = "sdpa"


def _specdec(*models):
    for m in models:
        m.config._attn_implementation = "specdec"


def test_trees_equal_a_from_scratch_recomputation(tmp_path):
    """First-step trees of the real drafts equal the brute-force reference over the same
    models run from scratch with plain HF attention: STANDALONE over the whole committed
    sequence, EAGLE over pairs (x_{p+1}, h_p) with each path node's input hidden being its
    parent's g. This pins the virtual rows and EAGLE's per-beam aux input on real models."""
    topk, depth, n = 3, 3, 9
    target = tiny(2)
    engine, draft_engine, spec = _standalone(target, tiny(5, layers=1), 2, n, topk, depth)
    ps = prompts(2, seed=11)
    first = [o[0] for o in engine.generate(ps, 1)]
    proposer = spec.proposer
    proposer.start([0, 1], [p + [f] for p, f in zip(ps, first)])
    tree = proposer.propose([0, 1], torch.tensor([len(p) for p in ps]))
    proposer.finish([0, 1])
    draft_model = draft_engine.model
    _sdpa(draft_model)
    try:
        for b, (p, f) in enumerate(zip(ps, first)):
            def after(path, ctx=p + [f]):
                with torch.no_grad():
                    return draft_model(torch.tensor([ctx + list(path)])).logits[0, -1]
            assert tree_paths(tree, b) == eagle2_reference(after, topk, depth, n), b
    finally:
        _specdec(draft_model)
    _free(draft_engine)

    engine, draft, head, spec = _eagle(tmp_path, target, 2, n, topk, depth, seed=6)
    proposer = spec.proposer
    _sdpa(target)
    with torch.no_grad():
        hidden = [target(torch.tensor([p + [f]]), output_hidden_states=True).hidden_states[-1][0]
                  for p, f in zip(ps, first)]
    _specdec(target)
    proposer.start([0, 1], [p + [f] for p, f in zip(ps, first)],
                   [h[:len(p)] for h, p in zip(hidden, ps)])
    tree = proposer.propose([0, 1], torch.tensor([len(p) for p in ps]))
    proposer.finish([0, 1])
    _sdpa(head)
    try:
        for b, (p, f) in enumerate(zip(ps, first)):
            ctx = p + [f]
            gs = {}

            def run(path, ctx=ctx, h=hidden[b]):
                """(logits, g) of the head at the last pair of committed + path."""
                ids = ctx[1:] + list(path)
                hid = [h[:len(ctx) - 1]] + [gs[path[:i]].view(1, -1) for i in range(len(path))]
                with torch.no_grad():
                    out = head(input_ids=torch.tensor([ids]),
                               position_ids=torch.arange(len(ids)).view(1, -1),
                               aux_hidden=torch.cat(hid)[None])
                gs[path] = out.hidden_states[0][0, -1]
                return out.logits[0, -1]

            assert tree_paths(tree, b) == eagle2_reference(run, topk, depth, n), b
    finally:
        _specdec(head)
    _free(draft)


def test_compiled_tree_does_not_recompile():
    """STANDALONE tree compiled (target prefill / verify / decode; draft prefill, catch-up
    extend of T = depth + 1, decode of B*topk beams, inside the step program): after a
    warm-up, new prompts run without a recompile. (EAGLE trees use the same draft decode
    graph with an aux input.)"""
    target = tiny(0)
    engine, draft_engine, spec = _standalone(target, copy.deepcopy(target), 2, 6, 2, 3,
                                             compiled=True)
    ps = prompts(2)
    assert spec.generate(ps, 10) == engine.generate(ps, 10)  # warm-up: every graph compiles
    with torch.compiler.set_stance("fail_on_recompile"):
        ps2 = prompts(2, seed=8)
        stats = SpeculativeStats()
        assert spec.generate(ps2, 14, stats=stats) == engine.generate(ps2, 14)
    assert stats.recompiles == 0 and stats.graphs == 0
    (step,) = spec._drafted_steps.values()  # the tree ran inside the compiled step program
    assert step.compiled_runs >= stats.drafted_in_program > 0
    _free(engine, draft_engine)


def test_compiled_tree_program_equals_eager_with_an_idle_request(tmp_path):
    """On a compiled draft Engine the whole tree (every draft decode, the top-k work and
    build_tree) is one graph: TreeDrafter.compiled_drafts counts its runs, an eager Engine's
    drafter never runs it. Its trees equal the op-by-op eager run over the same draft KV, also
    for a batch where one request drafts nothing (row None: its beams decode on the padding
    row and its tree is never used), and drafting leaves the pool consistent."""
    topk, depth, n = 2, 3, 6
    target = tiny(2)
    _, draft, _, spec = _eagle(tmp_path, target, 3, n, topk, depth, compiled=True)
    drafter = spec.proposer._tree
    pool = draft.pool
    ps = prompts(3, seed=5)
    reqs = pool.admit([len(p) for p in ps], 24)
    virtual = drafter.reserve_rows(3)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, max(map(len, ps)), HIDDEN, generator=gen)
    rows = torch.tensor([r.row for r in reqs])
    draft.prefill(ps, rows, hidden)  # the draft KV of each prompt
    roots = torch.tensor([p[-1] for p in ps])
    seq_lens = torch.tensor([len(p) + 5 for p in ps])  # the target's, only the positions use it
    logits = torch.randn(3, VOCAB, generator=gen)
    aux = torch.randn(3, HIDDEN, generator=gen)
    for live in ([True, True, True], [True, False, True]):
        req_rows = [r.row if ok else None for r, ok in zip(reqs, live)]
        args = (roots, seq_lens, logits, req_rows, [len(p) for p in ps], virtual, aux)
        before = drafter.compiled_drafts
        compiled = drafter.draft(*args)
        assert drafter.compiled_drafts == before + 1
        saved, drafter._compiled = drafter._compiled, None
        drafter.engine.compiled = False  # the op-by-op path, over the same KV
        try:
            eager = drafter.draft(*args)
        finally:
            drafter._compiled, drafter.engine.compiled = saved, True
        assert drafter.compiled_drafts == before + 1
        for b in (b for b in range(3) if live[b]):
            assert tree_paths(compiled, b) == tree_paths(eager, b), (live, b)
            assert torch.equal(compiled.tokens[b], eager.tokens[b])
            assert torch.equal(compiled.positions.view(3, n)[b], eager.positions.view(3, n)[b])
        if all(live):
            for got, want in zip(vars(compiled).values(), vars(eager).values()):
                assert torch.equal(got, want)
    for rows_ in virtual:
        drafter.release_rows(rows_)
    for r in reqs:
        pool.release(r)
    _free(draft)


def test_compiled_eagle_tree_extends_in_the_tree_graph_and_is_exact(tmp_path):
    """A compiled EAGLE tree runs the draft extend of the committed pairs inside the tree's
    graph (TreeDrafter.draft with `extend`), on its own (draft_in_program False) or inside the
    step program (DraftedStep): greedy output equals plain greedy on a ragged batch either
    way, every step's tree ran compiled, a second generation recompiles nothing, and both
    pools end free."""
    engine, draft, _, spec = _eagle(tmp_path, tiny(1), 2, 6, 2, 3, compiled=True)
    drafter = spec.proposer._tree
    ps = prompts(2)
    for in_program in (False, True):
        spec.draft_in_program = in_program
        stats = SpeculativeStats()
        before = drafter.compiled_drafts
        assert spec.generate(ps, 12, stats=stats) == engine.generate(ps, 12)
        drafted = stats.verify_steps - stats.decode_steps
        assert drafter.compiled_drafts - before + stats.drafted_in_program == drafted > 0
        assert (stats.drafted_in_program > 0) == in_program
        with torch.compiler.set_stance("fail_on_recompile"):
            ps2 = prompts(2, seed=9)
            stats = SpeculativeStats()
            assert spec.generate(ps2, 10, stats=stats) == engine.generate(ps2, 10)
        assert stats.recompiles == 0
    _free(engine, draft)


def test_cli_flags_reach_the_proposer_config_and_bad_ones_fail_early():
    from specdec_inductor import cli
    from specdec_inductor.proposers.registry import ProposerConfig, draft_engine_size
    args = cli.make_parser().parse_args(["generate", "--method", "standalone", "--topk", "3",
                                         "--depth", "4", "--num-draft-tokens", "10",
                                         "--max-batch", "2"])
    config = cli.proposer_config(args)
    assert (config.topk, config.depth, config.num_draft_tokens) == (3, 4, 10)
    engine = type("E", (), {"max_batch": 2, "max_len": 100})()
    assert draft_engine_size(config, engine) == (8, 112)
    # the measured default tree, when N holds it: (topk, depth), (draft max_batch, max_len)
    for method, shape, size in (("eagle", (2, 4), (6, 108)), ("eagle3", (3, 4), (8, 112))):
        default = ProposerConfig(method=method)
        assert default.tree_shape() == shape
        assert draft_engine_size(default, engine) == size
        # depth 4 does not fit N=4: a chain of 3
        assert ProposerConfig(method=method, num_draft_tokens=4).tree_shape() == (1, 3)
        assert ProposerConfig(method=method, topk=1).tree_shape() == (1, 7)
    default = ProposerConfig(method="standalone")
    assert default.tree_shape() == (1, 7)
    assert draft_engine_size(default, engine) == (2, 100)
    for argv, match in [(["--method", "ngram", "--topk", "2"], "--topk/--depth"),
                        (["--method", "standalone", "--topk", "2", "--depth", "1"],
                         "num_draft_tokens"),
                        (["--method", "eagle", "--topk", "0"], "--topk")]:
        with pytest.raises(SystemExit, match=match):  # before any model loads
            cli.make_proposer(cli.make_parser().parse_args(["generate"] + argv))


def test_pool_bare_rows_are_all_or_nothing_and_accounted():
    pool = KVPool(1, 1, 1, 32, 4, 8)
    (req,) = pool.admit([3], 2)
    rows = pool.take_rows(2)
    pool.req_to_token[rows[0], :2] = torch.tensor([5, 6], dtype=torch.int32)
    pool.check_consistent()
    with pytest.raises(Exception, match="no free request rows"):
        pool.take_rows(2)  # only one row left: takes nothing
    assert pool.num_free_rows == 1
    with pytest.raises(ValueError, match="rows"):
        pool.return_rows([req.row])  # a request's row, not a bare one
    pool.return_rows(rows)
    assert (pool.req_to_token[rows] == -1).all()
    pool.release(req)
    pool.check_consistent()
    assert pool.num_free_rows == 4 and pool.num_free_slots == 32
