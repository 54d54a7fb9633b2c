"""Every speculative method on the default model (SmolLM2-135M-Instruct), batch 8 with ragged
prompts and ragged acceptance, greedy: output == the same engine's plain greedy output token for
token, and both KV pools are fully free afterwards. Eager (30-layer compiles cost minutes here;
compiled == eager is tested on tiny models). The drafts are whatever exists offline: NGRAM,
SmolLM2 cut to 8 layers (STANDALONE) and a random head in the EAGLE layout -- the last two
rarely get a draft accepted, so they pin exactness, not speed."""
import pytest

pytest.importorskip("transformers")

from specdec_inductor.engine.engine import Engine  # noqa: E402
from specdec_inductor.loading import keep_first_layers, load_model  # noqa: E402
from specdec_inductor.proposers.eagle import EagleProposer, load_eagle_head  # noqa: E402
from specdec_inductor.proposers.ngram import NgramProposer  # noqa: E402
from specdec_inductor.proposers.standalone import StandaloneProposer  # noqa: E402
from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats  # noqa: E402
from specdec_inductor.testing import write_random_eagle_checkpoint  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "Count: one, two, three, four, one, two, three,",
    "Q: What is 17 times 3?\nA:",
    "Write a haiku about autumn leaves.",
    "Repeat after me: the quick brown fox. The quick brown fox. The quick",
    "List three colors:",
    "Hello",
]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def target():
    model, tokenizer = load_model()
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    return model, prompts, tokenizer.eos_token_id


def _check(engine, proposer, prompts, eos, *drafts):
    plain = engine.generate(prompts, NEW_TOKENS, eos_token_id=eos)
    stats = SpeculativeStats()
    got = SpeculativeGenerator(engine, proposer, min_accepted=0.0).generate(
        prompts, NEW_TOKENS, eos_token_id=eos, stats=stats)
    assert got == plain
    for e in (engine,) + drafts:
        e.pool.check_consistent()
        assert e.pool.num_free_slots == e.pool.num_slots
    return stats


def test_ngram_batch8(target):
    model, prompts, eos = target
    engine = Engine(model, max_batch=8, max_len=96, compile=False, prefill_chunk=16)
    stats = _check(engine, NgramProposer(num_draft_tokens=6, breadth=(2, 1)), prompts, eos)
    assert stats.accepted_drafts > 0  # the repetitive prompts get drafts accepted


def test_standalone_batch8(target):
    model, prompts, eos = target
    engine = Engine(model, max_batch=8, max_len=96, compile=False, prefill_chunk=16)
    draft_model = keep_first_layers(load_model()[0], 8)
    draft = Engine(draft_model, max_batch=8, max_len=96, compile=False, prefill_chunk=16)
    _check(engine, StandaloneProposer(draft, 4), prompts, eos, draft)


def test_eagle_batch8(target, tmp_path):
    model, prompts, eos = target
    write_random_eagle_checkpoint(str(tmp_path), model.config, scale=0.02)
    engine = Engine(model, max_batch=8, max_len=96, compile=False, prefill_chunk=16,
                    capture_hidden=[-1])
    head = load_eagle_head(str(tmp_path), model)
    draft = Engine(head, max_batch=8, max_len=96, compile=False, prefill_chunk=16,
                   capture_hidden=[-1])
    _check(engine, EagleProposer(draft, 4), prompts, eos, draft)
