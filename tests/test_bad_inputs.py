"""Bad inputs raise clear errors naming the argument, and never hang, crash or write: mutated
tables and pools are left exactly as they were."""
import pytest
import torch

import specdec_inductor
from specdec_inductor import ops

T = torch.tensor
TREE = (T([[-1, 0, 1]]), T([[0, 1, 2]]), T([5]), 2, 2, 4)


def _verify_args():
    return dict(candidates=T([[0, 1, 2, 3]]), retrieve_index=T([[0, 1, 2, 3]]),
                retrieve_next_token=T([[1, 3, -1, -1]]), retrieve_next_sibling=T([[-1, 2, -1, -1]]),
                target_predict=T([[1, 3, 0, 0]]), num_spec_steps=3)


@pytest.mark.parametrize("args,exc,needle", [
    ((T([[-1.0, 0, 1]]), *TREE[1:]), TypeError, "parent_list"),
    ((TREE[0], T([0, 1, 2]), *TREE[2:]), ValueError, "selected_index"),  # rank
    ((TREE[0], T([[0, 1]]), *TREE[2:]), ValueError, "selected_index"),  # N-1 columns
    ((T([[-1, 0]]), *TREE[1:]), ValueError, "parent_list"),  # width topk*(depth-1)+1
    ((TREE[0], T([[0, 1, 9]]), *TREE[2:]), IndexError, "selected_index"),  # id out of range
    ((TREE[0], T([[0, 2, 1]]), *TREE[2:]), ValueError, "ascending"),
    ((TREE[0], T([[0, 1, 3]]), T([5]), 2, 2, 4), None, None),  # valid: id 3 is a child of id 0
    ((TREE[0], T([[1, 2]]), T([5]), 2, 2, 3), ValueError, "malformed"),  # parent id 0 not selected
    ((T([[-1, 0, -7]]), T([[0, 1, 4]]), T([5]), 2, 2, 4), ValueError, "malformed"),  # garbage parent
    ((TREE[0], TREE[1], T([-1]), *TREE[3:]), ValueError, "seq_lens"),
    ((*TREE[:3], 0, 2, 4), ValueError, "topk"),
    ((TREE[0], torch.arange(8).view(1, 8), T([5]), 2, 2, 9), ValueError, "num_draft_tokens"),  # > candidates
])
def test_build_tree_bad_inputs(args, exc, needle):
    if exc is None:
        ops.build_tree(*args)
        return
    with pytest.raises(exc, match=needle):
        ops.build_tree(*args)


def test_build_tree_bad_mode_and_bitpacking_limit():
    with pytest.raises(ValueError, match="tree_mask_mode"):
        ops.build_tree(*TREE, 3)
    sel = torch.arange(64).view(1, 64)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        ops.build_tree(T([[-1, 0, 1]]), sel, T([0]), 64, 2, 65, 2)


@pytest.mark.parametrize("change,exc,needle", [
    (dict(candidates=T([[0.0, 1, 2, 3]])), TypeError, "candidates"),
    (dict(target_predict=T([[1, 3, 0]])), ValueError, "target_predict"),
    (dict(retrieve_index=T([[0, 1, 2, 7]])), IndexError, "retrieve_index"),
    (dict(retrieve_next_token=T([[1, 4, -1, -1]])), IndexError, "retrieve_next_token"),
    (dict(retrieve_next_token=T([[1, 0, -1, -1]])), IndexError, "retrieve_next_token"),  # root as child
    (dict(retrieve_next_sibling=T([[-1, 2, 1, -1]]), target_predict=T([[9, 3, 0, 0]])), ValueError, "cycle"),
    (dict(num_spec_steps=0), ValueError, "num_spec_steps"),
])
def test_verify_bad_inputs(change, exc, needle):
    args = {**_verify_args(), **change}
    with pytest.raises(exc, match=needle):
        ops.verify_tree_greedy(**args)


