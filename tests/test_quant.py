"""Quantized-weight ops (csrc/quant.cpp) on every runnable ISA path: exact dequantization against
the gguf package (bitwise, all 8 formats, extreme fp16 scales), quant_linear against an fp64
reference by the 2x rule, batch invariance (a row alone == the same row inside M = 8/16/64
batches, bitwise), quant_embedding, bad inputs, read-only weights, opcheck, eager == compiled."""
import os
import tempfile
import warnings

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import specdec_inductor
from specdec_inductor.ops import (QuantFormat, quant_block, quant_dequantize, quant_embedding,
                                  quant_linear, quant_row_bytes)
from specdec_inductor.ops.quant import FILE_FORMATS, QuantActivation
from specdec_inductor.ops.reference import (quant_dequantize_ref, quant_embedding_ref,
                                            quant_linear_int8_terms_ref, quant_linear_ref)

PATHS = specdec_inductor.runnable_isas()
FORMATS = FILE_FORMATS  # the repacked layouts: tests/test_quant_repack.py
# Byte offsets of each format's fp16 fields (d, and m / dmin) inside a block.
F16_FIELDS = {
    QuantFormat.Q4_0: [0], QuantFormat.Q4_1: [0, 2], QuantFormat.Q5_0: [0], QuantFormat.Q5_1: [0, 2],
    QuantFormat.Q8_0: [0],
    QuantFormat.Q4_K: [0, 2], QuantFormat.Q5_K: [0, 2], QuantFormat.Q6_K: [208],
}
# fp16 values at the edges: largest finite, smallest subnormal, smallest normal, signed zeros.
EXTREME_F16 = [65504.0, -65504.0, 2.0 ** -24, -(2.0 ** -24), 2.0 ** -14, 0.0, -0.0, 1.0, -3.5]


def _cpu_has_vnni():
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512_vnni" in f.read()
    except OSError:
        return False


VNNI = _cpu_has_vnni()


def int8_kernel_of(path, fmt):
    """INT8 activations run the AVX-512 VNNI kernels on an AVX-512 path of a VNNI CPU (recorded
    as 'avx512'); else the K formats run their AVX2 kernel on an AVX2 or wider path; the portable
    kernel runs the rest."""
    if kernel_of(path) == "avx512" and VNNI:
        return "avx512"
    if path != "portable" and quant_block(fmt)[0] == 256:
        return "avx2"
    return "portable"


def kernel_of(path):
    """The quant kernels have no AMX variant: an AMX machine runs the AVX-512 ones."""
    return {"amx": "avx512"}.get(path, path)


def random_weight(fmt, n, k, seed, extreme=False, scale=0.02):
    """uint8 [N, row_bytes]: random blocks of `fmt` (every byte random: all quant and 6-bit scale
    patterns) with finite fp16 fields: random N(0, scale) values, or edge values when `extreme`."""
    gen = torch.Generator().manual_seed(seed)
    size, nbytes = quant_block(fmt)
    blocks = torch.randint(0, 256, (n * k // size, nbytes), generator=gen, dtype=torch.uint8)
    for off in F16_FIELDS[fmt]:
        if extreme:
            pick = torch.randint(0, len(EXTREME_F16), (blocks.shape[0],), generator=gen)
            vals = torch.tensor(EXTREME_F16, dtype=torch.float16)[pick]
        else:
            vals = (torch.randn(blocks.shape[0], generator=gen) * scale).to(torch.float16)
        blocks[:, off:off + 2] = vals.view(torch.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)  # [N, row_bytes]


def gguf_dequantize(weight, fmt):
    return torch.from_numpy(np.ascontiguousarray(
        gguf.quants.dequantize(weight.numpy(), gguf.GGMLQuantizationType(int(fmt))))).float()


def bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("fmt", FORMATS)
def test_row_bytes(fmt):
    size, nbytes = quant_block(fmt)
    assert (size, nbytes) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(fmt))]
    assert quant_row_bytes(fmt, 6 * size) == 6 * nbytes
    assert quant_row_bytes(fmt, 0) == 0
    with pytest.raises(ValueError, match="'k'"):
        quant_row_bytes(fmt, size + 16)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_is_bitwise_gguf(fmt, extreme, path):
    k = 512 if quant_block(fmt)[0] == 256 else 96
    w = random_weight(fmt, 1024 * 256 // k, k, seed=int(fmt) * 10 + extreme, extreme=extreme)
    expected = gguf_dequantize(w, fmt)  # [N, K]
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        out = quant_dequantize(w, fmt)
    assert specdec_inductor.kernel_path_counts() == {f"quant_dequantize:{kernel_of(path)}": 1}
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert torch.equal(bits(out), bits(expected))
    assert torch.equal(bits(quant_dequantize_ref(w, fmt)), bits(expected))


@pytest.mark.parametrize("fmt", [QuantFormat.Q4_0, QuantFormat.Q8_0])
def test_dequantize_of_gguf_quantized_values(fmt):
    """Blocks written by gguf's own quantizer (real scale distributions) round-trip exactly."""
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(3)).numpy()
    raw = torch.from_numpy(gguf.quants.quantize(x, gguf.GGMLQuantizationType(int(fmt))))
    assert torch.equal(bits(quant_dequantize(raw, fmt)), bits(gguf_dequantize(raw, fmt)))


