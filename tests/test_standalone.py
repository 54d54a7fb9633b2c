"""STANDALONE drafts (proposers/standalone.py): greedy speculative output equals the target
engine's plain greedy output with a draft that is the target itself (then nearly every draft
is accepted, which pins the draft's KV bookkeeping) and with an unrelated draft (ragged batch,
ragged acceptance), under sampling with seeds, compiled without recompiles; both pools are
fully free afterwards."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor.engine.engine import Engine  # noqa: E402
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
         min_accepted=0.0):
    engine = Engine(target, max_batch=batch, max_len=128, compile=compiled, prefill_chunk=16)
    draft_engine = Engine(draft, max_batch=batch, max_len=128, compile=compiled, prefill_chunk=16)
    ps = prompts(batch)
    plain = engine.generate(ps, max_new, eos_token_id=eos)
    spec = SpeculativeGenerator(engine, StandaloneProposer(draft_engine, n),
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
