"""The step API (speculative/loop.py): requests admitted into a running batch and retired from
it between steps. Every method's greedy tokens for a request that joins mid-run equal its solo
greedy tokens (Engine.generate), the pools end consistent and fully free (also after errors),
and on a compiled engine a long run that admits and retires requests compiles nothing new."""
import contextlib
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor.engine.engine import Engine, GenerationStats  # noqa: E402
from specdec_inductor.engine.kv_pool import RequestTooLongError  # noqa: E402
from specdec_inductor.proposers.eagle import EagleProposer, load_eagle_head  # noqa: E402
from specdec_inductor.proposers.ngram import NgramProposer  # noqa: E402
from specdec_inductor.proposers.standalone import StandaloneProposer  # noqa: E402
from specdec_inductor.sampler import SamplingParams  # noqa: E402
from specdec_inductor.speculative import (Proposer, SpeculativeGenerator,  # noqa: E402
                                          SpeculativeStats)
from specdec_inductor.speculative.commit import SampledStep  # noqa: E402
from specdec_inductor.testing import write_random_eagle_checkpoint  # noqa: E402
from test_speculative import repetitive_prompts, tiny_model  # noqa: E402  (tests/ is on the path)

METHODS = ["plain", "ngram", "standalone", "eagle", "eagle-tree"]


def _setup_eagle3(tmp_path, capacity, compiled):
    """An EAGLE-3 generator (the tiny random head of test_eagle3: drafts from 3 target layers)."""
    from specdec_inductor.proposers.eagle3 import Eagle3Proposer, load_eagle3_head
    from test_eagle3 import tiny_target, write_head
    target = tiny_target(4)
    write_head(tmp_path, target, seed=11)
    head = load_eagle3_head(str(tmp_path), target)
    draft = Engine(head, max_batch=capacity, max_len=128, compile=compiled, prefill_chunk=8,
                   capture_hidden=[-1])
    proposer = Eagle3Proposer(draft, 4)
    engine = Engine(target, max_batch=capacity, max_len=128, compile=compiled, prefill_chunk=16,
                    capture_hidden=proposer.target_hidden_layers)
    return engine, SpeculativeGenerator(engine, proposer, min_accepted=0.0), draft


def _setup(method, tmp_path, capacity=3, compiled=False):
    """(target engine, generator, draft engine or None) for `method`."""
    if method == "eagle3":
        return _setup_eagle3(tmp_path, capacity, compiled)
    target = tiny_model()
    hidden = method.startswith("eagle")
    engine = Engine(target, max_batch=capacity, max_len=128, compile=compiled, prefill_chunk=16,
                    capture_hidden=[-1] if hidden else None)
    draft = None
    if method == "plain":
        return engine, SpeculativeGenerator(engine, None), None
    if method == "ngram":
        proposer = NgramProposer(num_draft_tokens=6, breadth=(2, 1))
    elif method == "standalone":
        draft = Engine(tiny_model(seed=5), max_batch=capacity, max_len=128, compile=compiled,
                       prefill_chunk=16)
        proposer = StandaloneProposer(draft, 4)
    elif method == "standalone-chain":  # the target's own weights: most drafts accepted
        draft = Engine(tiny_model(), max_batch=capacity, max_len=128, compile=compiled,
                       prefill_chunk=16)
        proposer = StandaloneProposer(draft, 6)
    elif method == "standalone-tree":  # the target's own weights: most drafts accepted
        draft = Engine(tiny_model(), max_batch=capacity * 3, max_len=128 + 6, compile=compiled,
                       prefill_chunk=16)
        proposer = StandaloneProposer(draft, 6, topk=2, depth=3)
    else:
        write_random_eagle_checkpoint(str(tmp_path), target.config, seed=1, scale=0.3)
        head = load_eagle_head(str(tmp_path), target)
        topk = 2 if method == "eagle-tree" else 0  # a tree's beams take rows of their own
        draft = Engine(head, max_batch=capacity * (1 + topk), max_len=128 + topk * 3,
                       compile=compiled, prefill_chunk=8, capture_hidden=[-1])
        proposer = EagleProposer(draft, 6, topk=2, depth=3) if topk else EagleProposer(draft, 4)
    return engine, SpeculativeGenerator(engine, proposer, min_accepted=0.0), draft


