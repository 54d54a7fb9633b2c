"""Stock HF models (tiny random Llama, Qwen2, Qwen3, Mistral) through our attention and pool:
logits equal to the stock model's and greedy tokens equal to `generate(do_sample=False)`."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor.engine import attention_backend as ab  # noqa: E402
from specdec_inductor.engine.engine import Engine  # noqa: E402

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


def tiny_model(arch: str, seed: int = 0):
    configs = {
        "llama": lambda: transformers.LlamaConfig(**TINY),
        "qwen2": lambda: transformers.Qwen2Config(**TINY),
        "qwen3": lambda: transformers.Qwen3Config(**TINY, head_dim=16),
        "mistral": lambda: transformers.MistralConfig(**TINY, sliding_window=None),
    }
    torch.manual_seed(seed)
    config = configs[arch]()
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def eager_backends():
    names = ["torch", "reference"]
    if ab.ops_available():
        names.insert(0, "ops")
    return names


PROMPTS = [[5, 17, 99, 3, 42], [7, 7, 1, 250, 8, 9, 10, 11, 12], [200]]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("attention", eager_backends())
def test_prefill_and_decode_logits_match_stock(arch, attention):
    model = tiny_model(arch)
    with torch.no_grad():
        stock = [model(torch.tensor([p])).logits[0] for p in PROMPTS]  # [T, V] each
        nxt = [int(s[-1].argmax()) for s in stock]
        stock_next = [model(torch.tensor([p + [n]])).logits[0, -1] for p, n in zip(PROMPTS, nxt)]
    engine = Engine(model, max_batch=4, max_len=32, compile=False, attention=attention,
                    prefill_chunk=4)  # 4-token chunks: the 9-token prompt takes 3 chunks
    assert engine.attention_backend is ab.AttentionBackend(attention)
    reqs = engine.pool.admit([len(p) for p in PROMPTS], max_new_tokens=2)
    rows = torch.tensor([r.row for r in reqs] + [engine.pool.padding_row])  # bucket of 4
    last = engine.prefill(PROMPTS, rows).logits  # [4, V]
    for b, s in enumerate(stock):
        torch.testing.assert_close(last[b], s[-1], atol=1e-4, rtol=1e-4)
    seq_lens = torch.tensor([len(p) for p in PROMPTS] + [1])
    tokens, logits, _ = engine.decode(last.argmax(-1), rows, seq_lens)
    assert tokens[:3].tolist() == [int(s.argmax()) for s in stock_next]
    for b, s in enumerate(stock_next):
        torch.testing.assert_close(logits[b], s, atol=1e-4, rtol=1e-4)
    for r in reqs:
        engine.pool.release(r)
    engine.pool.check_consistent()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefill_runs_the_lm_head_on_last_rows_only(arch):
    """A prefill chunk feeds the LM head each request's last row (HF's logits_to_keep), not
    every row of the chunk; the logits still match stock."""
    model = tiny_model(arch)
    prompts = PROMPTS[:2]  # 5 and 9 tokens: the second ends in the second chunk
    with torch.no_grad():
        stock = [model(torch.tensor([p])).logits[0, -1] for p in prompts]  # before Engine
    seen = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda mod, inp, out: seen.append(tuple(inp[0].shape)))
    try:
        engine = Engine(model, max_batch=2, max_len=32, compile=False, attention="torch",
                        prefill_chunk=8)
        assert engine.keeps_last_rows
        reqs = engine.pool.admit([len(p) for p in prompts], 1)
        last = engine.prefill(prompts, torch.tensor([r.row for r in reqs])).logits
    finally:
        hook.remove()
    assert seen == [(2, 2, TINY["hidden_size"])] * 2, seen  # 2 chunks x [B, B, H], not [B, 8, H]
    for b, s in enumerate(stock):
        torch.testing.assert_close(last[b], s, atol=1e-4, rtol=1e-4)
    for r in reqs:
        engine.pool.release(r)
    engine.pool.check_consistent()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_extend_logits_all_positions_match_stock(arch):
    """Every position of a ragged, right-padded single-chunk batch equals the stock logits."""
    model = tiny_model(arch, seed=1)
    prompts = PROMPTS[:2]
    with torch.no_grad():
        stock = [model(torch.tensor([p])).logits[0] for p in prompts]
    engine = Engine(model, max_batch=2, max_len=16, compile=False, attention="torch")
    reqs = engine.pool.admit([len(p) for p in prompts], 1)
    ids = torch.zeros(2, 9, dtype=torch.int64)  # [B, T], right-padded
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    logits = engine.extend(ids, torch.arange(9).expand(2, 9), torch.tensor([r.row for r in reqs]),
                           torch.zeros(2, dtype=torch.int64), lens).logits
    for b, s in enumerate(stock):
        torch.testing.assert_close(logits[b, :len(prompts[b])], s, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_tokens_equal_hf_generate(arch):
    model = tiny_model(arch, seed=2)
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                                   pad_token_id=0)[0, len(p):].tolist() for p in PROMPTS]
    engine = Engine(model, max_batch=4, max_len=32, compile=False, attention="torch",
                    prefill_chunk=4)
    assert engine.generate(PROMPTS, max_new_tokens=12) == expected
    assert engine.generate(PROMPTS[1:2], max_new_tokens=12) == expected[1:2]
    engine.pool.check_consistent()
    assert engine.pool.num_free_slots == engine.pool.num_slots


def test_model_without_pool_metadata_raises():
    model = tiny_model("llama")
    Engine(model, max_batch=1, max_len=8, compile=False, attention="torch")
    with pytest.raises(RuntimeError, match="specdec_batch"):
        model(torch.tensor([[1, 2]]), use_cache=False)
