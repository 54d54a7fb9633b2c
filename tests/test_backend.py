"""The `specdec` torch.compile backend: registered with Dynamo through the entry point, really
used, and compiled == eager on a stock HF model."""
from importlib.metadata import entry_points

import pytest
import torch

import specdec_inductor.backend as backend

transformers = pytest.importorskip("transformers")


def test_entry_point_registers_backend():
    eps = entry_points(group="torch_dynamo_backends")
    assert "specdec" in [ep.name for ep in eps]
    assert "specdec" in torch._dynamo.list_backends()
    assert torch._dynamo.lookup_backend("specdec") is backend.specdec_backend


def test_compile_stock_model_with_specdec_backend():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = torch.tensor([[1, 5, 9, 3, 2]])
    before = backend.compiled_graphs
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        compiled = torch.compile(model, backend="specdec", fullgraph=True)(ids, use_cache=False).logits
    assert backend.compiled_graphs > before  # our backend ran, not a fallback
    torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)
