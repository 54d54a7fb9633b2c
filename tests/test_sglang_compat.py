"""The SGLang adapter (specdec_inductor.compat.sglang) keeps SGLang's CPU calling contracts: its
`retrive_*` spelling, output buffers larger than needed (written at the front, tails untouched),
size errors that name the argument, and the entry points tree_speculative_sampling_target_only,
extend_attention_cpu, build_draft_decode_metadata_cpu, copy_all_layer_kv_cache_cpu and
rotate_input_ids_cpu -- checked on kernels.md's golden examples and random trees against our
ops."""
import math

import pytest
import torch

from specdec_inductor import ops
from specdec_inductor.compat import sglang
from specdec_inductor.ops import TreeMaskMode
from specdec_inductor.testing import random_draft, random_verify_inputs

T = torch.tensor
SENTINEL = 77


def example_d():
    """kernels.md worked example D (two requests, N=6, S=4), SGLang's spelling."""
    return dict(
        candidates=T([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]),
        retrive_index=T([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]),
        retrive_next_token=T([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]),
        retrive_next_sibling=T([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]),
        target_predict=T([[3, 18, 18, 4, 5, 18], [11, 18, 18, 18, 12, 18]]),
    )


# ---- spelling and oversized buffers -------------------------------------------------------------

def test_verify_greedy_sglang_spelling_and_oversized_predicts():
    predicts = torch.full((13,), SENTINEL, dtype=torch.int32)  # bs*N + 1, as SGLang allocates
    accept_index = torch.full((2, 4), -1, dtype=torch.int32)
    accept_num = torch.zeros(2, dtype=torch.int32)
    sglang.verify_tree_greedy(predicts=predicts, accept_index=accept_index,
                              accept_token_num=accept_num, **example_d())
    assert predicts.tolist() == [3, 77, 77, 4, 5, 18, 11, 77, 77, 77, 12, 18, 77]
    assert accept_index.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    assert accept_num.tolist() == [3, 2]