def _all_free(*engines):
    for e in engines:
        if e is not None:
            e.pool.check_consistent()
            assert e.pool.num_free_slots == e.pool.num_slots and not e.pool.live_requests


def _run_to_done(spec, batch, request):
    while not request.done:
        spec.step(batch)


@pytest.mark.parametrize("method", METHODS)
def test_requests_joining_mid_run_emit_their_solo_greedy_tokens(method, tmp_path):
    engine, spec, draft = _setup(method, tmp_path)
    prompts = repetitive_prompts(4, shapes=4)
    budgets = [20, 12, 12, 16]
    solo = [engine.generate([p], n)[0] for p, n in zip(prompts, budgets)]
    stats = SpeculativeStats()
    with spec.batch(3, stats) as batch:
        (first,) = spec.admit(batch, [prompts[0]], budgets[0])
        for _ in range(3):
            spec.step(batch)
        assert not first.done and len(first.tokens) > 1
        second, third = spec.admit(batch, prompts[1:3], budgets[1])  # prefilled together
        _run_to_done(spec, batch, second)
        spec.retire(batch, second)  # leaves while the others keep going
        (fourth,) = spec.admit(batch, [prompts[3]], budgets[3])  # takes the freed place
        while batch.live:
            emitted = spec.step(batch)
            assert all(r in batch.requests and tokens for r, tokens in emitted.items())
        got = [r.tokens for r in (first, second, third, fourth)]
    assert got == solo, stats.summary()
    assert stats.new_tokens == sum(budgets)
    _all_free(engine, draft)


def test_eos_and_retiring_a_live_request_leave_the_others_exact(tmp_path):
    engine, spec, _ = _setup("ngram", tmp_path)
    prompts = repetitive_prompts(3, seed=4)
    solo = [engine.generate([p], 30)[0] for p in prompts]
    eos = solo[2][5]
    with spec.batch(3) as batch:
        reqs = [spec.admit(batch, [p], 30, eos_token_id=eos if i == 2 else None)[0]
                for i, p in enumerate(prompts)]
        for _ in range(2):
            spec.step(batch)
        cancelled = reqs[1]
        spec.retire(batch, cancelled)  # cancelled mid-run: its slots are free at once
        assert cancelled not in batch.requests and len(engine.pool.live_requests) == 2
        while batch.live:
            spec.step(batch)
    assert reqs[0].tokens == solo[0]
    assert reqs[2].tokens == solo[2][:solo[2].index(eos) + 1]  # stops after (and with) eos
    assert cancelled.tokens == solo[1][:len(cancelled.tokens)]
    _all_free(engine)


class _Failing(Proposer):
    """Raises in start or in propose; records the requests it was told to finish."""
    num_draft_tokens = 4
    num_spec_steps = 4

    def __init__(self, where):
        self.where, self.finished = where, []

    def start(self, request_ids, contexts):
        if self.where == "start":
            raise RuntimeError("start failed")

    def propose(self, request_ids, seq_lens):
        raise RuntimeError("propose failed")

    def finish(self, request_ids):
        self.finished += request_ids


def test_admit_errors_and_failed_steps_leak_nothing(tmp_path):
    engine, spec, _ = _setup("ngram", tmp_path, capacity=2)
    prompts = repetitive_prompts(3)
    with spec.batch(2) as batch:
        spec.admit(batch, prompts[:2], 8)
        with pytest.raises(ValueError, match="'prompts'.*capacity 2"):
            spec.admit(batch, prompts[2:], 8)
    with spec.batch(2) as batch:
        with pytest.raises(RequestTooLongError):
            spec.admit(batch, [prompts[0]], 200)
        assert not batch.requests
    failing = _Failing("start")
    spec_fail = SpeculativeGenerator(engine, failing)
    with spec_fail.batch(2) as batch:
        with pytest.raises(RuntimeError, match="start failed"):
            spec_fail.admit(batch, prompts[:2], 8)
        assert not batch.requests and len(failing.finished) == 2
    _all_free(engine)
    failing = _Failing("propose")
    with pytest.raises(RuntimeError, match="propose failed"):  # the scope still frees all
        SpeculativeGenerator(engine, failing, min_accepted=0.0).generate(prompts[:2], 8)
    assert len(failing.finished) == 2
    _all_free(engine)