def _check_close(out, x, w_dq, b):
    """STYLE.md 2x rule vs an fp64 reference on the dequantized weight: our error is at most
    twice plain torch's F.linear in x's dtype (plus one ulp of the output's scale)."""
    exact = x.double() @ w_dq.double().T + (b.double() if b is not None else 0)
    ref = F.linear(x, w_dq.to(x.dtype), b)
    torch_err = (ref.double() - exact).abs().max().item()
    ours_err = (out.double() - exact).abs().max().item()
    ulp = torch.finfo(x.dtype).eps * max(1.0, exact.abs().max().item())
    assert ours_err <= 2 * torch_err + ulp, (ours_err, torch_err)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m,n,blocks,bias", [(1, 37, 3, False), (3, 8, 2, True), (8, 21, 4, True),
                                            (13, 5, 1, False)])
def test_linear_matches_reference(fmt, dtype, path, m, n, blocks, bias):
    k = blocks * quant_block(fmt)[0]
    seed = int(fmt) * 1000 + m * 10 + n
    gen = torch.Generator().manual_seed(seed)
    w = random_weight(fmt, n, k, seed)  # [N, row_bytes]
    x = torch.randn(m, k, generator=gen).to(dtype)  # [M, K]
    b = torch.randn(n, generator=gen).to(dtype) if bias else None  # [N]
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        out = quant_linear(x, w, fmt, b)
    assert specdec_inductor.kernel_path_counts() == {f"quant_linear:{kernel_of(path)}": 1}
    assert out.dtype == dtype and out.shape == (m, n)
    w_dq = quant_dequantize_ref(w, fmt)  # [N, K]
    _check_close(out, x, w_dq, b)
    magnitude = (x.double().abs() @ w_dq.double().abs().T).max().item()  # scale of the sums
    torch.testing.assert_close(out.float(), quant_linear_ref(x, w, fmt, b).float(),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-6 * magnitude)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_linear_is_batch_invariant(fmt, path):
    """Row r of the output is bitwise the same alone, inside batches of 8, 16 and 64 rows, at any
    position, in fp32 and bf16 (greedy verify of 8 drafts must reproduce 1-row decode)."""
    k = 2 * quant_block(fmt)[0]
    w = random_weight(fmt, 19, k, seed=int(fmt))  # [N, row_bytes]
    b = torch.randn(19)  # [N]
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(int(fmt)))  # [64, K]
    with specdec_inductor.forced_isa(path):
        for dtype in (torch.float32, torch.bfloat16):
            xd, bd = x.to(dtype), b.to(dtype)
            alone = torch.cat([quant_linear(xd[r:r + 1], w, fmt, bd) for r in range(64)])  # [64, N]
            for rows in (8, 16, 64):
                for start in range(0, 64, rows):
                    batch = quant_linear(xd[start:start + rows], w, fmt, bd)
                    assert torch.equal(batch, alone[start:start + rows]), (dtype, rows, start)
            # The same row at every position of an 8-row batch of other rows.
            for pos in range(8):
                xs = xd[8:16].clone()
                xs[pos] = xd[3]
                assert torch.equal(quant_linear(xs, w, fmt, bd)[pos], alone[3])
            assert torch.equal(quant_linear(xd.reshape(4, 16, k), w, fmt, bd).reshape(64, -1), alone)


