// The R16 layouts (quant_repack.h): repacking a group of 16 file rows, giving back a row's file
// bytes, and the portable INT8 path over a repacked weight. No ATen here (quant.cpp has the ops).
#include "quant_repack.h"

#include <cstring>
#include <vector>

namespace specdec {
namespace {

constexpr int64_t kQ4Chunk = 16 * 148, kQ6Chunk = 16 * 212;

// Q4_K / Q5_K's 12 scale bytes from the 8 6-bit scales and mins (the inverse of k_scale_min:
// every one of the 96 bits is a bit of one value, so this gives back the file's bytes).
void k_pack_scale_min(const int* sc, const int* mn, uint8_t* q) {
  for (int j = 0; j < 4; ++j) {
    q[j] = static_cast<uint8_t>(sc[j] | (sc[j + 4] >> 4) << 6);
    q[j + 4] = static_cast<uint8_t>(mn[j] | (mn[j + 4] >> 4) << 6);
    q[j + 8] = static_cast<uint8_t>((sc[j + 4] & 15) | (mn[j + 4] & 15) << 4);
  }
}

// Q6_K's 256 6-bit quants u of a file block (quant_isa.h's layout), and back.
void q6_quants(const uint8_t* p, uint8_t* u) {
  for (int g = 0; g < 8; ++g) {
    const int h = g / 4, t = g % 4;
    for (int l = 0; l < 32; ++l) {
      const int lo = (p[64 * h + 32 * (t % 2) + l] >> (4 * (t / 2))) & 15;
      const int hi = (p[128 + 32 * h + l] >> (2 * t)) & 3;
      u[32 * g + l] = static_cast<uint8_t>(lo | hi << 4);
    }
  }
}
void q6_set_quants(const uint8_t* u, uint8_t* p) {
  std::memset(p, 0, 192);
  for (int g = 0; g < 8; ++g) {
    const int h = g / 4, t = g % 4;
    for (int l = 0; l < 32; ++l) {
      p[64 * h + 32 * (t % 2) + l] |= static_cast<uint8_t>((u[32 * g + l] & 15) << (4 * (t / 2)));
      p[128 + 32 * h + l] |= static_cast<uint8_t>((u[32 * g + l] >> 4) << (2 * t));
    }
  }
}

// Where a Q6_K_R16 chunk keeps weight k's 6-bit quant in lane r (quant_repack.h): the byte
// offset of its group vector `slot` for slot 0..2 (the quant in bits 0-5), or of vector 0 for
// slot 3 (its bits 2s .. 2s + 1 in bits 6-7 of vector s, s = 0..2).
struct Q6Place {
  int64_t at;
  int slot;
};
Q6Place q6_place(int k, int r) {
  const int g = k / 16, slot = (k % 16) / 4, i = k % 4;
  return {320 + ((3 * g + (slot < 3 ? slot : 0)) * 16 + r) * 4 + i, slot};
}
constexpr int64_t kQ6Vector = 64;

void q4_repack_block(const uint8_t* const* rows, uint8_t* c) {
  for (int r = 0; r < 16; ++r) {
    const uint8_t* p = rows[r];
    std::memcpy(c + 2 * r, p, 2);
    std::memcpy(c + 32 + 2 * r, p + 2, 2);
    for (int s = 0; s < 8; ++s) {
      int sc, mn;
      k_scale_min(p + 4, s, &sc, &mn);
      c[64 + (s / 2) * 32 + 2 * r + s % 2] = static_cast<uint8_t>(sc);
      c[192 + (s / 2) * 32 + 2 * r + s % 2] = static_cast<uint8_t>(mn);
    }
    for (int j = 0; j < 4; ++j)
      for (int t = 0; t < 8; ++t)
        std::memcpy(c + 320 + ((j * 8 + t) * 16 + r) * 4, p + 16 + 32 * j + 4 * t, 4);
  }
}

void q4_unpack_block(const uint8_t* c, int r, uint8_t* p) {
  std::memcpy(p, c + 2 * r, 2);
  std::memcpy(p + 2, c + 32 + 2 * r, 2);
  int sc[8], mn[8];
  for (int s = 0; s < 8; ++s) {
    sc[s] = c[64 + (s / 2) * 32 + 2 * r + s % 2];
    mn[s] = c[192 + (s / 2) * 32 + 2 * r + s % 2];
  }
  k_pack_scale_min(sc, mn, p + 4);
  for (int j = 0; j < 4; ++j)
    for (int t = 0; t < 8; ++t)
      std::memcpy(p + 16 + 32 * j + 4 * t, c + 320 + ((j * 8 + t) * 16 + r) * 4, 4);
}

void q6_repack_block(const uint8_t* const* rows, uint8_t* c) {
  std::memset(c, 0, kQ6Chunk);  // the split quants' bits are or-ed in; the padding stays zero
  uint8_t u[256];
  for (int r = 0; r < 16; ++r) {
    const uint8_t* p = rows[r];
    std::memcpy(c + 2 * r, p + 208, 2);
    for (int g = 0; g < 16; ++g) c[64 + (g / 2) * 32 + 2 * r + g % 2] = p[192 + g];
    q6_quants(p, u);
    for (int k = 0; k < 256; ++k) {
      const Q6Place w = q6_place(k, r);
      if (w.slot < 3) {
        c[w.at] |= u[k];
      } else {
        for (int s = 0; s < 3; ++s)
          c[w.at + s * kQ6Vector] |= static_cast<uint8_t>(((u[k] >> 2 * s) & 3) << 6);
      }
    }
  }
}

void q6_unpack_block(const uint8_t* c, int r, uint8_t* p) {
  uint8_t u[256];
  for (int k = 0; k < 256; ++k) {
    const Q6Place w = q6_place(k, r);
    int v = 0;
    if (w.slot < 3) {
      v = c[w.at] & 63;
    } else {
      for (int s = 0; s < 3; ++s) v |= (c[w.at + s * kQ6Vector] >> 6) << 2 * s;
    }
    u[k] = static_cast<uint8_t>(v);
  }
  q6_set_quants(u, p);
  for (int g = 0; g < 16; ++g) p[192 + g] = c[64 + (g / 2) * 32 + 2 * r + g % 2];
  std::memcpy(p + 208, c + 2 * r, 2);
}

// A 32-weight format's file block and R16 pair chunk (quant_repack.h): field offsets.
struct SmallLayout {
  bool min, qh;
  uint8_t flip;  // xor-ed into the quant bytes (Q8_0: q + 128, the unsigned byte)
  int64_t file_bytes, file_qh, file_qs;  // the file block
  int64_t qh_at, qs_at, vectors, chunk;  // the chunk; vectors: 64-byte qs vectors per block
};

SmallLayout small_layout(QuantFmt base) {
  const bool min = base == QuantFmt::Q4_1 || base == QuantFmt::Q5_1;
  const bool qh = base == QuantFmt::Q5_0 || base == QuantFmt::Q5_1;
  const bool q8 = base == QuantFmt::Q8_0;
  const int64_t file_qh = min ? 4 : 2, file_qs = file_qh + (qh ? 4 : 0);
  const int64_t qh_at = min ? 128 : 64, qs_at = qh_at + (qh ? 128 : 0), vectors = q8 ? 8 : 4;
  const uint8_t flip = q8 ? 0x80 : 0;
  return {min,   qh,    flip,    file_qs + (q8 ? 32 : 16), file_qh, file_qs,
          qh_at, qs_at, vectors, qs_at + 2 * 64 * vectors};
}

// 4 quant bytes from src to dst, xor-ed with flip (the same both ways).
void copy_quads(uint8_t* dst, const uint8_t* src, uint8_t flip) {
  for (int i = 0; i < 4; ++i) dst[i] = static_cast<uint8_t>(src[i] ^ flip);
}

// Byte and bit of lane r's fifth bit j (0..31) of block `blk` in a chunk's qh masks.
int64_t small_qh_bit(const SmallLayout& L, int blk, int r, int j, int* bit) {
  const int h = j / 16, t = (j % 16) / 4, i = j % 4, pos = 4 * r + i;
  *bit = pos % 8;
  return L.qh_at + 8 * ((blk * 4 + t) * 2 + h) + pos / 8;
}

// rows[r]: row r's two file blocks (b0 then b1).
void small_repack_pair(const SmallLayout& L, const uint8_t* const* rows, uint8_t* c) {
  std::memset(c, 0, static_cast<size_t>(L.chunk));  // the fifth bits are or-ed in
  for (int r = 0; r < 16; ++r) {
    for (int blk = 0; blk < 2; ++blk) {
      const uint8_t* p = rows[r] + blk * L.file_bytes;
      std::memcpy(c + 32 * blk + 2 * r, p, 2);
      if (L.min) std::memcpy(c + 64 + 32 * blk + 2 * r, p + 2, 2);
      if (L.qh) {
        uint32_t h;
        std::memcpy(&h, p + L.file_qh, 4);
        for (int j = 0; j < 32; ++j) {
          int bit;
          c[small_qh_bit(L, blk, r, j, &bit)] |= static_cast<uint8_t>(((h >> j) & 1) << bit);
        }
      }
      for (int t = 0; t < L.vectors; ++t)
        copy_quads(c + L.qs_at + ((blk * L.vectors + t) * 16 + r) * 4, p + L.file_qs + 4 * t,
                   L.flip);
    }
  }
}

void small_unpack_pair(const SmallLayout& L, const uint8_t* c, int r, uint8_t* p0) {
  for (int blk = 0; blk < 2; ++blk) {
    uint8_t* p = p0 + blk * L.file_bytes;
    std::memcpy(p, c + 32 * blk + 2 * r, 2);
    if (L.min) std::memcpy(p + 2, c + 64 + 32 * blk + 2 * r, 2);
    if (L.qh) {
      uint32_t h = 0;
      for (int j = 0; j < 32; ++j) {
        int bit;
        h |= static_cast<uint32_t>((c[small_qh_bit(L, blk, r, j, &bit)] >> bit) & 1) << j;
      }
      std::memcpy(p + L.file_qh, &h, 4);
    }
    for (int t = 0; t < L.vectors; ++t)
      copy_quads(p + L.file_qs + 4 * t, c + L.qs_at + ((blk * L.vectors + t) * 16 + r) * 4, L.flip);
  }
}

// File bytes of K weights of `base` in one row.
int64_t file_row_bytes(QuantFmt base, int64_t K) {
  QuantFormatInfo info{};
  quant_format_info(static_cast<int>(base), &info);
  return K / info.block_size * info.block_bytes;
}

}  // namespace

void quant_repack_group(QuantFmt base, const uint8_t* src, int64_t src_stride, int64_t K,
                        uint8_t* dst) {
  if (!is_k_format(base)) {
    const SmallLayout L = small_layout(base);
    for (int64_t c = 0; c < K / 64; ++c) {
      const uint8_t* rows[16];
      for (int r = 0; r < 16; ++r) rows[r] = src + r * src_stride + 2 * c * L.file_bytes;
      small_repack_pair(L, rows, dst + c * L.chunk);
    }
    return;
  }
  const bool q4 = base == QuantFmt::Q4_K;
  const int64_t file_bytes = q4 ? 144 : 210, chunk = q4 ? kQ4Chunk : kQ6Chunk;
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* rows[16];
    for (int r = 0; r < 16; ++r) rows[r] = src + r * src_stride + b * file_bytes;
    if (q4)
      q4_repack_block(rows, dst + b * chunk);
    else
      q6_repack_block(rows, dst + b * chunk);
  }
}

