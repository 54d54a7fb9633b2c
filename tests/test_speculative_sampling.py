"""Sampling through the shared speculative loop (sampler.py): the emitted tokens of sampled
requests follow the target's sampling distribution exactly (exact marginals by enumeration on a
tiny model, chi-square, and a deliberately biased rule that the same test catches), seeded runs
repeat, greedy requests mixed into a sampled batch stay exactly greedy, eager == compiled for the
same seeds, and bad sampling arguments are rejected by name."""
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor import ops  # noqa: E402
from specdec_inductor.engine.engine import Engine  # noqa: E402
from specdec_inductor.proposers.ngram import NgramProposer  # noqa: E402
from specdec_inductor.sampler import Sampler, SamplingParams  # noqa: E402
from specdec_inductor.speculative import DraftTree, Proposer, SpeculativeGenerator  # noqa: E402

VOCAB = 48
PROMPT = [3, 17, 5, 9, 3, 17, 5]


def tiny_model(seed=0, sharpen=6.0):
    """Tiny random Llama whose next-token distributions are peaked enough (lm_head scaled)
    that drafts are accepted often and rejected often."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return model


def _probs(model, seqs, params):
    """Target sampling distributions [S, V] of the next token after each sequence."""
    with torch.no_grad():
        logits = model(torch.tensor(seqs)).logits[:, -1].float()  # [S, V]
    s = Sampler([params] * len(seqs))
    return s.target_probs(logits.unsqueeze(1))[:, 0]


class _TableProposer(Proposer):
    """Drafts, on each request's first step only, a 4-node tree rooted at the prefill's token
    x0: two siblings (the target's two likeliest x1) and, under the first, its likeliest x2.
    Later steps draft nothing, so they run the loop's plain (sampled) decode step."""

    num_draft_tokens = 4
    num_spec_steps = 3

    def __init__(self, table):
        self.table = table  # x0 -> (a, b, c)

    def start(self, request_ids, contexts):
        self.root = {r: c[-1] for r, c in zip(request_ids, contexts)}
        self.fresh = set(request_ids)

    def propose(self, request_ids, seq_lens):
        n = self.num_draft_tokens
        tokens, masks, drafts = [], [], []
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]],
                            dtype=torch.bool)  # node 1 = a, node 2 = b (sibling), node 3 = c
        for r in request_ids:
            if r in self.fresh:
                a, b, c = self.table[self.root[r]]
                tokens.append([self.root[r], a, b, c])
                masks.append(tree)
                drafts.append(3)
            else:
                tokens.append([self.root[r], 0, 0, 0])
                masks.append(tree)
                drafts.append(0)
        mask = torch.stack(masks).flatten()
        positions, ridx, nxt, sib = ops.reconstruct_tree_from_mask(mask, seq_lens, n)
        return DraftTree(torch.tensor(tokens), mask, positions, ridx, nxt, sib,
                         torch.tensor(drafts))

    def commit(self, request_ids, emitted):
        for r, e in zip(request_ids, emitted):
            if e:
                self.fresh.discard(r)
                self.root[r] = e[-1]

    def finish(self, request_ids):
        pass


def _exact_marginals(model, params):
    """Exact P(x0), P(x1), P(x2) of plain sampling after PROMPT, by enumeration."""
    p0 = _probs(model, [PROMPT], params)[0]  # [V]
    p1 = _probs(model, [PROMPT + [x0] for x0 in range(VOCAB)], params)  # [V(x0), V(x1)]
    seqs = [PROMPT + [x0, x1] for x0 in range(VOCAB) for x1 in range(VOCAB)]
    p2 = _probs(model, seqs, params).view(VOCAB, VOCAB, VOCAB)  # [x0, x1, x2]
    joint01 = p0.view(-1, 1) * p1  # [x0, x1]
    return [p0, joint01.sum(0), (joint01.unsqueeze(-1) * p2).sum((0, 1))], p1, p2


