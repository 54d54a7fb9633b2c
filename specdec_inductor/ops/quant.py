"""Quantized-weight ops over ggml block formats (csrc/quant.cpp): a GGUF tensor's bytes are used
in place -- a uint8 [N, row_bytes] tensor, row n holding the K / block_size ggml blocks of
weight row n exactly as stored in the file (a zero-copy view of a memory-mapped file is fine: the
ops never write to it and need no alignment).

Every weight the ops use equals the file's value exactly (`quant_dequantize` is bitwise
`gguf.quants.dequantize`). `quant_linear` streams each quantized row once and dequantizes it in
registers (AVX-512 / AVX2 paths), so a decode step reads ~4.5-6.6 bits per weight instead of 32;
a row of its output is bitwise the same whatever the number of rows of x (batch invariance:
verifying 8 draft rows at once reproduces the 1-row decode exactly).
"""
import enum
from typing import Optional, Sequence

import torch
from torch import Tensor

import specdec_inductor._library  # noqa: F401  (loads the schemas before register_fake)


class QuantFormat(enum.IntEnum):
    """ggml block formats; the values are ggml's type ids (gguf.GGMLQuantizationType).

    The *_R16 members are our own layouts of a file format (256 + its id; `quant_repack` makes
    them): 16 weight rows interleaved so that one vector lane is one weight row (the layout is
    described in csrc/quant_repack.h). A weight in one is uint8 [N / 16, 16 * row_bytes]; every
    weight keeps its exact file value; quant_linear runs them with INT8 activations only. The
    32-weight formats' layouts (Q4_0_R16 ... Q8_0_R16) hold two blocks per chunk: K a multiple
    of 64. Their INT8 results are batch invariant but not bitwise the file layout's (the kernel
    scales each 32-weight block's integer dot once instead of every 4-weight lane).
    """
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q4_0_R16 = 256 + 2
    Q4_1_R16 = 256 + 3
    Q5_0_R16 = 256 + 6
    Q5_1_R16 = 256 + 7
    Q8_0_R16 = 256 + 8
    Q4_K_R16 = 256 + 12
    Q6_K_R16 = 256 + 14


# The formats a GGUF file holds (QuantFormat less our repacked layouts).
FILE_FORMATS = [f for f in QuantFormat if f < 256]
REPACK_ROWS = 16


def is_repacked(fmt) -> bool:
    """True for our row-interleaved layouts (QuantFormat.*_R16)."""
    return int(fmt) >= 256


def file_format(fmt) -> "QuantFormat":
    """The GGUF format a layout holds (itself for a file format)."""
    fmt = _format(fmt)
    return QuantFormat(int(fmt) - 256) if is_repacked(fmt) else fmt


def repacked_format(fmt) -> Optional["QuantFormat"]:
    """The row-interleaved layout of a file format, or None where there is none."""
    try:
        return QuantFormat(int(_format(fmt)) + 256)
    except ValueError:
        return None


def group_rows(fmt) -> int:
    """Weight rows per tensor row: 16 for a repacked layout, 1 for a file format."""
    return REPACK_ROWS if is_repacked(fmt) else 1


class QuantActivation(enum.IntEnum):
    """How quant_linear multiplies x into the weights.

    FLOAT: exact fp32 products of x and the exactly dequantized weights.
    INT8: x is quantized to 8 bits per block first (32 values for the 32-weight formats, 256 for
    the K formats, as llama.cpp's Q8_0 / Q8_K activations) and the products are integer dot
    products: on AVX-512 VNNI one vpdpbusd does 64 multiply-adds (32-weight formats), or a
    vpmaddubsw + vpdpwssd pair does 64 with the K formats' integer sub-block scales applied in
    integer space and one float multiply per 256 weights, so decode runs at memory speed and
    verify rows cost a fraction of a decode step each. The result differs from FLOAT by the
    activation rounding (about 0.4 % of each block's largest |x|). Rows are batch invariant as
    with FLOAT (x is quantized row by row), but a last-bit difference in x can move a quant by
    one step, so INT8 needs inputs that are themselves bitwise the same in decode and verify.
    """
    FLOAT = 0
    INT8 = 1


def int8_path(fmt: Optional["QuantFormat"] = None) -> str:
    """The path INT8 activations take now for `fmt`: "avx512" (the VNNI kernels: built, the CPU
    has avx512_vnni, AVX-512 or better active), "avx2" (the K formats' AVX2 kernel where VNNI
    does not run) or "portable" (scalar loops, slower than FLOAT's SIMD kernels). fmt=None: the
    path of the 32-weight formats (Q8_0 ...), which is "avx512" only with VNNI."""
    from specdec_inductor import _C
    return _C.quant_int8_path(int(_format(QuantFormat.Q8_0 if fmt is None else fmt)))


