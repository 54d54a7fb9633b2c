"""Inductor entry point of the `specdec` torch.compile backend: `compile_fx` with our config
patches (kept here so that private `torch._inductor` imports stay inside `lowerings/`)."""
from typing import Dict, List

import torch
from torch._inductor.compile_fx import compile_fx


def compile_graph(gm: torch.fx.GraphModule, example_inputs: List, config_patches: Dict):
    """Compile one Dynamo graph with Inductor under `config_patches`."""
    return compile_fx(gm, example_inputs, config_patches=dict(config_patches))
