"""A verify row reproduces the decode step's row bit for bit in the compiled engine (what
makes greedy speculation emit exactly plain greedy's tokens), even where Inductor would split a
one-row reduction across threads: the engine's step graphs keep every row's reductions serial
(engine.batch_invariant_options)."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor.engine.engine import Engine, batch_invariant_options  # noqa: E402
from specdec_inductor.speculative import star_tree  # noqa: E402

# hidden 256: at Inductor's default minimum chunk (512) the norms stay serial on 2 threads, so
# the test lowers the global minimum to 64 (a 128-element share per thread would be split).
TINY = dict(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
PROMPT = [3, 14, 15, 92, 65, 35, 8, 9]


def tiny_llama():
    torch.manual_seed(5)
    config = transformers.LlamaConfig(**TINY)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_options_keep_reductions_over_the_hidden_size_serial():
    assert batch_invariant_options(1536)["cpp.min_chunk_size"] > 1536
    assert batch_invariant_options(8192)["cpp.min_chunk_size"] > 8192
    assert batch_invariant_options(32)["cpp.min_chunk_size"] >= 4096


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="a split reduction needs 2 threads")
def test_verify_rows_equal_decode_rows_bitwise():
    with torch._inductor.config.patch({"cpp.min_chunk_size": 64}):
        engine = Engine(tiny_llama(), max_batch=1, max_len=64, compile=True, prefill_chunk=8)
        (req,) = engine.pool.admit([len(PROMPT)], 16)
        try:
            rows = torch.tensor([req.row])
            first = int(engine.prefill([PROMPT], rows).argmax[0])
            n = len(PROMPT)
            decoded = [first]
            decode_logits = []
            for step in range(4):  # decode steps at positions n .. n+3
                out = engine.decode(torch.tensor([decoded[-1]]), rows, torch.tensor([n + step]))
                decode_logits.append(out.logits[0].clone())
                decoded.append(int(out.argmax[0]))
            # The same tokens again, each as the root of a verify(4) at its position (the KV
            # it rewrites is the same), its children other tokens.
            mask, depth = star_tree(4)
            for step in range(4):
                tokens = torch.tensor([[decoded[step], 1, 2, 3]])
                positions = (n + step) + depth.view(1, 4)
                out = engine.verify(tokens, positions, rows, torch.tensor([n + step]), mask)
                assert torch.equal(out.logits[0, 0], decode_logits[step]), step
        finally:
            engine.pool.release(req)
        engine.pool.check_consistent()