def _join_and_leave(spec, prompts, budgets, capacity, steps=256, chunk_every=3, sampling=None):
    """Up to `steps` steps of one batch while the requests of `prompts` join (every
    chunk_every-th with a chunked prefill of the engine's prefill_chunk: the one-row
    prefill graph _warm_chunked_prefill compiles; request i with sampling[i] when given) as places free up and leave when
    done. Returns (the finished requests, the steps run)."""
    done, waiting, count = [], list(enumerate(zip(prompts, budgets))), 0
    chunk = spec.engine.prefill_chunk
    with spec.batch(capacity) as batch:
        while count < steps and (waiting or batch.live):
            for r in [r for r in batch.requests if r.done]:
                spec.retire(batch, r)
                done.append(r)
            while waiting and batch.size < capacity:
                i, (p, n) = waiting.pop(0)
                spec.admit(batch, [p], n, None if sampling is None else sampling[i],
                           prefill_chunk=chunk if i % chunk_every == 0 else None)
            spec.step(batch)
            count += 1
        done += [r for r in batch.requests if r.done]
    return done, count


def _warm_chunked_prefill(spec, prompt):
    """Compile the one-row prefill graph of the engine's prefill_chunk (chunked admission)."""
    with spec.batch(1) as batch:
        spec.admit(batch, [prompt], 2, prefill_chunk=spec.engine.prefill_chunk)
        while batch.live:
            spec.step(batch)


