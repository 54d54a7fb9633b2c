"""KV-slot bookkeeping ops against kernels.md section 5 and the references, on both index
dtypes, ragged batches and every ISA path this machine runs."""
import pytest
import torch

import specdec_inductor
from specdec_inductor import ops
from specdec_inductor.ops import reference as ref
from specdec_inductor.compat import sglang

T = torch.tensor
PATHS = specdec_inductor.runnable_isas()


def _simd(path):
    """The path compact_accepted_cache_locs records: its only SIMD kernel is AVX-512 (which an
    AMX machine runs too); on AVX2 it runs portable."""
    return {"amx": "avx512", "avx2": "portable"}.get(path, path)


def _table(rows=6, width=40, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(rows * width, generator=gen).to(torch.int32).view(rows, width)  # [R, L]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_assign_req_to_token_ragged_and_empty(dtype):
    table = torch.full((5, 10), -7, dtype=torch.int32)
    rows, start, end = T([3, 0, 4], dtype=dtype), T([2, 0, 5], dtype=dtype), T([5, 0, 9], dtype=dtype)
    loc = torch.arange(100, 107, dtype=torch.int64)
    expected = table.clone()
    ref.assign_req_to_token_ref(expected, rows, start, end, loc)
    ops.assign_req_to_token(table, rows, start, end, loc)
    assert torch.equal(table, expected)
    assert table[3, 2:5].tolist() == [100, 101, 102] and table[4, 5:9].tolist() == [103, 104, 105, 106]
    assert (table[0] == -7).all()  # empty range wrote nothing


def test_assign_draft_cache_locs_candidate_major():
    table = _table()
    out = ops.assign_draft_cache_locs(table, T([4, 1]), T([3, 0], dtype=torch.int32), 2, 3)
    assert out.dtype == torch.int64 and out.shape == (12,)
    assert out[:6].tolist() == table[4, 3:9].tolist()  # k*steps + s order
    assert out[6:].tolist() == table[1, 0:6].tolist()
    assert torch.equal(out, ref.assign_draft_cache_locs_ref(table, T([4, 1]), T([3, 0]), 2, 3))


def test_gather_extend_cache_locs_with_and_without_total():
    table = _table()
    rows, start, end = T([2, 5, 0]), T([4, 0, 7]), T([8, 0, 9])
    want = ref.gather_extend_cache_locs_ref(table, rows, start, end)
    assert torch.equal(ops.gather_extend_cache_locs(table, rows, start, end), want)
    assert torch.equal(ops.gather_extend_cache_locs(table, rows.int(), start, end.int(), 6), want)
    with pytest.raises(ValueError, match="total"):
        ops.gather_extend_cache_locs(table, rows, start, end, 7)


def test_build_draft_decode_table_rows():
    table = _table(width=20)
    out = ops.build_draft_decode_table(table, T([3, 0]), T([5, 0]), 2, 3)
    assert out.shape == (4, 20) and out.dtype == torch.int32
    assert out[1, :8].tolist() == table[3, :5].tolist() + table[3, 8:11].tolist()
    assert (out[1, 8:] == -1).all()
    assert out[2, :3].tolist() == table[0, 0:3].tolist() and (out[2, 3:] == -1).all()
    assert torch.equal(out, ref.build_draft_decode_table_ref(table, T([3, 0]), T([5, 0]), 2, 3))
    # A transposed-storage table (non-unit stride 1) takes the strided copy.
    t_table = table.t().contiguous().t()
    assert torch.equal(ops.build_draft_decode_table(t_table, T([3, 0]), T([5, 0]), 2, 3), out)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_fill_bonus_tokens(dtype):
    tokens = T([[5, 6, 7, 8], [9, 10, -1, -1], [11, -1, -1, -1]], dtype=dtype)
    bonus = ops.fill_bonus_tokens(tokens, T([4, 2, 1], dtype=torch.int32))
    assert bonus.tolist() == [8, 10, 11] and bonus.dtype == dtype


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1000])
def test_compact_accepted_cache_locs_every_path(path, dtype, n):
    gen = torch.Generator().manual_seed(n)
    cache_loc = torch.randperm(5000, generator=gen)[: max(n, 4)]
    accept = torch.randint(0, cache_loc.numel(), (n,), generator=gen)
    accept[torch.rand(n, generator=gen) < 0.4] = -1
    accept = accept.to(dtype)
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        out, count = ops.compact_accepted_cache_locs(cache_loc, accept)
    assert specdec_inductor.kernel_path_counts() == {f"compact_accepted_cache_locs:{_simd(path)}": 1}
    want_out, want_count = ref.compact_accepted_cache_locs_ref(cache_loc, accept)
    assert torch.equal(out, want_out) and int(count) == int(want_count)


