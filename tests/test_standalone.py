"""STANDALONE drafts (proposers/standalone.py): greedy speculative output equals the target
engine's plain greedy output with a draft that is the target itself (then nearly every draft
is accepted, which pins the draft's KV bookkeeping) and with an unrelated draft (ragged batch,
ragged acceptance), under sampling with seeds, compiled without recompiles; both pools are
fully free afterwards. A draft vocabulary (proposers/draft_vocab.py: the draft's LM head kept
to Vd ids, a view or a gather of its rows, never a dense copy of quantized ones) keeps greedy
output exact and sampling lossless, and bad vocabularies are refused by name."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor.engine.engine import Engine  # noqa: E402
from specdec_inductor.proposers import draft_vocab  # noqa: E402
from specdec_inductor.proposers.draft_vocab import DraftVocabError, restrict_lm_head  # noqa: E402
from specdec_inductor.proposers.standalone import StandaloneProposer  # noqa: E402
from specdec_inductor.sampler import SamplingParams  # noqa: E402
from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats  # noqa: E402

VOCAB = 96


FAMILIES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
            "mistral": "MistralConfig"}


def tiny(seed, layers=2, hidden=32, family="llama"):
    torch.manual_seed(seed)
    extra = dict(head_dim=hidden // 4) if family == "qwen3" else {}
    config = getattr(transformers, FAMILIES[family])(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, **extra)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def prompts(count, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (3 + 5 * i,), generator=gen).tolist() for i in range(count)]


def _run(target, draft, batch, max_new, n, *, compiled=False, eos=None, sampling=None,
         min_accepted=0.0, topk=1):
    engine = Engine(target, max_batch=batch, max_len=128, compile=compiled, prefill_chunk=16)
    # a tree decodes one virtual row per beam and writes topk*(depth-1) slots past the target's
    draft_engine = Engine(draft, max_batch=batch * (1 + topk if topk > 1 else 1),
                          max_len=128 + topk * n, compile=compiled, prefill_chunk=16)
    ps = prompts(batch)
    plain = engine.generate(ps, max_new, eos_token_id=eos)
    depth = 3 if topk > 1 else None
    spec = SpeculativeGenerator(engine, StandaloneProposer(draft_engine, n, topk=topk, depth=depth),
                                min_accepted=min_accepted)
    stats = SpeculativeStats()
    got = spec.generate(ps, max_new, eos_token_id=eos, stats=stats, sampling=sampling)
    for e in (engine, draft_engine):
        e.pool.check_consistent()
        assert e.pool.num_free_slots == e.pool.num_slots
        assert not e.pool.live_requests
    return plain, got, stats, spec


def test_self_draft_accepts_nearly_everything_and_is_exact():
    target = tiny(0)
    plain, got, stats, _ = _run(target, copy.deepcopy(target), 1, 40, 5)
    assert got == plain
    # The draft is the target: only GEMM-vs-GEMV rounding can reject a draft.
    assert stats.mean_accepted_length > 0.9 * 5, stats.summary()


@pytest.mark.parametrize("n", [2, 4, 6])
def test_unrelated_draft_ragged_batch_is_exact(n):
    plain, got, stats, _ = _run(tiny(0), tiny(7, layers=1, hidden=16), 3, 30, n)
    assert got == plain
    assert stats.verify_steps > stats.decode_steps


def test_batch_of_eight_with_eos_and_short_limits():
    target = tiny(1)
    plain, got, _, _ = _run(target, copy.deepcopy(target), 8, 25, 4, eos=5)
    assert got == plain
    for max_new in (1, 2, 3):
        plain, got, _, _ = _run(target, tiny(2, layers=1), 2, max_new, 4)
        assert got == plain


def test_sampled_standalone_repeats_with_seeds():
    target = tiny(0)
    params = [SamplingParams(0.8, seed=1), SamplingParams(), SamplingParams(1.0, top_k=10, seed=2)]
    plain, first, _, spec = _run(target, copy.deepcopy(target), 3, 20, 4, sampling=params)
    assert first[1] == plain[1]  # the greedy request stays greedy
    assert spec.generate(prompts(3), 20, sampling=params) == first


def test_compiled_no_recompiles_after_warmup():
    target = tiny(0)
    plain, got, _, spec = _run(target, copy.deepcopy(target), 2, 12, 4, compiled=True)
    assert got == plain
    with torch.compiler.set_stance("fail_on_recompile"):
        assert spec.generate(prompts(2, seed=9), 16) == spec.engine.generate(prompts(2, seed=9), 16)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_draft_tokens"):
        StandaloneProposer(None, 1)


def test_gated_steps_skip_the_draft_and_catch_up_later():
    """A poor draft trips the acceptance gate: plain decode steps run without drafting, and
    the next draft step catches the draft's KV up over all the tokens committed meanwhile."""
    plain, got, stats, _ = _run(tiny(0), tiny(7, layers=1, hidden=16), 3, 40, 5,
                                min_accepted=None)
    assert got == plain
    assert stats.decode_steps > 0 and stats.verify_steps > stats.decode_steps, stats.summary()


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "mistral"])
def test_other_families_target_and_draft(family):
    target = tiny(0, family=family)
    plain, got, _, _ = _run(target, copy.deepcopy(target), 3, 20, 4)
    assert got == plain
    plain, got, _, _ = _run(target, tiny(5, layers=1, family=family), 3, 20, 4)
    assert got == plain


