"""Inductor entry point of the `specdec` torch.compile backend: `compile_fx` with our config
patches and graph passes (kept here so that private `torch._inductor` imports stay inside
`lowerings/`)."""
import os
from typing import Dict, List, Optional

import torch
from torch._inductor.compile_fx import compile_fx

from torch._inductor.custom_graph_pass import CustomGraphPass

from specdec_inductor.engine import threads
from specdec_inductor.lowerings.quant_cat import QuantCatPass
from specdec_inductor.lowerings.skinny_linear import LinearCatPass, SkinnyLinearPass

# Graph passes by name, in the order they run; the backend's `specdec.<name>` options switch
# them (default on).
PASSES = {"skinny_linear": SkinnyLinearPass, "linear_cat": LinearCatPass, "quant_cat": QuantCatPass}


class PassSequence(CustomGraphPass):
    """Several custom passes in order, as the one post-grad custom pass Inductor takes."""

    def __init__(self, passes: List[CustomGraphPass]):
        self.passes = passes

    def __call__(self, graph: torch.fx.Graph) -> None:
        for p in self.passes:
            p(graph)

    def uuid(self) -> bytes:
        return b"".join(p.uuid() for p in self.passes)


def thread_patches(config_patches: Dict, governor: threads.ThreadGovernor) -> Dict:
    """Inductor options that let the governor's run-time thread count reach the compiled
    kernels. Inductor writes `#pragma omp parallel` (run-time count) when it compiles at
    os.cpu_count() threads, but `num_threads(N)` for any other N, which set_num_threads cannot
    lower (a CPU-affinity or cgroup cpuset smaller than the machine, or a chosen maximum): an
    adaptive governor then needs cpp.dynamic_threads. Not by default: it also gives every tiny
    kernel a parallel region (more barriers per step; benchmarks/bench_cotenant.py times it)."""
    if (not governor.adaptive or governor.max_threads == os.cpu_count()
            or "cpp.dynamic_threads" in config_patches):
        return {}
    return {"cpp.dynamic_threads": True}


def compile_graph(gm: torch.fx.GraphModule, example_inputs: List, config_patches: Dict,
                  passes: List[str], pass_kwargs: Optional[Dict[str, dict]] = None):
    """Compile one Dynamo graph with Inductor under `config_patches`, with the named passes
    (constructed with pass_kwargs[name], if given) run as the post-grad custom pass (after
    Inductor's own post-grad passes). Compiles at the thread governor's maximum thread count
    (engine/threads.py), with thread_patches."""
    governor = threads.governor()
    patches = {**thread_patches(config_patches, governor), **config_patches}
    if passes:
        if patches.get("post_grad_custom_post_pass") is not None:
            raise ValueError("option 'post_grad_custom_post_pass' is taken by the specdec passes "
                             f"{passes}; switch them off with specdec.<name>=False to use your own")
        unknown = [p for p in passes if p not in PASSES]
        if unknown:
            raise ValueError(f"unknown specdec pass(es) {unknown}; known: {sorted(PASSES)}")
        patches["post_grad_custom_post_pass"] = PassSequence([PASSES[p](**(pass_kwargs or {}).get(p, {}))
                                                         for p in PASSES if p in passes])
    with governor.at_max():
        return compile_fx(gm, example_inputs, config_patches=patches)


def run_and_get_code(fn, *args, **kwargs):
    """(result, [generated source of each compiled graph]) of calling a torch.compile'd fn;
    tests use it to check what the passes put into the code."""
    from torch._inductor.utils import run_and_get_code as inductor_run_and_get_code
    return inductor_run_and_get_code(fn, *args, **kwargs)