def test_compiled_steps_never_recompile_while_requests_join_and_leave(tmp_path):
    """256 steps of a compiled engine while requests of assorted prompt lengths and budgets
    join (some with a chunked prefill interleaved with the others' steps) and leave: after a
    warm-up (one batch, compile_verify) no graph compiles or recompiles, every greedy step ran
    as one compiled program (target step, acceptance and commit: GreedyStep), every request's
    tokens equal plain greedy's of the same engine, and the eager engine's run gives the
    same tokens."""
    torch._dynamo.reset()
    engine, spec, _ = _setup("ngram", tmp_path, capacity=4, compiled=True)
    prompts = repetitive_prompts(96, seed=7, shapes=4)
    prompts = [p * (1 + i % 3) for i, p in enumerate(prompts)]  # some span several chunks
    rng = random.Random(0)
    budgets = [rng.randrange(4, 40) for _ in prompts]
    spec.compile_verify(batch_size=4)
    spec.generate(prompts[:4], 4)  # the bucket's prefill and decode graphs
    _warm_chunked_prefill(spec, prompts[0])
    counters = torch._dynamo.utils.counters
    graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
    programs = spec._greedy.compiled_runs
    with torch.compiler.set_stance("fail_on_recompile"):
        done, steps = _join_and_leave(spec, prompts, budgets, 4)
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["recompiles"].values()) == recompiles
    assert steps == 256 and len(done) >= 16, (steps, len(done))  # requests came and went
    assert any(r.prefill_chunk for r in done)
    assert spec._greedy.compiled_runs - programs >= 200  # the steps ran as one program each
    for group in range(0, len(done) // 4 * 4, 4):  # plain greedy in the bucket: its graphs
        rs = done[group:group + 4]
        want = engine.generate([r.prompt for r in rs], max(r.max_new_tokens for r in rs))
        assert [r.tokens for r in rs] == [w[:r.max_new_tokens] for w, r in zip(want, rs)]
    _all_free(engine)
    _, eager, _ = _setup("ngram", tmp_path, capacity=4, compiled=False)
    eager_done, _ = _join_and_leave(eager, prompts, budgets, 4)
    assert eager._greedy.compiled_runs == 0
    assert ({tuple(r.prompt): r.tokens for r in eager_done} ==
            {tuple(r.prompt): r.tokens for r in done})


@pytest.mark.parametrize("method", ["plain", "ngram", "standalone", "eagle3"])
def test_chunked_prefill_interleaves_with_decode_and_keeps_greedy_tokens(method, tmp_path):
    """A long prompt admitted with prefill_chunk is prefilled one chunk per step while the
    request already in the batch keeps decoding; it emits nothing before its last chunk, its
    first token with it, and then exactly its solo greedy tokens. A proposer drafting from
    target hidden states (EAGLE-3) gets the prompt's hidden rows concatenated over the chunks:
    equal to those of an unchunked prefill."""
    engine, spec, draft = _setup(method, tmp_path, capacity=2)
    vocab = engine.vocab_size
    prompts = [[t % vocab for t in p] for p in repetitive_prompts(2, shapes=4)]
    long = prompts[1] * 4
    chunk = 5
    chunks = -(-len(long) // chunk)
    solo = [engine.generate([prompts[0]], 40)[0], engine.generate([long], 12)[0]]
    starts = []
    if spec.proposer is not None and spec.proposer.needs_target_hidden:
        start = spec.proposer.start
        spec.proposer.start = lambda ids, ctx, hidden: (starts.append(hidden), start(ids, ctx,
                                                                                     hidden))
    with spec.batch(2) as batch:
        (a,) = spec.admit(batch, [prompts[0]], 40)
        spec.step(batch)
        (b,) = spec.admit(batch, [long], 12, prefill_chunk=chunk)
        assert b in batch.live and b in batch.prefilling and batch.size == 2
        for k in range(chunks):
            before = len(a.tokens)
            out = spec.step(batch)
            assert len(a.tokens) > before  # a keeps decoding during b's prefill
            if k < chunks - 1:
                assert b not in out and not b.tokens and b.prefilled == chunk * (k + 1)
            else:
                assert out[b][0] == solo[1][0] and b in batch.requests and not batch.prefilling
        while batch.live:
            spec.step(batch)
    assert [a.tokens, b.tokens] == solo
    if starts:  # a's prefill, then b's chunks concatenated: b's equal an unchunked prefill's
        reqs = engine.pool.admit([len(long)], 1)
        rows = torch.tensor([reqs[0].row] + [engine.pool.padding_row])
        whole = engine.prefill([long], rows).hidden[0, :len(long)]
        engine.pool.release(reqs[0])
        assert starts[1][0].shape == whole.shape
        torch.testing.assert_close(starts[1][0], whole)
    _all_free(engine, draft)


def test_a_request_retired_while_prefilling_frees_its_slots(tmp_path):
    engine, spec, _ = _setup("ngram", tmp_path, capacity=2)
    prompts = repetitive_prompts(2, shapes=4)
    with spec.batch(2) as batch:
        (a,) = spec.admit(batch, [prompts[0]], 20)
        (b,) = spec.admit(batch, [prompts[1] * 3], 20, prefill_chunk=4)
        spec.step(batch)
        assert b.prefilled == 4 and not b.tokens
        spec.retire(batch, b)
        assert batch.live == [a] and len(engine.pool.live_requests) == 1
        with pytest.raises(ValueError, match="prefill_chunk"):
            spec.admit(batch, [prompts[1]], 4, prefill_chunk=0)
        (c,) = spec.admit(batch, [prompts[1] * 3], 20, prefill_chunk=4)  # left open at the end
        spec.step(batch)
    assert a.tokens and c.prefilled == 4
    _all_free(engine)


def _commit_reference(table, rows, seq_lens, accept_index, predicts, size):
    """The per-request commit the loop ran before it was tensor ops: each live request's path
    tokens, its accepted slots moved to the front of its tree positions, seq_len advanced."""
    table, seq_lens = table.clone(), seq_lens.clone()
    tokens = []
    for b, path in enumerate(accept_index.tolist()):
        path = [i for i in path if i >= 0]
        tokens.append([int(predicts[i]) for i in path])
        local = [i - b * size for i in path]
        rest = [i for i in range(size) if i not in local]
        start = int(seq_lens[b])
        slots = table[rows[b], start:start + size].clone()
        table[rows[b], start:start + size] = slots[local + rest]
        seq_lens[b] += len(path)
    return table, seq_lens, tokens


def test_commit_ops_match_the_per_request_commit_eager_and_compiled():
    from specdec_inductor import ops
    from specdec_inductor.speculative.commit import commit_step
    gen = torch.Generator().manual_seed(0)
    bs, size, steps, padding_row = 3, 6, 4, 5
    table = torch.randperm(6 * 40, generator=gen).view(6, 40).to(torch.int32)
    table[padding_row] = 999  # the padding row maps every position to the sink
    rows = torch.tensor([2, 0, 4, padding_row])
    seq_lens = torch.tensor([7, 3, 12, 1])
    roots = torch.tensor([11, 12, 13, 0])
    mask = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0],
                         [1, 1, 0, 1, 0, 0], [1, 1, 0, 1, 1, 0], [1, 0, 1, 0, 0, 1]],
                        dtype=torch.bool).flatten().repeat(bs)  # the same tree for each
    _, ridx, nxt, sib = ops.reconstruct_tree_from_mask(mask, seq_lens[:bs], size)
    candidates = torch.randint(0, 9, (bs, size), generator=gen)
    target = candidates.roll(-1, dims=1)  # every request accepts along some path
    target[1] = candidates[1, 2]  # request 1: only node 2's token at the root
    predicts, accept_index, accept_num = ops.verify_tree_greedy(candidates, ridx, nxt, sib,
                                                                target, steps)
    want_table, want_lens, want_tokens = _commit_reference(table, rows, seq_lens, accept_index,
                                                           predicts, size)
    assert max(int(a) for a in accept_num) > 0
    compiled = torch.compile(commit_step, fullgraph=True)
    for fn in (commit_step, compiled):
        t, lens, r = table.clone(), seq_lens.clone(), roots.clone()
        done = fn(t, rows, lens, r, padding_row, predicts, accept_index, accept_num, size)
        assert torch.equal(t, want_table)
        assert torch.equal(lens[:bs], want_lens[:bs]) and lens[bs] == 1  # padding untouched
        assert [[x for x in row if x >= 0] for row in done.tokens.tolist()] == want_tokens
        assert r[:bs].tolist() == [tok[-1] for tok in want_tokens] and r[bs] == 0
    # A finished request's row is the padding row: nothing of its own moves.
    t, lens, r = table.clone(), seq_lens.clone(), roots.clone()
    finished = rows.clone()
    finished[1] = padding_row
    commit_step(t, finished, lens, r, padding_row, predicts, accept_index, accept_num, size)
    assert torch.equal(t[0], table[0]) and lens[1] == seq_lens[1] and r[1] == roots[1]


