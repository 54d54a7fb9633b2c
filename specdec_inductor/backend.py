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
# - skinny_linear: mm/addmm of <= 16 rows -> specdec.skinny_linear (weight-streaming GEMV);
#   SmolLM2-135M batch-1 decode, benchmarks/bench_e2e.py: see the README's numbers.
PASS_DEFAULTS: Dict[str, bool] = {
    "skinny_linear": True,
}


# Graphs this backend has compiled (tests check it really ran, rather than another backend).
compiled_graphs = 0


def specdec_backend(gm: torch.fx.GraphModule, example_inputs: List, **kwargs):
    """Dynamo backend: Inductor with INDUCTOR_CONFIG (plus any `options` passed as kwargs)."""
    global compiled_graphs
    compiled_graphs += 1
    from specdec_inductor.lowerings.compile import compile_graph  # private Inductor names
    patches = dict(INDUCTOR_CONFIG)
    passes = dict(PASS_DEFAULTS)
    for key, value in (kwargs.get("options") or {}).items():
        if key.startswith("specdec."):
            name = key[len("specdec."):]
            if name not in PASS_DEFAULTS:
                raise ValueError(f"unknown option {key!r}; specdec passes: {sorted(PASS_DEFAULTS)}")
            passes[name] = bool(value)
        else:
            patches[key] = value
    return compile_graph(gm, example_inputs, patches, [p for p, on in passes.items() if on])

