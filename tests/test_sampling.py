"""Lossless sampling ops: exact agreement with the references for fixed uniforms, greedy as
the one-hot limit, and statistical tests that speculation reproduces the target's sampling
distribution at every emitted position -- with a deliberately wrong rule shown to be caught."""
import pytest
import torch
from torch.library import opcheck

import specdec_inductor
from specdec_inductor import ops
from specdec_inductor.ops import reference as ref
from specdec_inductor.testing import random_draft, random_verify_inputs

PATHS = specdec_inductor.runnable_isas()
# The vocabulary passes' kernel per forced path (AMX has no sampling kernel of its own).
VOCAB_PATH = {"portable": "portable", "avx2": "avx2", "avx512": "avx512", "amx": "avx512"}


def _random_probs(shape, gen, sharp=3.0):
    return torch.softmax(torch.randn(*shape, generator=gen) * sharp, dim=-1)


def _renorm_checked(path, probs, top_k, top_p):
    """top_k_top_p_renorm on `path`: the vocabulary kernel that ran, the keep sets and values
    against the sort-based reference."""
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        got = ops.top_k_top_p_renorm(probs, top_k, top_p)
    assert specdec_inductor.kernel_path_counts() == {f"top_k_top_p_renorm:{VOCAB_PATH[path]}": 1}
    want = ref.top_k_top_p_renorm_ref(probs, top_k, top_p)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    return got


@pytest.mark.parametrize("path", PATHS)
def test_top_k_top_p_renorm_matches_reference(path):
    gen = torch.Generator().manual_seed(0)
    probs = _random_probs((6, 1003), gen)
    probs[5, :10] = probs[5].max() * 2  # ten-way tie at the top: top-4 keeps all ten
    top_k = torch.tensor([0, 1, 7, 1003, 50, 4], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 0.5, 0.9, 0.3, 1.0])
    got = _renorm_checked(path, probs, top_k, top_p)
    assert (got > 0).sum(1).tolist()[:2] == [1003, 1] and int((got[5] > 0).sum()) == 10
    torch.testing.assert_close(got.sum(1), torch.ones(6))


@pytest.mark.parametrize("path", PATHS)
def test_top_k_top_p_renorm_full_vocabulary(path):
    """SmolLM2's vocabulary: the threshold searches drop the values below their lower end as
    they go (csrc/sampling.cpp); the keep sets still match the reference exactly, ties at the
    k-th value and a plateau of equal probabilities included."""
    gen = torch.Generator().manual_seed(3)
    probs = _random_probs((5, 49152), gen, sharp=4.0)
    probs[3] = ((probs[3] * 2e4).round() + 1) / 2e4  # many ties at every level
    probs[3] /= probs[3].sum()
    probs[4, 100:140] = probs[4].max() * 2  # 40-way tie at the top: top-20 keeps all 40
    top_k = torch.tensor([50, 0, 1, 1000, 20], dtype=torch.int32)
    top_p = torch.tensor([0.9, 0.5, 1.0, 0.95, 1.0])
    got = _renorm_checked(path, probs, top_k, top_p)
    assert int((got[2] > 0).sum()) == 1 and int((got[4] > 0).sum()) == 40


def _tree_inputs(gen, bs=7, topk=2, depth=3, n=8, vocab=12):
    d = random_draft(bs, topk, depth, n, gen)
    _, _, ridx, nxt, sib = ops.build_tree(d.parent_list, d.selected_index, d.seq_lens, topk, depth, n)
    cand, _ = random_verify_inputs(nxt, sib, gen, vocab=vocab)
    probs = _random_probs((bs, n, vocab), gen)
    # Make the drafts plausible so that the walk accepts, rejects and hops.
    probs.scatter_add_(2, cand.roll(-1, 1).unsqueeze(-1), torch.full((bs, n, 1), 2.0))
    probs /= probs.sum(-1, keepdim=True)
    return cand, ridx, nxt, sib, probs, depth + 1