def _draft_table(p1, p2):
    table = {}
    for x0 in range(VOCAB):
        a, b = p1[x0].topk(2).indices.tolist()
        table[x0] = (a, b, int(p2[x0, a].argmax()))
    return table


def _chi2(counts, expected_probs, total):
    """Chi-square statistic and degrees of freedom, cells with expected count < 5 merged."""
    exp = expected_probs.double() * total
    big = exp >= 5
    obs_cells = counts[big].double().tolist() + [float(counts[~big].sum())]
    exp_cells = exp[big].tolist() + [float(exp[~big].sum())]
    if exp_cells[-1] < 5:  # fold a tiny remainder into the largest cell
        obs_cells[0] += obs_cells.pop()
        exp_cells[0] += exp_cells.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(obs_cells, exp_cells))
    return stat, len(exp_cells) - 1


def _critical(df, z=3.29):
    """Wilson-Hilferty chi-square quantile (z = 3.29: p = 0.0005)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _sample_marginals(model, params, samples, table, tree_sampling=None):
    engine = Engine(model, max_batch=16, max_len=64, compile=False, prefill_chunk=16)
    spec = SpeculativeGenerator(engine, _TableProposer(table), min_accepted=0.0)
    if tree_sampling is not None:
        spec.tree_sampling = tree_sampling
    counts = [torch.zeros(VOCAB, dtype=torch.int64) for _ in range(3)]
    seed = 0
    for _ in range(samples // 16):
        batch = [SamplingParams(params.temperature, params.top_k, params.top_p, seed + i)
                 for i in range(16)]
        seed += 16
        for out in spec.generate([PROMPT] * 16, 3, sampling=batch):
            for pos, tok in enumerate(out):
                counts[pos][tok] += 1
    engine.pool.check_consistent()
    assert engine.pool.num_free_slots == engine.pool.num_slots
    return counts


def _biased_tree_sampling(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                          uniform_samples, uniform_final, target_probs, num_spec_steps):
    """A wrong rule: after the walk stops, the bonus comes from the plain target
    distribution instead of the residual (so a rejected draft can be re-emitted)."""
    predicts, accept_index, accept_num = ops.tree_speculative_sampling(
        candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, uniform_samples,
        uniform_final, target_probs, num_spec_steps)
    bs = candidates.shape[0]
    for b in range(bs):
        k = int(accept_num[b])
        last = int(accept_index[b, k])
        node = last - b * candidates.shape[1]
        cdf = target_probs[b, node].double().cumsum(0)
        predicts[last] = int(torch.searchsorted(cdf, float(uniform_final[b]) * float(cdf[-1])))
    return predicts, accept_index, accept_num


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8),
                                    SamplingParams(temperature=1.3, top_k=12, top_p=0.9)],
                         ids=["t0.8", "t1.3-topk12-topp0.9"])
def test_speculative_sampling_is_lossless_and_a_biased_rule_is_caught(params):
    model = tiny_model()
    marginals, p1, p2 = _exact_marginals(model, params)
    table = _draft_table(p1, p2)
    n = 4800
    counts = _sample_marginals(model, params, n, table)
    for pos in range(3):
        stat, df = _chi2(counts[pos], marginals[pos], n)
        assert stat < _critical(df), (pos, stat, df)
    # The same test rejects the wrong rule (x0 comes from the prefill, so only x1, x2 can move).
    biased = _sample_marginals(model, params, n, table, _biased_tree_sampling)
    ratios = []
    for pos in (1, 2):
        stat, df = _chi2(biased[pos], marginals[pos], n)
        ratios.append(stat / _critical(df))
    assert max(ratios) > 1.0, ratios


def _repetitive_prompts():
    gen = torch.Generator().manual_seed(4)
    prompts = []
    for i in range(3):
        phrase = torch.randint(0, VOCAB, (4 + i,), generator=gen).tolist()
        prompts.append(phrase + [i] + phrase + phrase[:2])
    return prompts


def test_seeded_runs_repeat_and_greedy_requests_stay_greedy():
    model = tiny_model(seed=1, sharpen=3.0)
    prompts = _repetitive_prompts()
    engine = Engine(model, max_batch=4, max_len=96, compile=False, prefill_chunk=16)
    greedy = engine.generate(prompts, 24)
    spec = SpeculativeGenerator(engine, NgramProposer(num_draft_tokens=5, breadth=(2, 1)))
    mixed = [SamplingParams(0.9, seed=11), SamplingParams(), SamplingParams(0.9, seed=12)]
    first = spec.generate(prompts, 24, sampling=mixed)
    again = spec.generate(prompts, 24, sampling=mixed)
    assert first == again
    assert first[1] == greedy[1]  # the greedy request of a sampled batch is exactly greedy
    other = spec.generate(prompts, 24, sampling=[SamplingParams(0.9, seed=99), SamplingParams(),
                                                 SamplingParams(0.9, seed=98)])
    assert other[0] != first[0] or other[2] != first[2]  # the seeds matter
    assert spec.generate(prompts, 24, sampling=SamplingParams()) == greedy  # T=0: greedy path
    engine.pool.check_consistent()
    assert engine.pool.num_free_slots == engine.pool.num_slots


def test_sampled_eager_equals_compiled_for_the_same_seeds():
    model = tiny_model(seed=2, sharpen=3.0)
    prompts = _repetitive_prompts()[:2]
    params = [SamplingParams(0.7, top_k=20, seed=5), SamplingParams(1.0, top_p=0.8, seed=6)]
    outs = []
    for compiled in (False, True):
        engine = Engine(model, max_batch=2, max_len=96, compile=compiled, prefill_chunk=16)
        spec = SpeculativeGenerator(engine, NgramProposer(num_draft_tokens=4, breadth=(2, 1)),
                                    tree_sizes=(1, 4))
        outs.append(spec.generate(prompts, 16, sampling=params))
    assert outs[0] == outs[1]


def test_sampled_program_and_pieces_emit_the_same_tokens():
    """A sampled batch's step as one program (SampledStep: verify, rejection sampling and
    commit) and in pieces (the engine's verify graph, then Sampler.verify and the commit op by
    op: one_program = False) draw the same uniforms and emit the same tokens for the same
    seeds; only the pieces call the engine's verify."""
    model = tiny_model(seed=3, sharpen=3.0)
    prompts = _repetitive_prompts()
    engine = Engine(model, max_batch=4, max_len=96, compile=False, prefill_chunk=16)
    spec = SpeculativeGenerator(engine, NgramProposer(num_draft_tokens=5, breadth=(2, 1)),
                                min_accepted=0.0)
    mixed = [SamplingParams(0.9, top_k=10, seed=21), SamplingParams(),
             SamplingParams(1.1, top_p=0.85, seed=22)]
    calls = []
    verify = engine.verify
    engine.verify = lambda *a, **k: (calls.append(1), verify(*a, **k))[1]
    whole = spec.generate(prompts, 20, sampling=mixed)
    assert not calls
    spec.one_program = False
    assert spec.generate(prompts, 20, sampling=mixed) == whole
    assert calls
    assert whole[1] == engine.generate(prompts[1:2], 20)[0]


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "argument 'temperature'"),
    (dict(temperature=float("nan")), "argument 'temperature'"),
    (dict(temperature=float("inf")), "argument 'temperature'"),
    (dict(top_k=-1), "argument 'top_k'"),
    (dict(top_k=2.5), "argument 'top_k'"),
    (dict(top_p=0.0), "argument 'top_p'"),
    (dict(top_p=1.5), "argument 'top_p'"),
    (dict(seed="x"), "argument 'seed'"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_sampling_list_must_match_the_batch():
    with pytest.raises(ValueError, match="argument 'sampling' has 1 entries for 2 prompts"):
        Sampler.for_batch([SamplingParams(0.5)], 2)
    with pytest.raises(TypeError, match=r"argument 'sampling' \[0\]"):
        Sampler.for_batch([0.5], 1)
