"""Compiled engine with its decoder layers as one nested compile region
(Engine(compile_layers_once=True), the default): each step's code compiles the layer once and
calls it per layer, stores K/V with a fused aten index_copy_ (the custom store_kv op cannot sit
inside a region), and gives the tokens of the per-layer graph and of eager mode. Also the
engine's Inductor options (no size asserts) and the parameter-layout check that replaces them."""
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import specdec_inductor  # noqa: E402
from specdec_inductor.engine import attention_backend as ab  # noqa: E402
from specdec_inductor.engine.engine import Engine  # noqa: E402
from specdec_inductor.engine.hf import (MIN_TORCH_FOR_REGIONS, compile_layers_once,  # noqa: E402
                                        layer_regions_supported)
from specdec_inductor.lowerings.compile import run_and_get_code  # noqa: E402

LAYERS = 3
TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [90, 3]]

pytestmark = pytest.mark.skipif(not ab.ops_available(), reason="the C++ attention ops are not built")
needs_regions = pytest.mark.skipif(not layer_regions_supported(),
                                   reason=f"layer regions need torch >= {MIN_TORCH_FOR_REGIONS}")


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**TINY)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def step_codes(engine):
    """(tokens, {"decode": code, "extend": code}) of a first generate, which compiles both."""
    tokens, codes = run_and_get_code(engine.generate, PROMPTS, 6)
    by_kind = {}
    for code in codes:
        kind = "decode" if "specdec.decode_attention" in code else "extend"
        assert kind not in by_kind, "one graph per step kind"
        by_kind[kind] = code
    assert set(by_kind) == {"decode", "extend"}
    return tokens, by_kind


@needs_regions
def test_layers_compile_once_and_match_per_layer_graph_and_eager():
    engine = Engine(tiny_llama(), max_batch=2, max_len=64, compile=True, prefill_chunk=8)
    assert engine.layer_regions == LAYERS
    tokens, codes = step_codes(engine)
    for kind, code in codes.items():
        defs = re.findall(r"^def (\w*subgraph\w*)\(args\):", code, re.M)
        assert len(defs) == 1, (kind, defs)  # the layer, lowered and compiled once
        assert len(re.findall(rf"= {defs[0]}\(", code)) == LAYERS, kind  # called per layer
        assert "specdec.store_kv" not in code, kind
        assert re.search(r"cpp_fused\w*index_copy", code), kind  # the store, fused
        assert "specdec.skinny_linear" in code, kind  # the passes run inside the region
        assert "assert_size_stride(" not in code, kind  # ENGINE_INDUCTOR_OPTIONS

    flat = Engine(tiny_llama(), max_batch=2, max_len=64, compile=True, prefill_chunk=8,
                  compile_layers_once=False, compile_options={"size_asserts": True})
    assert flat.layer_regions == 0
    flat_tokens, flat_codes = step_codes(flat)
    for kind, code in flat_codes.items():
        assert "subgraph" not in code, kind
        calls = re.findall(r"= torch\.ops\.specdec\.(?:decode|extend)_attention\.default\(", code)
        assert len(calls) == LAYERS, kind  # every layer lowered on its own
        assert "assert_size_stride(" in code, kind  # the caller's options win
    assert flat_tokens == tokens

    specdec_inductor.reset_kernel_path_counts()
    eager = Engine(tiny_llama(), max_batch=2, max_len=64, compile=False, prefill_chunk=8)
    assert eager.layer_regions == 0  # eager engines leave the model unmarked
    assert eager.generate(PROMPTS, 6) == tokens
    assert any(k.startswith("store_kv:") for k in specdec_inductor.kernel_path_counts())
    for e in (engine, flat, eager):
        e.pool.check_consistent()
        assert e.pool.num_free_slots == e.pool.num_slots


def test_compiled_pool_contents_equal_eager():
    # The fused index_copy_ writes the same K/V into the same slots as the store_kv op.
    pools = []
    for compiled in (True, False):
        engine = Engine(tiny_llama(), max_batch=2, max_len=64, compile=compiled, prefill_chunk=8)
        engine.generate(PROMPTS, 5)
        pools.append((engine.pool.k, engine.pool.v))
    for a, b in zip(pools[0][0] + pools[0][1], pools[1][0] + pools[1][1]):
        torch.testing.assert_close(a[:-1], b[:-1], atol=1e-5, rtol=1e-5)  # the sink row aside