@pytest.mark.parametrize("path", PATHS)
def test_tree_sampling_matches_reference_for_fixed_uniforms(path):
    gen = torch.Generator().manual_seed(1)
    accepted = 0
    for trial in range(20):
        cand, ridx, nxt, sib, probs, steps = _tree_inputs(gen)
        u = torch.rand(cand.shape, generator=gen)
        uf = torch.rand(cand.shape[0], generator=gen)
        with specdec_inductor.forced_isa(path):
            got = ops.tree_speculative_sampling(cand, ridx, nxt, sib, u, uf, probs, steps)
        want = ref.tree_speculative_sampling_ref(cand, ridx, nxt, sib, u, uf, probs, steps)
        for g, w in zip(got, want):
            assert torch.equal(g, w), trial
        accepted += int(got[2].sum())
    assert accepted > 20


def test_tree_sampling_with_one_hot_targets_is_greedy_verify():
    gen = torch.Generator().manual_seed(2)
    cand, ridx, nxt, sib, probs, steps = _tree_inputs(gen, bs=17)
    argmax = probs.argmax(-1)
    one_hot = torch.nn.functional.one_hot(argmax, probs.shape[-1]).float()
    u, uf = torch.rand(cand.shape, generator=gen), torch.rand(cand.shape[0], generator=gen)
    sampled = ops.tree_speculative_sampling(cand, ridx, nxt, sib, u, uf, one_hot, steps)
    greedy = ops.verify_tree_greedy(cand, ridx, nxt, sib, argmax, steps)
    for s, g in zip(sampled, greedy):
        assert torch.equal(s, g)


def test_chain_sampling_matches_reference_and_seeds_repeat():
    gen = torch.Generator().manual_seed(3)
    bs, k, vocab = 9, 4, 30
    q = _random_probs((bs, k, vocab), gen)
    p = _random_probs((bs, k + 1, vocab), gen)
    drafts = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(bs, k)
    u, uf = torch.rand(bs, k, generator=gen), torch.rand(bs, generator=gen)
    got = ops.chain_speculative_sampling(drafts, q, p, u, uf)
    want = ref.chain_speculative_sampling_ref(drafts, q, p, u, uf)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    again = ops.chain_speculative_sampling(drafts, q, p, u, uf)
    assert all(torch.equal(g, w) for g, w in zip(got, again))


# ------------------------------------------------------------------------- losslessness
# Target: a bigram model P[prev] over a tiny vocabulary; draft: another bigram model Q. Each
# sample generates L tokens from token 0 by repeated speculative steps; the empirical
# distribution of the token at every position must match e_0 P^t (chi-square, 4 dof).

V, L, CHI2_LIMIT = 5, 4, 30.0  # chi2(4) > 30 has probability ~5e-6


def _bigrams(seed):
    gen = torch.Generator().manual_seed(seed)
    target = _random_probs((V, V), gen, sharp=1.5).double()
    draft = _random_probs((V, V), gen, sharp=1.5).double()
    return target, draft


def _expected_marginals(target):
    dist, out = torch.zeros(V, dtype=torch.float64), []
    dist[0] = 1.0
    for _ in range(L):
        dist = dist @ target
        out.append(dist)
    return out


def _chi2(samples, expected):
    """Largest chi-square statistic over positions; samples [M, L]."""
    worst = 0.0
    for t in range(L):
        counts = torch.bincount(samples[:, t], minlength=V).double()
        exp = expected[t] * samples.shape[0]
        worst = max(worst, float(((counts - exp) ** 2 / exp).sum()))
    return worst


# Fixed verify tree: root -> {1, 2}; 1 -> {3}; 2 -> {4}; 3 -> {5}.
NEXT = torch.tensor([1, 3, 4, 5, -1, -1])
SIB = torch.tensor([-1, 2, -1, -1, -1, -1])
PARENT = [-1, 0, 0, 1, 2, 3]