@pytest.mark.parametrize("method", ["ngram", "eagle"])
def test_one_program_and_pieces_emit_the_same_tokens(method, tmp_path):
    """A greedy step as one program (GreedyStep) and as the engine's step graph followed by
    acceptance and commit in eager (one_program = False) emit the same tokens; only the
    first runs the program."""
    engine, spec, draft = _setup(method, tmp_path)
    prompts = repetitive_prompts(3, shapes=3)
    calls = []
    verify = engine.verify
    engine.verify = lambda *a, **k: (calls.append(1), verify(*a, **k))[1]
    whole = spec.generate(prompts, 24)
    assert not calls  # the program calls the step function itself
    spec.one_program = False
    assert spec.generate(prompts, 24) == whole == engine.generate(prompts, 24)
    assert calls and spec._greedy.compiled_runs == 0  # eager: nothing compiled either way
    _all_free(engine, draft)


def _ragged_run(spec, prompts, budget, sampling=None):
    """Tokens and stats of a batch of 3 that one request starts and two join after 3 steps
    (sampling: one SamplingParams per prompt, or None: greedy)."""
    stats = SpeculativeStats()
    with spec.batch(3, stats) as batch:
        requests = spec.admit(batch, prompts[:1], budget, sampling and sampling[:1])
        for _ in range(3):
            spec.step(batch)
        requests += spec.admit(batch, prompts[1:3], budget, sampling and sampling[1:3])
        while batch.live:
            spec.step(batch)
    return [r.tokens for r in requests], stats


