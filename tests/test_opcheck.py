"""torch.library.opcheck on every op: schema (incl. mutation annotations), fake kernel,
autograd registration and AOT dispatch, on contiguous, transposed and sliced samples with int32
and int64 indices."""
import pytest
import torch
from torch.library import opcheck

from specdec_inductor.ops import TreeMaskMode

from specdec_inductor.testing import random_draft, random_verify_inputs

OPS = torch.ops.specdec
T = torch.tensor


def _layout(x, kind):
    """Same values as x with another memory layout."""
    if kind == "contiguous":
        return x.contiguous()
    if kind == "transposed":  # 2-D: column-major storage; 1-D: a column of a row-major matrix
        if x.dim() == 2:
            return x.t().contiguous().t()
        junk = torch.full_like(x, 99)
        return torch.stack([junk, x, junk], dim=1)[:, 1]  # stride 3, storage offset 1
    # sliced: every other element of a twice-as-wide buffer
    wide = torch.stack([x, torch.full_like(x, 123)], dim=-1)
    return wide[..., 0]


LAYOUTS = ["contiguous", "transposed", "sliced"]
DTYPES = [torch.int32, torch.int64]


def _tree(dtype, topk=2, depth=3, n=6, bs=3):
    gen = torch.Generator().manual_seed(7)
    return random_draft(bs, topk, depth, n, gen, dtype=dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", list(TreeMaskMode))
def test_opcheck_build_tree(layout, dtype, mode):
    d = _tree(dtype)
    args = (_layout(d.parent_list, layout), _layout(d.selected_index, layout), _layout(d.seq_lens, layout),
            d.topk, d.depth, d.num_draft_tokens, int(mode))
    if mode == TreeMaskMode.FULL_MASK:  # data-dependent output size: no dynamic-shape AOT check
        opcheck(OPS.build_tree.default, args, test_utils=("test_schema", "test_faketensor"))
    else:
        opcheck(OPS.build_tree.default, args)


def _verify_args(dtype, layout):
    d = _tree(torch.int64)
    _, _, ridx, nxt, sib = OPS.build_tree(d.parent_list, d.selected_index, d.seq_lens, d.topk, d.depth,
                                          d.num_draft_tokens, 1)
    cand, target = random_verify_inputs(nxt, sib, torch.Generator().manual_seed(3))
    return [_layout(t.to(dtype), layout) for t in (cand, ridx, nxt, sib, target)], d.depth + 1


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_verify_tree_greedy(layout, dtype):
    tensors, steps = _verify_args(dtype, layout)
    opcheck(OPS.verify_tree_greedy.default, (*tensors, steps))
    bs, n = tensors[0].shape
    outs = (torch.full((bs * n,), -1, dtype=torch.int32), torch.full((bs, steps), -1, dtype=torch.int32),
            torch.zeros(bs, dtype=torch.int32))
    opcheck(OPS.verify_tree_greedy_out.default, (*outs, *tensors))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_reconstruct_tree_from_mask(layout, dtype):
    d = _tree(torch.int64)
    mask = OPS.build_tree(d.parent_list, d.selected_index, d.seq_lens, d.topk, d.depth, d.num_draft_tokens, 1)[0]
    opcheck(OPS.reconstruct_tree_from_mask.default,
            (_layout(mask, layout), _layout(d.seq_lens.to(dtype), layout), d.num_draft_tokens))


def _slot_table(layout):
    table = torch.randperm(6 * 30, generator=torch.Generator().manual_seed(5)).to(torch.int32).view(6, 30)
    return _layout(table, layout)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_slot_ops(layout, dtype):
    table = _slot_table(layout)
    rows = _layout(T([4, 0, 2], dtype=dtype), layout)
    lens = _layout(T([3, 0, 9], dtype=torch.int64 if dtype == torch.int32 else torch.int32), layout)
    ends = _layout(T([7, 4, 9], dtype=dtype), layout)
    opcheck(OPS.assign_draft_cache_locs.default, (table, rows, lens, 2, 3))
    opcheck(OPS.build_draft_decode_table.default, (table, rows, lens, 2, 3))
    opcheck(OPS.gather_extend_cache_locs.default, (table, rows, lens, ends, 8))
    opcheck(OPS.gather_extend_cache_locs.default, (table, rows, lens, ends),
            test_utils=("test_schema", "test_faketensor"))  # data-dependent size without total
    loc = _layout(torch.arange(100, 108, dtype=dtype), layout)
    opcheck(OPS.assign_req_to_token.default, (table.clone() if layout == "contiguous" else table, rows, lens, ends, loc))
    tokens = _layout(T([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=dtype), layout)
    opcheck(OPS.fill_bonus_tokens.default, (tokens, _layout(T([3, 1, 2], dtype=dtype), layout)))
    accept = _layout(T([[0, 3, -1], [4, 5, 7]], dtype=dtype), layout)
    opcheck(OPS.compact_accepted_cache_locs.default, (_layout(torch.arange(10, 18), layout), accept))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck_move_kv_slots(layout, dtype):
    big = torch.randn(2, 16, 2, 4)
    k = [big[0], torch.randn(16, 2, 4)]
    v = [big[1], torch.randn(16, 8)]
    src, dst = _layout(T([5, 6, 9], dtype=dtype), layout), _layout(T([4, 5, 1], dtype=dtype), layout)
    opcheck(OPS.move_kv_slots.default, (k, v, src, dst))