# -- draft vocabularies ----------------------------------------------------------------------------
EVERY_OTHER = torch.arange(0, VOCAB, 2)  # 48 ids: not one run, so the head's rows are gathered


def with_vocab(model, ids):
    draft = copy.deepcopy(model)
    restrict_lm_head(draft, ids)
    return draft


def _recorded(spec):
    """Every draft token the generator's proposer offers (its propose wrapped; trees are
    drafted by propose, not inside the step program, which drafts the same trees:
    test_step_api's test_drafting_inside_the_step_program_keeps_trees_and_tokens), as a list
    it fills."""
    spec.draft_in_program = False
    proposer = spec.proposer
    seen, propose = [], proposer.propose

    def recording(request_ids, seq_lens):
        tree = propose(request_ids, seq_lens)
        for b, n in enumerate(tree.num_drafts.tolist()):
            seen.extend(tree.tokens[b, 1:].tolist() if n else [])
        return tree
    proposer.propose = recording
    return seen


@pytest.mark.parametrize("topk", [1, 2])
def test_draft_vocabulary_keeps_greedy_exact_and_drafts_only_its_ids(topk):
    target = tiny(0)
    draft = with_vocab(target, EVERY_OTHER)
    engine = Engine(target, max_batch=3, max_len=128, compile=False, prefill_chunk=16)
    assert Engine(draft, max_batch=1, max_len=16, compile=False).vocab_size == EVERY_OTHER.numel()
    # the target itself as the draft, restricted: it drafts the target's token where the
    # vocabulary has it, so drafts are accepted and rejected
    plain, got, stats, spec = _run(target, draft, 3, 30, 5, topk=topk, min_accepted=None)
    assert got == plain
    seen = _recorded(spec)
    ps = prompts(3, seed=8)
    assert spec.generate(ps, 24, stats=(stats := SpeculativeStats())) == engine.generate(ps, 24)
    assert seen and set(seen) <= set(EVERY_OTHER.tolist())
    assert 0 < stats.mean_accepted_length - 1 < 4, stats.summary()


def test_compiled_draft_vocabulary_no_recompiles_after_warmup():
    target = tiny(0)
    plain, got, _, spec = _run(target, with_vocab(target, torch.arange(16, 64)), 2, 12, 4,
                               compiled=True)
    assert got == plain
    with torch.compiler.set_stance("fail_on_recompile"):
        assert spec.generate(prompts(2, seed=9), 16) == spec.engine.generate(prompts(2, seed=9), 16)