@contextlib.contextmanager
def _recorded_draft_kv(proposer):
    """Records (cached, pending) of every draft request after each commit of `proposer`."""
    seen, commit = [], proposer.commit

    def recording(request_ids, emitted, *hidden):
        commit(request_ids, emitted, *hidden)
        seen.append([(proposer._requests[r].cached, len(proposer._requests[r].pending))
                     for r in request_ids])
    proposer.commit = recording
    try:
        yield seen
    finally:
        del proposer.commit


# A compiled tree drafted in the program: the 256-step test below (against eager's tokens).
@pytest.mark.parametrize("method,compiled", [("standalone-tree", False), ("eagle-tree", False),
                                             ("standalone-chain", False),
                                             ("standalone-chain", True), ("eagle", False)])
def test_drafting_inside_the_step_program_keeps_trees_and_tokens(method, compiled, tmp_path):
    """Draft trees and chains made inside the step program (DraftedStep: the draft's catch-up
    and tree or chain, verify, acceptance and commit as one program) and by propose before
    the step program: the same tokens, plain greedy's, and the same acceptance at every depth
    (a draft that accepts most drafts, so another tree would show; a chain of a draft without
    hidden states keeps its accepted drafts' KV either way, so a wrong kept count would show
    too) on a ragged batch that requests join mid-run. Every step drafts in the program (a
    joining request's prompt first catches up in the draft's own extend graphs), on a
    compiled engine as the compiled program, and the draft's own tree graph or chain loop
    never runs; the pools end free."""
    engine, spec, draft = _setup(method, tmp_path, compiled=compiled)
    prompts = repetitive_prompts(3, shapes=3)
    solo = [engine.generate([p], 24)[0] for p in prompts]
    spec.draft_in_program = False
    with _recorded_draft_kv(spec.proposer) as kv_by_propose:
        want, by_propose = _ragged_run(spec, prompts, 24)
    spec.draft_in_program = True
    with _recorded_draft_kv(spec.proposer) as kv_in_program:
        got, in_program = _ragged_run(spec, prompts, 24)
    assert got == want == solo
    # The draft's cached length and pending tokens after every commit: kept drafts counted alike.
    assert kv_in_program == kv_by_propose
    assert in_program.accepted_at_depth == by_propose.accepted_at_depth
    assert in_program.verify_steps == by_propose.verify_steps
    if method.startswith("standalone"):
        assert in_program.mean_accepted_length > 2.0, in_program.summary()
    assert by_propose.drafted_in_program == 0
    assert in_program.drafted_in_program == in_program.verify_steps, in_program.summary()
    if compiled and method == "standalone-chain":  # propose's chains: the draft's own graph
        drafted = by_propose.verify_steps - by_propose.decode_steps
        assert drafted > 0 and spec.proposer._chain_drafter.compiled_drafts == drafted
    (step,) = spec._drafted_steps.values()
    assert step.compiled_runs == (in_program.drafted_in_program if compiled else 0)
    calls, proposer = [], spec.proposer
    drafter, name = (proposer._tree, "draft") if proposer._tree else (proposer, "_chain")
    own_graph = getattr(drafter, name)
    setattr(drafter, name, lambda *a, **k: (calls.append(1), own_graph(*a, **k))[1])
    assert _ragged_run(spec, prompts, 24)[0] == solo
    assert not calls  # the draft's own tree graph never ran
    _all_free(engine, draft)


@pytest.mark.parametrize("method", ["standalone-chain", "eagle-tree"])
def test_sampled_drafting_inside_the_step_program_repeats_the_propose_path(method, tmp_path):
    """Sampled requests (a greedy one among them) drafted inside the step program (the sampled
    step program's tree rejection sampling) and by propose: the same seeds draw the same
    uniforms over the same drafts, so the tokens are the same, and every step of the
    in-program run drafts there; the pools end free."""
    engine, spec, draft = _setup(method, tmp_path)
    prompts = repetitive_prompts(3, shapes=3)
    sampling = [SamplingParams(temperature=0.8, top_p=0.9, seed=5), SamplingParams(),
                SamplingParams(temperature=1.2, top_k=20, seed=6)]
    spec.draft_in_program = False
    want, by_propose = _ragged_run(spec, prompts, 24, sampling)
    spec.draft_in_program = True
    got, in_program = _ragged_run(spec, prompts, 24, sampling)
    assert got == want
    assert got[1] == engine.generate([prompts[1]], 24)[0]  # the greedy request
    assert by_propose.drafted_in_program == 0
    assert in_program.drafted_in_program == in_program.verify_steps, in_program.summary()
    _all_free(engine, draft)