def _tree_generate(target, draft, m, gen, ignore_residual=False):
    tp = target.float()
    out = [[] for _ in range(m)]
    last = torch.zeros(m, dtype=torch.int64)
    ridx = torch.arange(m * 6).view(m, 6)
    while min(len(o) for o in out) < L:
        cand = torch.empty(m, 6, dtype=torch.int64)  # [M, N] draft tokens from Q, top-k style
        cand[:, 0] = last
        top2 = draft[last].topk(2).indices
        cand[:, 1], cand[:, 2] = top2[:, 0], top2[:, 1]
        for node in (3, 4, 5):
            cand[:, node] = draft[cand[:, PARENT[node]]].argmax(-1)
        probs = tp[cand]  # [M, N, V]: node i's next-token distribution
        u, uf = torch.rand(m, 6, generator=gen), torch.rand(m, generator=gen)
        predicts, accept_index, num = ops.tree_speculative_sampling(
            cand, ridx, NEXT.expand(m, 6), SIB.expand(m, 6), u, uf, probs, 4)
        path = accept_index.long()  # [M, S] flat rows, -1 padded
        emitted = torch.where(path >= 0, predicts[path.clamp(min=0)].long(), -1)  # [M, S]
        if ignore_residual:  # the biased rule: bonus from the plain target, not the residual
            end = path.gather(1, num.long().unsqueeze(1)).squeeze(1) % 6
            cdf = probs[torch.arange(m), end].double().cumsum(-1)
            wrong = (cdf <= uf.double().unsqueeze(1)).sum(-1).clamp(max=V - 1)
            emitted[torch.arange(m), num.long()] = wrong
        for o, row in zip(out, emitted.tolist()):
            o.extend(t for t in row if t >= 0)
        last = torch.tensor([o[-1] for o in out])
    return torch.tensor([o[:L] for o in out])


def test_tree_sampling_is_lossless_and_a_biased_rule_is_caught():
    target, draft = _bigrams(10)
    expected = _expected_marginals(target)
    gen = torch.Generator().manual_seed(4)
    good = _tree_generate(target, draft, 20000, gen)
    assert _chi2(good, expected) < CHI2_LIMIT
    bad = _tree_generate(target, draft, 20000, torch.Generator().manual_seed(4), ignore_residual=True)
    assert _chi2(bad, expected) > CHI2_LIMIT


def _chain_generate(target, draft, m, gen, k=3, ignore_residual=False):
    tp, qd = target.float(), draft.float()
    out = [[] for _ in range(m)]
    last = torch.zeros(m, dtype=torch.int64)
    while min(len(o) for o in out) < L:
        drafts, q = [], []
        prev = last
        for _ in range(k):
            qi = qd[prev]
            x = torch.multinomial(qi, 1, generator=gen).squeeze(1)
            drafts.append(x)
            q.append(qi)
            prev = x
        drafts_t = torch.stack(drafts, 1)  # [M, K]
        q_t = torch.stack(q, 1)  # [M, K, V]
        context = torch.cat([last.unsqueeze(1), drafts_t], 1)  # [M, K+1]
        p_t = tp[context]  # [M, K+1, V]
        u, uf = torch.rand(m, k, generator=gen), torch.rand(m, generator=gen)
        tokens, num = ops.chain_speculative_sampling(drafts_t, q_t, p_t, u, uf)
        if ignore_residual:  # biased: a rejected position redraws from p instead of max(p-q, 0)
            rejected = num < k
            rows = torch.arange(m)[rejected]
            cdf = p_t[rows, num[rejected].long()].double().cumsum(-1)
            tokens[rows, num[rejected].long()] = (cdf <= uf[rejected].double().unsqueeze(1)).sum(-1).clamp(max=V - 1)
        for i in range(m):
            out[i].extend(int(t) for t in tokens[i] if t >= 0)
        last = torch.tensor([o[-1] for o in out])
    return torch.tensor([o[:L] for o in out])


def test_chain_sampling_is_lossless_and_a_biased_rule_is_caught():
    target, draft = _bigrams(11)
    expected = _expected_marginals(target)
    good = _chain_generate(target, draft, 12000, torch.Generator().manual_seed(5))
    assert _chi2(good, expected) < CHI2_LIMIT
    bad = _chain_generate(target, draft, 12000, torch.Generator().manual_seed(5), ignore_residual=True)
    assert _chi2(bad, expected) > CHI2_LIMIT