@pytest.mark.parametrize("path", PATHS)
def test_linear_large_k_and_layouts(path):
    """K = 8960 (the 1.5B model's down projection), a 3-D x, a transposed x and a weight whose rows
    are spaced wider than row_bytes."""
    fmt = QuantFormat.Q4_K
    k = 8960 // 256 * 256
    w = random_weight(fmt, 24, k, seed=5)
    w_dq = quant_dequantize_ref(w, fmt)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, k, generator=gen)  # [2, 3, K]
    xt = torch.randn(k, 5, generator=gen).t()  # [5, K] transposed
    wide = torch.zeros(24, w.shape[1] + 7, dtype=torch.uint8)
    wide[:, 3:3 + w.shape[1]] = w
    w_strided = wide[:, 3:3 + w.shape[1]]  # rows dense, stride(0) > row_bytes
    with specdec_inductor.forced_isa(path):
        out = quant_linear(x, w, fmt)
        out_t = quant_linear(xt, w_strided, fmt)
    assert out.shape == (2, 3, 24)
    _check_close(out.reshape(6, 24), x.reshape(6, k), w_dq, None)
    _check_close(out_t, xt, w_dq, None)


def test_read_only_weight_from_a_memory_map():
    """The loader hands a zero-copy view of a read-only memory-mapped file: the ops only read."""
    fmt = QuantFormat.Q6_K
    w = random_weight(fmt, 10, 256, seed=9)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "w.bin")
        w.numpy().tofile(path)
        mm = np.memmap(path, dtype=np.uint8, mode="r", shape=tuple(w.shape))
        assert not mm.flags.writeable
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the array is not writable
            view = torch.from_numpy(mm)
        x = torch.randn(2, 256)
        assert torch.equal(quant_linear(x, view, fmt), quant_linear(x, w, fmt))
        assert torch.equal(quant_dequantize(view, fmt), quant_dequantize(w, fmt))
        assert torch.equal(quant_embedding(torch.tensor([9, 0]), view, fmt),
                           quant_dequantize(w, fmt)[[9, 0]])
        del view, mm


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_embedding(fmt, path):
    k = quant_block(fmt)[0] * 2
    w = random_weight(fmt, 30, k, seed=int(fmt) + 7)
    ids = torch.tensor([[0, 29, 5], [5, 17, 1]])  # [2, 3]
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        for index_dtype in (torch.int32, torch.int64):
            out = quant_embedding(ids.to(index_dtype), w, fmt)
            assert out.shape == (2, 3, k) and out.dtype == torch.float32
            assert torch.equal(bits(out), bits(quant_embedding_ref(ids, w, fmt)))
        out_bf16 = quant_embedding(ids, w, fmt, torch.bfloat16)
    assert torch.equal(out_bf16, quant_embedding_ref(ids, w, fmt, torch.bfloat16))
    assert specdec_inductor.kernel_path_counts() == {f"quant_embedding:{kernel_of(path)}": 3}


def test_empty_shapes():
    fmt = QuantFormat.Q8_0
    w = random_weight(fmt, 4, 64, seed=1)
    assert quant_linear(torch.randn(0, 64), w, fmt).shape == (0, 4)
    assert quant_linear(torch.randn(3, 64), w[:0], fmt).shape == (3, 0)
    b = torch.randn(4)
    assert torch.equal(quant_linear(torch.randn(2, 0), w[:, :0], fmt, b), b.expand(2, 4))
    assert quant_embedding(torch.zeros(0, 3, dtype=torch.long), w, fmt).shape == (0, 3, 64)
    assert quant_dequantize(w[:0], fmt).shape == (0, 64)