def test_verify_out_variant_checks_output_buffers():
    args = _verify_args()
    steps = args.pop("num_spec_steps")
    good = (torch.zeros(4, dtype=torch.int32), torch.zeros(1, steps, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(TypeError, match="predicts"):
        ops.verify_tree_greedy_out(good[0].long(), *good[1:], *args.values())
    with pytest.raises(ValueError, match="accept_token_num"):
        ops.verify_tree_greedy_out(*good[:2], torch.zeros(2, dtype=torch.int32), *args.values())


def test_reconstruct_rejects_malformed_masks():
    seq = T([3])
    rows = torch.eye(3, dtype=torch.bool)  # nodes that do not see the root
    with pytest.raises(ValueError, match="tree_mask"):
        ops.reconstruct_tree_from_mask(rows.flatten(), seq, 3)
    bad = T([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=torch.bool)
    bad[2, 0] = True
    bad[2, 1] = False
    ops.reconstruct_tree_from_mask(bad.flatten(), seq, 3)  # 2 is a child of the root: fine
    bad[1, 2] = True  # a node seeing a later node
    with pytest.raises(ValueError, match="tree_mask"):
        ops.reconstruct_tree_from_mask(bad.flatten(), seq, 3)
    inconsistent = T([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    inconsistent[3, 2] = True  # sees 1 and 2 but 2's row does not contain 1
    with pytest.raises(ValueError, match="parent's row"):
        ops.reconstruct_tree_from_mask(inconsistent.flatten(), T([0]), 4)
    with pytest.raises(ValueError, match="tree_mask"):
        ops.reconstruct_tree_from_mask(torch.ones(8, dtype=torch.bool), seq, 3)


def test_assign_req_to_token_bad_inputs_leave_table_untouched():
    table = torch.arange(40, dtype=torch.int32).view(4, 10)
    before = table.clone()
    cases = [
        ((T([9]), T([0]), T([2]), T([1, 2])), IndexError, "req_rows"),
        ((T([1]), T([8]), T([12]), T([1, 2, 3, 4])), IndexError, "start"),
        ((T([1]), T([3]), T([2]), T([], dtype=torch.int64)), IndexError, "end"),
        ((T([1, 2]), T([0, 0]), T([2, 2]), T([1, 2, 3])), ValueError, "cache_loc"),
        ((T([1]), T([0]), T([2]), T([1, -5])), IndexError, "cache_loc"),
        ((T([1]), T([0]), T([2]), T([1.0, 2.0])), TypeError, "cache_loc"),
    ]
    for args, exc, needle in cases:
        with pytest.raises(exc, match=needle):
            ops.assign_req_to_token(table, *args)
        assert torch.equal(table, before)
    with pytest.raises(TypeError, match="req_to_token"):
        ops.assign_req_to_token(table.long(), T([1]), T([0]), T([1]), T([3]))


def test_slot_ops_bad_ranges():
    table = torch.zeros(4, 10, dtype=torch.int32)
    with pytest.raises(IndexError, match="seq_lens"):
        ops.assign_draft_cache_locs(table, T([0]), T([6]), 2, 3)  # 6 + 6 > 10
    with pytest.raises(IndexError, match="seq_lens"):
        ops.build_draft_decode_table(table, T([0]), T([9]), 1, 2)
    with pytest.raises(ValueError, match="seq_lens"):
        ops.build_draft_decode_table(table, T([0, 1]), T([1]), 1, 2)
    with pytest.raises(IndexError, match="accept_lens"):
        ops.fill_bonus_tokens(T([[1, 2]]), T([0]))
    with pytest.raises(IndexError, match="accept_lens"):
        ops.fill_bonus_tokens(T([[1, 2]]), T([3]))


@pytest.mark.parametrize("path", specdec_inductor.runnable_isas())
def test_compact_rejects_out_of_range_on_every_path(path):
    with specdec_inductor.forced_isa(path):
        with pytest.raises(IndexError, match="accept_index"):
            ops.compact_accepted_cache_locs(torch.arange(4), T([0, 1, 4]))
        with pytest.raises(ValueError, match="accept_index"):
            ops.compact_accepted_cache_locs(torch.arange(4), torch.zeros(1, 1, 1, dtype=torch.int64))


def test_move_kv_slots_bad_inputs_leave_pools_untouched():
    k = [torch.randn(8, 2, 4) for _ in range(2)]
    v = [torch.randn(8, 2, 4) for _ in range(2)]
    before = [t.clone() for t in k + v]
    cases = [
        ((k, v, T([1, 2]), T([3, 3])), ValueError, "dst"),  # two moves into one slot
        ((k, v, T([1, 8]), T([3, 4])), IndexError, "src"),
        ((k, v, T([1, 2]), T([3, -1])), IndexError, "dst"),
        ((k, v, T([1, 2]), T([3])), ValueError, "same length"),
        ((k, v[:1], T([1]), T([3])), ValueError, "v_buffers"),
        ((k, [v[0], torch.randn(9, 2, 4)], T([1]), T([3])), ValueError, "v_buffers"),
        ((k, [v[0], torch.randn(8, 4, 2).transpose(1, 2)], T([1]), T([3])), ValueError, "dense slot rows"),
        ((k, v, T([1.0]), T([3])), TypeError, "src"),
    ]
    for args, exc, needle in cases:
        with pytest.raises(exc, match=needle):
            ops.move_kv_slots(*args)
        assert all(torch.equal(a, b) for a, b in zip(k + v, before))


def test_isa_selection_errors():
    with pytest.raises(ValueError, match="unknown path"):
        specdec_inductor.set_active_isa("sse2")
    if specdec_inductor.detected_isa() != "amx":
        with pytest.raises(ValueError, match="cannot run"):
            specdec_inductor.set_active_isa("amx")


BIG = 2 ** 63 - 1


@pytest.mark.parametrize("path", specdec_inductor.runnable_isas())
@pytest.mark.parametrize("op", [ops.build_draft_decode_table, ops.assign_draft_cache_locs])
@pytest.mark.parametrize("topk,steps,lens", [
    (1, BIG, 0),            # topk * steps fits, its sum with seq_lens does not
    (2, 2 ** 62, 0),        # topk * steps overflows to a negative number
    (2 ** 32, 2 ** 32, 0),  # ... to 0, which passed every bound
    (2, 2, BIG - 1),        # seq_lens + topk * steps overflows
])
def test_slot_ops_refuse_overflowing_sizes(path, op, topk, steps, lens):
    """Sizes whose products or sums overflow int64 are named errors, never a wrapped bound
    that lets the op write out of bounds (it corrupted the heap on every ISA path)."""
    table = torch.arange(40, dtype=torch.int32).view(4, 10)
    before = table.clone()
    with specdec_inductor.forced_isa(path):
        with pytest.raises((ValueError, IndexError), match="topk|steps|seq_lens"):
            op(table, T([0]), T([lens]), topk, steps)
    assert torch.equal(table, before)


def test_slot_ops_fakes_refuse_what_the_kernels_refuse():
    table = torch.zeros(4, 10, dtype=torch.int32)
    for op in (ops.build_draft_decode_table, ops.assign_draft_cache_locs):
        fn = torch.compile(lambda t, r, s, op=op: op(t, r, s, 2, 2 ** 62), backend="eager",
                           fullgraph=True)
        with pytest.raises(Exception, match="'topk' \\* 'steps'"):
            fn(table, T([0]), T([0]))


@pytest.mark.parametrize("call,needle", [
    (lambda: ops.build_tree(T([[-1, 0, 1]]), T([[0, 1, 2]]), T([5]), 2 ** 32, 2 ** 32, 4),
     "topk"),
    (lambda: ops.build_tree(torch.zeros(0, 0, dtype=torch.int64),
                            torch.zeros(0, 2 ** 32, dtype=torch.int64), T([]).long(), 1, 1,
                            2 ** 32 + 1), "num_draft_tokens"),
    (lambda: ops.reconstruct_tree_from_mask(torch.zeros(0, dtype=torch.bool), T([5]), 2 ** 32),
     "num_draft_tokens"),
    (lambda: ops.verify_tree_greedy(**{**_verify_args(), "num_spec_steps": 2 ** 62}),
     "num_spec_steps"),
])
def test_tree_ops_refuse_overflowing_sizes(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()


def test_ngram_refuses_overflowing_windows():
    from specdec_inductor.proposers.ngram import NgramProposer
    with pytest.raises((ValueError, RuntimeError), match="max_window"):
        NgramProposer(num_draft_tokens=4, min_window=1, max_window=2 ** 62)
