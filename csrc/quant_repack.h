// Row-interleaved ("R16") layouts of Q4_K / Q6_K and of the 32-weight formats, made at load from
// a GGUF tensor for the INT8 (AVX-512 VNNI) kernel: 16 weight rows per group, so that one 16-lane
// vector holds one value of each of the group's rows and a vpdpbusd multiplies 4 weights of all
// 16 rows into a broadcast of 4 activation quants (no horizontal sums; the scales apply once per
// 32 / 16 weights per lane). A repacked tensor is uint8 [N / 16, 16 * row_bytes]: tensor row g
// holds weight rows 16g .. 16g + 15, as chunks of 16 * block_bytes bytes (K formats: one per
// 256-weight block b; 32-weight formats: one per two blocks), every value copied or re-encoded
// exactly (quant_unpack_group_row gives back the file's bytes).
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
//     [320, 3392)  u8 q[16][3][16][4]    (group g, vector v, r, i), one stream in the order the
//                  kernel reads it: the 16 weights of group g as 4 slots t (weight 16g + 4t + i).
//                  Vector v < 3: bits 0-5 = u of slot v, bits 6-7 = bits 2v .. 2v + 1 of u of
//                  slot 3: a group's 4 vectors of quants in 9 ops (three masks; three shifts,
//                  two bit selects and a mask for slot 3)
// The 32-weight formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; K a multiple of 64): one chunk per two
// file blocks (64 weights, blocks 2c and 2c + 1 = b0, b1) of the 16 rows, every field lane by
// lane, so that the chunk and each of its 64-byte vectors sit on whole cache lines:
//     [0, 64)        fp16 d[2][16]         (block, lane r)
//     then, Q4_1 / Q5_1: fp16 m[2][16]     (64 bytes)
//     then, Q5_0 / Q5_1: u64 qh[2][4][2]   (block, t, h): bit 4r + i = bit 16h + 4t + i of lane
//                                          r's qh (the fifth bits of a 64-byte vector of quants
//                                          as the mask of its bytes; 128 bytes)
//     then qs: nibble formats u8 [2][4][16][4] (block, t, r, i) = the file row's qs[4t + i]:
//                  low nibble weight 4t + i, high nibble weight 16 + 4t + i (512 bytes);
//              Q8_0 u8 [2][8][16][4] (block, t, r, i) = the file row's qs[4t + i] + 128, the
//                  unsigned byte vpdpbusd takes (its sign bit flipped; 1024 bytes).
//   Q4_0_R16 576 B = 16 x 36, Q4_1_R16 640 = 16 x 40, Q5_0_R16 704 = 16 x 44,
//   Q5_1_R16 768 = 16 x 48, Q8_0_R16 1088 = 16 x 68: the file's bytes, rearranged (and Q8_0's
//   sign bits flipped).
// Raw-pointer functions (no ATen): portable ones in quant_repack.cpp, the kernel in
// quant_repack_avx512vnni.cpp.
#pragma once
#include <cstdint>

#include "quant_isa.h"

namespace specdec {

constexpr int kRepackRows = 16;

namespace {

inline bool is_repacked(QuantFmt fmt) { return static_cast<int>(fmt) >= 256; }

// The file format a repacked layout holds (itself for a file format).
inline QuantFmt file_format(QuantFmt fmt) {
  return is_repacked(fmt) ? static_cast<QuantFmt>(static_cast<int>(fmt) - 256) : fmt;
}

// The repacked layout of a file format, or the format itself when it has none.
inline QuantFmt repacked_format(QuantFmt fmt) {
  switch (fmt) {
    case QuantFmt::Q4_0:
    case QuantFmt::Q4_1:
    case QuantFmt::Q5_0:
    case QuantFmt::Q5_1:
    case QuantFmt::Q8_0:
    case QuantFmt::Q4_K:
    case QuantFmt::Q6_K: return static_cast<QuantFmt>(static_cast<int>(fmt) + 256);
    default: return fmt;
  }
}

// The K a repacked layout of `base` needs besides the block size: 64 for the 32-weight formats
// (two blocks per chunk), 256 for the K formats.
inline int64_t repack_k_unit(QuantFmt base) { return is_k_format(base) ? 256 : 64; }

}  // namespace

// 16 file rows of K weights in `base` (a format with a repacked layout; row r at
// src + r * src_stride) into one repacked tensor row at dst (16 * row_bytes bytes).
void quant_repack_group(QuantFmt base, const uint8_t* src, int64_t src_stride, int64_t K,
                        uint8_t* dst);
// Lane r (0..15) of a repacked tensor row back into the file's row_bytes bytes at dst.
void quant_unpack_group_row(QuantFmt base, const uint8_t* group, int64_t K, int r, uint8_t* dst);
// x's per-block terms for the R16 kernel of the 32-weight formats (QuantizedX::bsum32 and
// d_sum32, whatever the format) into per-thread buffers of the calling thread that only grow.
void quant_block_sums(QuantizedX& x);
// INT8 activations over a repacked weight (quant_isa.h's K definition; n_begin / n_end are
// output features, multiples of 16; w_stride the bytes between tensor rows). Portable: each group
// unpacked into the file's rows and run by quant_linear_int8_portable.
void quant_linear_int8_r16_portable(const QuantLinearInt8Block& blk);
// AVX-512 VNNI: per (x row, 16-row group, 256-weight block) the integer block sums of all 16
// rows in one vector (sub-block scales by vpmulld, Q4_K mins / Q6_K's -32 offset by vpdpwssd
// against the activation's block sums), one convert and one FMA per 256 weights per lane (two
// for Q4_K). Each lane's float sequence is that of one (x row, weight row) pair whatever the
// number of rows of x: batch invariance. The 32-weight formats: per x row, 32-weight block and
// 16 rows the exact integer dot (8 vpdpbusd, started at -offset * the block's quant sum), then
// acc += I * (d * d_x) and, for Q4_1 / Q5_1, acc += m * (d_x * quant sum), block after block.
// Called only when cpu_has_avx512_vnni().
void quant_linear_int8_r16_avx512vnni(const QuantLinearInt8Block& blk);

}  // namespace specdec