_W = random_weight(QuantFormat.Q4_0, 4, 64, seed=2)  # [4, 36]
_X = torch.randn(2, 64)


@pytest.mark.parametrize("call,match", [
    (lambda: quant_linear(_X.double(), _W, QuantFormat.Q4_0), "'x'"),
    (lambda: quant_linear(_X, _W.float(), QuantFormat.Q4_0), "'weight'"),
    (lambda: quant_linear(_X, _W[0], QuantFormat.Q4_0), "'weight'"),
    (lambda: quant_linear(_X, _W, QuantFormat.Q8_0), "'weight'"),  # row_bytes != K's for fmt
    (lambda: quant_linear(_X[:, :48], _W[:, :27], QuantFormat.Q4_0), "'x'"),  # K % 32 != 0
    (lambda: quant_linear(torch.randn(2, 256), _W, QuantFormat.Q4_K), "'weight'"),
    (lambda: quant_linear(_X, _W, 5), "'fmt'"),
    (lambda: quant_linear(_X, _W, QuantFormat.Q4_0, activation=2), "'activation'"),
    (lambda: torch.ops.specdec.quant_linear(_X, _W, int(QuantFormat.Q4_0), None, 2), "'activation'"),
    (lambda: torch.ops.specdec.quant_linear(_X, _W, 99), "'fmt'"),
    (lambda: torch.ops.specdec.quant_linear(_X, _W, -1), "'fmt'"),
    (lambda: quant_linear(_X, _W, QuantFormat.Q4_0, torch.randn(5)), "'bias'"),
    (lambda: quant_linear(_X, _W, QuantFormat.Q4_0, torch.randn(4).double()), "'bias'"),
    (lambda: quant_linear(_X, _W.t().contiguous().t(), QuantFormat.Q4_0), "'weight'"),  # column-major
    (lambda: quant_linear(_X, _W.reshape(-1).as_strided((4, 36), (10, 1)), QuantFormat.Q4_0),
     "'weight'"),  # overlapping rows
    (lambda: quant_embedding(torch.tensor([4]), _W, QuantFormat.Q4_0), "'ids'"),
    (lambda: quant_embedding(torch.tensor([-1]), _W, QuantFormat.Q4_0), "'ids'"),
    (lambda: quant_embedding(torch.tensor([0.0]), _W, QuantFormat.Q4_0), "'ids'"),
    (lambda: quant_embedding(torch.tensor([0]), _W, QuantFormat.Q4_0, torch.float16), "'dtype'"),
    (lambda: quant_embedding(torch.tensor([0]), _W[:, :35], QuantFormat.Q4_0), "'weight'"),
    (lambda: quant_dequantize(_W.view(torch.int8), QuantFormat.Q4_0), "'weight'"),
    (lambda: quant_dequantize(_W.reshape(-1), QuantFormat.Q4_0), "'weight'"),
])
def test_bad_inputs(call, match):
    with pytest.raises((ValueError, TypeError, IndexError, RuntimeError), match=match):
        call()


def _samples():
    gen = torch.Generator().manual_seed(11)
    out = []
    for fmt in (QuantFormat.Q4_1, QuantFormat.Q5_K):
        k = 2 * quant_block(fmt)[0]
        w = random_weight(fmt, 12, k, seed=int(fmt))
        x = torch.randn(3, k, generator=gen)
        out += [
            (x, w, int(fmt), None),
            (x.bfloat16(), w, int(fmt), torch.randn(12, generator=gen).bfloat16()),
            (torch.randn(k, 4, generator=gen).t(), w, int(fmt), torch.randn(12, generator=gen)),
            (torch.randn(2, 5, k, generator=gen)[:, 1:4], w[2:9], int(fmt), None),  # sliced
            (x, w, int(fmt), None, int(QuantActivation.INT8)),
            (torch.randn(k, 4, generator=gen).t().bfloat16(), w, int(fmt),
             torch.randn(12, generator=gen).bfloat16(), int(QuantActivation.INT8)),
        ]
    return out


