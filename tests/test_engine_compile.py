"""Compiled engine on a tiny random Llama: one graph per (batch bucket, step kind), no
recompiles over 256 decode steps with varying lengths, compiled == eager == SPECDEC_EAGER=1."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

import specdec_inductor  # noqa: E402
from specdec_inductor.engine import attention_backend as ab  # noqa: E402
from specdec_inductor.ops import packed_weight_stats  # noqa: E402
from specdec_inductor.engine.engine import Engine  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**TINY)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def compiled_engine():
    torch._dynamo.reset()
    engine = Engine(tiny_llama(), max_batch=2, max_len=320, compile=True, prefill_chunk=8)
    assert engine.compiled
    # The default backend is the C++ ops whenever they are built; TORCH otherwise.
    expected = ab.AttentionBackend.OPS if ab.ops_available() else ab.AttentionBackend.TORCH
    assert engine.attention_backend is expected
    return engine


def unique_graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def test_one_graph_per_bucket_and_kind_and_no_recompiles(compiled_engine):
    engine = compiled_engine
    before = unique_graphs()
    engine.generate([[1, 2, 3], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]], max_new_tokens=3)  # warm-up
    assert unique_graphs() - before == 2  # bucket 2: EXTEND (prefill chunk) + DECODE
    with torch.compiler.set_stance("fail_on_recompile"):
        # 2 x 128 = 256 decode steps, other prompt lengths and chunk counts, other rows.
        out_a = engine.generate([[9] * 17, [3, 1]], max_new_tokens=129)
        out_b = engine.generate([[2, 2, 2, 2, 5], list(range(20, 45))], max_new_tokens=129)
    assert unique_graphs() - before == 2
    assert [len(o) for o in out_a + out_b] == [129] * 4
    engine.pool.check_consistent()
    assert engine.pool.num_free_slots == engine.pool.num_slots


@pytest.mark.skipif(not {"avx2", "avx512"} & set(specdec_inductor.runnable_isas()),
                    reason="the packed skinny_linear kernels are AVX2 / AVX-512")
def test_steps_read_packed_weights(compiled_engine):
    # The backend registered the model's matrices: every GEMV of a prefill chunk (8 rows) and
    # decode step reads a packed copy; none falls back to the row kernel.
    compiled_engine.generate([[1, 2, 3]], max_new_tokens=2)  # packs outside the counted run
    specdec_inductor.reset_kernel_path_counts()
    compiled_engine.generate([[4, 5, 6, 7]], max_new_tokens=4)
    counts = specdec_inductor.kernel_path_counts()
    layers = TINY["num_hidden_layers"]
    # Per step (1 prefill chunk + 3 decode steps): q/k/v and gate/up as two packed groups per
    # layer (the linear_cat pass), o, down and the lm_head on their own.
    best = "avx512" if "avx512" in specdec_inductor.runnable_isas() else "avx2"
    assert counts.get(f"skinny_linear_cat_packed:{best}") == 4 * 2 * layers, counts
    assert counts.get(f"skinny_linear_packed:{best}") == 4 * (2 * layers + 1), counts
    assert not any(k.startswith("skinny_linear:") or "split" in k for k in counts), counts
    stats = packed_weight_stats()
    assert stats["groups"] >= 2 * layers and stats["packed"] >= 2 * layers + 1 and stats["bytes"] > 0


def test_compiled_equals_eager_and_env_eager(compiled_engine, monkeypatch):
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [100, 3]]
    compiled_tokens = compiled_engine.generate(prompts, max_new_tokens=24)
    eager = Engine(tiny_llama(), max_batch=2, max_len=64, compile=False,
                   attention=compiled_engine.attention_backend.value, prefill_chunk=8)
    assert eager.generate(prompts, max_new_tokens=24) == compiled_tokens
    monkeypatch.setenv("SPECDEC_EAGER", "1")
    env_eager = Engine(tiny_llama(), max_batch=2, max_len=64,
                       attention=compiled_engine.attention_backend.value, prefill_chunk=8)
    assert not env_eager.compiled
    assert env_eager.generate(prompts, max_new_tokens=24) == compiled_tokens


def test_compiled_logits_match_stock_model(compiled_engine):
    model = tiny_llama()
    prompt = [7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    with torch.no_grad():
        stock = model(torch.tensor([prompt])).logits[0, -1]
    engine = compiled_engine
    (req,) = engine.pool.admit([len(prompt)], 1)
    rows = torch.tensor([req.row, engine.pool.padding_row])
    try:
        last = engine.prefill([prompt], rows).logits
    finally:
        engine.pool.release(req)
    torch.testing.assert_close(last[0], stock, atol=1e-4, rtol=1e-4)


def test_reference_backend_refuses_compile():
    with pytest.raises(ValueError, match="eager-only"):
        Engine(tiny_llama(), max_batch=1, max_len=16, compile=True, attention="reference")