void quant_unpack_group_row(QuantFmt base, const uint8_t* group, int64_t K, int r, uint8_t* dst) {
  if (!is_k_format(base)) {
    const SmallLayout L = small_layout(base);
    for (int64_t c = 0; c < K / 64; ++c)
      small_unpack_pair(L, group + c * L.chunk, r, dst + 2 * c * L.file_bytes);
    return;
  }
  const bool q4 = base == QuantFmt::Q4_K;
  const int64_t file_bytes = q4 ? 144 : 210, chunk = q4 ? kQ4Chunk : kQ6Chunk;
  for (int64_t b = 0; b < K / 256; ++b) {
    if (q4)
      q4_unpack_block(group + b * chunk, r, dst + b * file_bytes);
    else
      q6_unpack_block(group + b * chunk, r, dst + b * file_bytes);
  }
}

void quant_linear_int8_r16_portable(const QuantLinearInt8Block& b) {
  const QuantFmt base = file_format(b.fmt);
  const int64_t K = is_k_format(base) ? b.xk.K : b.x.K, row_bytes = file_row_bytes(base, K);
  thread_local std::vector<uint8_t> rows;
  rows.resize(static_cast<size_t>(16 * row_bytes));
  for (int64_t n = b.n_begin; n < b.n_end; n += 16) {
    const uint8_t* group = b.w + (n / 16) * b.w_stride;
    for (int r = 0; r < 16; ++r)
      quant_unpack_group_row(base, group, K, r, rows.data() + r * row_bytes);
    QuantLinearInt8Block part = b;
    part.fmt = base;
    part.w = rows.data();
    part.w_stride = row_bytes;
    part.bias = b.bias ? b.bias + n : nullptr;
    part.y = b.y + n;
    part.n_begin = 0;
    part.n_end = 16;
    quant_linear_int8_portable(part);
  }
}

void quant_block_sums(QuantizedX& x) {
  thread_local std::vector<int32_t> sums;
  thread_local std::vector<float> d_sums;
  const int64_t blocks = x.Kp / 32;
  sums.resize(static_cast<size_t>(x.M * blocks));
  d_sums.resize(static_cast<size_t>(x.M * blocks));
  for (int64_t m = 0; m < x.M; ++m) {
    for (int64_t b = 0; b < blocks; ++b) {
      const int8_t* q = x.q + m * x.Kp + 32 * b;
      int32_t s = 0;
      for (int j = 0; j < 32; ++j) s += q[j];
      const size_t at = static_cast<size_t>(m * blocks + b);
      sums[at] = s;
      d_sums[at] = x.d[m * (x.Kp / 4) + 8 * b] * static_cast<float>(s);  // one rounding
    }
  }
  x.bsum32 = sums.data();
  x.d_sum32 = d_sums.data();
}

}  // namespace specdec
