"""Post-grad graph pass (option "specdec.quant_cat"): `specdec.quant_linear` calls that read the
same x (seen through views, as linear_cat sees them) with the same activation mode -- q/k/v and
gate/up of a quantized model -- become one `specdec.quant_linear_cat` whose output columns are
sliced back out (views). One call per group instead of one per matrix: with INT8 activations x
is quantized once, and the group's rows share one parallel region, where a small matrix alone
(k/v, q/o of a 135M model) stays under the parallel grain on one thread.

Every value of the cat is bitwise the separate call's (csrc/quant.cpp runs the same kernels on
the same rows), so greedy tokens cannot change. Members: every such call whose weight and bias
exist before the first of them. Each merged group increments counters["specdec"]["quant_cat"].
"""
import hashlib
import inspect

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

import specdec_inductor.ops.quant  # noqa: F401  (fake kernel of the op the pass inserts)
from specdec_inductor.lowerings.skinny_linear import _operands_before, _val, _x_key, merge_into_cat

_ARG_NAMES = ("x", "weight", "fmt", "bias", "activation")
_DEFAULTS = {"bias": None, "activation": 0}


def _quant_args(node) -> dict:
    """quant_linear's arguments of `node` by name, defaults filled in."""
    args = dict(zip(_ARG_NAMES, node.args))
    args.update(node.kwargs)
    return {name: args.get(name, _DEFAULTS.get(name)) for name in _ARG_NAMES}


def group_quant_linear(graph: torch.fx.Graph) -> int:
    """Merges the quant_linear nodes of `graph` that read the same x (_x_key) with the same
    activation, their weights and biases existing before the first of them, into
    quant_linear_cat + slices; returns how many groups."""
    quant_linear = torch.ops.specdec.quant_linear.default
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_key = {}
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not quant_linear or _val(node) is None:
            continue
        args = _quant_args(node)
        if _val(args["x"]) is None or not isinstance(args["activation"], int):
            continue
        by_key.setdefault((_x_key(args["x"]), args["activation"]), []).append(node)
    groups = 0
    for (_, activation), nodes in by_key.items():
        first = nodes[0]  # graph order
        members = [n for n in nodes if _operands_before(n, first, order)]
        if len(members) < 2:
            continue
        member_args = [_quant_args(n) for n in members]
        x = member_args[0]["x"]
        merge_into_cat(graph, first, members, x, torch.ops.specdec.quant_linear_cat.default,
                       (x, [a["weight"] for a in member_args], [a["fmt"] for a in member_args],
                        [a["bias"] for a in member_args], activation))
        groups += 1
    counters["specdec"]["quant_cat"] += groups
    return groups


class QuantCatPass(CustomGraphPass):
    """Post-grad pass of the specdec backend: group_quant_linear (see module docstring)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        group_quant_linear(graph)

    def uuid(self) -> bytes:
        # The FX graph cache keys on this: any edit of this file changes it.
        src = inspect.getsource(inspect.getmodule(QuantCatPass)) + "quant_cat"
        return hashlib.sha256(src.encode()).digest()