def test_sampled_drafts_over_a_draft_vocabulary_stay_lossless():
    """The drafts are the draft's argmax over its Vd columns, candidates that the target's
    tree rejection sampling accepts against its own distribution: the emitted tokens' marginals
    are plain sampling's (exact, by enumeration; chi-square as test_speculative_sampling)."""
    from test_speculative_sampling import PROMPT, _chi2, _critical, _exact_marginals, tiny_model
    target = tiny_model()
    vocab = target.config.vocab_size
    ids = torch.arange(0, vocab, 3)  # 16 ids
    draft = with_vocab(target, ids)
    params = SamplingParams(temperature=0.8)
    marginals, _, _ = _exact_marginals(target, params)
    engine = Engine(target, max_batch=16, max_len=64, compile=False, prefill_chunk=16)
    draft_engine = Engine(draft, max_batch=16, max_len=64, compile=False, prefill_chunk=16)
    spec = SpeculativeGenerator(engine, StandaloneProposer(draft_engine, 4), min_accepted=0.0)
    n, stats = 3200, SpeculativeStats()
    counts = [torch.zeros(vocab, dtype=torch.int64) for _ in range(3)]
    for first in range(0, n, 16):
        batch = [SamplingParams(params.temperature, seed=first + i) for i in range(16)]
        for out in spec.generate([PROMPT] * 16, 3, sampling=batch, stats=stats):
            for pos, tok in enumerate(out):
                counts[pos][tok] += 1
    assert stats.verify_steps > 0 and stats.mean_accepted_length > 1, stats.summary()
    for pos in range(3):
        stat, df = _chi2(counts[pos], marginals[pos], n)
        assert stat < _critical(df), (pos, stat, df)
    for e in (engine, draft_engine):
        assert e.pool.num_free_slots == e.pool.num_slots


def test_draft_vocabulary_head_is_a_view_or_a_gather_in_the_heads_dtype():
    model = tiny(0).to(torch.bfloat16)
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    full = model.lm_head
    want = full(x)
    run = with_vocab(model, torch.arange(32, 80))  # deepcopy: compare with its own full head
    assert run.lm_head.weight.dtype == torch.bfloat16
    viewed = copy.deepcopy(model)
    base = viewed.lm_head.weight
    restrict_lm_head(viewed, torch.arange(32, 80))
    head = viewed.lm_head.weight
    assert head.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # no copy
    assert head.data_ptr() == base[32].data_ptr() and head.shape == (48, 32)
    torch.testing.assert_close(viewed.lm_head(x), want[:, 32:80], rtol=0, atol=0)
    gathered = with_vocab(model, EVERY_OTHER)
    assert gathered.lm_head.weight.dtype == torch.bfloat16  # the rows, never an fp32 copy
    torch.testing.assert_close(gathered.lm_head(x), want[:, EVERY_OTHER], rtol=0, atol=0)
    assert torch.equal(gathered.draft_to_target, EVERY_OTHER)
    # the input embedding stays whole: the draft reads every target token
    assert gathered.get_input_embeddings().weight.shape[0] == VOCAB


@pytest.mark.parametrize("bad,match", [
    (torch.arange(8), "multiple of 16"),
    (torch.arange(17), "multiple of 16"),
    (torch.arange(VOCAB), "below the draft's vocabulary"),
    (torch.arange(16).flip(0), "ascending"),
    (torch.cat([torch.arange(15), torch.tensor([14])]), "ascending"),
    (torch.arange(VOCAB - 8, VOCAB + 8), r"\[0, 96\)"),
    (torch.arange(16, dtype=torch.float32), "integer"),
    ([0, 1], "integer")])
def test_bad_draft_vocabularies_are_refused_by_name(bad, match):
    model = tiny(0)
    with pytest.raises(DraftVocabError, match=f"argument 'ids'.*{match}"):
        restrict_lm_head(model, bad)
    assert model.lm_head.out_features == VOCAB and getattr(model, "draft_to_target", None) is None
    restrict_lm_head(model, torch.arange(16))
    with pytest.raises(ValueError, match="already has a draft vocabulary"):
        restrict_lm_head(model, torch.arange(16))


