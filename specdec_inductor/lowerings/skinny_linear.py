"""Post-grad graph pass: `mm(x, permute(W, [1, 0]))` and `addmm(b, x, permute(W, [1, 0]))` --
what `F.linear` becomes after Inductor's decompositions -- with few rows of x become
`specdec.skinny_linear(x, W, b)`, which streams W once at memory bandwidth instead of calling
a GEMM library tuned for large M (benchmarks/bench_linear.py).

Only static row counts <= MAX_ROWS (PACKED_MAX_ROWS with packed weights), fp32/bf16, and weights with dense rows are rewritten; the
rest is left to Inductor. Each rewrite increments counters["specdec"]["skinny_linear"].
"""
import hashlib
import inspect

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

import specdec_inductor.ops.linear  # noqa: F401  (fake kernel of the op the pass inserts)

# Rows (batch x new tokens) up to which skinny_linear beats aten's GEMM on this machine class
# (benchmarks/bench_linear.py sweeps M): MAX_ROWS for the row kernel (plain weights),
# PACKED_MAX_ROWS when the backend packs the parameters (its default; the packed kernel ran
# at 1.35-2.6x aten up to M=64 -- prefill chunks of 64 rows and batched verify steps). Above
# 16 rows the op itself sends a weight that has no packed copy to aten's GEMM.
MAX_ROWS = 16
PACKED_MAX_ROWS = 64
_DTYPES = (torch.float32, torch.bfloat16)

aten = torch.ops.aten


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _transposed_weight(node):
    """W when node is permute(W, [1, 0]) of a 2-D W with dense rows, else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target is aten.permute.default and list(node.args[1]) == [1, 0]):
        return None
    w = node.args[0]
    wv = _val(w)
    if wv is None or wv.dim() != 2 or wv.dtype not in _DTYPES or wv.stride(1) != 1:
        return None
    return w


def _rows_ok(x, max_rows: int) -> bool:
    xv = _val(x)
    return (xv is not None and xv.dim() == 2 and isinstance(xv.shape[0], int)
            and 0 < xv.shape[0] <= max_rows and xv.dtype in _DTYPES)


def rewrite_skinny_linear(graph: torch.fx.Graph, max_rows: int = MAX_ROWS) -> int:
    """Rewrites matching mm/addmm nodes of `graph` with <= max_rows rows in place; returns how
    many."""
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.mm.default and not node.kwargs:
            x, wt = node.args
            bias = None
        elif node.target is aten.addmm.default and not node.kwargs:  # beta = alpha = 1
            bias, x, wt = node.args
            bv = _val(bias)
            if bv is None or bv.dim() != 1 or bv.dtype not in _DTYPES:
                continue
        else:
            continue
        w = _transposed_weight(wt)
        if w is None or not _rows_ok(x, max_rows) or _val(x).dtype != _val(w).dtype:
            continue
        if bias is not None and _val(bias).dtype != _val(x).dtype:
            continue
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.specdec.skinny_linear.default, (x, w, bias))
        new.meta.update(node.meta)  # same shape, dtype and (dense) strides as the mm result
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        if not wt.users:
            graph.erase_node(wt)
        rewritten += 1
    counters["specdec"]["skinny_linear"] += rewritten
    return rewritten


class SkinnyLinearPass(CustomGraphPass):
    """`post_grad_custom_post_pass` of the specdec backend (see module docstring); max_rows is
    MAX_ROWS, or PACKED_MAX_ROWS when the backend packs the weights."""

    def __init__(self, max_rows: int = MAX_ROWS):
        self.max_rows = max_rows

    def __call__(self, graph: torch.fx.Graph) -> None:
        rewrite_skinny_linear(graph, self.max_rows)

    def uuid(self) -> bytes:
        # The FX graph cache keys on this: any edit of this file, or of max_rows, changes it.
        src = inspect.getsource(inspect.getmodule(SkinnyLinearPass)) + f"max_rows={self.max_rows}"
        return hashlib.sha256(src.encode()).digest()