@pytest.mark.parametrize("sample", _samples())
def test_opcheck_linear(sample):
    opcheck(torch.ops.specdec.quant_linear.default, sample)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_opcheck_embedding_and_dequantize(index_dtype):
    w = random_weight(QuantFormat.Q6_K, 9, 256, seed=4)
    ids = torch.tensor([[3, 0], [7, 3]], dtype=index_dtype)
    opcheck(torch.ops.specdec.quant_embedding.default, (ids, w, int(QuantFormat.Q6_K), None))
    opcheck(torch.ops.specdec.quant_embedding.default, (ids[:, ::2], w[1:], int(QuantFormat.Q6_K),
                                                        torch.bfloat16))
    opcheck(torch.ops.specdec.quant_dequantize.default, (w[2:7], int(QuantFormat.Q6_K)))


class _QuantModel(torch.nn.Module):
    """Embedding lookup and two projections from quantized weights, fp32 and bf16."""

    def __init__(self):
        super().__init__()
        self.emb = random_weight(QuantFormat.Q8_0, 50, 256, seed=21)  # [V, row_bytes]
        self.up = random_weight(QuantFormat.Q4_K, 40, 256, seed=22)
        self.down = random_weight(QuantFormat.Q6_K, 64, 256, seed=23)
        self.bias = torch.randn(64, generator=torch.Generator().manual_seed(24)).bfloat16()

    def forward(self, ids):
        h = quant_embedding(ids, self.emb, QuantFormat.Q8_0)  # [B, T, 256]
        u = quant_linear(h, self.up, QuantFormat.Q4_K)  # [B, T, 40]
        d = quant_linear(h.bfloat16(), self.down, QuantFormat.Q6_K, self.bias)  # [B, T, 64]
        u8 = quant_linear(h, self.up, QuantFormat.Q4_K, activation=QuantActivation.INT8)  # [B, T, 40]
        return h, u, d, u8


def test_eager_equals_compiled(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    model = _QuantModel().eval()
    ids = torch.tensor([[1, 49, 7]])
    with torch.no_grad():
        eager = model(ids)
        compiled = torch.compile(model, fullgraph=True)(ids)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("activation", list(QuantActivation))
@pytest.mark.parametrize("fmt", FORMATS)
def test_threads_do_not_change_the_result(path, activation, fmt):
    """Threads split the output features, never a sum: 1 thread == all threads, bitwise."""
    w = random_weight(fmt, 1001, 512, seed=31)  # enough rows to fan out
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(31))
    with specdec_inductor.forced_isa(path):
        assert_one_thread_equals_all(x, w, fmt, activation)


def assert_one_thread_equals_all(x, w, fmt, activation):
    many = quant_linear(x, w, fmt, activation=activation)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = quant_linear(x, w, fmt, activation=activation)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


# --- INT8 activations ------------------------------------------------------------------------


def _int8_x(m, k, gen, dtype, block=32):
    """x [M, K] with the INT8 edge cases in row 0 for activation blocks of `block` values: an
    all-zero block and a block whose quants are exact halves (max 127 -> d = 1: 2.5 -> 2,
    -3.5 -> -4, 0.5 -> 0, half to even)."""
    x = torch.randn(m, k, generator=gen)
    x[0, :block] = 0.0
    if k >= 2 * block:
        x[0, block:2 * block] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5, 126.5, -126.5] * (block // 8))
    return x.to(dtype)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 8, 13, 64])
