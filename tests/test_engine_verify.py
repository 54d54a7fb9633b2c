"""verify(N): a draft tree through the target in one pass; each node's logits equal the stock
model's on the root-to-node path (tiny random Llama), eager and compiled."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor.engine.engine import Engine  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

PROMPT = [3, 14, 15, 92, 65, 35]
# Tree: node 0 = root r; 1 = a (child of r); 2 = b (child of a); 3 = c (child of r).
TREE_TOKENS = [7, 21, 40, 99]
PARENTS = [-1, 0, 1, 0]
DEPTHS = [0, 1, 2, 1]


def tiny_llama():
    torch.manual_seed(3)
    config = transformers.LlamaConfig(**TINY)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def ancestor_mask():
    n = len(PARENTS)
    mask = torch.zeros(n, n, dtype=torch.bool)  # [N, N]
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = PARENTS[j]
    return mask


def path(i):
    nodes = []
    while i >= 0:
        nodes.append(TREE_TOKENS[i])
        i = PARENTS[i]
    return nodes[::-1]


@pytest.mark.parametrize("compiled", [False, True])
def test_verify_tree_logits_equal_stock_paths(compiled):
    model = tiny_llama()
    with torch.no_grad():
        stock = [model(torch.tensor([PROMPT + path(i)])).logits[0, -1] for i in range(4)]
    engine = Engine(model, max_batch=1, max_len=32, compile=compiled, prefill_chunk=8)
    (req,) = engine.pool.admit([len(PROMPT)], max_new_tokens=8)
    rows = torch.tensor([req.row])
    engine.prefill([PROMPT], rows)
    seq_lens = torch.tensor([len(PROMPT)])
    positions = seq_lens.view(1, 1) + torch.tensor([DEPTHS])  # [1, N]
    mask = ancestor_mask().flatten()  # QLEN_ONLY [B*N*N]
    argmax, logits, _ = engine.verify(torch.tensor([TREE_TOKENS]), positions, rows, seq_lens, mask)
    for i in range(4):
        torch.testing.assert_close(logits[0, i], stock[i], atol=1e-4, rtol=1e-4)
    assert torch.equal(argmax, logits.argmax(-1))  # the graph's own argmax, [1, N]
    # The drafts' KV sits at positions [seq_len, seq_len + N) of the row.
    assert (engine.pool.k[0][req.slots[len(PROMPT):len(PROMPT) + 4]].abs().sum((1, 2)) > 0).all()
    engine.pool.release(req)
    engine.pool.check_consistent()
