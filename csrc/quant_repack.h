// Row-interleaved ("R16") layouts of the K formats, made at load from a GGUF tensor for the INT8
// (AVX-512 VNNI) kernel: 16 weight rows per group, so that one 16-lane vector holds one value of
// each of the group's rows and a vpdpbusd multiplies 4 weights of all 16 rows into a broadcast of
// 4 activation quants (no horizontal sums; the sub-block scales apply once per 32 / 16 weights
// per lane). A repacked tensor is uint8 [N / 16, 16 * row_bytes]: tensor row g holds weight rows
// 16g .. 16g + 15, as K / 256 chunks of 16 * block_bytes bytes (one per 256-weight block b), every
// value copied or re-encoded exactly (quant_unpack_group_row gives back the file's bytes).
//   Q4_K_R16 chunk (2368 B = 16 x 148):
//     [0, 32)      fp16 d[16]            (lane r: row 16g + r)
//     [32, 64)     fp16 dmin[16]
//     [64, 192)    u8 sc[4][16][2]       pair j, lane r: the 6-bit scales of sub-blocks 2j, 2j + 1
//     [192, 320)   u8 mn[4][16][2]       the same for the 6-bit mins
//     [320, 2368)  u8 qs[4][8][16][4]    (j, t, r, i) = the file row's qs[32j + 4t + i]: low nibble
//                  weight 64j + 4t + i (sub-block 2j), high nibble weight 64j + 32 + 4t + i
//   Q6_K_R16 chunk (3392 B = 16 x 212, 53 cache lines; the padding puts every 64-byte vector of
//   quants on one cache line of a 64-byte aligned tensor, no split loads), u[k] = the 6-bit quant
//   of weight k (0..63, wq = u - 32):
//     [0, 32)      fp16 d[16]
//     [32, 64)     zero padding
//     [64, 320)    i8 sc[8][16][2]       pair e, lane r: the int8 scales of 16-weight groups 2e, 2e + 1
//     [320, 2368)  u8 ql[4][8][16][4]    (p, t, r, i): low nibble u[64p + 4t + i] & 15, high nibble
//                  u[64p + 32 + 4t + i] & 15
//     [2368, 3392) u8 qh[2][8][16][4]    (c, t, r, i): bits 2(2a + h) .. +1 = u[64p + 32h + 4t + i] >> 4
//                  for p = 2c + a (a, h in {0, 1})
// Raw-pointer functions (no ATen): portable ones in quant_repack.cpp, the kernel in
// quant_repack_avx512vnni.cpp.
#pragma once
#include <cstdint>

#include "quant_isa.h"

namespace specdec {

constexpr int kRepackRows = 16;

namespace {

inline bool is_repacked(QuantFmt fmt) {
  return fmt == QuantFmt::Q4_K_R16 || fmt == QuantFmt::Q6_K_R16;
}

// The file format a repacked layout holds (itself for a file format).
inline QuantFmt file_format(QuantFmt fmt) {
  return is_repacked(fmt) ? static_cast<QuantFmt>(static_cast<int>(fmt) - 256) : fmt;
}

// The repacked layout of a file format, or the format itself when it has none.
inline QuantFmt repacked_format(QuantFmt fmt) {
  return fmt == QuantFmt::Q4_K || fmt == QuantFmt::Q6_K
             ? static_cast<QuantFmt>(static_cast<int>(fmt) + 256)
             : fmt;
}

}  // namespace

// 16 file rows of K weights in `base` (Q4_K or Q6_K; row r at src + r * src_stride) into one
// repacked tensor row at dst (16 * row_bytes bytes).
void quant_repack_group(QuantFmt base, const uint8_t* src, int64_t src_stride, int64_t K,
                        uint8_t* dst);
// Lane r (0..15) of a repacked tensor row back into the file's row_bytes bytes at dst.
void quant_unpack_group_row(QuantFmt base, const uint8_t* group, int64_t K, int r, uint8_t* dst);
// INT8 activations over a repacked weight (quant_isa.h's K definition; n_begin / n_end are
// output features, multiples of 16; w_stride the bytes between tensor rows). Portable: each group
// unpacked into the file's rows and run by quant_linear_int8_portable.
void quant_linear_int8_r16_portable(const QuantLinearInt8Block& blk);
// AVX-512 VNNI: per (x row, 16-row group, 256-weight block) the integer block sums of all 16
// rows in one vector (sub-block scales by vpmulld, Q4_K mins / Q6_K's -32 offset by vpdpwssd
// against the activation's block sums), one convert and one FMA per 256 weights per lane (two
// for Q4_K). Each lane's float sequence is that of one (x row, weight row) pair whatever the
// number of rows of x: batch invariance. Called only when cpu_has_avx512_vnni().
void quant_linear_int8_r16_avx512vnni(const QuantLinearInt8Block& blk);

}  // namespace specdec
