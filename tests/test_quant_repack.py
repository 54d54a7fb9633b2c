"""The row-interleaved layouts *_R16 (csrc/quant_repack.h: Q4_K_R16 / Q6_K_R16 and the 32-weight
formats' Q4_0_R16 / Q4_1_R16 / Q5_0_R16 / Q5_1_R16 / Q8_0_R16): quant_repack against the
Python reference of the layout and back to the file's bytes, every weight dequantizing to the
file's value, quant_linear with INT8 activations over them (the VNNI kernel where it runs, the
portable loops else; path asserted) against the fp64 definition, batch invariance for every M in
1..16 and 64, threads, extreme integer sums, K = 8960, opcheck, eager == compiled, bad inputs."""
import pytest
import torch
from torch.library import opcheck

import specdec_inductor
from specdec_inductor.ops.quant import (QuantActivation, QuantFormat, file_format, int8_path,
                                        quant_block, quant_dequantize, quant_embedding,
                                        quant_linear, quant_linear_cat, quant_repack,
                                        quant_row_bytes, repacked_format)
from specdec_inductor.ops.reference import (_q6_file_quants, quant_dequantize_ref,
                                            quant_linear_int8_terms_ref, quant_repack_ref,
                                            quant_unpack_ref)
from test_quant import (PATHS, _int8_x, _saturating_weight, _saturating_x, assert_one_thread_equals_all, bits,
                        check_int8_rows_alone_equal_batches, int8_kernel_of, random_weight)

K_BASES = [QuantFormat.Q4_K, QuantFormat.Q6_K]
SMALL_BASES = [QuantFormat.Q4_0, QuantFormat.Q4_1, QuantFormat.Q5_0, QuantFormat.Q5_1, QuantFormat.Q8_0]
BASES = K_BASES + SMALL_BASES
INT8 = QuantActivation.INT8


def r16_kernel_of(path):
    """The repacked layouts have the VNNI kernel and the portable loops (no AVX2 kernel)."""
    return "avx512" if int8_kernel_of(path, QuantFormat.Q4_K) == "avx512" else "portable"


def packed(base, n, k, seed, extreme=False):
    """(file rows [N, row_bytes], the same rows repacked, the R16 fmt)."""
    w = random_weight(base, n, k, seed, extreme=extreme)
    return w, quant_repack(w, base), repacked_format(base)


def act_block(base):
    """Values per INT8 activation block: 256 for the K formats, 32 for the others."""
    return quant_block(base)[0]


def bound(base, k, magnitude):
    """Twice the fp32 rounding of the INT8 definition per lane: the K formats, test_quant's
    K/64 + 8 roundings of |terms|; the 32-weight formats' R16 kernel, one FMA per 32-weight block
    and one more for the min (K/16), the scale products and the bias (+ 8)."""
    per_k = 64 if quant_block(base)[0] == 256 else 16
    return 2 * (k / per_k + 8) * 2.0 ** -24 * magnitude


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("base", BASES)
def test_repack_matches_reference_and_unpacks_to_the_file_bytes(base, extreme):
    w, r, fmt = packed(base, 48, 3 * 256, seed=int(base) + extreme, extreme=extreme)
    assert fmt == QuantFormat(int(base) + 256) and file_format(fmt) == base
    assert r.dtype == torch.uint8 and r.shape == (3, 16 * quant_row_bytes(fmt, 3 * 256))
    assert r.numel() == w.numel() + {QuantFormat.Q4_K: 48 * 3 * 4, QuantFormat.Q6_K: 3 * 3 * 32}.get(base, 0)
    assert torch.equal(r, quant_repack_ref(w, base))
    assert torch.equal(quant_repack(r, fmt), w)
    assert torch.equal(quant_unpack_ref(r, fmt), w)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("base", BASES)