def _warm_draft_graphs(spec, prompts, capacity):
    """Compile what a draft-model proposer's steps use in a batch of `capacity`: the draft's
    catch-up graphs per bucket, and the step program that drafts inside it."""
    for k in range(1, capacity + 1):
        with spec.batch(capacity) as batch:
            spec.admit(batch, prompts[:k], 6)
            while batch.live:
                spec.step(batch)


def test_drafted_step_program_never_recompiles_while_requests_join_and_leave(tmp_path):
    """256 steps of a compiled EAGLE tree batch while requests join (some chunk-prefilled)
    and leave: after a warm-up nothing compiles or recompiles, most steps drafted inside the
    compiled step program, every request's tokens equal plain greedy's, and the eager engine
    gives the same tokens."""
    torch._dynamo.reset()
    engine, spec, draft = _setup("eagle-tree", tmp_path, capacity=4, compiled=True)
    prompts = repetitive_prompts(96, seed=3, shapes=4)
    prompts = [p * (1 + i % 2) for i, p in enumerate(prompts)]
    rng = random.Random(2)
    budgets = [rng.randrange(4, 32) for _ in prompts]
    spec.compile_verify(batch_size=4, sampled=False)
    _warm_draft_graphs(spec, prompts, 4)
    _warm_chunked_prefill(spec, prompts[0])
    counters = torch._dynamo.utils.counters
    graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
    (step,) = spec._drafted_steps.values()
    runs = step.compiled_runs
    with torch.compiler.set_stance("fail_on_recompile"):
        done, steps = _join_and_leave(spec, prompts, budgets, 4)
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["recompiles"].values()) == recompiles
    assert steps == 256 and len(done) >= 16, (steps, len(done))
    assert any(r.prefill_chunk for r in done)
    assert step.compiled_runs - runs >= 128, step.compiled_runs - runs
    for r in done:
        assert r.tokens == engine.generate([r.prompt], r.max_new_tokens)[0]
    _all_free(engine, draft)
    _, eager, eager_draft = _setup("eagle-tree", tmp_path, capacity=4, compiled=False)
    eager_done, _ = _join_and_leave(eager, prompts, budgets, 4)
    assert ({tuple(r.prompt): r.tokens for r in eager_done} ==
            {tuple(r.prompt): r.tokens for r in done})
    _all_free(eager_draft)


def test_chunked_admission_checks_the_parameter_layout():
    """The compiled steps read the parameters unchecked: a chunked admission refuses a model
    whose parameters changed layout since compiling, as a whole-prompt prefill does, and the
    refused request leaves no slot behind."""
    model = tiny_model()
    engine = Engine(model, max_batch=1, max_len=64, compile=True, prefill_chunk=8)
    spec = SpeculativeGenerator(engine, None)
    with torch.no_grad():
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.t().contiguous().t())
    with spec.batch(1) as batch:
        spec.admit(batch, [[1, 2, 3, 4, 5]], 4, prefill_chunk=4)
        with pytest.raises(RuntimeError, match="changed shape"):
            spec.step(batch)
    assert engine.pool.num_free_slots == engine.pool.num_slots


