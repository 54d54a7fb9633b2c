"""build_tree, verify_tree_greedy and reconstruct_tree_from_mask: the golden examples of
kernels.md exactly, then randomized drafts against the references."""
import itertools

import pytest
import torch

import specdec_inductor
from specdec_inductor import ops
from specdec_inductor.ops import TreeMaskMode, reference as ref
from specdec_inductor.compat import sglang

from specdec_inductor.testing import random_draft, random_verify_inputs

T = torch.tensor


def _qlen_rows(mask, n):
    return ["".join("1" if x else "0" for x in row) for row in mask.view(-1, n).tolist()]


# ----------------------------------------------------------------------------- golden examples


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_example_a_topk2_depth2(dtype):
    mask, pos, ridx, nxt, sib = ops.build_tree(T([[-1, 0, 1]], dtype=dtype), T([[0, 1, 2]], dtype=dtype),
                                               T([5], dtype=dtype), 2, 2, 4, TreeMaskMode.QLEN_ONLY)
    assert nxt.tolist() == [[1, 3, -1, -1]]
    assert sib.tolist() == [[-1, 2, -1, -1]]
    assert pos.tolist() == [5, 6, 6, 7]
    assert ridx.tolist() == [[0, 1, 2, 3]]
    assert _qlen_rows(mask, 4) == ["1000", "1100", "1010", "1101"]


def test_example_a_full_and_bitpacked_masks():
    args = (T([[-1, 0, 1]]), T([[0, 1, 2]]), T([5]), 2, 2, 4)
    full = ops.build_tree(*args, TreeMaskMode.FULL_MASK)[0]
    assert full.numel() == 5 * 4 + 16
    assert _qlen_rows(full, 9) == ["11111" + r for r in ["1000", "1100", "1010", "1101"]]
    bits = ops.build_tree(*args, TreeMaskMode.QLEN_ONLY_BITPACKING)[0]
    assert bits.dtype == torch.uint8
    assert bits.tolist() == [0b0001, 0b0011, 0b0101, 0b1011]


def test_example_b_chain():
    mask, pos, _, nxt, sib = ops.build_tree(T([[-1, 0, 1]]), T([[0, 1, 2]]), T([7]), 1, 3, 4)
    assert torch.equal(mask.view(4, 4), torch.ones(4, 4, dtype=torch.bool).tril())
    assert pos.tolist() == [7, 8, 9, 10]
    assert nxt.tolist() == [[1, 2, 3, -1]] and sib.tolist() == [[-1, -1, -1, -1]]


def test_example_c_depth1_mtp():
    parent_list = torch.empty(3, 0, dtype=torch.int64)
    mask, pos, _, nxt, sib = ops.build_tree(parent_list, T([[0], [1], [0]]), T([0, 4, 9]), 2, 1, 2)
    assert pos.tolist() == [0, 1, 4, 5, 9, 10]
    assert nxt.tolist() == [[1, -1]] * 3 and sib.tolist() == [[-1, -1]] * 3
    assert _qlen_rows(mask, 2) == ["10", "11"] * 3


def _example_d():
    return dict(
        candidates=T([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]),
        retrieve_index=T([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]),
        retrieve_next_token=T([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]),
        retrieve_next_sibling=T([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]),
        target_predict=T([[3, 18, 18, 4, 5, 18], [11, 18, 18, 18, 12, 18]]),
    )


def test_example_d_verify_greedy():
    predicts, accept_index, accept_num = ops.verify_tree_greedy(**_example_d(), num_spec_steps=4)
    assert predicts.tolist() == [3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18]
    assert accept_index.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert accept_num.tolist() == [3, 2]
    for out in (predicts, accept_index, accept_num):
        assert out.dtype == torch.int32
    expected = ref.verify_tree_greedy_ref(**_example_d(), num_spec_steps=4)
    for got, want in zip((predicts, accept_index, accept_num), expected):
        assert torch.equal(got, want)


def test_example_d_sglang_out_variant_keeps_caller_fill():
    predicts = torch.full((12,), 77, dtype=torch.int32)
    accept_index = torch.full((2, 4), -1, dtype=torch.int32)
    accept_num = torch.zeros(2, dtype=torch.int32)
    sglang.verify_tree_greedy(predicts, accept_index, accept_num, *_example_d().values())
    assert predicts.tolist() == [3, 77, 77, 4, 5, 18, 11, 77, 77, 77, 12, 18]
    assert accept_index.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert accept_num.tolist() == [3, 2]


def test_example_e_reconstruct_from_mask():
    rows = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    chain = torch.ones(4, 4, dtype=torch.bool).tril()
    mask = torch.cat([T(rows, dtype=torch.bool).flatten(), chain.flatten()])
    pos, ridx, nxt, sib = ops.reconstruct_tree_from_mask(mask, T([12, 5], dtype=torch.int32), 4)
    assert pos.tolist() == [12, 13, 13, 14, 5, 6, 7, 8]
    assert nxt.tolist() == [[1, -1, 3, -1], [1, 2, 3, -1]]
    assert sib.tolist() == [[-1, 2, -1, -1], [-1, -1, -1, -1]]
    assert ridx.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_sglang_build_tree_adapter_fills_buffers():
    n = 4
    outs = dict(tree_mask=torch.zeros(n * n, dtype=torch.bool), positions=torch.zeros(n, dtype=torch.int64),
                retrieve_index=torch.zeros(1, n, dtype=torch.int64),
                retrieve_next_token=torch.zeros(1, n, dtype=torch.int64),
                retrieve_next_sibling=torch.zeros(1, n, dtype=torch.int64))
    sglang.build_tree_kernel_efficient(T([[-1, 0, 1]]), T([[0, 1, 2]]), T([5], dtype=torch.int32),
                                       *outs.values(), 2, 2, n, int(TreeMaskMode.QLEN_ONLY))
    assert outs["retrieve_next_token"].tolist() == [[1, 3, -1, -1]]
    assert outs["positions"].tolist() == [5, 6, 6, 7]
    assert _qlen_rows(outs["tree_mask"], 4) == ["1000", "1100", "1010", "1101"]