def test_every_weight_keeps_its_file_value(base, path):
    w, r, fmt = packed(base, 32, 2 * 256, seed=7, extreme=True)
    with specdec_inductor.forced_isa(path):
        expected = quant_dequantize(w, base)  # [N, K]
        assert torch.equal(bits(quant_dequantize(r, fmt)), bits(expected))
        ids = torch.tensor([[31, 0], [17, 16]])
        assert torch.equal(bits(quant_embedding(ids, r, fmt)), bits(expected[ids]))
    assert torch.equal(bits(quant_dequantize_ref(r, fmt)), bits(expected))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("base", BASES)
@pytest.mark.parametrize("m", [1, 3, 8, 13, 64])
def test_int8_linear_matches_reference(base, dtype, path, m):
    k, n = 2 * 256, 48
    w, r, fmt = packed(base, n, k, seed=int(base) * 100 + m)
    gen = torch.Generator().manual_seed(m)
    x = _int8_x(m, k, gen, dtype, block=act_block(base))  # [M, K]
    b = torch.randn(n, generator=gen).to(dtype) if m % 2 else None  # [N]
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        out = quant_linear(x, r, fmt, b, activation=INT8)
    assert specdec_inductor.kernel_path_counts() == {f"quant_linear_int8_r16:{r16_kernel_of(path)}": 1}
    assert out.dtype == dtype and out.shape == (m, n)
    ref, magnitude = quant_linear_int8_terms_ref(x, r, fmt, b)  # [M, N] fp64
    assert torch.equal(ref, quant_linear_int8_terms_ref(x, w, base, b)[0])
    limit = bound(base, k, magnitude) + (2.0 ** -8 * ref.abs() if dtype == torch.bfloat16 else 0)
    assert ((out.double() - ref).abs() <= limit).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("base", BASES)
def test_int8_linear_is_batch_invariant(base, path):
    """Every M in 1..16 and 64 (each remainder of the 4- and 8-row tiles), every position of a row in an
    8-row batch, 1 thread or all: a row's bits never change; on the path asserted."""
    k, n = 2 * 256, 64
    _, r, fmt = packed(base, n, k, seed=int(base))
    bias = torch.randn(n)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(int(base)))  # [64, K]
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        check_int8_rows_alone_equal_batches(x, r, fmt, bias)
    assert set(specdec_inductor.kernel_path_counts()) == {f"quant_linear_int8_r16:{r16_kernel_of(path)}"}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("base", BASES)
def test_threads_split_groups_not_sums(base, path):
    _, r, fmt = packed(base, 1008, 512, seed=31)  # 63 groups: enough to fan out
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(31))
    with specdec_inductor.forced_isa(path):
        assert_one_thread_equals_all(x, r, fmt, INT8)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("base", K_BASES)
def test_extreme_integer_sums(base, path):
    """The largest quants and scales against x = +-1: no int32 sum overflows."""
    k, n = 3 * 256, 16
    x = _saturating_x(k)
    for sign in (1, -1):
        w = _saturating_weight(base, n, k, sign)
        r, fmt = quant_repack(w, base), repacked_format(base)
        with specdec_inductor.forced_isa(path):
            out = quant_linear(x, r, fmt, activation=INT8)
        ref, magnitude = quant_linear_int8_terms_ref(x, w, base)
        assert ((out.double() - ref).abs() <= bound(base, k, magnitude)).all(), (out, ref)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("base", BASES)
def test_long_rows(base, path):
    """K = 8960 (the 1.5B's down projection): M = 1..9 and 16 bitwise == each row alone, within
    the bound of the fp64 definition."""
    k, n = 8960, 32
    w, r, fmt = packed(base, n, k, seed=41)
    x = _int8_x(16, k, torch.Generator().manual_seed(41), torch.float32, block=act_block(base))  # [16, K]
    with specdec_inductor.forced_isa(path):
        alone = torch.cat([quant_linear(x[i:i + 1], r, fmt, activation=INT8) for i in range(16)])
        for rows in list(range(2, 10)) + [16]:
            assert torch.equal(quant_linear(x[:rows], r, fmt, activation=INT8), alone[:rows]), rows
    ref, magnitude = quant_linear_int8_terms_ref(x, w, base)
    assert ((alone.double() - ref).abs() <= bound(base, k, magnitude)).all()