def test_int8_linear_matches_reference(fmt, dtype, path, m):
    """Against the fp64 value of the INT8 definition (exact integer dots): the only error allowed
    is fp32 rounding, bounded by 2 * (K/64 + 8) * 2^-24 * (sum of |terms|) -- K/64 fused
    multiply-adds per lane, the scale products, the 16-lane reduction and the bias -- plus the
    final bf16 rounding (2^-8 relative) for bf16 x. An odd number of 32-weight blocks (K = 96)
    exercises the unpaired last block. The K formats quantize x per 256 values (their own
    reference), the others per 32."""
    size = quant_block(fmt)[0]
    k = 3 * 32 if size == 32 else 2 * 256
    n = 11
    bias = m % 2 == 1
    seed = int(fmt) * 1000 + m
    gen = torch.Generator().manual_seed(seed)
    w = random_weight(fmt, n, k, seed)  # [N, row_bytes]
    x = _int8_x(m, k, gen, dtype, block=size)  # [M, K]
    b = torch.randn(n, generator=gen).to(dtype) if bias else None  # [N]
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        out = quant_linear(x, w, fmt, b, activation=QuantActivation.INT8)
    assert specdec_inductor.kernel_path_counts() == {f"quant_linear_int8:{int8_kernel_of(path, fmt)}": 1}
    assert out.dtype == dtype and out.shape == (m, n)
    ref, magnitude = quant_linear_int8_terms_ref(x, w, fmt, b)  # [M, N] each, fp64
    bound = 2 * (k / 64 + 8) * 2.0 ** -24 * magnitude
    if dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * ref.abs()
    err = (out.double() - ref).abs()
    assert (err <= bound).all(), (err - bound).max()
    # The public reference agrees, and INT8 is a close approximation of FLOAT.
    torch.testing.assert_close(out, quant_linear_ref(x, w, fmt, b, activation=QuantActivation.INT8),
                               rtol=1e-2 if dtype == torch.bfloat16 else 1e-4, atol=1e-5 * magnitude.max().item())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_linear_is_batch_invariant(fmt, path):
    """As test_linear_is_batch_invariant, with INT8 activations (rows quantized independently):
    every M in 1..16 and 64 (each remainder of the 4-row passes and of the 2- or 4-row weight
    groups), every position of a row in an 8-row batch, 1 thread or all; on the path asserted."""
    k = 2 * quant_block(fmt)[0] + (32 if quant_block(fmt)[0] == 32 else 0)
    w = random_weight(fmt, 19, k, seed=int(fmt))  # [N, row_bytes]
    b = torch.randn(19)  # [N]
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(int(fmt)))  # [64, K]
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        check_int8_rows_alone_equal_batches(x, w, fmt, b)
    assert set(specdec_inductor.kernel_path_counts()) == {f"quant_linear_int8:{int8_kernel_of(path, fmt)}"}


def check_int8_rows_alone_equal_batches(x, w, fmt, b):
    """For x [64, K] in fp32 and bf16: each row alone == the same row in batches of every M in
    2..16 and 64, at every position of an 8-row batch, and with 1 thread."""
    int8 = QuantActivation.INT8
    threads = torch.get_num_threads()
    for dtype in (torch.float32, torch.bfloat16):
        xd, bd = x.to(dtype), b.to(dtype)
        alone = torch.cat([quant_linear(xd[r:r + 1], w, fmt, bd, int8) for r in range(64)])  # [64, N]
        for rows in list(range(2, 17)) + [64]:
            for start in range(0, 64 - rows + 1, max(rows, 13)):
                batch = quant_linear(xd[start:start + rows], w, fmt, bd, int8)
                assert torch.equal(batch, alone[start:start + rows]), (dtype, rows, start)
        for pos in range(8):
            xs = xd[8:16].clone()
            xs[pos] = xd[3]
            assert torch.equal(quant_linear(xs, w, fmt, bd, int8)[pos], alone[3])
        torch.set_num_threads(1)
        try:
            assert torch.equal(quant_linear(xd[:16], w, fmt, bd, int8), alone[:16])
        finally:
            torch.set_num_threads(threads)


def test_int8_default_is_float():
    """activation defaults to FLOAT: the existing calls keep their exact results."""
    w = random_weight(QuantFormat.Q4_K, 5, 256, seed=3)
    x = torch.randn(2, 256)
    assert torch.equal(quant_linear(x, w, QuantFormat.Q4_K),
                       quant_linear(x, w, QuantFormat.Q4_K, activation=QuantActivation.FLOAT))
    assert torch.equal(torch.ops.specdec.quant_linear(x, w, int(QuantFormat.Q4_K)),
                       quant_linear(x, w, QuantFormat.Q4_K))