@needs_regions
def test_compile_layers_once_is_idempotent_and_keeps_the_class():
    model = tiny_llama()
    cls_forward = type(model.model.layers[0]).forward
    assert compile_layers_once(model) == LAYERS
    first = [layer.forward.__func__ for layer in model.model.layers]
    assert compile_layers_once(model) == LAYERS
    assert [layer.forward.__func__ for layer in model.model.layers] == first
    assert len(set(first)) == 1  # one function object: Dynamo reuses one region
    assert type(model.model.layers[0]).forward is cls_forward  # the class is untouched
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():  # outside torch.compile the marked layers run as before
        marked = model(ids, use_cache=False).logits
        plain = tiny_llama()(ids, use_cache=False).logits
    torch.testing.assert_close(marked, plain, atol=0, rtol=0)
    assert compile_layers_once(torch.nn.Linear(2, 2)) == 0  # no decoder layers: nothing marked


def test_changed_parameter_layout_is_refused():
    # The compiled steps read parameters unchecked (model guards skipped, no size asserts):
    # a parameter of another shape must be refused before any step runs, not read.
    model = tiny_llama()
    engine = Engine(model, max_batch=2, max_len=64, compile=True, prefill_chunk=8)
    first = engine.generate(PROMPTS, 3)
    with torch.no_grad():  # new values in place are fine
        model.lm_head.weight.mul_(1.0)
    assert engine.generate(PROMPTS, 3) == first
    model.model.layers[1].mlp.up_proj.weight = torch.nn.Parameter(torch.zeros(65, 32))
    with pytest.raises(RuntimeError, match=r"model.layers.1.mlp.up_proj.weight.*new Engine"):
        engine.generate(PROMPTS, 3)
    engine.pool.check_consistent()
    assert engine.pool.num_free_slots == engine.pool.num_slots


@needs_regions
def test_each_step_traces_the_layer_once_and_stamps_out_the_rest():
    """Dynamo traces the first layer's region of a step and reuses it for the others (a
    re-trace per layer was most of a warm start's time): the StepBatch reaches the region
    narrowed to the layer's own pool tensors, as flat positional inputs."""
    from torch._dynamo.utils import compilation_time_metrics, counters
    compilation_time_metrics.clear()
    graphs0 = counters["stats"]["unique_graphs"]
    engine = Engine(tiny_llama(), max_batch=2, max_len=64, compile=True, prefill_chunk=8)
    tokens = engine.generate(PROMPTS, 6)
    graphs = counters["stats"]["unique_graphs"] - graphs0
    traced = len(compilation_time_metrics.get("invoke_subgraph_trace", []))
    reused = len(compilation_time_metrics.get("invoke_subgraph_reuse_stamp_out", []))
    assert graphs == 2  # decode and extend, each compiled once
    assert traced == graphs  # one layer trace per step graph
    assert reused == graphs * (LAYERS - 1)
    eager = Engine(tiny_llama(), max_batch=2, max_len=64, compile=False, prefill_chunk=8)
    assert eager.generate(PROMPTS, 6) == tokens
    for e in (engine, eager):
        e.pool.check_consistent()


@needs_regions
def test_sliding_and_full_layers_get_a_region_each():
    """Gemma-2 style layers alternate sliding-window and full attention: a region is reused
    only by layers of its own kind (the window is a constant of the trace), and the compiled
    tokens equal eager's."""
    from torch._dynamo.utils import compilation_time_metrics, counters
    from specdec_inductor.testing import tiny_gemma2
    model = tiny_gemma2(num_layers=4)
    assert model.config.layer_types.count("sliding_attention") == 2
    prompts = [[5, 17, 42, 8, 61, 3, 9, 70, 5, 17]]
    eager = Engine(model, max_batch=1, max_len=64, compile=False, prefill_chunk=8).generate(prompts, 8)
    compilation_time_metrics.clear()
    graphs0 = counters["stats"]["unique_graphs"]
    engine = Engine(model, max_batch=1, max_len=64, compile=True, prefill_chunk=8)
    assert engine.generate(prompts, 8) == eager
    graphs = counters["stats"]["unique_graphs"] - graphs0
    assert graphs == 2
    assert len(compilation_time_metrics.get("invoke_subgraph_trace", [])) == 2 * graphs
    assert len(compilation_time_metrics.get("invoke_subgraph_reuse_stamp_out", [])) == 2 * graphs
    engine.pool.check_consistent()
