"""Post-grad graph pass: `mm(x, permute(W, [1, 0]))` and `addmm(b, x, permute(W, [1, 0]))` --
what `F.linear` becomes after Inductor's decompositions -- with few rows of x become
`specdec.skinny_linear(x, W, b)`, which streams W once at memory bandwidth instead of calling
a GEMM library tuned for large M (benchmarks/bench_linear.py).

Only static row counts <= MAX_ROWS (PACKED_MAX_ROWS with packed weights), fp32/bf16, and weights with dense rows are rewritten; the
rest is left to Inductor. Each rewrite increments counters["specdec"]["skinny_linear"].

A second pass (LinearCatPass, option "specdec.linear_cat") then merges the skinny_linear calls
that share their x -- q/k/v, gate/up -- into one `specdec.skinny_linear_cat` whose output
columns are sliced back out (views): one weight stream per group instead of one per matrix.
Each merged group increments counters["specdec"]["linear_cat"].
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


# Outputs per packed block (csrc/linear_isa.h kPackLanes): skinny_linear_cat streams a group as
# one packed weight only when every member but the last fills whole blocks.
PACK_LANES = 16


def _operands_before(node, first, order) -> bool:
    return all(order[a] < order[first] for a in node.args[1:] if isinstance(a, torch.fx.Node))


_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)


def _x_key(x):
    """The tensor x reads, seen through views (each projection views the normed hidden state
    itself), with x's shape: calls with equal keys read the same values. The sizes as text: a
    symbolic size (dynamic shapes) is not hashable, and equal expressions are equal sizes."""
    base = x
    while isinstance(base, torch.fx.Node) and base.op == "call_function" and base.target in _VIEWS:
        base = base.args[0]
    return base, tuple(str(d) for d in _val(x).shape)


def merge_into_cat(graph: torch.fx.Graph, first, members, x, cat_op, cat_args) -> torch.fx.Node:
    """Inserts `cat_op(*cat_args)` -- the members' outputs side by side along the last dim, in
    the order of `members` -- before `first`, the member that comes first in the graph (cat_args'
    nodes must all come before it), and replaces each
    member by its columns, sliced back out as views; erases the members, and each member's own
    x (a view of the shared `x`) once unused. Returns the new node."""
    fake_mode = torch._guards.detect_fake_mode([_val(x)])
    with fake_mode:
        cat_val = cat_op(*torch.fx.node.map_arg(cat_args, _val))
    dim = cat_val.dim() - 1
    with graph.inserting_before(first):
        cat = graph.call_function(cat_op, cat_args)
    # The first member's meta (stack trace, ...), less the eager input values Inductor would
    # constrain the cat's arguments to (they are the member's, not the cat's).
    cat.meta.update({k: v for k, v in first.meta.items() if k != "eager_input_vals"})
    cat.meta["val"] = cat_val
    start, anchor = 0, cat
    for node in members:
        n_out = _val(node).shape[-1]
        with graph.inserting_after(anchor):
            part = graph.call_function(aten.slice.Tensor, (cat, dim, start, start + n_out))
        anchor = part
        part.meta.update({k: v for k, v in node.meta.items() if k != "eager_input_vals"})
        part.meta["val"] = aten.slice.Tensor(cat_val, dim, start, start + n_out)
        node.replace_all_uses_with(part)
        own_x = node.args[0]
        graph.erase_node(node)
        if own_x is not x and not own_x.users:
            graph.erase_node(own_x)
        start += n_out
    return cat


def group_skinny_linear(graph: torch.fx.Graph) -> int:
    """Merges the skinny_linear nodes of `graph` that read the same x (_x_key; their weights
    and biases existing before the first of them) into skinny_linear_cat + slices; returns how many
    groups. Members: every weight with N % PACK_LANES == 0, plus at most one other, last."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    by_x = {}
    for node in graph.nodes:
        if (node.op == "call_function" and node.target is torch.ops.specdec.skinny_linear.default
                and _val(node.args[0]) is not None):
            by_x.setdefault(_x_key(node.args[0]), []).append(node)
    groups = 0
    for nodes in by_x.values():
        if len(nodes) < 2:
            continue
        first = nodes[0]  # graph order
        x = first.args[0]
        nodes = [n for n in nodes if _operands_before(n, first, order) and _val(n.args[1]) is not None]
        aligned = [n for n in nodes if _val(n.args[1]).shape[0] % PACK_LANES == 0]
        members = aligned + [n for n in nodes if n not in aligned][:1]
        if len(members) < 2:
            continue
        weights = [n.args[1] for n in members]
        biases = [n.args[2] if len(n.args) > 2 else None for n in members]
        merge_into_cat(graph, first, members, x, torch.ops.specdec.skinny_linear_cat.default,
                       (x, weights, biases))
        groups += 1
    counters["specdec"]["linear_cat"] += groups
    return groups


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


class LinearCatPass(CustomGraphPass):
    """Post-grad pass after SkinnyLinearPass: group_skinny_linear (see module docstring)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        group_skinny_linear(graph)

    def uuid(self) -> bytes:
        src = inspect.getsource(inspect.getmodule(LinearCatPass)) + "linear_cat"
        return hashlib.sha256(src.encode()).digest()
