// Raw-pointer kernels of the quantized-weight ops (quant.cpp) and the ggml block layouts they
// read. Declared here, defined in quant.cpp (portable) and quant_<isa>.cpp (built with that
// ISA's flags only when the compiler supports it: SPECDEC_BUILT_<ISA>). No ATen types cross
// this boundary.
#pragma once
#include <cstdint>

namespace specdec {

// ggml type ids (gguf.GGMLQuantizationType) of the supported block formats.
// The *_R16 ids are our own layouts (csrc/quant_repack.h): 256 + the file format's id.
enum class QuantFmt : int {
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q4_0_R16 = 256 + 2,
  Q4_1_R16 = 256 + 3,
  Q5_0_R16 = 256 + 6,
  Q5_1_R16 = 256 + 7,
  Q8_0_R16 = 256 + 8,
  Q4_K_R16 = 256 + 12,
  Q6_K_R16 = 256 + 14
};

// Block layouts, byte offsets as stored in a GGUF file (little-endian, no padding, blocks packed
// back to back with no alignment: every field is read with unaligned loads / memcpy).
//   Q4_0 (32 weights, 18 B): f16 d | u8 qs[16]             w[j] = d * ((qs[j%16] >> 4*(j/16) & 15) - 8)
//   Q4_1 (32 weights, 20 B): f16 d | f16 m | u8 qs[16]     w[j] = d * (nibble j) + m
//   Q5_0 (32 weights, 22 B): f16 d | u32 qh | u8 qs[16]    w[j] = d * ((nibble j | bit j of qh << 4) - 16)
//   Q5_1 (32 weights, 24 B): f16 d | f16 m | u32 qh | u8 qs[16]   w[j] = d * (nibble j | bit j of qh << 4) + m
//   Q8_0 (32 weights, 34 B): f16 d | i8 qs[32]             w[j] = d * qs[j]
//   Q4_K (256, 144 B): f16 d | f16 dmin | u8 scales[12] (8 6-bit scales + 8 6-bit mins) | u8 qs[128]
//     sub-block s (32 weights): w = (d * sc[s]) * q - dmin * mn[s]; q = nibble (s % 2) of
//     qs[32 * (s / 2) + l]
//   Q5_K (256, 176 B): f16 d | f16 dmin | u8 scales[12] | u8 qh[32] | u8 qs[128]
//     as Q4_K with q |= (bit s of qh[l]) << 4
//   Q6_K (256, 210 B): u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d
//     group g (32 weights), h = g / 4, t = g % 4, l < 32:
//     q = (ql[64h + 32(t%2) + l] >> 4(t/2) & 15 | (qh[32h + l] >> 2t & 3) << 4) - 32,
//     w = (d * scales[2g + l/16]) * q
// Every product above is exact in fp32 (few mantissa bits), so d*sc*q in any order, and one
// fused multiply-add for the "- dmin*mn" / "+ m" forms, give the file's value bit for bit.
// Helpers below sit in an anonymous namespace: each translation unit (compiled with its own ISA
// flags) keeps its own copy, so the linker can never hand an AVX-512 copy to the portable code.
namespace {

struct QuantFormatInfo {
  int64_t block_size;      // weights per block
  int64_t block_bytes;     // bytes per block and weight row
  int64_t group_rows = 1;  // weight rows per tensor row (16: rows interleaved, quant_repack.h)
};
inline bool quant_format_info(int fmt, QuantFormatInfo* info) {
  switch (static_cast<QuantFmt>(fmt)) {
    case QuantFmt::Q4_0: *info = {32, 18}; return true;
    case QuantFmt::Q4_1: *info = {32, 20}; return true;
    case QuantFmt::Q5_0: *info = {32, 22}; return true;
    case QuantFmt::Q5_1: *info = {32, 24}; return true;
    case QuantFmt::Q8_0: *info = {32, 34}; return true;
    case QuantFmt::Q4_K: *info = {256, 144}; return true;
    case QuantFmt::Q5_K: *info = {256, 176}; return true;
    case QuantFmt::Q6_K: *info = {256, 210}; return true;
    // The 32-weight formats' R16 chunks hold two blocks (64 weights) of 16 rows.
    case QuantFmt::Q4_0_R16: *info = {64, 36, 16}; return true;
    case QuantFmt::Q4_1_R16: *info = {64, 40, 16}; return true;
    case QuantFmt::Q5_0_R16: *info = {64, 44, 16}; return true;
    case QuantFmt::Q5_1_R16: *info = {64, 48, 16}; return true;
    case QuantFmt::Q8_0_R16: *info = {64, 68, 16}; return true;
    case QuantFmt::Q4_K_R16: *info = {256, 148, 16}; return true;
    case QuantFmt::Q6_K_R16: *info = {256, 212, 16}; return true;
  }
  return false;
}

// The 6-bit scale and min of sub-block s (0..7) of a Q4_K / Q5_K block's 12 scale bytes.
inline void k_scale_min(const uint8_t* q, int s, int* sc, int* mn) {
  if (s < 4) {
    *sc = q[s] & 63;
    *mn = q[s + 4] & 63;
  } else {
    *sc = (q[s + 4] & 0xF) | ((q[s - 4] >> 6) << 4);
    *mn = (q[s + 4] >> 4) | ((q[s] >> 6) << 4);
  }
}

}  // namespace

// One block of output features [n_begin, n_end) for all M rows:
//   y[m, n] = sum_k x[m, k] * W[n, k] (+ bias[n]),  W[n, :] = dequantize(w + n * w_stride).
// x: [M, K] fp32, row stride x_stride; w: N rows of K / block_size blocks of `fmt`; bias: [N]
// fp32 or nullptr; y: [M, N] fp32, row stride y_stride. fp32 accumulation.
// Batch invariance: y[m, n] is computed by the same sequence of operations whatever M is and
// whichever row of x holds it (rows of x never share an accumulator or a reduction).
struct QuantLinearBlock {
  QuantFmt fmt;
  int64_t M, K;
  const float* x;
  int64_t x_stride;
  const uint8_t* w;
  int64_t w_stride;
  const float* bias;
  float* y;
  int64_t y_stride;
  int64_t n_begin, n_end;
};

// Portable: weights dequantized one row at a time, sums in double.
void quant_linear_portable(const QuantLinearBlock& blk);
void quant_dequantize_row_portable(QuantFmt fmt, const uint8_t* row, int64_t K, float* out);
// AVX-512 (F/BW/VL/DQ + FMA + F16C): each 32-weight sub-block is dequantized into two 16-lane
// fp32 vectors in registers (M = 1), or weight rows in pairs into an L1/L2 buffer multiplied
// into 4 rows of x at a time (M > 1).
void quant_linear_avx512(const QuantLinearBlock& blk);
void quant_dequantize_row_avx512(QuantFmt fmt, const uint8_t* row, int64_t K, float* out);
// AVX2 + FMA + F16C: 8 lanes; up to 4 rows of x straight from registers, a buffered row past 4.
// (FLOAT activations only: INT8 runs the portable kernel on AVX2 CPUs.)
void quant_linear_avx2(const QuantLinearBlock& blk);
void quant_dequantize_row_avx2(QuantFmt fmt, const uint8_t* row, int64_t K, float* out);

// INT8 activations (QuantActivation.INT8 in ops/quant.py). Each row of x is cut into blocks of
// G values along K: G = 32 for the 32-weight formats, G = 256 for the K formats (one activation
// block per weight super-block, as ggml's Q8_K). Block b has d[b] = max|x| / 127 (fp32
// division; 0 for an all-zero block) and q[k] = round-half-to-even(x[k] / d[b]) (fp32
// division; 0 when d[b] == 0), clamped to [-127, 127].
// 32-weight formats: the weight row is read as w[k] = scale[k / 16] * wq[k] + min[k / 32] with
// integer quants wq (q - 8 for Q4_0, q - 16 for Q5_0, q for Q4_1 / Q5_1 / Q8_0) and the exact
// fp32 scale d and min (m for Q4_1 / Q5_1, 0 else):
//   y[m, n] = sum_g scale[g] * d[g / 2] * (sum_{k in 16-group g} wq[k] q[k])
//           + sum_b min[b] * d[b] * (sum_{k in block b} q[k])   (+ bias[n]).
// K formats: the integer sub-block scales stay integers; per 256-weight block b with the file's
// fp16 d (and dmin), the 6-bit sc[s] / mn[s] (Q4_K / Q5_K, 32-weight sub-blocks s) or the int8
// sc[g] (Q6_K, 16-weight groups g, wq = q - 32):
//   I[b] = sum_s sc[s] * (sum_{k in s} wq[k] q[k])   (an exact integer)
//   y[m, n] = sum_b (d * d[b]) * I[b]
//           + sum_b sum_s (-dmin * mn[s]) * (d[b] * sum_{k in s} q[k])   (Q4_K / Q5_K)   (+ bias),
// the integer sums exact, the rest in fp32 in a fixed order per (x row, weight row) pair.
// The quantized rows of x for the 32-weight formats, padded with zeros to Kp = K rounded up to
// 64 (64 quants per VNNI step; "lane" = 4 consecutive quants, one int32 lane of vpdpbusd):
struct QuantizedX {
  int64_t M, K, Kp;
  const int8_t* q;                // [M, Kp] quants
  const float* d;                 // [M, Kp / 4] the block's d of each lane
  const float* d_sum;             // [M, Kp / 4] d * (sum of the lane's 4 quants)
  const int32_t* neg_offset_sum;  // [M, Kp / 4] -offset * (sum of the lane's 4 quants), see below
  // The R16 kernel's per-block terms (quant_block_sums), [M, Kp / 32] each: the block's quant
  // sum (times -offset, the start of its integer dot) and d * the quant sum (the min's factor).
  const int32_t* bsum32 = nullptr;
  const float* d_sum32 = nullptr;
};
// The VNNI kernel multiplies unsigned weight bytes by signed quants (vpdpbusd): a format whose
// integer quant is wq = u - offset (u the unsigned stored value) starts each lane's integer dot
// at -offset * (sum of the lane's quants), so the lane holds sum wq * q exactly. (Anonymous
// namespace: see above.)
namespace {
inline int int8_weight_offset(QuantFmt fmt) {
  switch (fmt) {
    case QuantFmt::Q4_0: return 8;
    case QuantFmt::Q5_0: return 16;
    case QuantFmt::Q8_0: return 128;  // stored signed; u = wq + 128 (sign bit flipped)
    default: return 0;
  }
}
inline bool is_k_format(QuantFmt fmt) {
  return fmt == QuantFmt::Q4_K || fmt == QuantFmt::Q5_K || fmt == QuantFmt::Q6_K;
}

}  // namespace
// The quantized rows of x for the K formats (K a multiple of 256), with the sums the kernels
// need besides the quants: the 32-quant sums times d for the mins of Q4_K / Q5_K, the 16-quant
// sums for Q6_K's offset (wq = u - 32: the integer dot of u is corrected by -32 * sc * sum).
struct QuantizedXK {
  int64_t M, K;
  const int8_t* q;        // [M, K] quants
  const float* d;         // [M, K / 256] each block's d
  const float* d_bsum32;  // [M, K / 32] d * (sum of the 32 quants)
  const int16_t* bsum16;  // [M, K / 16] sum of the 16 quants
  const int16_t* bsum32;  // [M, K / 32] sum of the 32 quants
};
// One block of output features [n_begin, n_end) for all M rows (bias as QuantLinearBlock).
// x is filled for the 32-weight formats, xk for the K formats.
struct QuantLinearInt8Block {
  QuantFmt fmt;
  QuantizedX x;
  QuantizedXK xk;
  const uint8_t* w;
  int64_t w_stride;
  const float* bias;
  float* y;
  int64_t y_stride;
  int64_t n_begin, n_end;
};
// Portable: integer dots in int32, the sum in double (the correctness path).
void quant_linear_int8_portable(const QuantLinearInt8Block& blk);
// AVX-512 VNNI (+ F/BW/VL/DQ). 32-weight formats: 64 weights per vpdpbusd step, fp32 lane
// accumulators, up to 4 rows of x per pass over a weight row. K formats: vpmaddubsw + vpdpwssd
// against the integer sub-block scales into one int32 accumulator per 256 weights, one convert
// and one FMA per block. Called only when cpu_has_avx512_vnni().
void quant_linear_int8_avx512vnni(const QuantLinearInt8Block& blk);
// AVX2 + FMA + F16C, K formats only (quant_avx2.cpp): the same scheme with vpmaddubsw +
// vpmaddwd on 8 lanes.
void quant_linear_int8k_avx2(const QuantLinearInt8Block& blk);
// Rows [m_begin, m_end) of x [M, K] fp32 quantized into QuantizedX's buffers (offset: the
// format's int8_weight_offset). The portable version (quant.cpp) is the same bit for bit.
void quant_quantize_x_avx512vnni(const float* x, int64_t K, int offset, int64_t Kp, int8_t* q,
                                 float* d, float* d_sum, int32_t* neg_offset_sum, int64_t m_begin,
                                 int64_t m_end);
// Rows [m_begin, m_end) of x [M, K] fp32 quantized in 256-value blocks into QuantizedXK's
// buffers; the portable version (quant.cpp) is the same bit for bit.
void quant_quantize_xk_avx512vnni(const float* x, int64_t K, int8_t* q, float* d, float* d_bsum32,
                                  int16_t* bsum16, int16_t* bsum32, int64_t m_begin, int64_t m_end);

// The FLOAT kernels' format dispatch, written once for the AVX2 and AVX-512 units: each unit
// defines its own row types (Q4_0Rows ... Q6_KRows, QK45Rows<is_q5>) under these names and
// calls CALL(RowsType) for `fmt`.
#define SPECDEC_QUANT_FLOAT_DISPATCH(fmt, CALL)        \
  switch (fmt) {                                       \
    case QuantFmt::Q4_0: CALL(Q4_0Rows); break;        \
    case QuantFmt::Q4_1: CALL(Q4_1Rows); break;        \
    case QuantFmt::Q5_0: CALL(Q5_0Rows); break;        \
    case QuantFmt::Q5_1: CALL(Q5_1Rows); break;        \
    case QuantFmt::Q8_0: CALL(Q8_0Rows); break;        \
    case QuantFmt::Q4_K: CALL(QK45Rows<false>); break; \
    case QuantFmt::Q5_K: CALL(QK45Rows<true>); break;  \
    case QuantFmt::Q6_K: CALL(Q6_KRows); break;        \
    default: break; /* repacked layouts: INT8 only */  \
  }

}  // namespace specdec