def test_sampled_and_greedy_requests_join_and_leave_a_compiled_batch_without_recompiles(
        tmp_path):
    """Sampled requests (tree rejection sampling inside the step program: SampledStep, greedy
    rows of the batch as one-hot targets) and greedy ones join and leave a compiled batch:
    after compile_verify no graph compiles or recompiles, the steps of batches holding a
    sampled request ran as the sampled program, greedy requests emit their plain greedy
    tokens, and the eager engine gives the same tokens for the same seeds."""
    torch._dynamo.reset()
    engine, spec, _ = _setup("ngram", tmp_path, capacity=4, compiled=True)
    prompts = repetitive_prompts(40, seed=9, shapes=4)
    rng = random.Random(1)
    budgets = [rng.randrange(4, 30) for _ in prompts]
    sampling = [SamplingParams(0.8, top_k=8 * (i % 3), top_p=0.9, seed=i) if i % 2
                else SamplingParams() for i in range(len(prompts))]
    spec.compile_verify(batch_size=4)  # the greedy and the sampled programs
    spec.generate(prompts[:4], 4)  # the bucket's prefill graph
    _warm_chunked_prefill(spec, prompts[0])
    sampled = SampledStep.of(engine, spec.proposer.num_spec_steps, spec.tree_sampling)
    counters = torch._dynamo.utils.counters
    graphs, recompiles = counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())
    runs = sampled.compiled_runs
    with torch.compiler.set_stance("fail_on_recompile"):
        done, steps = _join_and_leave(spec, prompts, budgets, 4, steps=128, sampling=sampling)
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["recompiles"].values()) == recompiles
    assert len(done) >= 12 and sampled.compiled_runs - runs >= 64, (len(done), steps)
    greedy = [r for r in done if r.sampling.greedy]
    assert greedy and len(greedy) < len(done)
    for r in greedy:
        assert r.tokens == engine.generate([r.prompt], r.max_new_tokens)[0]
    _all_free(engine)
    _, eager, _ = _setup("ngram", tmp_path, capacity=4, compiled=False)
    # The adaptive size's probe rule reads the probe's measured cost: the eager run must plan
    # with the compiled run's measurement (a sampled row's tokens depend on its tree sizes).
    eager.costs.probe_cost = spec.costs.probe_cost
    eager_done, _ = _join_and_leave(eager, prompts, budgets, 4, steps=128, sampling=sampling)
    assert ({tuple(r.prompt): r.tokens for r in eager_done} ==
            {tuple(r.prompt): r.tokens for r in done})


def test_plain_generate_is_the_loop_without_a_proposer():
    """Engine.generate / generate_stream run the speculative loop's decode program (one AR
    path: the engine's own decode step is never called), stop each request at its eos or
    budget (None in the stream after it), and report consistent GenerationStats. A request
    fits a max_len of prompt + max_new_tokens (+ N - 1 with a proposer of N-node trees)."""
    engine = Engine(tiny_model(), max_batch=3, max_len=64, compile=False, prefill_chunk=16)
    engine.decode = None  # the loop's program calls the step function, never Engine.decode
    runs = []
    run_program = engine.run_program
    engine.run_program = lambda *a: (runs.append(1), run_program(*a))[1]
    prompts = repetitive_prompts(3, seed=2)
    plain = engine.generate(prompts, 12)
    eos = plain[1][4]
    stats = GenerationStats()
    runs.clear()
    stream = list(engine.generate_stream(prompts, 12, eos, stats))
    assert len(runs) == stats.decode_steps > 0  # one program per decode step
    got = [[step[b] for step in stream if step[b] is not None] for b in range(3)]
    cut = [p[:p.index(eos) + 1] if eos in p else p for p in plain]
    assert got == cut and engine.generate(prompts, 12, eos) == cut
    assert all(step[b] is None for b in range(3) for step in stream[len(cut[b]):])
    assert stats.prompt_tokens == sum(map(len, prompts))
    assert stats.new_tokens == sum(map(len, cut)) and stats.decode_tokens == stats.new_tokens - 3
    assert stats.decode_steps == len(stats.step_times) == len(stream) - 1 == max(map(len, cut)) - 1
    assert stats.decode_s > 0 and stats.prefill_s > 0
    _all_free(engine)
    prompt, new = prompts[0], 64 - len(prompts[0])  # exactly max_len
    assert engine.generate([prompt], new)[0][:12] == plain[0]
    ngram = SpeculativeGenerator(engine, NgramProposer(num_draft_tokens=6), min_accepted=0.0)
    assert ngram.generate([prompt], new - 5) == engine.generate([prompt], new - 5)
    with pytest.raises(RequestTooLongError):
        ngram.generate([prompt], new - 4)
    _all_free(engine)
