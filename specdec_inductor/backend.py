"""The `specdec` torch.compile backend: Inductor (compile_fx) with this package's config, so
`torch.compile(model, backend="specdec")` works once the package is installed (Dynamo finds
it through the `torch_dynamo_backends` entry point in pyproject.toml); passing the function
itself (`backend=specdec_backend`) needs no installation.

Config is kept only where benchmarks/bench_e2e.py shows it pays (see INDUCTOR_CONFIG).
"""
from typing import Dict, List

import torch

# Inductor settings of the backend. Each one stays only if a benchmark shows it pays:
# - max_autotune stays off: autotuning GEMMs costs minutes of compile time on 2 cores.
# - freezing is NOT set: on SmolLM2-135M batch-1 decode (1 thread, bench_e2e.py
#   --inductor-option freezing=1) it gave 16.5 vs 16.4 tok/s fp32 and 18.7 vs 19.7 bf16.
INDUCTOR_CONFIG: Dict[str, object] = {
    "max_autotune": False,
}

# Our graph passes (lowerings/), each switched by the option "specdec.<name>" (bool):
# - skinny_linear: mm/addmm of few rows (16, or 64 with pack_weights) -> specdec.skinny_linear
#   (weight-streaming GEMV);
#   SmolLM2-135M batch-1 decode, benchmarks/bench_e2e.py: see the README's numbers.
# - linear_cat: skinny_linear calls that share their x (q/k/v, gate/up) -> one
#   specdec.skinny_linear_cat (one packed stream per group); README: the interleaved A/B
#   (+6-8% decode tok/s on the AVX2 machine) and bench_linear.py's grouped column.
# - quant_cat: specdec.quant_linear calls that share their x -> one specdec.quant_linear_cat
#   (one activation quantization and one parallel region per group, bitwise the same values);
#   benchmarks/bench_quant_cat.py times it on and off.
PASS_DEFAULTS: Dict[str, bool] = {
    "skinny_linear": True,
    "linear_cat": True,
    "quant_cat": True,
}

# Backend switches besides the passes, also set by "specdec.<name>" options:
# - pack_weights: register the graph's 2-D fp32/bf16 parameters with skinny_linear's packed-
#   weight registry (csrc/linear.cpp): a weight that reaches skinny_linear is copied once into
#   a blocked layout, and later calls stream that copy with no horizontal sums. Costs the
#   packed weights' size again in memory (`linear_pack_stats()`); weights that never reach
#   skinny_linear (embeddings) are registered but not copied. With it the pass rewrites GEMMs
#   of up to PACKED_MAX_ROWS rows (prefill chunks, batched verify) instead of MAX_ROWS.
#   benchmarks/bench_linear.py measures both kernels; the README quotes the engine effect.
SWITCH_DEFAULTS: Dict[str, bool] = {
    "pack_weights": True,
}


def _register_packable(example_inputs: List) -> None:
    """Registers the 2-D fp32/bf16 CPU parameters among `example_inputs` for packing."""
    from specdec_inductor.ops.linear import register_packed_weight
    for t in example_inputs:
        if (isinstance(t, torch.nn.Parameter) and t.dim() == 2 and t.device.type == "cpu"
                and t.dtype in (torch.float32, torch.bfloat16)):
            register_packed_weight(t)


# Graphs this backend has compiled (tests check it really ran, rather than another backend).
compiled_graphs = 0


def specdec_backend(gm: torch.fx.GraphModule, example_inputs: List, **kwargs):
    """Dynamo backend: Inductor with INDUCTOR_CONFIG (plus any `options` passed as kwargs)."""
    global compiled_graphs
    compiled_graphs += 1
    from specdec_inductor.lowerings.compile import compile_graph  # private Inductor names
    patches = dict(INDUCTOR_CONFIG)
    passes = dict(PASS_DEFAULTS)
    switches = dict(SWITCH_DEFAULTS)
    for key, value in (kwargs.get("options") or {}).items():
        if key.startswith("specdec."):
            name = key[len("specdec."):]
            if name in PASS_DEFAULTS:
                passes[name] = bool(value)
            elif name in SWITCH_DEFAULTS:
                switches[name] = bool(value)
            else:
                raise ValueError(f"unknown option {key!r}; specdec options: "
                                 f"{sorted(PASS_DEFAULTS) + sorted(SWITCH_DEFAULTS)}")
        else:
            patches[key] = value
    pass_kwargs = {}
    if switches["pack_weights"] and passes["skinny_linear"]:
        _register_packable(example_inputs)
        from specdec_inductor.lowerings.skinny_linear import PACKED_MAX_ROWS
        pass_kwargs["skinny_linear"] = {"max_rows": PACKED_MAX_ROWS}
    return compile_graph(gm, example_inputs, patches, [p for p, on in passes.items() if on],
                         pass_kwargs)