# ----------------------------------------------------------------------------- randomized


def _cases():
    for topk, depth, bs in itertools.product([1, 2, 4, 8], [1, 2, 3, 6], [1, 3, 17]):
        max_n = 1 + topk + topk * topk * (depth - 1)
        for n in sorted({2, min(8, max_n), min(64, max_n)}):
            yield topk, depth, bs, n


CASES = list(_cases())


def test_random_cases_cover_the_interesting_shapes():
    assert {c[0] for c in CASES} == {1, 2, 4, 8} and {c[1] for c in CASES} == {1, 2, 3, 6}
    assert max(c[3] for c in CASES) == 64 and {c[2] for c in CASES} == {1, 3, 17}


@pytest.mark.parametrize("topk,depth,bs,n", CASES)
def test_build_tree_matches_reference(topk, depth, bs, n):
    gen = torch.Generator().manual_seed(hash((topk, depth, bs, n)) % 2**31)
    index_dtype = torch.int32 if (topk + depth) % 2 else torch.int64
    d = random_draft(bs, topk, depth, n, gen, dtype=index_dtype)
    modes = list(TreeMaskMode) if n <= 64 else [TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY]
    for mode in modes:
        got = ops.build_tree(d.parent_list, d.selected_index, d.seq_lens, topk, depth, n, mode)
        want = ref.build_tree_ref(d.parent_list, d.selected_index, d.seq_lens, topk, depth, n, mode)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w), mode
    # The QLEN_ONLY mask, fed back through reconstruct_tree_from_mask, gives the same tree.
    mask, pos, ridx, nxt, sib = ops.build_tree(d.parent_list, d.selected_index, d.seq_lens, topk, depth, n)
    again = ops.reconstruct_tree_from_mask(mask, d.seq_lens, n)
    assert all(torch.equal(a, b) for a, b in zip(again, (pos, ridx, nxt, sib)))


def test_random_verify_matches_reference_and_exercises_every_branch():
    gen = torch.Generator().manual_seed(0)
    seen = dict(branching=0, accepted=0, rejected_at_root=0, sibling_hop=0, full_depth=0)
    for topk, depth, bs, n in CASES:
        d = random_draft(bs, topk, depth, n, gen)
        _, _, ridx, nxt, sib = ops.build_tree(d.parent_list, d.selected_index, d.seq_lens, topk, depth, n)
        candidates, target = random_verify_inputs(nxt, sib, gen)
        got = ops.verify_tree_greedy(candidates, ridx, nxt, sib, target, depth + 1)
        want = ref.verify_tree_greedy_ref(candidates, ridx, nxt, sib, target, depth + 1)
        for g, w in zip(got, want):
            assert torch.equal(g, w), (topk, depth, bs, n)
        predicts, accept_index, accept_num = got
        seen["branching"] += int((sib >= 0).any())
        seen["accepted"] += int((accept_num > 0).sum())
        seen["rejected_at_root"] += int(((accept_num == 0) & (nxt[:, 0] >= 0)).sum())
        seen["full_depth"] += int((accept_num == depth).sum())
        for b in range(bs):
            path = [int(i) - b * n for i in accept_index[b] if i >= 0]
            seen["sibling_hop"] += sum(1 for parent, child in zip(path, path[1:]) if int(nxt[b, parent]) != child)
            # Accepted tokens are the candidates on the path; the bonus is the target at its end.
            assert [int(predicts[b * n + p]) for p in path[:-1]] == [int(candidates[b, c]) for c in path[1:]]
            assert int(predicts[b * n + path[-1]]) == int(target[b, path[-1]])
    assert all(v > 0 for v in seen.values()), seen


def test_build_tree_parallel_batch_matches_serial():
    """bs=64 crosses the parallel grain; every request must equal its single-request result."""
    gen = torch.Generator().manual_seed(1)
    d = random_draft(64, 4, 4, 16, gen)
    batched = ops.build_tree(d.parent_list, d.selected_index, d.seq_lens, 4, 4, 16)
    for b in (0, 17, 63):
        single = ops.build_tree(d.parent_list[b:b + 1], d.selected_index[b:b + 1], d.seq_lens[b:b + 1], 4, 4, 16)
        assert torch.equal(single[0], batched[0][b * 256:(b + 1) * 256])
        assert torch.equal(single[3], batched[3][b:b + 1])


def test_tree_ops_record_portable_path():
    specdec_inductor.reset_kernel_path_counts()
    ops.build_tree(T([[-1, 0, 1]]), T([[0, 1, 2]]), T([5]), 2, 2, 4)
    ops.verify_tree_greedy(**_example_d(), num_spec_steps=4)
    counts = specdec_inductor.kernel_path_counts()
    assert counts["build_tree:portable"] == 1 and counts["verify_tree_greedy:portable"] == 1