def test_compact_accepted_cache_locs_2d_accept_index():
    cache_loc = torch.arange(100, 112)
    accept_index = T([[0, 3, 4, 5], [6, 10, 11, -1]], dtype=torch.int32)
    out, count = ops.compact_accepted_cache_locs(cache_loc, accept_index)
    assert out.tolist() == [100, 103, 104, 105, 106, 110, 111, -1] and int(count) == 7
    out_t, count_t = ops.compact_accepted_cache_locs(cache_loc, accept_index.t().contiguous().t())
    assert torch.equal(out_t, out) and int(count_t) == 7


def _pools(layers=3, slots=12, dtype=torch.float32):
    k = [torch.randn(slots, 2, 4).to(dtype) for _ in range(layers)]
    v = [torch.randn(slots, 2, 3).to(dtype) for _ in range(layers)]  # V head dim may differ
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_kv_slots_chain_overlap_reads_sources_first(dtype):
    k, v = _pools(dtype=dtype)
    k_ref, v_ref = [t.clone() for t in k], [t.clone() for t in v]
    src, dst = T([5, 6, 7]), T([4, 5, 6])  # dst[i] == src[i-1]: a naive in-order copy would smear
    ops.move_kv_slots(k, v, src, dst)
    ref.move_kv_slots_ref(k_ref, v_ref, src, dst)
    for a, b in zip(k + v, k_ref + v_ref):
        assert torch.equal(a, b)
    assert not torch.equal(k[0][4], k[0][5])  # really moved (random rows differ)


def test_move_kv_slots_swap_and_disjoint():
    k, v = _pools()
    before_k = [t.clone() for t in k]
    ops.move_kv_slots(k, v, T([1, 2, 9], dtype=torch.int32), T([2, 1, 0], dtype=torch.int32))
    assert torch.equal(k[2][2], before_k[2][1]) and torch.equal(k[2][1], before_k[2][2])
    assert torch.equal(k[0][0], before_k[0][9]) and torch.equal(k[1][9], before_k[1][9])


def test_move_kv_slots_sliced_pool_view():
    big = torch.randn(20, 2, 4)
    view = big[4:16]  # a pool that is a slice of a larger buffer
    expected = big.clone()
    expected[4 + 3] = big[4 + 8]
    ops.move_kv_slots([view], [view.clone()], T([8]), T([3]))
    assert torch.equal(big, expected)


def test_sglang_slot_adapters():
    table = _table()
    out = torch.empty(12, dtype=torch.int64)
    sglang.assign_draft_cache_locs(T([4, 1]), table, T([3, 0]), out, 2, 3)
    assert torch.equal(out, ops.assign_draft_cache_locs(table, T([4, 1]), T([3, 0]), 2, 3))
    dense = torch.empty(6, dtype=torch.int64)
    sglang.get_target_cache_loc(T([2, 5]), table, T([4, 0]), T([8, 2]), dense)
    assert dense.tolist() == table[2, 4:8].tolist() + table[5, 0:2].tolist()
    verified = torch.empty(2, dtype=torch.int64)
    sglang.fill_new_verified_id(T([[1, 2], [3, 4]]), T([2, 1]), verified)
    assert verified.tolist() == [2, 3]
    # SGLang's kernel writes the kept slots at the front and leaves the tail as it was.
    compacted = torch.full((4,), 99, dtype=torch.int64)
    assert int(sglang.filter_finished_cache_loc(T([10, 11, 12, 13]), T([0, -1, 3, -1]), compacted)) == 2
    assert compacted.tolist() == [10, 13, 99, 99]