def test_both_spellings_or_none_raise():
    d = example_d()
    outs = (torch.zeros(12, dtype=torch.int32), torch.full((2, 4), -1, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TypeError, match="retrive_index"):
        sglang.verify_tree_greedy(*outs, **d, retrieve_index=d["retrive_index"])
    d.pop("retrive_next_sibling")
    with pytest.raises(TypeError, match="retrieve_next_sibling"):
        sglang.verify_tree_greedy(*outs, **d)
    with pytest.raises(ValueError, match="'predicts'"):
        sglang.verify_tree_greedy(torch.zeros(11, dtype=torch.int32), *outs[1:], **example_d())


def test_build_tree_preallocated_buffers_written_at_the_front():
    """Example A into SGLang-style buffers: oversized tree_mask / positions / linkage (tails
    keep their fill), `retrive_*` keywords; then FULL_MASK, and a too-small buffer named."""
    n = 4
    outs = dict(tree_mask=torch.zeros(20, dtype=torch.bool),
                positions=torch.full((6,), SENTINEL, dtype=torch.int64),
                retrive_index=torch.full((2, n), SENTINEL, dtype=torch.int64),
                retrive_next_token=torch.full((2, n), SENTINEL, dtype=torch.int64),
                retrive_next_sibling=torch.full((2, n), SENTINEL, dtype=torch.int64))
    args = (T([[-1, 0, 1]]), T([[0, 1, 2]]), T([5]))
    sglang.build_tree_kernel_efficient(*args, outs["tree_mask"], outs["positions"], topk=2,
                                       depth=2, draft_token_num=n,
                                       tree_mask_mode=int(TreeMaskMode.QLEN_ONLY),
                                       retrive_index=outs["retrive_index"],
                                       retrive_next_token=outs["retrive_next_token"],
                                       retrive_next_sibling=outs["retrive_next_sibling"])
    rows = ["".join("1" if x else "0" for x in r) for r in outs["tree_mask"][:16].view(4, 4).tolist()]
    assert rows == ["1000", "1100", "1010", "1101"] and not outs["tree_mask"][16:].any()
    assert outs["positions"].tolist() == [5, 6, 6, 7, SENTINEL, SENTINEL]
    assert outs["retrive_next_token"].tolist() == [[1, 3, -1, -1], [SENTINEL] * 4]
    assert outs["retrive_next_sibling"].tolist() == [[-1, 2, -1, -1], [SENTINEL] * 4]
    assert outs["retrive_index"].tolist() == [[0, 1, 2, 3], [SENTINEL] * 4]

    full = torch.zeros(5 * 4 + 16 + 3, dtype=torch.bool)
    sglang.build_tree_kernel_efficient(*args, full, torch.empty(4, dtype=torch.int64),
                                       *[torch.empty(1, n, dtype=torch.int64) for _ in range(3)],
                                       2, 2, n, int(TreeMaskMode.FULL_MASK))
    want = ops.build_tree(*args, 2, 2, n, TreeMaskMode.FULL_MASK)[0]
    assert torch.equal(full[:36], want) and not full[36:].any()

    with pytest.raises(ValueError, match="'tree_mask'"):
        sglang.build_tree_kernel_efficient(*args, torch.zeros(15, dtype=torch.bool),
                                           torch.empty(4, dtype=torch.int64),
                                           *[torch.empty(1, n, dtype=torch.int64) for _ in range(3)],
                                           2, 2, n, int(TreeMaskMode.QLEN_ONLY))
    with pytest.raises(ValueError, match="'retrieve_next_token'"):
        sglang.build_tree_kernel_efficient(*args, torch.zeros(16, dtype=torch.bool),
                                           torch.empty(4, dtype=torch.int64),
                                           torch.empty(1, n, dtype=torch.int64),
                                           torch.empty(1, n - 1, dtype=torch.int64),
                                           torch.empty(1, n, dtype=torch.int64),
                                           2, 2, n, int(TreeMaskMode.QLEN_ONLY))


def test_reconstruct_sglang_spelling_example_e():
    rows = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    mask = T(rows, dtype=torch.bool).flatten()
    pos = torch.full((5,), SENTINEL, dtype=torch.int64)
    outs = [torch.full((1, 4), SENTINEL, dtype=torch.int64) for _ in range(3)]
    sglang.reconstruct_indices_from_tree_mask(mask, T([12]), pos, retrive_index=outs[0],
                                              retrive_next_token=outs[1],
                                              retrive_next_sibling=outs[2], batch_size=1,
                                              draft_token_num=4)
    assert pos.tolist() == [12, 13, 13, 14, SENTINEL]
    assert outs[1].tolist() == [[1, -1, 3, -1]] and outs[2].tolist() == [[-1, 2, -1, -1]]
    bad = T([[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool).flatten()
    with pytest.raises(ValueError, match="tree_mask"):
        sglang.reconstruct_indices_from_tree_mask(bad, T([3]), pos, *outs, 1, 4)


def test_filter_finished_cache_loc_leaves_the_tail():
    out = torch.full((6,), SENTINEL, dtype=torch.int64)  # at capacity
    count = sglang.filter_finished_cache_loc(T([10, 11, 12, 13]), T([0, -1, 3, -1]), out)
    assert int(count) == 2
    assert out.tolist() == [10, 13, SENTINEL, SENTINEL, SENTINEL, SENTINEL]
    with pytest.raises(ValueError, match="'out'"):
        sglang.filter_finished_cache_loc(T([10, 11, 12, 13]), T([0, 1, 3, -1]), torch.empty(2, dtype=torch.int64))


def _table():
    g = torch.Generator().manual_seed(0)
    return torch.randperm(6 * 20, generator=g).int().view(6, 20)  # [R, L] distinct slots


def test_slot_helpers_write_the_front_of_capacity_buffers():
    table = _table()
    draft = torch.full((14,), SENTINEL, dtype=torch.int64)
    sglang.assign_draft_cache_locs(T([4, 1]), table, T([3, 0]), draft, 2, 3)
    assert draft[:12].tolist() == ops.assign_draft_cache_locs(table, T([4, 1]), T([3, 0]), 2, 3).tolist()
    assert draft[12:].tolist() == [SENTINEL] * 2
    dense = torch.full((9,), SENTINEL, dtype=torch.int64)
    sglang.get_target_cache_loc(T([2, 5]), table, T([4, 0]), T([8, 2]), dense)
    assert dense.tolist() == table[2, 4:8].tolist() + table[5, 0:2].tolist() + [SENTINEL] * 3
    with pytest.raises(ValueError, match="'out_cache_loc'"):
        sglang.get_target_cache_loc(T([2, 5]), table, T([4, 0]), T([8, 2]), torch.empty(5, dtype=torch.int64))
    verified = torch.full((3,), SENTINEL, dtype=torch.int64)
    sglang.fill_new_verified_id(T([[1, 2], [3, 4]]), T([2, 1]), verified)
    assert verified.tolist() == [2, 3, SENTINEL]
    t2 = table.clone()
    sglang.assign_req_to_token(T([0]), t2, T([2]), T([5]), T([100, 101, 102, 103, 104]))
    assert t2[0, 2:5].tolist() == [100, 101, 102] and torch.equal(t2[1:], table[1:])


def test_build_draft_decode_metadata_cpu():
    table = _table()
    got = sglang.build_draft_decode_metadata_cpu(table, T([3, 0]), T([5, 2]), 2, 3, 20)
    assert got.shape == (4, 20) and got.dtype == torch.int32
    for b, (row, sl) in enumerate(((3, 5), (0, 2))):
        for k in range(2):
            want = table[row, :sl].tolist() + table[row, sl + 3 * k: sl + 3 * k + 3].tolist()
            assert got[b * 2 + k, :sl + 3].tolist() == want
    with pytest.raises(ValueError, match="'pool_len'"):
        sglang.build_draft_decode_metadata_cpu(table, T([3, 0]), T([5, 2]), 2, 3, 19)


# ---- tree speculative sampling (target only) ----------------------------------------------------

def test_tree_sampling_target_only_matches_our_op_on_random_trees():
    gen = torch.Generator().manual_seed(4)
    for topk, depth, bs, n in [(2, 3, 3, 8), (4, 2, 2, 6), (1, 4, 2, 5)]:
        d = random_draft(bs, topk, depth, n, gen)
        _, _, ridx, nxt, sib = ops.build_tree(d.parent_list, d.selected_index, d.seq_lens, topk, depth, n)
        candidates, _ = random_verify_inputs(nxt, sib, gen, vocab=12)
        probs = torch.rand(bs, n, 12, generator=gen) ** 4
        probs = probs / probs.sum(-1, keepdim=True)  # [B, N, V]
        coins = torch.rand(bs, n, generator=gen)
        final = torch.rand(bs, generator=gen)
        want = ops.tree_speculative_sampling(candidates, ridx, nxt, sib, coins, final, probs, depth + 1)
        predicts = torch.full((bs * n + 1,), SENTINEL, dtype=torch.int32)
        accept_index = torch.full((bs, depth + 1), -1, dtype=torch.int32)
        accept_num = torch.zeros(bs, dtype=torch.int32)
        sglang.tree_speculative_sampling_target_only(
            predicts, accept_index, accept_num, candidates, retrive_index=ridx,
            retrive_next_token=nxt, retrive_next_sibling=sib, uniform_samples=coins,
            uniform_samples_for_final_sampling=final, target_probs=probs,
            draft_probs=torch.zeros_like(probs))
        assert torch.equal(accept_index, want[1]) and torch.equal(accept_num, want[2])
        on_path = want[0] >= 0
        assert torch.equal(predicts[:-1][on_path], want[0][on_path])
        assert (predicts[:-1][~on_path] == SENTINEL).all() and int(predicts[-1]) == SENTINEL


def test_tree_sampling_target_only_rejects_lossy_thresholds():
    d = example_d()
    probs = torch.full((2, 6, 20), 1 / 20)
    args = (torch.zeros(12, dtype=torch.int32), torch.full((2, 4), -1, dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32), d["candidates"], d["retrive_index"],
            d["retrive_next_token"], d["retrive_next_sibling"], torch.rand(2, 6), torch.rand(2),
            probs, torch.zeros_like(probs))
    with pytest.raises(ValueError, match="'threshold_single'"):
        sglang.tree_speculative_sampling_target_only(*args, threshold_single=0.5)
    with pytest.raises(ValueError, match="'threshold_acc'"):
        sglang.tree_speculative_sampling_target_only(*args, threshold_acc=0.9)


# ---- extend attention ---------------------------------------------------------------------------

def _extend_case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    prefix, ext, h, h_kv, d = [7, 0, 30], [5, 3, 1], 4, 2, 64
    slots = 80
    k_buffer = torch.randn(slots, h_kv, d, generator=g).to(dtype)  # [S, Hkv, D]
    v_buffer = torch.randn(slots, h_kv, d, generator=g).to(dtype)
    req_to_token = torch.randperm(4 * 40, generator=g)[:4 * 40].remainder(slots).int().view(4, 40)
    # distinct slots per request row
    perm = torch.randperm(slots, generator=g)
    rows = T([3, 0, 2])
    used = 0
    for b in range(3):
        req_to_token[rows[b], :prefix[b] + ext[b]] = perm[used:used + prefix[b] + ext[b]].int()
        used += prefix[b] + ext[b]
    num = sum(ext)
    q = torch.randn(num, h, d, generator=g).to(dtype)  # [tokens, H, D]
    start = T([0, 5, 8])
    return q, k_buffer, v_buffer, req_to_token, rows, T(prefix), T(ext), start


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_extend_attention_cpu_matches_sdpa(dtype):
    q, kb, vb, table, rows, prefix, ext, start = _extend_case(dtype)
    num, h, d = q.shape
    scale = 1 / math.sqrt(d)
    for kw in ({}, {"sliding_window_size": 4}, {"logit_cap": 2.0}):
        out = torch.full((num, h, d), float("nan"), dtype=dtype)
        sglang.extend_attention_cpu(q, q[:, :2], q[:, :2], out, kb, vb, table, rows,
                                    prefix + ext, ext, start, int(ext.max()), scale, **kw)
        for b in range(3):
            p, e, s = int(prefix[b]), int(ext[b]), int(start[b])
            keys = table[int(rows[b]), :p + e].long()
            k = kb[keys].float().repeat_interleave(2, 1).transpose(0, 1)  # [H, K, D]
            v = vb[keys].float().repeat_interleave(2, 1).transpose(0, 1)
            qpos = torch.arange(p, p + e).view(-1, 1)
            kpos = torch.arange(p + e).view(1, -1)
            mask = kpos <= qpos
            if "sliding_window_size" in kw:
                mask &= kpos > qpos - kw["sliding_window_size"]
            scores = (q[s:s + e].float().transpose(0, 1) @ k.transpose(1, 2)) * scale
            if "logit_cap" in kw:
                scores = kw["logit_cap"] * torch.tanh(scores / kw["logit_cap"])
            want = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(0, 1)
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(out[s:s + e].float(), want, atol=tol, rtol=tol)


def test_extend_attention_cpu_tree_mask_and_unsupported():
    q, kb, vb, table, rows, prefix, ext, start = _extend_case(torch.float32, seed=2)
    num, h, d = q.shape
    t = int(ext.max())
    tree = torch.zeros(3, t, t, dtype=torch.bool)
    tree[:, :, 0] = True
    tree |= torch.eye(t, dtype=torch.bool)  # every draft sees the root and itself
    out = torch.empty(num, h, d)
    sglang.extend_attention_cpu(q, q, q, out, kb, vb, table, rows, prefix + ext, ext, start, t,
                                0.125, 0.0, False, 0, None, None, tree.reshape(-1))
    qpad = torch.zeros(3, t, h, d)
    for b in range(3):
        qpad[b, :int(ext[b])] = q[int(start[b]):int(start[b]) + int(ext[b])]
    want = ops.extend_attention(qpad, kb, vb, table, rows, prefix, ext, tree.reshape(-1), 0.125)
    for b in range(3):
        s, e = int(start[b]), int(ext[b])
        torch.testing.assert_close(out[s:s + e], want[b, :e])
    for kw in ({"is_cross_attn": True}, {"sinks": torch.zeros(h)}, {"encoder_lens": T([1, 1, 1])}):
        with pytest.raises(NotImplementedError):
            sglang.extend_attention_cpu(q, q, q, out, kb, vb, table, rows, prefix + ext, ext, start,
                                        t, 0.125, **kw)
    with pytest.raises(ValueError, match="'o_extend'"):
        sglang.extend_attention_cpu(q, q, q, out[:-1], kb, vb, table, rows, prefix + ext, ext,
                                    start, t, 0.125)


# ---- KV copies and input rotation --------------------------------------------------------------

def test_copy_all_layer_kv_cache_cpu_resolves_registered_buffers():
    g = torch.Generator().manual_seed(1)
    k = [torch.randn(10, 2, 4, generator=g) for _ in range(2)]
    v = [torch.randn(10, 2, 4, generator=g).bfloat16() for _ in range(2)]
    before = [b.clone() for b in k + v]
    sglang.register_kv_buffers(k + v)
    ptrs = torch.tensor([b.data_ptr() for b in k + v], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in k + v], dtype=torch.int64)
    src, tgt = T([3, 4, 5]), T([4, 5, 9])  # a chain: sources read before any write
    sglang.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, old in zip(k + v, before):
        want = old.clone()
        want[tgt] = old[src]
        assert torch.equal(b, want)
    with pytest.raises(ValueError, match="'strides'"):
        sglang.copy_all_layer_kv_cache_cpu(ptrs, strides + 1, tgt, src)
    sglang.register_kv_buffers([])
    with pytest.raises(ValueError, match="'data_ptrs'"):
        sglang.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)


def test_rotate_input_ids_cpu():
    ids = T([10, 11, 12, 20, 21, 30, 40, 41, 42, 43])
    sglang.rotate_input_ids_cpu(ids, T([0, 3, 5, 6]), T([3, 2, 1, 4]), T([99, 98, 97, 96]))
    assert ids.tolist() == [11, 12, 99, 21, 98, 97, 41, 42, 43, 96]
    ids = T([10, 11, 12, 20, 21])
    sglang.rotate_input_ids_cpu(ids, T([0, 3]), T([3, 2]), T([99, 98]), select_index=T([0, 3]))
    # shifted left; the new token goes to select_index, the segment's last entry keeps its value
    assert ids.tolist() == [99, 12, 12, 98, 21]
    ids = T([5, 6])
    sglang.rotate_input_ids_cpu(ids, T([0, 2]), T([2, 0]), T([7, 8]))  # an empty segment
    assert ids.tolist() == [6, 7]
    with pytest.raises(ValueError, match="'topk_index'"):
        sglang.rotate_input_ids_cpu(ids, T([0]), T([2]), T([7, 8]))


def test_sglang_cpu_names():
    """sgl_kernel's `*_cpu` spellings, with their pool_len / accept_stride arguments."""
    table = _table()
    predicts = torch.full((12,), SENTINEL, dtype=torch.int32)
    accept_index = torch.full((2, 4), -1, dtype=torch.int32)
    accept_num = torch.zeros(2, dtype=torch.int32)
    sglang.verify_tree_greedy_cpu(predicts, accept_index, accept_num, *example_d().values())
    assert accept_index.tolist() == [[0, 3, 4, 5], [6, 10, 11, -1]]
    out = torch.full((13,), SENTINEL, dtype=torch.int64)
    sglang.assign_draft_cache_locs_contiguous_cpu(T([4, 1]), table, T([3, 0]), out, 20, 2, 3)
    assert out[:12].tolist() == ops.assign_draft_cache_locs(table, T([4, 1]), T([3, 0]), 2, 3).tolist()
    assert int(out[12]) == SENTINEL
    dense = torch.full((7,), SENTINEL, dtype=torch.int64)
    sglang.assign_extend_cache_locs_cpu(T([2, 5]), table, T([4, 0]), T([8, 2]), dense, 20)
    assert dense.tolist() == table[2, 4:8].tolist() + table[5, 0:2].tolist() + [SENTINEL]
    t2 = table.clone()
    sglang.assign_req_to_token_pool_cpu(T([0]), t2, T([2]), T([4]), T([100, 101]), 20)
    assert t2[0, 2:4].tolist() == [100, 101]
    with pytest.raises(ValueError, match="'pool_len'"):
        sglang.assign_req_to_token_pool_cpu(T([0]), t2, T([2]), T([4]), T([100, 101]), 21)
    bonus = torch.zeros(2, dtype=torch.int32)
    sglang.fill_bonus_tokens_cpu(T([1, 2, 3, 4, 5, 6], dtype=torch.int32), T([3, 1], dtype=torch.int32),
                                 bonus, 3)
    assert bonus.tolist() == [3, 4]
    acc = torch.full((8,), SENTINEL, dtype=torch.int64)
    sglang.fill_accept_out_cache_loc_cpu(T([[0, 2, -1], [3, -1, -1]]), T([10, 11, 12, 13]), acc)
    assert acc.tolist() == [10, 12, 13] + [SENTINEL] * 5