class _CharTokenizer:
    """A stand-in tokenizer: one id per character (its code point mod `size`)."""

    def __init__(self, size):
        self.size = size

    def __call__(self, text):
        return {"input_ids": [ord(c) % self.size for c in text]}

    def get_vocab(self):
        return {chr(i): i for i in range(self.size)}


def test_frequency_ranking_orders_by_count_then_id_and_is_cached(monkeypatch, tmp_path):
    assert draft_vocab.rank_by_count(torch.tensor([0, 3, 1, 3, 0])).tolist() == [1, 3, 2, 0, 4]
    # the real sample: the standard library's sources, code with English prose
    text = next(iter(draft_vocab.stdlib_sources()))
    assert "def " in text or "import " in text
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(draft_vocab, "stdlib_sources", lambda: iter(["ccb", "cba", "d"]))
    tok = _CharTokenizer(128)
    ranking = draft_vocab.frequency_ranking(tok, 128)
    assert ranking[:4].tolist() == [ord("c"), ord("b"), ord("a"), ord("d")]
    assert sorted(ranking.tolist()) == list(range(128)) and ranking[4:].tolist() == sorted(
        set(range(128)) - {97, 98, 99, 100})
    assert draft_vocab.top_ids(ranking, 16).tolist() == sorted(ranking[:16].tolist())

    def no_sources():
        raise AssertionError("the cached ranking is read, not recomputed")
    monkeypatch.setattr(draft_vocab, "stdlib_sources", no_sources)
    assert torch.equal(draft_vocab.frequency_ranking(tok, 128), ranking)
    with pytest.raises(ValueError, match="argument 'tokenizer'"):
        draft_vocab.count_tokens(_CharTokenizer(128), 64, ["\x7f"])


@pytest.mark.parametrize("activation", ["FLOAT", "INT8"])
def test_quantized_head_rows_stay_quantized_and_one_run_is_a_view(tmp_path, monkeypatch,
                                                                   activation):
    """A GGUF draft's head (the tied Q8_0 embedding of a tiny llama GGUF: with INT8 on VNNI its
    16-row interleaved copy, which the embedding then reads too): one run of whole row groups
    is a view of its bytes, other ids a gather of their quantized rows; the logits are the full
    head's columns; the embedding stays whole; the tokenizer comes from the GGUF's metadata."""
    gguf = pytest.importorskip("gguf")
    from test_gguf_model import TYPES, write_tiny_gguf
    from specdec_inductor.engine.gguf_model import QuantLinear, load_gguf
    from specdec_inductor.loading import default_gguf_path
    from specdec_inductor.ops.quant import QuantActivation, QuantFormat, int8_path, is_repacked
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    fields = [f for f in gguf.GGUFReader(default_gguf_path()).fields.values()
              if f.name.startswith("tokenizer.")]
    path = str(tmp_path / "tiny.gguf")
    write_tiny_gguf(path, "llama", TYPES["llama"], fields)
    act = QuantActivation[activation]
    x = torch.randn(3, load_gguf(path, activation=act)[0].config.hidden_size)
    for ids, viewed in ((torch.arange(32, 96), True), (torch.arange(0, 512, 4), False)):
        model, _ = load_gguf(path, activation=act)
        full = model.lm_head
        embedding = model.model.embed_tokens.weight
        want = full(x)[:, ids]
        vnni = int8_path(QuantFormat.Q8_0_R16) == "avx512"
        assert is_repacked(full.fmt) == (activation == "INT8" and vnni)
        restrict_lm_head(model, ids)
        head = model.lm_head
        assert isinstance(head, QuantLinear) and head.weight.dtype == torch.uint8
        assert head.out_features == ids.numel() and head.fmt == full.fmt
        shares = head.weight.untyped_storage().data_ptr() == full.weight.untyped_storage().data_ptr()
        assert shares == viewed
        assert head.weight.numel() == full.weight.numel() * ids.numel() // full.out_features
        assert torch.equal(head.dequantized_weight(), full.dequantized_weight()[ids])
        torch.testing.assert_close(head(x), want, rtol=0, atol=0)
        assert model.model.embed_tokens.weight is embedding  # whole, untouched
    assert draft_vocab.model_tokenizer(model) is not None