def _q6_one_quant_per_row(n):
    """Q6_K file rows [n, 210] (K = 256) whose quants are all u = 32 (wq = 0) but weight n's of
    row n: 0, 63, 1 or 62 by turns (every bit pattern of the low, middle and high bits), 16
    distinct nonzero scales, d = 1."""
    u = torch.full((n, 256), 32, dtype=torch.int64)
    rows = torch.arange(n)
    u[rows, rows % 256] = torch.tensor([0, 63, 1, 62])[rows % 4]
    scales = ((torch.arange(16) + 1) * (1 - 2 * (torch.arange(16) % 2))).repeat(n, 1) & 255  # 1, -2, 3, ...
    d = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8).long().repeat(n, 1)
    return torch.cat([_q6_file_quants(u), scales, d], 1).to(torch.uint8)


@pytest.mark.parametrize("path", PATHS)
def test_q6_every_weight_position_reaches_its_row(path):
    """Q6_K_R16 keeps each of a block's 256 quants in one of 4 slots per step (slot 3 split over
    the top bits of three bytes): a weight whose quant alone is nonzero, at every position,
    meets its own activation quant and scale, M = 1..8, against the fp64 definition."""
    w = _q6_one_quant_per_row(256)
    r, fmt = quant_repack(w, QuantFormat.Q6_K), QuantFormat.Q6_K_R16
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(3))  # [8, K]
    ref, magnitude = quant_linear_int8_terms_ref(x, w, QuantFormat.Q6_K)  # [8, 256]
    assert (ref != 0).sum() > 0.9 * ref.numel()  # most activation quants nonzero
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        for m in range(1, 9):
            out = quant_linear(x[:m], r, fmt, activation=INT8)
            assert ((out.double() - ref[:m]).abs() <= bound(QuantFormat.Q6_K, 256, magnitude[:m])).all(), m
    assert specdec_inductor.kernel_path_counts() == {f"quant_linear_int8_r16:{r16_kernel_of(path)}": 8}


def test_int8_path_names_the_kernel_that_runs():
    for fmt in map(repacked_format, BASES):
        _, r, _ = packed(file_format(fmt), 16, 256, seed=5)
        for path in PATHS:
            specdec_inductor.reset_kernel_path_counts()
            with specdec_inductor.forced_isa(path):
                quant_linear(torch.randn(2, 256), r, fmt, activation=INT8)
                assert int8_path(fmt) == r16_kernel_of(path)
            assert specdec_inductor.kernel_path_counts() == {f"quant_linear_int8_r16:{r16_kernel_of(path)}": 1}


@pytest.mark.parametrize("path", PATHS)
def test_cat_members_of_every_layout_equal_their_calls_alone(path):
    """quant_linear_cat over members of different layouts and weight offsets (x's 32-value block
    sums shared by the 32-weight R16 members): each member's columns bitwise its call alone."""
    k = 512
    members = [packed(QuantFormat.Q4_1, 32, k, seed=51), packed(QuantFormat.Q8_0, 16, k, seed=52),
               packed(QuantFormat.Q4_0, 48, k, seed=53), packed(QuantFormat.Q4_K, 16, k, seed=54)]
    weights = [r for _, r, _ in members] + [members[2][0]]  # and Q4_0 in the file layout
    fmts = [f for _, _, f in members] + [QuantFormat.Q4_0]
    for m in (1, 5):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
        with specdec_inductor.forced_isa(path):
            cat = quant_linear_cat(x, weights, fmts, activation=INT8)
            alone = torch.cat([quant_linear(x, w, f, activation=INT8) for w, f in zip(weights, fmts)], 1)
        assert torch.equal(cat, alone), m


