"""Tests of store_kv / extend_attention / decode_attention against the fp32 references in
specdec_inductor/ops/reference.py, on every ISA path this machine runs (kernel_path_counts()
proves which one ran). Float results follow the 2x rule: the kernel's error against the fp32
reference is at most twice the error of plain PyTorch doing the same math in the same dtype,
plus a small absolute floor."""
import math
import os
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F

import specdec_inductor as si
from specdec_inductor.ops import (
    build_draft_decode_table,
    decode_attention,
    extend_attention,
    store_kv,
)
from specdec_inductor.ops.reference import (
    decode_attention_ref,
    extend_attention_ref,
    store_kv_ref,
    unpack_tree_mask_ref,
)

_ORDER = ["portable", "avx2", "avx512", "amx"]
ISAS = [i for i in _ORDER
        if i in si.built_isas() and _ORDER.index(si.detected_isa()) >= _ORDER.index(i)]


def recorded(isa, dtype, head_dim, rows=1, group=1):
    """The kernel path an op must record when `isa` is forced: the AMX kernel exists for bf16
    only (fp32 on AMX runs AVX-512) and runs where a chunk holds at least 8 queries (`rows` query
    rows per request, at most 128 // group of them per chunk, times the GQA `group`; decode with
    a group of 4 runs AVX-512), a head dim without an AVX-512 tile shape runs AVX2 where it is a
    multiple of 8, and any other head dim runs portable."""
    if (isa == "amx" and dtype == torch.bfloat16 and head_dim % 32 == 0
            and min(rows, max(1, 128 // group)) * group >= 8):
        return "amx"
    if isa in ("avx512", "amx") and head_dim % (16 if dtype == torch.float32 else 32) == 0:
        return "avx512"
    if isa != "portable" and head_dim % 8 == 0:
        return "avx2"
    return "portable"


DTYPES = [torch.float32, torch.bfloat16]
FLOOR = {torch.float32: 1e-5, torch.bfloat16: 2e-3}


# ---- fixtures ---------------------------------------------------------------------------------

def make_batch(prefixes, n, h, h_kv, d, dtype, seed=0, pool_slack=7, width_slack=5):
    """A KV pool [S, Hkv, D] whose rows are scattered at random over the slots, a req_to_token
    table [B + 2, L] (requests use rows 2.. in reverse order, so req_rows matter), and q."""
    g = torch.Generator().manual_seed(seed)
    bs = len(prefixes)
    width = max(prefixes) + n + width_slack
    num_slots = sum(p + n for p in prefixes) + pool_slack
    k_pool = torch.randn(num_slots, h_kv, d, generator=g).to(dtype)  # [S, Hkv, D]
    v_pool = torch.randn(num_slots, h_kv, d, generator=g).to(dtype)  # [S, Hkv, D]
    perm = torch.randperm(num_slots, generator=g)
    req_to_token = torch.full((bs + 2, width), -1, dtype=torch.int32)  # [R, L]
    req_rows = torch.arange(bs + 1, 1, -1)  # [B]
    used = 0
    for b, p in enumerate(prefixes):
        req_to_token[req_rows[b], : p + n] = perm[used: used + p + n].int()
        used += p + n
    q = torch.randn(bs, n, h, d, generator=g).to(dtype)  # [B, N, H, D]
    return q, k_pool, v_pool, req_to_token, req_rows


def random_tree(bs, n, seed=0):
    """QLEN_ONLY bool [B*N*N]: node i's parent is a random earlier node; rows are ancestor sets."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(bs, n, n, dtype=torch.bool)  # [B, N, N]
    for b in range(bs):
        for i in range(n):
            mask[b, i, i] = True
            if i > 0:
                parent = int(torch.randint(0, i, (1,), generator=g))
                mask[b, i] |= mask[b, parent]
    return mask.reshape(-1)


def chain_tree(bs, n):
    return torch.ones(n, n, dtype=torch.bool).tril().expand(bs, n, n).reshape(-1)


def bitpack(mask_bool, bs, n):
    """Bit-packed QLEN_ONLY_BITPACKING [B*N] in the smallest integer type that holds N bits."""
    rows = mask_bool.view(bs * n, n).long()
    packed = (rows << torch.arange(n)).sum(-1)  # [B*N]
    if n <= 8:
        return packed.to(torch.uint8)
    if n <= 16:
        return packed.to(torch.int16)  # wraps bit 15 into the sign: still the same 16 bits
    if n <= 32:
        return packed.to(torch.int32)
    return packed  # int64 (bit 63 is the sign bit, kept by two's complement)


def plain_torch_attention(q, k_pool, v_pool, req_to_token, req_rows, prefix_lens, extend_lens,
                          tree_mask, scale, sliding_window=-1, logit_cap=0.0):
    """The reference's math done by plain PyTorch in q's own dtype (the 2x rule's yardstick)."""
    bs, t_max, h, d = q.shape
    h_kv = k_pool.shape[1]
    out = torch.zeros_like(q)  # [B, T, H, D]
    tree = unpack_tree_mask_ref(tree_mask, bs, t_max) if tree_mask is not None else None
    for b in range(bs):
        prefix, ext = int(prefix_lens[b]), int(extend_lens[b])
        if ext == 0:
            continue
        slots = req_to_token[int(req_rows[b]), :prefix + ext].long()
        k = k_pool[slots].repeat_interleave(h // h_kv, dim=1).transpose(0, 1)  # [H, K, D]
        v = v_pool[slots].repeat_interleave(h // h_kv, dim=1).transpose(0, 1)  # [H, K, D]
        new = tree[b, :ext, :ext] if tree is not None else torch.ones(ext, ext, dtype=torch.bool).tril()
        mask = torch.cat([torch.ones(ext, prefix, dtype=torch.bool), new], dim=1)  # [ext, K]
        if sliding_window > 0:
            qpos = torch.arange(prefix, prefix + ext).view(-1, 1)
            mask &= torch.arange(prefix + ext).view(1, -1) > qpos - sliding_window
        scores = (q[b, :ext].transpose(0, 1) @ k.transpose(1, 2)) * scale  # [H, ext, K]
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        scores = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[b, :ext] = (scores @ v).transpose(0, 1)
    return out


def check_2x(out, ref32, plain, dtype):
    """Kernel error vs the fp32 reference <= 2 x plain PyTorch's error + floor."""
    assert out.dtype == dtype
    err = (out.float() - ref32).abs().max().item()
    plain_err = (plain.float() - ref32).abs().max().item()
    bound = 2 * plain_err + FLOOR[dtype]
    assert err <= bound, f"kernel error {err:.3g} > 2 x plain-torch error {plain_err:.3g} + floor"


def run_extend(isa, q, k_pool, v_pool, req_to_token, req_rows, prefix_lens, extend_lens,
               tree_mask, scale, **kw):
    si.reset_kernel_path_counts()
    with si.forced_isa(isa):
        out = extend_attention(q, k_pool, v_pool, req_to_token, req_rows, prefix_lens,
                               extend_lens, tree_mask, scale, **kw)
    path = recorded(isa, q.dtype, q.shape[-1], q.shape[1], q.shape[2] // k_pool.shape[1])
    if path == "amx" and has_path_rows(tree_mask, q.shape[0], q.shape[1], extend_lens):
        path = "avx512"  # tree rows run as their decode steps run, and decode is not on AMX
    assert si.kernel_path_counts() == {f"extend_attention:{path}": 1}
    return out


def has_path_rows(tree_mask, bs, n, extend_lens):
    """Whether a tree mask has a row that is not causal (sees other than new keys [0, t]):
    extend_attention then runs such rows one by one, decode-shaped."""
    if tree_mask is None:
        return False
    tree = unpack_tree_mask_ref(tree_mask, bs, n).view(bs, n, n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return any(not torch.equal(tree[b, :e, :e], causal[:e, :e])
               for b, e in enumerate(extend_lens.tolist()))


def check_extend(isa, dtype, q, k_pool, v_pool, req_to_token, req_rows, prefix_lens, extend_lens,
                 tree_mask, **kw):
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = run_extend(isa, q, k_pool, v_pool, req_to_token, req_rows, prefix_lens, extend_lens,
                     tree_mask, scale, **kw)
    assert out.shape == q.shape and out.is_contiguous()
    ref32 = extend_attention_ref(q.float(), k_pool.float(), v_pool.float(), req_to_token, req_rows,
                                 prefix_lens, extend_lens, tree_mask, scale, **kw)
    plain = plain_torch_attention(q, k_pool, v_pool, req_to_token, req_rows, prefix_lens,
                                  extend_lens, tree_mask, scale, **kw)
    check_2x(out, ref32, plain, dtype)
    for b in range(q.shape[0]):  # padding rows come out exactly zero
        assert (out[b, int(extend_lens[b]):] == 0).all()
    return out


# ---- verify (tree) attention ------------------------------------------------------------------

# (prefixes per request, N, H, Hkv, D, tree kind)
VERIFY_CASES = [
    ([0], 1, 4, 4, 64, "chain"),
    ([5], 4, 9, 3, 64, "random"),
    ([100, 3], 8, 8, 2, 64, "random"),
    ([37, 0, 250], 16, 5, 5, 64, "random"),
    ([130], 64, 3, 1, 128, "random"),
    ([700, 64], 64, 4, 4, 64, "chain"),
    ([4096], 8, 4, 1, 64, "random"),
    ([2000, 17], 16, 6, 2, 128, "chain"),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", VERIFY_CASES, ids=lambda c: f"p{c[0]}-n{c[1]}-h{c[2]}x{c[3]}-d{c[4]}-{c[5]}")
@pytest.mark.parametrize("packed", [False, True], ids=["bool", "bits"])
def test_verify_matches_reference(isa, dtype, case, packed):
    prefixes, n, h, h_kv, d, kind = case
    bs = len(prefixes)
    q, k_pool, v_pool, table, rows = make_batch(prefixes, n, h, h_kv, d, dtype, seed=n + h)
    tree = chain_tree(bs, n) if kind == "chain" else random_tree(bs, n, seed=d)
    mask = bitpack(tree, bs, n) if packed else tree
    prefix_lens = torch.tensor(prefixes, dtype=torch.int32)
    extend_lens = torch.full((bs,), n, dtype=torch.int64)
    check_extend(isa, dtype, q, k_pool, v_pool, table, rows, prefix_lens, extend_lens, mask)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_ragged_extend_and_noncontiguous_q(isa, dtype):
    """Ragged new-token counts (padding rows zero) and a q read through transposed strides."""
    q, k_pool, v_pool, table, rows = make_batch([300, 0, 41], 12, 6, 3, 64, dtype, seed=3)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, N, H, D] with strides of [B, H, N, D]
    assert not q_t.is_contiguous()
    tree = random_tree(3, 12, seed=5)
    extend_lens = torch.tensor([12, 5, 1])
    check_extend(isa, dtype, q_t, k_pool, v_pool, table, rows, torch.tensor([300, 0, 41]),
                 extend_lens, tree)
    check_extend(isa, dtype, q_t, k_pool, v_pool, table, rows, torch.tensor([300, 0, 41]),
                 extend_lens, None)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_prefill_causal(isa, dtype):
    """Long causal prefill: several query-row blocks per request, and key-range splits."""
    q, k_pool, v_pool, table, rows = make_batch([0, 60], 400, 4, 1, 64, dtype, seed=7)
    check_extend(isa, dtype, q, k_pool, v_pool, table, rows, torch.tensor([0, 60]),
                 torch.tensor([400, 333]), None)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_sliding_window_and_logit_cap(isa, dtype):
    """Window and soft cap on every path (bf16 with 40 rows x 2 heads per KV head runs the AMX
    kernel where there is one: its capped scores take the stored-score branch)."""
    q, k_pool, v_pool, table, rows = make_batch([500, 20], 40, 4, 2, 64, dtype, seed=9)
    q = q * 4  # large scores, so the soft cap matters
    args = (q, k_pool, v_pool, table, rows, torch.tensor([500, 20]), torch.tensor([40, 33]), None)
    for kw in ({"sliding_window": 100}, {"logit_cap": 5.0}, {"sliding_window": 7, "logit_cap": 2.0}):
        out = check_extend(isa, dtype, *args, **kw)
        plain = check_extend(isa, dtype, *args)
        assert (out - plain).abs().max() > 1e-2, f"{kw} had no effect"


def test_verify_invariant_prefix_is_seq_len():
    """Drafts' K/V live at positions [seq_len, seq_len + N) and the prefix is exactly seq_len:
    the result equals attention over explicitly assembled keys and differs from a prefix off by
    N in either direction."""
    seq_len, n, h, d = 50, 8, 2, 64
    q, k_pool, v_pool, table, rows = make_batch([seq_len + n], n, h, h, d, torch.float32, seed=11)
    row = table[int(rows[0])].long()
    # Give the N keys on each side of the boundary strong, distinct content.
    k_pool[row[seq_len - n: seq_len + 2 * n]] *= 3
    tree = random_tree(1, n, seed=2)
    scale = 1.0 / math.sqrt(d)
    tm = tree.view(n, n)

    def explicit(prefix):  # plain SDPA over keys assembled by hand
        keys = torch.cat([row[:prefix], row[prefix: prefix + n]])
        k = k_pool[keys].transpose(0, 1)  # [H, K, D]
        v = v_pool[keys].transpose(0, 1)  # [H, K, D]
        mask = torch.cat([torch.ones(n, prefix, dtype=torch.bool), tm], dim=1)  # [N, K]
        return F.scaled_dot_product_attention(q[0].transpose(0, 1), k, v, attn_mask=mask,
                                              scale=scale).transpose(0, 1)  # [N, H, D]

    for isa in ISAS:
        with si.forced_isa(isa):
            out = extend_attention(q, k_pool, v_pool, table, rows, torch.tensor([seq_len]),
                                   torch.tensor([n]), tree, scale)[0]
        torch.testing.assert_close(out, explicit(seq_len), atol=1e-5, rtol=1e-5)
        for wrong in (seq_len - n, seq_len + n):
            assert (out - explicit(wrong)).abs().max() > 0.05


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_extend_consecutive_slots_and_growing_scores(isa, dtype):
    """Two requests whose slots run consecutively (as a fresh pool hands them out; the AMX
    kernel then reads full 64-key blocks of K straight from the pool) with one scattered
    request beside them, and keys whose scores jump by far more than the AMX kernel's lazy
    rescaling margin (exp(8)) in later blocks, so the running max must move mid-prefix."""
    prefixes, n = [700, 130, 257], 8
    q, k_pool, v_pool, table, rows = make_batch(prefixes, n, 8, 2, 64, dtype, seed=9)
    start = 0
    for b in (0, 1):  # requests 0 and 1: consecutive slots from 0 on
        table[rows[b], : prefixes[b] + n] = torch.arange(start, start + prefixes[b] + n, dtype=torch.int32)
        start += prefixes[b] + n
    table[rows[2], : prefixes[2] + n] = torch.randperm(k_pool.shape[0] - start,
                                                        generator=torch.Generator().manual_seed(3))[
                                                            : prefixes[2] + n].int() + start
    grow = torch.ones(k_pool.shape[0], 1, 1)
    grow[300:600] = 5.0  # request 0's keys 300..599: scores x5 (block maxima ~3 -> ~15)
    grow[650:700] = 9.0  # and x9 further on (~27)
    k_pool = (k_pool.float() * grow).to(dtype)
    check_extend(isa, dtype, q, k_pool, v_pool, table, rows, torch.tensor(prefixes),
                 torch.tensor([n] * 3), random_tree(3, n, seed=5))


# ---- sliding window with a tree mask ------------------------------------------------------------
# Token positions (kernels.md section 6): draft i of a request with prefix P sits at P + depth(i);
# prefix key p at p. transformers' sliding window keeps key k for query q iff pos(k) > pos(q) - w
# (masking_utils.sliding_window_overlay), on top of the tree (or causal) rule.

def tree_with_depths(bs, n, seed, kind):
    """QLEN_ONLY bool [B*N*N] ancestor-set masks and the nodes' depths [B, N], taken from the
    parent links (not from the mask): a random tree (parent of i: a random earlier node), a
    chain (depth = row), or a wide tree (every node a child of the root)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(bs, n, n, dtype=torch.bool)  # [B, N, N]
    depth = torch.zeros(bs, n, dtype=torch.long)  # [B, N]
    for b in range(bs):
        for i in range(n):
            mask[b, i, i] = True
            if i == 0:
                continue
            parent = {"chain": i - 1, "wide": 0}.get(kind)
            if parent is None:
                parent = int(torch.randint(0, i, (1,), generator=g))
            mask[b, i] |= mask[b, parent]
            depth[b, i] = depth[b, parent] + 1
    return mask.reshape(-1), depth


def windowed_attention(q, k_pool, v_pool, table, rows, prefixes, tree, depth, scale, window,
                       logit_cap, dtype):
    """The combined explicit mask -- (prefix key or tree-visible draft) and in the window by
    token positions -- applied by SDPA (no cap) or a plain softmax (cap) computed in `dtype`."""
    bs, n, h, d = q.shape
    h_kv = k_pool.shape[1]
    tree = tree.view(bs, n, n)
    out = torch.zeros(bs, n, h, d, dtype=dtype)  # [B, N, H, D]
    for b in range(bs):
        p = prefixes[b]
        slots = table[int(rows[b]), :p + n].long()
        k = k_pool[slots].to(dtype).transpose(0, 1)  # [Hkv, K, D]
        v = v_pool[slots].to(dtype).transpose(0, 1)  # [Hkv, K, D]
        qpos = (p + depth[b]).view(n, 1)  # [N, 1]
        kpos = torch.cat([torch.arange(p), p + depth[b]]).view(1, -1)  # [1, K]
        mask = torch.cat([torch.ones(n, p, dtype=torch.bool), tree[b]], dim=1)  # [N, K]
        mask &= kpos > qpos - window
        qb = q[b].to(dtype).transpose(0, 1)  # [H, N, D]
        if logit_cap > 0:
            kr = k.repeat_interleave(h // h_kv, dim=0)
            vr = v.repeat_interleave(h // h_kv, dim=0)
            scores = logit_cap * torch.tanh((qb @ kr.transpose(1, 2)) * scale / logit_cap)
            o = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ vr  # [H, N, D]
        else:
            o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=h != h_kv)  # [H, N, D]
        out[b] = o.transpose(0, 1)
    return out


# (prefixes, N, H, Hkv, D, tree kind, windows): windows below the tree depth, around the
# prefix/draft boundary and wide enough to split the key range (4000 keys, one request).
WINDOW_CASES = [
    ([20], 8, 4, 2, 64, "chain", [1, 2, 3, 9]),
    ([37, 0, 90], 16, 6, 3, 64, "random", [1, 3, 5, 40]),
    ([130], 64, 8, 2, 64, "random", [2, 7, 30]),  # two query-row blocks per KV head
    ([300, 5], 12, 4, 4, 128, "wide", [1, 2, 6]),
    ([4000], 8, 4, 1, 64, "random", [3, 1500]),
]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", WINDOW_CASES, ids=lambda c: f"p{c[0]}-n{c[1]}-h{c[2]}x{c[3]}-d{c[4]}-{c[5]}")
@pytest.mark.parametrize("packed", [False, True], ids=["bool", "bits"])
def test_tree_verify_with_sliding_window_matches_sdpa(isa, dtype, case, packed):
    prefixes, n, h, h_kv, d, kind, windows = case
    bs = len(prefixes)
    q, k_pool, v_pool, table, rows = make_batch(prefixes, n, h, h_kv, d, dtype, seed=n + d)
    q = q * 3  # scores large enough for the soft cap to matter
    tree, depth = tree_with_depths(bs, n, seed=h, kind=kind)
    mask = bitpack(tree, bs, n) if packed else tree
    scale = 1.0 / math.sqrt(d)
    prefix_lens, extend_lens = torch.tensor(prefixes), torch.full((bs,), n)
    for window in windows:
        for cap in (0.0, 3.0):
            out = run_extend(isa, q, k_pool, v_pool, table, rows, prefix_lens, extend_lens, mask,
                             scale, sliding_window=window, logit_cap=cap)
            ref32 = windowed_attention(q.float(), k_pool.float(), v_pool.float(), table, rows,
                                       prefixes, tree, depth, scale, window, cap, torch.float32)
            plain = windowed_attention(q, k_pool, v_pool, table, rows, prefixes, tree, depth,
                                       scale, window, cap, dtype)
            check_2x(out, ref32, plain, dtype)
            if window < n:  # the window really cut drafts: rows' positions, not their indices
                unwindowed = windowed_attention(q.float(), k_pool.float(), v_pool.float(), table,
                                                rows, prefixes, tree, depth, scale, 10**9, cap,
                                                torch.float32)
                assert (ref32 - unwindowed).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_torch_backend_tree_window_matches_sdpa(dtype):
    """The engine's TORCH attention backend applies the same positions (depths) as the ops."""
    from specdec_inductor.engine import attention_backend as ab
    prefixes, n = [9, 40], 10
    q, k_pool, v_pool, table, rows = make_batch(prefixes, n, 4, 2, 64, dtype, seed=1)
    tree, depth = tree_with_depths(2, n, seed=3, kind="random")
    for window in (1, 3, 12):
        out = ab.extend_attention(ab.AttentionBackend.TORCH, q, k_pool, v_pool, table, rows,
                                  torch.tensor(prefixes), torch.full((2,), n), tree, 0.125, window)
        ref32 = windowed_attention(q.float(), k_pool.float(), v_pool.float(), table, rows,
                                   prefixes, tree, depth, 0.125, window, 0.0, torch.float32)
        plain = windowed_attention(q, k_pool, v_pool, table, rows, prefixes, tree, depth, 0.125,
                                   window, 0.0, dtype)
        check_2x(out, ref32, plain, dtype)


def test_sliding_window_model_verify_equals_stock_paths():
    """End to end: a tiny random Mistral with sliding_window=4 (prompt and tree both longer than
    the window) through Engine.verify on the OPS backend; every tree node's logits equal the
    stock model's (SDPA with transformers' own sliding-window mask) on its root-to-node path, so
    speculative verify accepts exactly the plain greedy tokens."""
    transformers = pytest.importorskip("transformers")
    from specdec_inductor.engine.engine import Engine
    torch.manual_seed(5)
    config = transformers.MistralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        sliding_window=4)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32]
    parents = [-1, 0, 1, 2, 3, 4, 0, 6, 1, 8]  # a depth-5 chain, a side branch and a short one
    tokens = [7, 21, 40, 99, 5, 61, 12, 33, 70, 2]
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)  # [N, N]
    depths, paths = [], []
    for i in range(n):
        path, j = [], i
        while j >= 0:
            mask[i, j] = True
            path.append(tokens[j])
            j = parents[j]
        depths.append(len(path) - 1)
        paths.append(path[::-1])
    with torch.no_grad():
        stock = [model(torch.tensor([prompt + paths[i]])).logits[0, -1] for i in range(n)]
    engine = Engine(model, max_batch=1, max_len=64, compile=False, prefill_chunk=4)
    (req,) = engine.pool.admit([len(prompt)], max_new_tokens=16)
    row = torch.tensor([req.row])
    engine.prefill([prompt], row)
    seq_lens = torch.tensor([len(prompt)])
    positions = seq_lens.view(1, 1) + torch.tensor([depths])  # [1, N]
    argmax, logits, _ = engine.verify(torch.tensor([tokens]), positions, row, seq_lens, mask.flatten())
    for i in range(n):
        torch.testing.assert_close(logits[0, i], stock[i], atol=1e-4, rtol=1e-4)
    assert torch.equal(argmax[0], torch.stack(stock).argmax(-1))  # verify's greedy picks
    engine.pool.release(req)
    # The window mattered: the same weights without it give other logits on the deep nodes.
    full = transformers.MistralConfig(**{**config.to_dict(), "sliding_window": None})
    full._attn_implementation = "sdpa"
    unwindowed = transformers.AutoModelForCausalLM.from_config(full).eval()
    unwindowed.load_state_dict(model.state_dict())
    with torch.no_grad():
        deep = unwindowed(torch.tensor([prompt + paths[5]])).logits[0, -1]
    assert (deep - stock[5]).abs().max() > 1e-3


def test_sliding_window_model_speculative_greedy_equals_plain():
    """End to end: n-gram speculation (tree drafts, depths beyond the window) on a tiny random
    Mistral with sliding_window=3 gives exactly the engine's plain greedy tokens, and those are
    the stock model's greedy tokens (transformers' generate with its own window mask). Eager
    only: the compiled engine runs the same op (it also passed, at 90 s more per run)."""
    transformers = pytest.importorskip("transformers")
    from specdec_inductor.engine.engine import Engine
    from specdec_inductor.proposers.ngram import NgramProposer
    from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats
    torch.manual_seed(11)
    config = transformers.MistralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        sliding_window=3)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    phrase = [5, 17, 42, 8, 61]
    prompts = [phrase + [3, 9, 70] + phrase + phrase[:2], [11, 12] + phrase * 3]
    with torch.no_grad():  # before the engine switches the model to our attention
        stock = [model.generate(torch.tensor([p]), max_new_tokens=24, min_new_tokens=24,
                                do_sample=False, pad_token_id=0)[0, len(p):].tolist()
                 for p in prompts]
    engine = Engine(model, max_batch=2, max_len=128, compile=False, prefill_chunk=16)
    plain = engine.generate(prompts, 24)
    assert plain == stock
    stats = SpeculativeStats()
    spec = SpeculativeGenerator(engine, NgramProposer(num_draft_tokens=6, breadth=(2, 1)))
    assert spec.generate(prompts, 24, stats=stats) == plain
    assert stats.verify_steps > 0 and stats.mean_accepted_length > 1.0, stats.summary()
    engine.pool.check_consistent()


def test_gemma2_window_and_softcap_speculative_greedy_equals_stock():
    """Gemma-2 style (sliding-window layers alternating with full ones, attention soft cap 5):
    n-gram speculation equals the engine's plain greedy, which equals the stock model's greedy
    by full forwards without a cache (transformers' own generate is not the yardstick here: its
    cached path disagrees with its uncached one for this tiny window)."""
    pytest.importorskip("transformers")
    from specdec_inductor.engine.engine import Engine
    from specdec_inductor.proposers.ngram import NgramProposer
    from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats
    from specdec_inductor.testing import tiny_gemma2
    model = tiny_gemma2(num_layers=2)
    assert "sliding_attention" in model.config.layer_types
    phrase = [5, 17, 42, 8, 61]
    prompt = phrase + [3, 9, 70] + phrase + phrase[:2]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(16):
            seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    engine = Engine(model, max_batch=1, max_len=128, compile=False, prefill_chunk=16)
    plain = engine.generate([prompt], 16)
    assert plain == [seq[len(prompt):]]
    stats = SpeculativeStats()
    spec = SpeculativeGenerator(engine, NgramProposer(num_draft_tokens=6, breadth=(2, 1)))
    assert spec.generate([prompt], 16, stats=stats) == plain
    assert stats.verify_steps > 0 and stats.mean_accepted_length > 1.0, stats.summary()


# ---- verify rows == decode rows, bit for bit -------------------------------------------------

# (prefix, N, H, Hkv, D, tree kind, window): trees across a 64-key block and a 256-key cut,
# split key ranges, chains, a window.
BITWISE_CASES = [
    (0, 8, 4, 2, 64, "random", -1),
    (61, 9, 6, 3, 64, "random", -1),
    (250, 12, 4, 1, 64, "wide", -1),
    (1015, 16, 8, 2, 128, "random", -1),  # the tree crosses a 1024-key cut
    (700, 16, 8, 2, 128, "chain", -1),
    (300, 10, 4, 2, 64, "random", 100),
    (130, 9, 12, 2, 64, "random", -1),  # a GQA group of 6: AVX2's tiled path
]


def with_threads(n, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", BITWISE_CASES,
                         ids=lambda c: f"p{c[0]}-n{c[1]}-h{c[2]}x{c[3]}-d{c[4]}-{c[5]}-w{c[6]}")
def test_verify_rows_reproduce_decode_rows_bitwise(isa, dtype, case):
    """Every verify row -- a tree row, a chain row -- equals bit for bit the decode step of its
    position over the same keys (the prefix, then its ancestors), alone or in a batch, at 1 or 2
    threads: greedy speculation == plain greedy needs exactly that, since INT8 activations turn
    last-bit differences into different tokens."""
    prefix, n, h, h_kv, d, kind, window = case
    mask, _ = tree_with_depths(1, n, seed=prefix + n, kind=kind)  # bool [N*N]
    q, k_pool, v_pool, table, rows = make_batch([prefix], n, h, h_kv, d, dtype, seed=prefix)
    kw = {"sliding_window": window} if window > 0 else {}
    if (isa == "amx" and dtype == torch.bfloat16
            and not has_path_rows(mask, 1, n, torch.tensor([n]))):
        pytest.skip("a chain verify runs AMX tiles where decode runs AVX-512: equal within "
                    "the 2x rule, not bitwise (docs/decisions.md)")

    def verify():
        with si.forced_isa(isa):
            return extend_attention(q, k_pool, v_pool, table, rows, torch.tensor([prefix]),
                                    torch.tensor([n]), mask, 0.125, **kw)

    one, two = with_threads(1, verify), with_threads(2, verify)
    assert torch.equal(one, two)
    tree = mask.view(n, n)
    dtab = torch.full((n, prefix + n), -1, dtype=torch.int32)  # [N, L]: row t = t's decode table
    kv_lens = torch.zeros(n, dtype=torch.int64)
    for t in range(n):
        ancestors = torch.nonzero(tree[t]).flatten()
        dtab[t, :prefix] = table[rows[0], :prefix]
        dtab[t, prefix:prefix + len(ancestors)] = table[rows[0], prefix + ancestors]
        kv_lens[t] = prefix + len(ancestors)
    with si.forced_isa(isa):
        batched = decode_attention(q[0], k_pool, v_pool, dtab, torch.arange(n), kv_lens, 0.125,
                                   **kw)  # [N, H, D]
    for t in range(n):
        with si.forced_isa(isa):
            alone = decode_attention(q[0, t:t + 1], k_pool, v_pool, dtab, torch.tensor([t]),
                                     kv_lens[t:t + 1], 0.125, **kw)
        assert torch.equal(alone[0], batched[t]), f"row {t}: decode alone != in a batch"
        assert torch.equal(one[0, t], batched[t]), (
            f"row {t} (depth {int(kv_lens[t]) - prefix - 1}): verify != decode, "
            f"max diff {(one[0, t] - batched[t]).abs().max().item():.3g}")


# ---- decode -----------------------------------------------------------------------------------

@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 8, 8, 64, [3000]), (3, 9, 3, 128, [1, 77, 1500]),
                                   (2, 7, 1, 64, [640, 5]), (2, 16, 2, 64, [1000, 33])], ids=str)
def test_decode_matches_reference(isa, dtype, shape):
    bs, h, h_kv, d, lens = shape
    q4, k_pool, v_pool, table, rows = make_batch([x - 1 for x in lens], 1, h, h_kv, d, dtype, seed=h)
    q = q4[:, 0]  # [B, H, D]
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    scale = 1.0 / math.sqrt(d)
    si.reset_kernel_path_counts()
    with si.forced_isa(isa):
        out = decode_attention(q, k_pool, v_pool, table, rows, kv_lens, scale)
    assert si.kernel_path_counts() == {f"decode_attention:{recorded(isa, dtype, d, 1, h // h_kv)}": 1}
    assert out.shape == q.shape
    ref32 = decode_attention_ref(q.float(), k_pool.float(), v_pool.float(), table, rows, kv_lens, scale)
    plain = plain_torch_attention(q4, k_pool, v_pool, table, rows, kv_lens - 1, torch.ones(bs), None,
                                  scale)[:, 0]
    check_2x(out, ref32, plain, dtype)


@pytest.mark.parametrize("isa", ISAS)
def test_decode_window_cap_and_draft_table(isa):
    """Draft decode over build_draft_decode_table rows, with a window and a soft cap."""
    topk, steps, seq_len = 3, 2, 900
    q4, k_pool, v_pool, table, rows = make_batch([seq_len], topk * steps, 4, 2, 64, torch.float32, seed=4)
    draft_table = build_draft_decode_table(table, rows, torch.tensor([seq_len]), topk, steps)
    q = torch.randn(topk, 4, 64) * 3  # [B*topk, H, D]
    kv_lens = torch.full((topk,), seq_len + steps)
    branch_rows = torch.arange(topk)
    for kw in ({}, {"sliding_window": 64, "logit_cap": 3.0}):
        with si.forced_isa(isa):
            out = decode_attention(q, k_pool, v_pool, draft_table, branch_rows, kv_lens, 0.125, **kw)
        ref = decode_attention_ref(q, k_pool, v_pool, draft_table, branch_rows, kv_lens, 0.125, **kw)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_amx_path_is_tested_where_available():
    """Every test above runs the AMX path when this machine has it; say so when it does not."""
    if "amx" not in ISAS:
        pytest.skip(f"no AMX here (detected {si.detected_isa()}, built {si.built_isas()}): "
                    "the AMX attention kernel is not exercised")
    q, k_pool, v_pool, table, rows = make_batch([300], 16, 8, 2, 128, torch.bfloat16)
    check_extend("amx", torch.bfloat16, q, k_pool, v_pool, table, rows, torch.tensor([300]),
                 torch.tensor([16]), random_tree(1, 16))


AMX_EMULATION_HARNESS = r"""
// Software emulation of the AMX tile intrinsics used by attention_amx.cpp (tile loads/stores by
// the loaded config, tdpbf16ps as plain bf16 products with fp32 sums), compiled together with the
// real kernel sources to check the AMX kernel's tile layout and index math against an fp64
// reference, next to the AVX-512 kernel, on machines without AMX.
#include <immintrin.h>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cmath>
#include <random>
#include <vector>
namespace emu {
struct Cfg { uint8_t palette_id, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };
Cfg cfg; bool configured = false;
alignas(64) uint8_t tiles[8][16][64];
inline float bf(uint16_t h) { uint32_t w = uint32_t(h) << 16; float f; std::memcpy(&f, &w, 4); return f; }
inline void loadconfig(const void* p) { std::memcpy(&cfg, p, 64); configured = true; }
inline void release() { configured = false; }
inline void loadd(int t, const void* base, long stride) {
  if (!configured) { std::printf("tile op without config\n"); std::abort(); }
  for (int r = 0; r < cfg.rows[t]; ++r) std::memcpy(tiles[t][r], (const char*)base + r * stride, cfg.colsb[t]);
}
inline void stored(int t, void* base, long stride) {
  for (int r = 0; r < cfg.rows[t]; ++r) std::memcpy((char*)base + r * stride, tiles[t][r], cfg.colsb[t]);
}
inline void zero(int t) { std::memset(tiles[t], 0, sizeof(tiles[t])); }
inline void dpbf16(int c, int a, int b) {
  // C [M x N fp32] += A [M x K pairs] . B [K x N pairs]; M = rows[a], K = colsb[a]/4, N = colsb[b]/4
  const int M = cfg.rows[a], K = cfg.colsb[a] / 4, N = cfg.colsb[b] / 4;
  if (cfg.rows[b] != K || cfg.rows[c] != M || cfg.colsb[c] != N * 4) { std::printf("shape mismatch\n"); std::abort(); }
  for (int m = 0; m < M; ++m) for (int n = 0; n < N; ++n) {
    float acc; std::memcpy(&acc, &tiles[c][m][4 * n], 4);
    for (int k = 0; k < K; ++k) {
      uint16_t a0, a1, b0, b1;
      std::memcpy(&a0, &tiles[a][m][4 * k], 2); std::memcpy(&a1, &tiles[a][m][4 * k + 2], 2);
      std::memcpy(&b0, &tiles[b][k][4 * n], 2); std::memcpy(&b1, &tiles[b][k][4 * n + 2], 2);
      acc += bf(a0) * bf(b0) + bf(a1) * bf(b1);
    }
    std::memcpy(&tiles[c][m][4 * n], &acc, 4);
  }
}
}  // namespace emu
#undef _tile_loadconfig
#undef _tile_release
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(p) emu::loadconfig(p)
#define _tile_release() emu::release()
#define _tile_loadd(t, base, stride) emu::loadd(t, base, stride)
#define _tile_stored(t, base, stride) emu::stored(t, base, stride)
#define _tile_zero(t) emu::zero(t)
#define _tile_dpbf16ps(c, a, b) emu::dpbf16(c, a, b)
#include "attention_amx.cpp"
#include "attention_avx512.cpp"

uint16_t to_bf(float f) { uint32_t w; std::memcpy(&w, &f, 4); w += 0x7FFF + ((w >> 16) & 1); return uint16_t(w >> 16); }

int main() {
  using namespace specdec;
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  int fails = 0;
  struct Case { int64_t D, rows, heads, prefix, ext; bool tree; int64_t window; };
  for (Case cs : {Case{64, 8, 4, 300, 8, true, -1}, Case{128, 16, 3, 130, 16, true, -1}, Case{96, 1, 4, 1000, 1, false, -1},
                  Case{64, 5, 7, 70, 5, false, -1}, Case{128, 64, 1, 0, 64, true, -1}, Case{32, 3, 2, 10, 3, false, -1},
                  Case{64, 16, 4, 300, 16, true, 5}, Case{128, 64, 1, 40, 64, true, 3}, Case{64, 5, 7, 70, 5, false, 9},
                  Case{64, 32, 2, 100, 32, true, 70}}) {
    const int64_t S = cs.prefix + cs.ext + 10, D = cs.D;
    std::vector<uint16_t> k(S * D), v(S * D), q(cs.rows * cs.heads * D);
    for (auto& x : k) x = to_bf(nd(rng)); for (auto& x : v) x = to_bf(nd(rng)); for (auto& x : q) x = to_bf(nd(rng));
    std::vector<int32_t> slots(cs.prefix + cs.ext);
    for (size_t i = 0; i < slots.size(); ++i) slots[i] = (i * 7 + 3) % S;
    std::vector<uint8_t> tree(cs.ext * cs.ext);
    for (int64_t t = 0; t < cs.ext; ++t) for (int64_t j = 0; j < cs.ext; ++j) tree[t * cs.ext + j] = (j == t) || (j < t && (rng() & 1));
    // With a window, drafts' token positions are prefix + depth (depth = drafts shown - 1).
    std::vector<int32_t> depth(cs.ext);
    for (int64_t t = 0; t < cs.ext; ++t) { int32_t n = 0; for (int64_t j = 0; j < cs.ext; ++j) n += tree[t * cs.ext + j]; depth[t] = n - 1; }
    const bool use_depth = cs.tree && cs.window > 0;
    auto pos = [&](int64_t p) { return p < cs.prefix ? p : cs.prefix + (use_depth ? depth[p - cs.prefix] : p - cs.prefix); };
    const int64_t M = cs.rows * cs.heads;
    std::vector<float> out[2];
    for (int which = 0; which < 2; ++which) {
      std::vector<float> acc(M * D), mx(M), sm(M);
      AttnChunk c{};
      c.dtype = AttnDtype::BFLOAT16; c.head_dim = D; c.q = q.data(); c.q_stride_row = cs.heads * D; c.q_stride_head = D;
      c.rows = cs.rows; c.heads = cs.heads; c.row0 = 0; c.k = k.data(); c.v = v.data(); c.k_stride_slot = D; c.v_stride_slot = D;
      c.slots = slots.data(); c.slot_stride = 1; c.key_begin = 0; c.key_end = cs.prefix + cs.ext; c.prefix = cs.prefix;
      c.tree = cs.tree ? tree.data() : nullptr; c.tree_stride = cs.ext; c.depth = use_depth ? depth.data() : nullptr; c.window = cs.window; c.scale = 0.125f; c.logit_cap = 0;
      c.acc = acc.data(); c.max = mx.data(); c.sum = sm.data();
      if (which == 0) attention_chunk_amx(c); else attention_chunk_avx512(c);
      out[which].resize(M * D);
      for (int64_t m = 0; m < M; ++m) for (int64_t d = 0; d < D; ++d) out[which][m * D + d] = acc[m * D + d] / sm[m];
    }
    // fp64 reference from the same bf16 inputs.
    std::vector<double> ref(M * D, 0.0);
    for (int64_t m = 0; m < M; ++m) {
      const int64_t t = m / cs.heads;
      std::vector<double> w(cs.prefix + cs.ext, 0.0);
      double mx = -1e300, sum = 0;
      for (int64_t p = 0; p < cs.prefix + cs.ext; ++p) {
        const int64_t e = p - cs.prefix;
        if (e >= 0 && (cs.tree ? !tree[t * cs.ext + e] : e > t)) { w[p] = -1e300; continue; }
        if (cs.window > 0 && pos(p) <= pos(cs.prefix + t) - cs.window) { w[p] = -1e300; continue; }
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += (double)emu::bf(q[m * D + d]) * emu::bf(k[slots[p] * D + d]);
        w[p] = dot * 0.125; mx = std::fmax(mx, w[p]);
      }
      for (int64_t p = 0; p < cs.prefix + cs.ext; ++p) { w[p] = w[p] <= -1e299 ? 0 : std::exp(w[p] - mx); sum += w[p]; }
      for (int64_t p = 0; p < cs.prefix + cs.ext; ++p)
        for (int64_t d = 0; d < D; ++d) ref[m * D + d] += w[p] / sum * emu::bf(v[slots[p] * D + d]);
    }
    double err[2] = {0, 0};
    for (int which = 0; which < 2; ++which)
      for (size_t i = 0; i < ref.size(); ++i) err[which] = std::fmax(err[which], std::fabs(out[which][i] - ref[i]));
    std::printf("D=%ld rows=%ld heads=%ld prefix=%ld tree=%d window=%ld: max error vs fp64: amx_emu %.3g, avx512 %.3g\n", (long)D, (long)cs.rows, (long)cs.heads, (long)cs.prefix, (int)cs.tree, (long)cs.window, err[0], err[1]);
    if (!(err[0] <= 2 * err[1] + 1e-3)) ++fails;
  }
  std::printf(fails ? "FAIL\n" : "OK\n");
  return fails;
}
"""


@pytest.mark.skipif(shutil.which(os.environ.get("CXX", "c++")) is None, reason="no C++ compiler")
@pytest.mark.skipif("avx512" not in ISAS, reason="the harness compares with the AVX-512 kernel")
def test_amx_kernel_matches_avx512_with_emulated_tiles(tmp_path):
    """The AMX kernel with software-emulated tile instructions is as close to an fp64 reference
    as the AVX-512 kernel (bf16; 2x rule), sliding windows over tree drafts included: checks its
    tile shapes, strides, padding and visibility masks without AMX hardware (not the hardware itself; test_amx_path_is_tested_where_available and every
    amx-parametrized test do that where the CPU has AMX)."""
    csrc = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
    src, exe = tmp_path / "harness.cpp", tmp_path / "harness"
    src.write_text(AMX_EMULATION_HARNESS)
    flags = ["-O1", "-std=c++17", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
             "-mavx512bf16", "-mfma", "-mf16c", f"-I{csrc}"]
    subprocess.run([os.environ.get("CXX", "c++"), *flags, str(src), "-o", str(exe)], check=True,
                   capture_output=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout


@pytest.mark.parametrize("isa", ISAS)
def test_head_dim_without_simd_kernel_runs_portable(isa):
    """D = 36 has no AVX-512 tile shape and is no multiple of 8 (AVX2): the portable kernel
    runs and is recorded as such."""
    q, k_pool, v_pool, table, rows = make_batch([33], 4, 2, 1, 36, torch.float32)
    si.reset_kernel_path_counts()
    with si.forced_isa(isa):
        out = extend_attention(q, k_pool, v_pool, table, rows, torch.tensor([33]), torch.tensor([4]),
                               None, 0.2)
    assert si.kernel_path_counts() == {"extend_attention:portable": 1}
    ref = extend_attention_ref(q, k_pool, v_pool, table, rows, torch.tensor([33]), torch.tensor([4]),
                               None, 0.2)
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("isa", [i for i in ISAS if i != "portable"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_head_dim_of_eights_runs_avx2_on_any_simd_path(isa, dtype):
    """D = 40 has no AVX-512 tile shape but is a multiple of 8: the AVX2 kernel takes it, tree
    mask and window included. Six rows of 3 heads take its tiled path (P.V over dims 16, 16, 8);
    one row takes its dot-product path (P.V over dims 32, 8)."""
    q, k_pool, v_pool, table, rows = make_batch([70, 3], 6, 6, 2, 40, dtype, seed=4)
    tree = random_tree(2, 6, seed=4)
    out = check_extend(isa, dtype, q, k_pool, v_pool, table, rows, torch.tensor([70, 3]),
                       torch.tensor([6, 6]), tree)
    assert out.abs().sum() > 0
    check_extend(isa, dtype, q, k_pool, v_pool, table, rows, torch.tensor([70, 3]),
                 torch.tensor([6, 4]), None, sliding_window=20)
    check_extend(isa, dtype, q, k_pool, v_pool, table, rows, torch.tensor([70, 3]),
                 torch.tensor([1, 1]), tree)


# ---- store_kv ---------------------------------------------------------------------------------

@pytest.mark.parametrize("pool_dtype,new_dtype", [(torch.float32, torch.float32),
                                                  (torch.bfloat16, torch.bfloat16),
                                                  (torch.bfloat16, torch.float32),
                                                  (torch.float16, torch.float32)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_store_kv_exact(pool_dtype, new_dtype, slot_dtype):
    bs, t, h_kv, d, num_slots = 2, 5, 3, 64, 40
    k_hf = torch.randn(bs, h_kv, t, d).to(new_dtype)  # HF layout [B, Hkv, T, D]
    v_hf = torch.randn(bs, h_kv, t, d).to(new_dtype)
    slots = torch.randperm(num_slots)[: bs * t].view(bs, t).to(slot_dtype)
    slots[1, 3:] = -1  # padding
    k_pool = torch.randn(num_slots, h_kv, d).to(pool_dtype)
    v_pool = torch.randn(num_slots, h_kv, d).to(pool_dtype)
    k_ref, v_ref = k_pool.clone(), v_pool.clone()
    store_kv(k_pool, v_pool, k_hf.transpose(1, 2), v_hf.transpose(1, 2), slots)
    store_kv_ref(k_ref, v_ref, k_hf.transpose(1, 2), v_hf.transpose(1, 2), slots)
    assert torch.equal(k_pool, k_ref) and torch.equal(v_pool, v_ref)


# ---- opcheck and torch.compile ----------------------------------------------------------------

def opcheck_samples():
    for index_dtype in (torch.int32, torch.int64):
        q, k_pool, v_pool, table, rows = make_batch([20, 9], 4, 4, 2, 64, torch.float32, seed=1)
        pre = torch.tensor([20, 9], dtype=index_dtype)
        ext = torch.tensor([4, 3], dtype=index_dtype)
        rows = rows.to(index_dtype)
        tree = random_tree(2, 4)
        q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # transposed strides
        q_wide = torch.randn(2, 4, 8, 64)[:, :, ::2]  # sliced heads
        for qq, tm in ((q, tree), (q_t, bitpack(tree, 2, 4)), (q_wide, None)):
            yield "extend_attention", (qq, k_pool, v_pool, table, rows, pre, ext, tm, 0.125)
        yield "decode_attention", (q[:, 0], k_pool, v_pool, table, rows, pre, 0.125)
        yield "decode_attention", (q_t[:, 1], k_pool, v_pool, table[:, :25], rows, pre, 0.125, 8, 2.0)
        k_new = torch.randn(2, 2, 3, 64).transpose(1, 2)  # [B, T, Hkv, D] from HF layout
        slots = torch.tensor([[0, 5, -1], [7, 8, 9]], dtype=index_dtype)
        yield "store_kv", (k_pool.clone(), v_pool.clone(), k_new, k_new * 2, slots)
        yield "store_kv", (k_pool.clone(), v_pool.clone(), k_new[:, :2], k_new[:, :2], slots[:, :2])


@pytest.mark.parametrize("op,args", list(opcheck_samples()), ids=lambda x: x if isinstance(x, str) else "")
def test_opcheck(op, args):
    torch.library.opcheck(getattr(torch.ops.specdec, op).default, args)


def test_compile_store_then_extend_matches_eager():
    q, k_pool, v_pool, table, rows = make_batch([30, 12], 6, 4, 2, 64, torch.float32, seed=8)
    k_new = torch.randn(2, 2, 6, 64).transpose(1, 2)  # [B, N, Hkv, D] from HF layout
    v_new = torch.randn(2, 2, 6, 64).transpose(1, 2)
    slots = torch.stack([table[int(rows[0]), 30:36], table[int(rows[1]), 12:18]]).long()  # [B, N]
    pre, ext, tree = torch.tensor([30, 12]), torch.tensor([6, 6]), random_tree(2, 6)

    def step(q, k_pool, v_pool, k_new, v_new):
        store_kv(k_pool, v_pool, k_new, v_new, slots)
        return extend_attention(q, k_pool, v_pool, table, rows, pre, ext, tree, 0.125)

    k_eager, v_eager = k_pool.clone(), v_pool.clone()
    eager = step(q, k_eager, v_eager, k_new, v_new)
    k_comp, v_comp = k_pool.clone(), v_pool.clone()
    compiled = torch.compile(step, fullgraph=True)(q, k_comp, v_comp, k_new, v_new)
    assert torch.equal(eager, compiled)
    assert torch.equal(k_eager, k_comp) and torch.equal(v_eager, v_comp)
    assert not torch.equal(k_eager, k_pool)  # the store really happened


# ---- bad inputs -------------------------------------------------------------------------------

def test_bad_inputs_name_the_argument():
    q, k_pool, v_pool, table, rows = make_batch([10], 4, 4, 2, 64, torch.float32)
    pre, ext = torch.tensor([10]), torch.tensor([4])

    def ext_call(**over):
        a = dict(q=q, k_pool=k_pool, v_pool=v_pool, req_to_token=table, req_rows=rows,
                 prefix_lens=pre, extend_lens=ext, tree_mask=None, scale=0.1)
        a.update(over)
        return extend_attention(**a)

    bad_table = table.clone()
    bad_table[int(rows[0]), 3] = k_pool.shape[0]
    cases = [
        (lambda: ext_call(q=q.double()), TypeError, "'q'"),
        (lambda: ext_call(q=q[0]), ValueError, "'q'"),
        (lambda: ext_call(k_pool=k_pool.bfloat16()), TypeError, "'k_pool'"),
        (lambda: ext_call(v_pool=v_pool[:-1]), ValueError, "'v_pool'"),
        (lambda: ext_call(q=torch.randn(1, 4, 3, 64)), ValueError, "'q'"),  # 3 heads vs 2 KV heads
        (lambda: ext_call(q=torch.randn(1, 4, 4, 32)), ValueError, "'k_pool'"),  # head_dim
        (lambda: ext_call(req_to_token=table.long()), TypeError, "'req_to_token'"),
        (lambda: ext_call(req_rows=torch.tensor([9])), IndexError, "'req_rows'"),
        (lambda: ext_call(req_rows=torch.tensor([0.0])), TypeError, "'req_rows'"),
        (lambda: ext_call(prefix_lens=torch.tensor([10, 1])), ValueError, "'prefix_lens'"),
        (lambda: ext_call(prefix_lens=torch.tensor([-1])), ValueError, "'prefix_lens'"),
        (lambda: ext_call(extend_lens=torch.tensor([5])), ValueError, "'extend_lens'"),
        (lambda: ext_call(req_to_token=bad_table), IndexError, "'req_to_token'"),
        (lambda: ext_call(tree_mask=torch.ones(15, dtype=torch.bool)), ValueError, "'tree_mask'"),
        (lambda: ext_call(tree_mask=torch.ones(4, dtype=torch.float32)), TypeError, "'tree_mask'"),
        # with a window, drafts' positions are depths: a row may not show more drafts than its
        # index + 1 (parents before children)
        (lambda: ext_call(tree_mask=torch.ones(16, dtype=torch.bool), sliding_window=8),
         ValueError, "'tree_mask'"),
        (lambda: ext_call(logit_cap=-1.0), ValueError, "'logit_cap'"),
        (lambda: decode_attention(q[:, 0], k_pool, v_pool, table, rows, torch.tensor([0]), 0.1),
         ValueError, "'kv_lens'"),
        (lambda: decode_attention(q, k_pool, v_pool, table, rows, pre, 0.1), ValueError, "'q'"),
        (lambda: store_kv(k_pool, v_pool, q[:, :, :2], q[:, :, :2], torch.tensor([[0, 1, 2, 99]])),
         IndexError, "'slots'"),
        (lambda: store_kv(k_pool, v_pool, q[:, :, :2], q[:, :, :2], torch.tensor([[0, 1, 1, 2]])),
         ValueError, "'slots'"),
        (lambda: store_kv(k_pool, v_pool, q[:, :, :2], q[:, :, :2], torch.tensor([0, 1, 2, 3])),
         ValueError, "'slots'"),
        (lambda: store_kv(k_pool, v_pool, q, q, torch.tensor([[0, 1, 2, 3]])), ValueError, "'k'"),
        (lambda: store_kv(k_pool, v_pool.int(), q[:, :, :2], q[:, :, :2], torch.tensor([[0, 1, 2, 3]])),
         TypeError, "'v_pool'"),
    ]
    for i, (call, exc, name) in enumerate(cases):
        with pytest.raises(exc, match=name):
            call()


def test_reference_tree_window_matches_sdpa():
    """extend_attention_ref (the REFERENCE backend) places tree drafts at prefix + depth too."""
    prefixes, n = [9, 40], 10
    q, k_pool, v_pool, table, rows = make_batch(prefixes, n, 4, 2, 64, torch.float32, seed=2)
    tree, depth = tree_with_depths(2, n, seed=5, kind="random")
    for window in (1, 3, 12):
        out = extend_attention_ref(q, k_pool, v_pool, table, rows, torch.tensor(prefixes),
                                   torch.full((2,), n), tree, 0.125, window)
        exact = windowed_attention(q.double(), k_pool.double(), v_pool.double(), table, rows,
                                   prefixes, tree, depth, 0.125, window, 0.0, torch.float64)
        assert (out.double() - exact).abs().max() < 1e-5, window