def default_activation() -> "QuantActivation":
    """The activation mode the CLI's `--quant-activations auto` picks: INT8 where the VNNI kernel
    runs (it reads the quantized weights at about twice FLOAT's speed at one row, and the
    engine's step graphs keep verify rows bit-identical to decode rows, so greedy speculation
    still equals plain greedy), FLOAT where INT8 would take the slower portable loops."""
    return QuantActivation.INT8 if int8_path() == "avx512" else QuantActivation.FLOAT


# fmt -> (weights per block, bytes per block); the layouts are described in csrc/quant_isa.h.
_BLOCKS = {
    QuantFormat.Q4_0: (32, 18),
    QuantFormat.Q4_1: (32, 20),
    QuantFormat.Q5_0: (32, 22),
    QuantFormat.Q5_1: (32, 24),
    QuantFormat.Q8_0: (32, 34),
    QuantFormat.Q4_K: (256, 144),
    QuantFormat.Q5_K: (256, 176),
    QuantFormat.Q6_K: (256, 210),
    # The 32-weight formats' R16 chunks hold two blocks of each of 16 rows: K a multiple of 64.
    QuantFormat.Q4_0_R16: (64, 36),
    QuantFormat.Q4_1_R16: (64, 40),
    QuantFormat.Q5_0_R16: (64, 44),
    QuantFormat.Q5_1_R16: (64, 48),
    QuantFormat.Q8_0_R16: (64, 68),
    QuantFormat.Q4_K_R16: (256, 148),  # bytes per block and weight row (unpacked 6-bit scales)
    QuantFormat.Q6_K_R16: (256, 212),  # 32 bytes of padding per 16 rows (64-byte aligned chunks)
}


def _format(fmt) -> QuantFormat:
    try:
        return QuantFormat(int(fmt))
    except ValueError:
        raise ValueError(f"argument 'fmt' must be one of {[f.name for f in QuantFormat]}, "
                         f"got {fmt!r}") from None


def quant_block(fmt: QuantFormat):
    """(weights per block, bytes per block and weight row) of `fmt`."""
    return _BLOCKS[_format(fmt)]


def quant_row_bytes(fmt: QuantFormat, k: int) -> int:
    """Bytes of one row of `k` weights in `fmt`; `k` must be a multiple of the block size (32, or
    256 for the *_K formats)."""
    size, nbytes = quant_block(fmt)
    if k < 0 or k % size:
        raise ValueError(f"argument 'k' must be a non-negative multiple of {size} for "
                         f"{_format(fmt).name}, got {k}")
    return k // size * nbytes


def _activation(activation) -> QuantActivation:
    try:
        return QuantActivation(int(activation))
    except ValueError:
        raise ValueError(f"argument 'activation' must be one of {[a.name for a in QuantActivation]}, "
                         f"got {activation!r}") from None


def quant_linear(x: Tensor, weight: Tensor, fmt: QuantFormat, bias: Optional[Tensor] = None,
                 activation: QuantActivation = QuantActivation.FLOAT) -> Tensor:
    """y = x @ dequantize(weight).T (+ bias), as `F.linear` on the dequantized weight.

    Args: x [..., K] float32 or bfloat16 (any strides); weight uint8 [N, quant_row_bytes(fmt, K)]
    (rows dense: stride(1) == 1), or [N / 16, 16 * quant_row_bytes(fmt, K)] for a repacked fmt
    (INT8 only); fmt a QuantFormat; bias [N] of x's dtype or None; activation a QuantActivation.
    Returns y [..., N] of x's dtype, accumulated in fp32 (bf16 rounded once, at the end). Any
    number of rows M = prod(x.shape[:-1]), each row's result independent of M.

    activation=INT8 (x taken in fp32, bf16 widened exactly; finite values):
      - each row of x is cut into blocks of G values along K (G = 32; G = 256 for Q4_K / Q5_K /
        Q6_K); block b has d_b = max|x| / 127 (fp32 division) and quants
        q = round-half-to-even(x / d_b) (fp32 division) clamped to [-127, 127]; an all-zero block
        has d_b = 0 and q = 0.
      - 32-weight formats: the weight row is read as w[k] = scale * wq[k] + min per 32-weight
        block, with integer quants wq (Q4_0: q - 8, Q5_0: q - 16, others the stored q) and the
        file's exact scale d and min (Q4_1 / Q5_1: m, others 0);
        y[m, n] = sum_g scale[g] * d_(g // 2) * (sum over the 16-group g of wq * q)
                  + sum_b min[b] * d_b * (sum over block b of q)   (+ bias[n]).
      - K formats, per 256-weight block b with the file's d (and dmin) and integer sub-block
        scales sc (Q4_K / Q5_K: 6-bit per 32 weights, wq = q; Q6_K: int8 per 16 weights,
        wq = q - 32): I_b = sum over sub-blocks s of sc[s] * (sum over s of wq * q), an exact
        integer; y[m, n] = sum_b (d * d_b) * I_b
                  + sum_b sum_s (-dmin * mn[s]) * (d_b * sum over s of q)   (Q4_K / Q5_K)   (+ bias[n]).
      The integer sums are exact, the rest accumulated in fp32 in a fixed order (the repacked
      layouts' kernel sums the Q4_K mins as the integer sum_s mn[s] * (sum over s of q) and adds
      it once per block times -dmin * d_b: the same value in exact arithmetic; the 32-weight
      formats' repacked layouts scale each block's exact integer dot once, in the order
      y += dot_b * (d * d_b), then y += m * (d_b * sum over block b of q), block after block).
    `quant_linear_ref(..., activation=INT8)` computes the same in fp64.
    """
    return torch.ops.specdec.quant_linear.default(x, weight, int(_format(fmt)), bias,
                                                  int(_activation(activation)))