def _samples():
    gen = torch.Generator().manual_seed(11)
    out = []
    for base in BASES:
        _, r, fmt = packed(base, 32, 512, seed=int(base))
        out += [
            (torch.randn(3, 512, generator=gen), r, int(fmt), None, int(INT8)),
            (torch.randn(512, 4, generator=gen).t().bfloat16(), r, int(fmt),
             torch.randn(32, generator=gen).bfloat16(), int(INT8)),
            (torch.randn(2, 5, 512, generator=gen)[:, 1:4], r[1:], int(fmt), None, int(INT8)),  # sliced
        ]
    return out


@pytest.mark.parametrize("sample", _samples())
def test_opcheck_linear(sample):
    opcheck(torch.ops.specdec.quant_linear.default, sample)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("base", BASES)
def test_opcheck_repack_embedding_dequantize(base, index_dtype):
    w, r, fmt = packed(base, 32, 256, seed=4)
    opcheck(torch.ops.specdec.quant_repack.default, (w, int(base)))
    opcheck(torch.ops.specdec.quant_repack.default, (w[16:], int(base)))
    opcheck(torch.ops.specdec.quant_repack.default, (r, int(fmt)))
    ids = torch.tensor([[3, 0], [31, 16]], dtype=index_dtype)
    opcheck(torch.ops.specdec.quant_embedding.default, (ids, r, int(fmt), None))
    opcheck(torch.ops.specdec.quant_dequantize.default, (r[1:], int(fmt)))


def test_eager_equals_compiled(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    _, r4, f4 = packed(QuantFormat.Q4_K, 32, 256, seed=22)
    _, r6, f6 = packed(QuantFormat.Q6_K, 48, 256, seed=23)
    _, r41, f41 = packed(QuantFormat.Q4_1, 16, 256, seed=24)
    _, r80, f80 = packed(QuantFormat.Q8_0, 32, 256, seed=25)

    def f(x):
        h = quant_linear(x, r4, f4, activation=INT8)  # [T, 32]
        return (h, quant_linear(x.bfloat16(), r6, f6, activation=INT8),  # [T, 48]
                quant_linear(x, r41, f41, activation=INT8),  # [T, 16]
                quant_linear(x.bfloat16(), r80, f80, activation=INT8))  # [T, 32]

    x = torch.randn(5, 256)
    for e, c in zip(f(x), torch.compile(f, fullgraph=True)(x)):
        assert torch.equal(e, c)


@pytest.mark.parametrize("call,match", [
    (lambda: quant_repack(random_weight(QuantFormat.Q4_K, 20, 256, 1), QuantFormat.Q4_K), "multiple of 16 rows"),
    (lambda: quant_repack(random_weight(QuantFormat.Q5_K, 16, 256, 1), QuantFormat.Q5_K), "argument 'fmt'"),
    (lambda: quant_repack(random_weight(QuantFormat.Q8_0, 16, 96, 1), QuantFormat.Q8_0),
     "multiple of 64 weights per row"),
    (lambda: quant_linear(torch.randn(2, 96), torch.zeros(1, 16 * 3 * 34, dtype=torch.uint8),
                          QuantFormat.Q8_0_R16, activation=INT8), r"argument 'x' must have .* multiple of the block size of 'fmt' \(64\)"),
    (lambda: quant_linear(torch.randn(2, 256), quant_repack(random_weight(QuantFormat.Q4_1, 16, 256, 1),
                                                             QuantFormat.Q4_1),
                          QuantFormat.Q4_1_R16), "argument 'activation' must be INT8"),
    (lambda: quant_linear(torch.randn(2, 256), quant_repack(random_weight(QuantFormat.Q4_K, 16, 256, 1),
                                                             QuantFormat.Q4_K),
                          QuantFormat.Q4_K_R16), "argument 'activation' must be INT8"),
    (lambda: quant_linear(torch.randn(2, 256), random_weight(QuantFormat.Q4_K, 16, 256, 1),
                          QuantFormat.Q4_K_R16, activation=INT8), "argument 'weight'"),
])
def test_bad_inputs(call, match):
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        call()