K_FORMATS = [QuantFormat.Q4_K, QuantFormat.Q5_K, QuantFormat.Q6_K]


def _saturating_weight(fmt, n, k, sign):
    """K-format blocks whose integer quants are all at the top (every quant byte 0xFF: Q4_K 15,
    Q5_K 31, Q6_K 63 - 32 = 31) and whose sub-block scales are the largest (6-bit 63, or int8
    127 / -128 by `sign`), d = 1: the largest int16 pair products and int32 block sums."""
    size, nbytes = quant_block(fmt)
    blocks = torch.full((n * k // size, nbytes), 0xFF, dtype=torch.uint8)
    one = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    for off in F16_FIELDS[fmt]:
        blocks[:, off:off + 2] = one
    if fmt == QuantFormat.Q6_K:
        blocks[:, 192:208] = torch.tensor([127 if sign > 0 else -128], dtype=torch.int8).view(torch.uint8)
    return blocks.reshape(n, -1)


def _saturating_x(k):
    """x [4, K] of +-1 (quants +-127) in four sign patterns, one row half at 0.5 past 256."""
    x = torch.ones(4, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3, 256:] = 0.5
    return x


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", K_FORMATS)
def test_int8_k_formats_extreme_integer_sums(fmt, path):
    """The largest quants and scales against x = +-1 (quants +-127): no int16 pair saturates
    and no int32 block sum overflows (the result matches the fp64 definition)."""
    k, n = 3 * 256, 4
    x = _saturating_x(k)
    for sign in (1, -1):
        w = _saturating_weight(fmt, n, k, sign)
        with specdec_inductor.forced_isa(path):
            out = quant_linear(x, w, fmt, activation=QuantActivation.INT8)
        ref, magnitude = quant_linear_int8_terms_ref(x, w, fmt)
        assert ((out.double() - ref).abs() <= 2 * (k / 64 + 8) * 2.0 ** -24 * magnitude).all(), (out, ref)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fmt", K_FORMATS)
def test_int8_k_formats_long_rows(fmt, path):
    """K = 8960 (the 1.5B model's down projection, 35 blocks of 256): every row of M = 1..9 and
    16 equals the same row alone bitwise, within the 2x-style bound of the fp64 definition."""
    k, n = 8960, 13
    w = random_weight(fmt, n, k, seed=41)  # [N, row_bytes]
    x = _int8_x(16, k, torch.Generator().manual_seed(41), torch.float32, block=256)  # [16, K]
    int8 = QuantActivation.INT8
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        alone = torch.cat([quant_linear(x[r:r + 1], w, fmt, activation=int8) for r in range(16)])
        for rows in list(range(2, 10)) + [16]:
            assert torch.equal(quant_linear(x[:rows], w, fmt, activation=int8), alone[:rows]), rows
    assert set(specdec_inductor.kernel_path_counts()) == {f"quant_linear_int8:{int8_kernel_of(path, fmt)}"}
    ref, magnitude = quant_linear_int8_terms_ref(x, w, fmt)
    assert ((alone.double() - ref).abs() <= 2 * (k / 64 + 8) * 2.0 ** -24 * magnitude).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_int8_path_names_the_kernel_that_runs(fmt):
    """ops.quant.int8_path(fmt) reports the kernel a call records, on every runnable path."""
    from specdec_inductor.ops.quant import int8_path
    w = random_weight(fmt, 3, quant_block(fmt)[0], seed=5)
    x = torch.randn(2, quant_block(fmt)[0])
    for path in PATHS:
        specdec_inductor.reset_kernel_path_counts()
        with specdec_inductor.forced_isa(path):
            quant_linear(x, w, fmt, activation=QuantActivation.INT8)
            assert int8_path(fmt) == int8_kernel_of(path, fmt)
        assert specdec_inductor.kernel_path_counts() == {f"quant_linear_int8:{int8_kernel_of(path, fmt)}": 1}