# -- chains that end at an unsure draft --------------------------------------------------------------
def test_chains_ending_at_unsure_drafts_keep_greedy_exact_and_their_kv():
    """stop_below ends each request's chain at its first draft of probability below it: the
    chains of a ragged batch end at different depths, are verified at their own sizes, and
    with the target as its own draft every offered draft is accepted (the kept draft KV of a
    chain that ended early, and of one that ran on for the others, is exact)."""
    from test_speculative_sampling import tiny_model
    target = tiny_model(seed=1)  # random: top-1 probabilities of 0.06-0.14
    vocab = target.config.vocab_size
    gen = torch.Generator().manual_seed(6)
    ps = [torch.randint(0, vocab, (3 + 4 * i,), generator=gen).tolist() for i in range(3)]
    engine = Engine(target, max_batch=3, max_len=128, compile=False, prefill_chunk=16)
    draft_engine = Engine(copy.deepcopy(target), max_batch=3, max_len=128, compile=False,
                          prefill_chunk=16)
    plain = engine.generate(ps, 40)
    proposer = StandaloneProposer(draft_engine, 5, stop_below=0.08)
    offered, decodes = [], []
    propose, decode = proposer.propose, draft_engine.decode

    def counting(*args):
        decodes.append(1)
        return decode(*args)

    def recording(request_ids, seq_lens):
        decodes.clear()
        tree = propose(request_ids, seq_lens)
        offered.extend(tree.num_drafts.tolist())
        # the drafts a chain keeps the KV of are those the decodes wrote (one a decode)
        for r in request_ids:
            assert min(len(proposer._requests[r].proposed), proposer.k - 1) <= len(decodes)
        return tree
    draft_engine.decode = counting
    proposer.propose = recording
    spec = SpeculativeGenerator(engine, proposer, min_accepted=0.0)
    assert spec.tree_sizes == [1, 2, 3, 4, 5]  # variable_drafts: every size by default
    stats = SpeculativeStats()
    assert spec.generate(ps, 40, stats=stats) == plain
    assert len(set(offered)) >= 3, offered  # chains of several lengths
    assert len([s for s in stats.steps_by_size if s > 1]) >= 2, stats.steps_by_size
    # self-draft: every offered draft accepted, but for GEMM-vs-GEMV rounding and the drafts
    # past a request's max_new_tokens
    assert stats.accepted_drafts >= 0.9 * sum(offered) - 3 * 4, (stats.accepted_drafts, offered)
    for e in (engine, draft_engine):
        e.pool.check_consistent()
        assert e.pool.num_free_slots == e.pool.num_slots
    # without it, the same chains run to K drafts
    full = StandaloneProposer(draft_engine, 5)
    assert SpeculativeGenerator(engine, full, min_accepted=0.0).generate(ps, 40) == plain


@pytest.mark.parametrize("kwargs,match", [({"stop_below": 1.0}, "stop_below"),
                                          ({"stop_below": -0.1}, "stop_below"),
                                          ({"stop_below": True}, "stop_below"),
                                          ({"stop_below": "0.5"}, "stop_below"),
                                          ({"stop_below": 0.5, "topk": 2, "depth": 2},
                                           "chains")])
def test_bad_stop_below_is_refused_by_name(kwargs, match):
    draft_engine = Engine(tiny(0), max_batch=3, max_len=64, compile=False)
    with pytest.raises(ValueError, match=f"argument 'stop_below'.*{match}|{match}"):
        StandaloneProposer(draft_engine, 5, **kwargs)