@torch.library.register_fake("specdec::quant_linear")
def _(x, weight, fmt, bias=None, activation=0):
    return x.new_empty((*x.shape[:-1], weight.shape[0] * group_rows(fmt)))


def quant_linear_cat(x: Tensor, weights: Sequence[Tensor], fmts: Sequence[QuantFormat],
                     biases: Optional[Sequence[Optional[Tensor]]] = None,
                     activation: QuantActivation = QuantActivation.FLOAT) -> Tensor:
    """quant_linear of each (weights[i], fmts[i], biases[i]) against x, side by side:
    y [..., sum N_i], y[..., columns of member i] bitwise quant_linear(x, weights[i], fmts[i],
    biases[i], activation) (the same kernels on the same rows).

    One call instead of one per projection (q/k/v, gate/up): with INT8, x is quantized once per
    activation block kind the members need (256 values for the K formats, 32 for the others), and
    all members' output rows are split across threads in one parallel region, so small matrices
    that would each stay on one thread share the threads. Members may differ in fmt (file or
    repacked layouts) and N; they share x's K and `activation` (arguments as quant_linear's;
    biases None: no bias anywhere).
    """
    weights = list(weights)
    biases = [None] * len(weights) if biases is None else list(biases)
    return torch.ops.specdec.quant_linear_cat.default(
        x, weights, [int(_format(f)) for f in fmts], biases, int(_activation(activation)))


@torch.library.register_fake("specdec::quant_linear_cat")
def _(x, weights, fmts, biases, activation=0):
    n = sum(w.shape[0] * group_rows(f) for w, f in zip(weights, fmts))
    return x.new_empty((*x.shape[:-1], n))


def quant_embedding(ids: Tensor, weight: Tensor, fmt: QuantFormat,
                    dtype: torch.dtype = torch.float32) -> Tensor:
    """Rows `ids` of the dequantized weight: [*ids.shape, K] in `dtype` (float32 or bfloat16).

    Args: ids int32 or int64, any shape, each in [0, N); weight uint8 [N, row_bytes] as in
    quant_linear; fmt a QuantFormat.
    """
    return torch.ops.specdec.quant_embedding.default(ids, weight, int(_format(fmt)), dtype)


@torch.library.register_fake("specdec::quant_embedding")
def _(ids, weight, fmt, dtype=None):
    size, nbytes = _BLOCKS[_format(fmt)]
    k = weight.shape[1] // (nbytes * group_rows(fmt)) * size
    return weight.new_empty((*ids.shape, k), dtype=dtype or torch.float32)


def quant_dequantize(weight: Tensor, fmt: QuantFormat) -> Tensor:
    """The exact fp32 weight [N, K] of a uint8 [N, row_bytes] tensor of `fmt` blocks (bitwise
    `gguf.quants.dequantize`; a repacked fmt: of the file rows it was made from)."""
    return torch.ops.specdec.quant_dequantize.default(weight, int(_format(fmt)))


@torch.library.register_fake("specdec::quant_dequantize")
def _(weight, fmt):
    size, nbytes = _BLOCKS[_format(fmt)]
    g = group_rows(fmt)
    return weight.new_empty((weight.shape[0] * g, weight.shape[1] // (nbytes * g) * size),
                            dtype=torch.float32)


def quant_repack(weight: Tensor, fmt: QuantFormat) -> Tensor:
    """A file-layout weight uint8 [N, row_bytes] of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 (K a multiple
    of 64) or Q4_K / Q6_K, N a multiple of 16, in its
    row-interleaved layout `repacked_format(fmt)`, [N / 16, 16 * quant_row_bytes(R16 fmt, K)]; a
    repacked weight (fmt its *_R16 format) back to the file's bytes [N, row_bytes], bitwise. A new
    tensor: the source is read once and not kept."""
    return torch.ops.specdec.quant_repack.default(weight, int(_format(fmt)))


@torch.library.register_fake("specdec::quant_repack")
def _(weight, fmt):
    fmt = _format(fmt)
    size, nbytes = _BLOCKS[fmt]
    if is_repacked(fmt):
        k = weight.shape[1] // (nbytes * REPACK_ROWS) * size
        return weight.new_empty((weight.shape[0] * REPACK_ROWS, quant_row_bytes(file_format(fmt), k)))
    k = weight.shape[1] // nbytes * size
    return weight.new_empty((weight.shape[0] // REPACK_ROWS,
                             REPACK_ROWS * quant_row_bytes(repacked_format(fmt), k)))