# ------------------------------------------------------------------------- opcheck, compile, errors


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_opcheck_sampling_ops(dtype):
    gen = torch.Generator().manual_seed(6)
    cand, ridx, nxt, sib, probs, steps = _tree_inputs(gen)
    u, uf = torch.rand(cand.shape, generator=gen), torch.rand(cand.shape[0], generator=gen)
    linkage = [t.to(dtype) for t in (cand, ridx, nxt, sib)]
    opcheck(torch.ops.specdec.tree_speculative_sampling.default, (*linkage, u, uf, probs, steps))
    transposed = [t.t().contiguous().t() for t in linkage]
    opcheck(torch.ops.specdec.tree_speculative_sampling.default, (*transposed, u.t().contiguous().t(), uf, probs, steps))
    rows = probs.view(-1, probs.shape[-1])
    opcheck(torch.ops.specdec.top_k_top_p_renorm.default,
            (rows[::2], torch.full((rows[::2].shape[0],), 3, dtype=dtype), torch.full((rows[::2].shape[0],), 0.8)))
    q = _random_probs((3, 2, 12), gen)
    opcheck(torch.ops.specdec.chain_speculative_sampling.default,
            (torch.randint(0, 12, (3, 2), dtype=dtype), q, _random_probs((3, 3, 12), gen),
             torch.rand(3, 2, generator=gen), torch.rand(3, generator=gen)))


def _sample_step(logits, top_k, top_p, temperature, cand, ridx, nxt, sib, u, uf):
    probs = torch.softmax(logits / temperature.view(-1, 1, 1), dim=-1)
    bs, n, vocab = probs.shape
    probs = ops.top_k_top_p_renorm(probs.view(bs * n, vocab), top_k.repeat_interleave(n),
                                   top_p.repeat_interleave(n)).view(bs, n, vocab)
    return ops.tree_speculative_sampling(cand, ridx, nxt, sib, u, uf, probs, 4)


def test_sampling_step_eager_equals_compiled():
    gen = torch.Generator().manual_seed(7)
    cand, ridx, nxt, sib, probs, steps = _tree_inputs(gen, bs=5)
    logits = probs.log()
    args = (logits, torch.tensor([0, 3, 5, 0, 2]), torch.tensor([1.0, 0.9, 0.7, 0.5, 1.0]),
            torch.tensor([0.7, 1.0, 1.3, 0.9, 0.5]), cand, ridx, nxt, sib,
            torch.rand(cand.shape, generator=gen), torch.rand(5, generator=gen))
    eager = _sample_step(*args)
    compiled = torch.compile(_sample_step, fullgraph=True)(*args)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def test_sampling_bad_inputs():
    gen = torch.Generator().manual_seed(8)
    cand, ridx, nxt, sib, probs, steps = _tree_inputs(gen, bs=2)
    u, uf = torch.rand(cand.shape, generator=gen), torch.rand(2, generator=gen)
    args = [cand, ridx, nxt, sib, u, uf, probs, steps]
    for i, bad, exc, needle in [
        (4, u + 1.0, ValueError, "uniform_samples"),
        (5, uf.double(), TypeError, "uniform_final"),
        (6, probs[:, :, :5], IndexError, "candidates"),
        (6, probs.double(), TypeError, "target_probs"),
        (6, probs[:1], ValueError, "target_probs"),
        (3, torch.full_like(sib, 8), IndexError, "retrieve_next_sibling"),
    ]:
        wrong = list(args)
        wrong[i] = bad
        with pytest.raises(exc, match=needle):
            ops.tree_speculative_sampling(*wrong)
    with pytest.raises(ValueError, match="top_p"):
        ops.top_k_top_p_renorm(probs[0], torch.zeros(8, dtype=torch.int64), torch.zeros(8))
    with pytest.raises(ValueError, match="top_k"):
        ops.top_k_top_p_renorm(probs[0], torch.zeros(3, dtype=torch.int64), torch.ones(8))
    with pytest.raises(ValueError, match="mass"):
        ops.top_k_top_p_renorm(torch.zeros(1, 4), torch.zeros(1, dtype=torch.int64), torch.ones(1))
