// Quantized-weight ops over ggml block formats, reading a GGUF tensor's bytes in place (no repack):
// quant_linear (y = x W^T + b, W dequantized on the fly while it streams from memory),
// quant_linear_cat (several weights against one x: their outputs side by side, each value bitwise
// quant_linear's), quant_embedding (rows of W by id) and quant_dequantize (the whole of W in
// fp32). Formats and block layouts: quant_isa.h. Every weight the kernels use equals the file's
// value exactly (the gguf package's dequantization, bit for bit).
// ISA paths: AVX-512 (quant_avx512.cpp) when active_isa() >= AVX512, AVX2 (quant_avx2.cpp) when it
// is AVX2, portable otherwise. Output features are split across threads in blocks of rows: one
// parallel region per call (quant_linear_cat: the blocks of all its weights in one region).
// Batch invariance: a row of quant_linear's output is bitwise the same whatever the number of
// rows of x and wherever the row sits (see QuantLinearBlock).
// INT8 activations (activation = 1; definition in quant_isa.h): x is quantized once per call
// (32-value blocks, or 256 for the K formats) into per-thread buffers that only grow, then the
// AVX-512 VNNI kernels (quant_avx512vnni.cpp) run when active_isa() >= AVX512 and the CPU has
// AVX-512 VNNI ("quant_linear_int8:avx512"); else the K formats run the AVX2 kernel
// (quant_avx2.cpp, "quant_linear_int8:avx2") when AVX2 or better is active; the portable
// loops run the rest ("quant_linear_int8:portable").
#include <c10/util/Half.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common.h"
#include "quant_isa.h"
#include "quant_repack.h"

namespace specdec {
namespace {

inline float load_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

}  // namespace

void quant_dequantize_row_portable(QuantFmt fmt, const uint8_t* p, int64_t K, float* out) {
  switch (fmt) {
    case QuantFmt::Q4_0:
      for (int64_t k = 0; k < K; k += 32, p += 18) {
        const float d = load_f16(p);
        for (int j = 0; j < 16; ++j) {
          out[k + j] = d * static_cast<float>((p[2 + j] & 15) - 8);
          out[k + j + 16] = d * static_cast<float>((p[2 + j] >> 4) - 8);
        }
      }
      break;
    case QuantFmt::Q4_1:
      for (int64_t k = 0; k < K; k += 32, p += 20) {
        const float d = load_f16(p), m = load_f16(p + 2);
        for (int j = 0; j < 16; ++j) {
          out[k + j] = d * static_cast<float>(p[4 + j] & 15) + m;
          out[k + j + 16] = d * static_cast<float>(p[4 + j] >> 4) + m;
        }
      }
      break;
    case QuantFmt::Q5_0:
      for (int64_t k = 0; k < K; k += 32, p += 22) {
        const float d = load_f16(p);
        uint32_t qh;
        std::memcpy(&qh, p + 2, 4);
        for (int j = 0; j < 16; ++j) {
          const int lo = (p[6 + j] & 15) | static_cast<int>((qh >> j) & 1) << 4;
          const int hi = (p[6 + j] >> 4) | static_cast<int>((qh >> (j + 16)) & 1) << 4;
          out[k + j] = d * static_cast<float>(lo - 16);
          out[k + j + 16] = d * static_cast<float>(hi - 16);
        }
      }
      break;
    case QuantFmt::Q5_1:
      for (int64_t k = 0; k < K; k += 32, p += 24) {
        const float d = load_f16(p), m = load_f16(p + 2);
        uint32_t qh;
        std::memcpy(&qh, p + 4, 4);
        for (int j = 0; j < 16; ++j) {
          const int lo = (p[8 + j] & 15) | static_cast<int>((qh >> j) & 1) << 4;
          const int hi = (p[8 + j] >> 4) | static_cast<int>((qh >> (j + 16)) & 1) << 4;
          out[k + j] = d * static_cast<float>(lo) + m;
          out[k + j + 16] = d * static_cast<float>(hi) + m;
        }
      }
      break;
    case QuantFmt::Q8_0:
      for (int64_t k = 0; k < K; k += 32, p += 34) {
        const float d = load_f16(p);
        for (int j = 0; j < 32; ++j)
          out[k + j] = d * static_cast<float>(static_cast<int8_t>(p[2 + j]));
      }
      break;
    case QuantFmt::Q4_K:
    case QuantFmt::Q5_K: {
      const bool fifth = fmt == QuantFmt::Q5_K;
      const int64_t block_bytes = fifth ? 176 : 144;
      for (int64_t k = 0; k < K; k += 256, p += block_bytes) {
        const float d = load_f16(p), dmin = load_f16(p + 2);
        const uint8_t* qh = p + 16;
        const uint8_t* qs = p + (fifth ? 48 : 16);
        for (int s = 0; s < 8; ++s) {
          int sc, mn;
          k_scale_min(p + 4, s, &sc, &mn);
          // Both products are exact in fp32; the difference is rounded once.
          const float ds = d * static_cast<float>(sc), dm = dmin * static_cast<float>(mn);
          for (int l = 0; l < 32; ++l) {
            int q = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 15;
            if (fifth) q |= ((qh[l] >> s) & 1) << 4;
            out[k + 32 * s + l] = ds * static_cast<float>(q) - dm;
          }
        }
      }
      break;
    }
    default:  // repacked layouts: rows are given back in the file's layout first
      break;
    case QuantFmt::Q6_K:
      for (int64_t k = 0; k < K; k += 256, p += 210) {
        const int8_t* scales = reinterpret_cast<const int8_t*>(p + 192);
        const float d = load_f16(p + 208);
        for (int g = 0; g < 8; ++g) {
          const int h = g / 4, t = g % 4;
          for (int l = 0; l < 32; ++l) {
            const int lo = (p[64 * h + 32 * (t % 2) + l] >> (4 * (t / 2))) & 15;
            const int hi = (p[128 + 32 * h + l] >> (2 * t)) & 3;
            const float ds = d * static_cast<float>(scales[2 * g + l / 16]);
            out[k + 32 * g + l] = ds * static_cast<float>((lo | hi << 4) - 32);
          }
        }
      }
      break;
  }
}

void quant_linear_portable(const QuantLinearBlock& b) {
  thread_local std::vector<float> row;
  row.resize(static_cast<size_t>(b.K));
  for (int64_t n = b.n_begin; n < b.n_end; ++n) {
    quant_dequantize_row_portable(b.fmt, b.w + n * b.w_stride, b.K, row.data());
    for (int64_t m = 0; m < b.M; ++m) {
      // Sums in double (as skinny_linear's portable path): this path is for correctness.
      double acc = 0.0;
      const float* xm = b.x + m * b.x_stride;
      for (int64_t k = 0; k < b.K; ++k) acc += static_cast<double>(xm[k]) * row[k];
      if (b.bias) acc += b.bias[n];
      b.y[m * b.y_stride + n] = static_cast<float>(acc);
    }
  }
}

// The integer form of a 32-weight-format row (quant_isa.h, INT8 activations): w[k] =
// scale[k / 16] * wq[k] + mn[k / 32], every value exact.
void int8_parts_portable(QuantFmt fmt, const uint8_t* p, int64_t K, int32_t* wq, float* scale,
                         float* mn) {
  for (int64_t b = 0; b < K / 32; ++b) mn[b] = 0.0f;
  switch (fmt) {
    case QuantFmt::Q4_0:
    case QuantFmt::Q4_1:
    case QuantFmt::Q5_0:
    case QuantFmt::Q5_1:
    case QuantFmt::Q8_0: {
      QuantFormatInfo info{};
      quant_format_info(static_cast<int>(fmt), &info);
      const int64_t nbytes = info.block_bytes;
      for (int64_t k = 0; k < K; k += 32, p += nbytes) {
        const float d = load_f16(p);
        scale[k / 16] = scale[k / 16 + 1] = d;
        for (int j = 0; j < 32; ++j) {
          int q;
          if (fmt == QuantFmt::Q8_0) {
            q = static_cast<int8_t>(p[2 + j]);
          } else {
            const uint8_t* qs = p + (fmt == QuantFmt::Q4_0   ? 2
                                     : fmt == QuantFmt::Q4_1 ? 4
                                     : fmt == QuantFmt::Q5_0 ? 6
                                                             : 8);
            q = (qs[j % 16] >> (4 * (j / 16))) & 15;
            if (fmt == QuantFmt::Q4_0) q -= 8;
            if (fmt == QuantFmt::Q5_0 || fmt == QuantFmt::Q5_1) {
              uint32_t qh;
              std::memcpy(&qh, p + (fmt == QuantFmt::Q5_0 ? 2 : 4), 4);
              q |= static_cast<int>((qh >> j) & 1) << 4;
              if (fmt == QuantFmt::Q5_0) q -= 16;
            }
          }
          wq[k + j] = q;
        }
        if (fmt == QuantFmt::Q4_1 || fmt == QuantFmt::Q5_1) mn[k / 32] = load_f16(p + 2);
      }
      break;
    }
    default:  // K formats: k_parts_portable
      break;
  }
}

// The integer form of a K-format weight row (quant_isa.h): wq [K] (q, or q - 32 for Q6_K),
// isc [K / 16] the integer scale of each 16 weights (Q4_K / Q5_K: the sub-block's 6-bit sc
// twice), d [K / 256] the block's fp16 d, minf [K / 32] -dmin * mn (exact; 0 for Q6_K).
void k_parts_portable(QuantFmt fmt, const uint8_t* p, int64_t K, int32_t* wq, int32_t* isc,
                      float* d, float* minf) {
  switch (fmt) {
    case QuantFmt::Q4_K:
    case QuantFmt::Q5_K: {
      const bool fifth = fmt == QuantFmt::Q5_K;
      for (int64_t k = 0; k < K; k += 256, p += fifth ? 176 : 144) {
        const float dmin = load_f16(p + 2);
        d[k / 256] = load_f16(p);
        const uint8_t* qh = p + 16;
        const uint8_t* qs = p + (fifth ? 48 : 16);
        for (int s = 0; s < 8; ++s) {
          int sc, m;
          k_scale_min(p + 4, s, &sc, &m);
          isc[(k + 32 * s) / 16] = isc[(k + 32 * s) / 16 + 1] = sc;
          minf[(k + 32 * s) / 32] = -(dmin * static_cast<float>(m));
          for (int l = 0; l < 32; ++l) {
            int q = (qs[32 * (s / 2) + l] >> (4 * (s % 2))) & 15;
            if (fifth) q |= ((qh[l] >> s) & 1) << 4;
            wq[k + 32 * s + l] = q;
          }
        }
      }
      break;
    }
    case QuantFmt::Q6_K:
      for (int64_t k = 0; k < K; k += 256, p += 210) {
        const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
        d[k / 256] = load_f16(p + 208);
        for (int i = 0; i < 16; ++i) isc[k / 16 + i] = sc[i];
        for (int s = 0; s < 8; ++s) minf[k / 32 + s] = 0.0f;
        for (int g = 0; g < 8; ++g) {
          const int h = g / 4, t = g % 4;
          for (int l = 0; l < 32; ++l) {
            const int lo = (p[64 * h + 32 * (t % 2) + l] >> (4 * (t / 2))) & 15;
            const int hi = (p[128 + 32 * h + l] >> (2 * t)) & 3;
            wq[k + 32 * g + l] = (lo | hi << 4) - 32;
          }
        }
      }
      break;
    default:  // 32-weight formats: int8_parts_portable
      break;
  }
}

// The K formats' INT8 definition (quant_isa.h) with the integer block sums in int32 and the
// rest in double.
void quant_linear_int8k_portable(const QuantLinearInt8Block& b) {
  const QuantizedXK& X = b.xk;
  const int64_t K = X.K;
  thread_local std::vector<int32_t> wq, isc;
  thread_local std::vector<float> dw, minf;
  wq.resize(static_cast<size_t>(K));
  isc.resize(static_cast<size_t>(K / 16));
  dw.resize(static_cast<size_t>(K / 256));
  minf.resize(static_cast<size_t>(K / 32));
  for (int64_t n = b.n_begin; n < b.n_end; ++n) {
    k_parts_portable(b.fmt, b.w + n * b.w_stride, K, wq.data(), isc.data(), dw.data(), minf.data());
    for (int64_t m = 0; m < X.M; ++m) {
      const int8_t* q = X.q + m * K;
      double acc = 0.0;
      for (int64_t k = 0; k < K; k += 256) {
        const double dx = X.d[m * (K / 256) + k / 256];
        int32_t block = 0;
        for (int64_t g = k / 16; g < (k + 256) / 16; ++g) {
          int32_t dot = 0;
          for (int j = 0; j < 16; ++j) dot += wq[16 * g + j] * q[16 * g + j];
          block += isc[g] * dot;
        }
        acc += static_cast<double>(dw[k / 256]) * dx * block;
        for (int64_t s = k / 32; s < (k + 256) / 32; ++s) {
          int32_t sum = 0;
          for (int j = 0; j < 32; ++j) sum += q[32 * s + j];
          acc += static_cast<double>(minf[s]) * dx * sum;
        }
      }
      if (b.bias) acc += b.bias[n];
      b.y[m * b.y_stride + n] = static_cast<float>(acc);
    }
  }
}

void quant_linear_int8_portable(const QuantLinearInt8Block& b) {
  if (is_k_format(b.fmt)) {
    quant_linear_int8k_portable(b);
    return;
  }
  const int64_t K = b.x.K, lanes = b.x.Kp / 4;
  thread_local std::vector<int32_t> wq;
  thread_local std::vector<float> scale, mn;
  wq.resize(static_cast<size_t>(K));
  scale.resize(static_cast<size_t>(K / 16));
  mn.resize(static_cast<size_t>(K / 32));
  for (int64_t n = b.n_begin; n < b.n_end; ++n) {
    int8_parts_portable(b.fmt, b.w + n * b.w_stride, K, wq.data(), scale.data(), mn.data());
    for (int64_t m = 0; m < b.x.M; ++m) {
      const int8_t* q = b.x.q + m * b.x.Kp;
      const float* d = b.x.d + m * lanes;
      double acc = 0.0;
      for (int64_t k = 0; k < K; k += 32) {
        const double dx = d[k / 4];
        int32_t dot0 = 0, dot1 = 0, sum = 0;
        for (int j = 0; j < 16; ++j) dot0 += wq[k + j] * q[k + j];
        for (int j = 16; j < 32; ++j) dot1 += wq[k + j] * q[k + j];
        for (int j = 0; j < 32; ++j) sum += q[k + j];
        acc += static_cast<double>(scale[k / 16]) * dx * dot0;
        acc += static_cast<double>(scale[k / 16 + 1]) * dx * dot1;
        acc += static_cast<double>(mn[k / 32]) * dx * sum;
      }
      if (b.bias) acc += b.bias[n];
      b.y[m * b.y_stride + n] = static_cast<float>(acc);
    }
  }
}

namespace {

// Rows [m_begin, m_end) of x [M, K] fp32 quantized into X's buffers (quant_isa.h's definition;
// the reference, quant_linear_ref(activation=INT8), rounds the same way).
void quantize_x_rows(const float* x, int64_t K, int offset, int64_t Kp, int8_t* q, float* d,
                     float* d_sum, int32_t* neg_offset_sum, int64_t m_begin, int64_t m_end) {
  for (int64_t m = m_begin; m < m_end; ++m) {
    const float* xm = x + m * K;
    int8_t* qm = q + m * Kp;
    for (int64_t k = 0; k < Kp; k += 32) {
      float amax = 0.0f;
      if (k < K)
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xm[k + j]));
      const float dk = amax / 127.0f;
      for (int j = 0; j < 32; ++j) {
        float v = 0.0f;
        if (k < K && dk != 0.0f)
          v = std::min(127.0f, std::max(-127.0f, std::nearbyint(xm[k + j] / dk)));
        qm[k + j] = static_cast<int8_t>(v);
      }
      for (int64_t l = k / 4; l < (k + 32) / 4; ++l) {
        const int32_t s = qm[4 * l] + qm[4 * l + 1] + qm[4 * l + 2] + qm[4 * l + 3];
        d[m * (Kp / 4) + l] = dk;
        d_sum[m * (Kp / 4) + l] = dk * static_cast<float>(s);
        neg_offset_sum[m * (Kp / 4) + l] = -offset * s;
      }
    }
  }
}

// Rows [m_begin, m_end) of x [M, K] fp32 quantized in 256-value blocks (the K formats;
// QuantizedXK), the rounding as quantize_x_rows.
void quantize_xk_rows(const float* x, int64_t K, int8_t* q, float* d, float* d_bsum32,
                      int16_t* bsum16, int16_t* bsum32, int64_t m_begin, int64_t m_end) {
  for (int64_t m = m_begin; m < m_end; ++m) {
    const float* xm = x + m * K;
    int8_t* qm = q + m * K;
    for (int64_t k = 0; k < K; k += 256) {
      float amax = 0.0f;
      for (int j = 0; j < 256; ++j) amax = std::max(amax, std::fabs(xm[k + j]));
      const float dk = amax / 127.0f;
      d[m * (K / 256) + k / 256] = dk;
      for (int j = 0; j < 256; ++j) {
        float v = 0.0f;
        if (dk != 0.0f) v = std::min(127.0f, std::max(-127.0f, std::nearbyint(xm[k + j] / dk)));
        qm[k + j] = static_cast<int8_t>(v);
      }
      for (int64_t g = k / 16; g < (k + 256) / 16; ++g) {
        int32_t s = 0;
        for (int j = 0; j < 16; ++j) s += qm[16 * g + j];
        bsum16[m * (K / 16) + g] = static_cast<int16_t>(s);
      }
      for (int64_t s = k / 32; s < (k + 256) / 32; ++s) {
        const int32_t sum = bsum16[m * (K / 16) + 2 * s] + bsum16[m * (K / 16) + 2 * s + 1];
        bsum32[m * (K / 32) + s] = static_cast<int16_t>(sum);
        d_bsum32[m * (K / 32) + s] = dk * static_cast<float>(sum);
      }
    }
  }
}

Isa quant_path() {
#ifdef SPECDEC_BUILT_AVX512
  if (active_isa() >= Isa::AVX512) return Isa::AVX512;
#endif
#ifdef SPECDEC_BUILT_AVX2
  if (active_isa() >= Isa::AVX2) return Isa::AVX2;
#endif
  return Isa::PORTABLE;
}

// The INT8 path of `fmt`: the VNNI kernels where they were built, the CPU has avx512_vnni and
// AVX-512 or better is active; for the K formats the AVX2 kernel where AVX2 or better is active
// otherwise; the portable loops else (also what _C.quant_int8_path(fmt) reports).
// The repacked layouts have no AVX2 kernel (the loader repacks only where VNNI runs).
Isa quant_int8_path(QuantFmt fmt) {
#ifdef SPECDEC_BUILT_AVX512VNNI
  if (active_isa() >= Isa::AVX512 && cpu_has_avx512_vnni()) return Isa::AVX512;
#endif
#ifdef SPECDEC_BUILT_AVX2
  if (is_k_format(fmt) && active_isa() >= Isa::AVX2) return Isa::AVX2;
#endif
  (void)fmt;
  return Isa::PORTABLE;
}

using DequantizeRowFn = void (*)(QuantFmt, const uint8_t*, int64_t, float*);

DequantizeRowFn dequantize_row_for(Isa isa) {
#ifdef SPECDEC_BUILT_AVX512
  if (isa == Isa::AVX512) return quant_dequantize_row_avx512;
#endif
#ifdef SPECDEC_BUILT_AVX2
  if (isa == Isa::AVX2) return quant_dequantize_row_avx2;
#endif
  (void)isa;
  return quant_dequantize_row_portable;
}

QuantFormatInfo check_fmt(int64_t fmt, const std::string& name = "fmt") {
  QuantFormatInfo info{};
  TORCH_CHECK_VALUE(fmt >= 0 && fmt < 512 && quant_format_info(static_cast<int>(fmt), &info),
                    "argument '", name, "' must be a supported ggml type id (Q4_0=2, Q4_1=3, "
                    "Q5_0=6, Q5_1=7, Q8_0=8, Q4_K=12, Q5_K=13, Q6_K=14) or repacked layout (256 + "
                    "the id of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K or Q6_K), got ", fmt);
  return info;
}

// weight: uint8 [N, row_bytes] (a repacked layout: [N / 16, 16 * row_bytes]), each row's bytes
// dense (stride(1) == 1; any row stride), never written. Returns K implied by row_bytes.
int64_t check_weight(const at::Tensor& weight, const QuantFormatInfo& info,
                     const std::string& name = "weight") {
  check_cpu(weight, name.c_str());
  TORCH_CHECK_TYPE(weight.scalar_type() == at::kByte, "argument '", name,
                   "' must be uint8 (the GGUF tensor's bytes), got ", weight.scalar_type());
  check_dim(weight, 2, name.c_str());
  const int64_t unit = info.block_bytes * info.group_rows;
  TORCH_CHECK_VALUE(weight.size(1) % unit == 0, "argument '", name,
                    "' must have a whole number of ", unit,
                    "-byte blocks per row for this fmt, got shape ", weight.sizes());
  TORCH_CHECK_VALUE(weight.size(1) <= 1 || weight.size(0) == 0 || weight.stride(1) == 1,
                    "argument '", name,
                    "' must have contiguous rows (stride(1) == 1), got strides ", weight.strides());
  TORCH_CHECK_VALUE(weight.size(0) <= 1 || weight.stride(0) >= weight.size(1), "argument '", name,
                    "' must have non-overlapping rows (stride(0) >= row bytes ", weight.size(1),
                    "), got strides ", weight.strides());
  return weight.size(1) / unit * info.block_size;
}

// Items (rows, or blocks of rows of `item_bytes` weight bytes) per parallel chunk: ~256 KiB of
// weights divided by the rows of x (tens of microseconds of work per chunk at M = 1), so a small
// matrix stays on the calling thread: on a loaded machine an OpenMP barrier can wait a whole
// scheduler slice (~10 ms) for a descheduled worker (see common.h).
int64_t row_grain(int64_t item_bytes, int64_t M) {
  return std::max<int64_t>(
      1, (int64_t{1} << 18) / std::max<int64_t>(1, item_bytes * std::max<int64_t>(1, M)));
}

// One weight of a quant_linear / quant_linear_cat call, checked (check_member): its output
// features are columns [col, col + N) of y.
struct LinearMember {
  QuantFmt fmt;
  const uint8_t* w;
  int64_t w_stride, row_bytes, N, col;
  at::Tensor bias;  // [N] fp32, or undefined
};

// Output rows of a member per work item: 8, or a repacked layout's 16-row group.
int64_t row_block(QuantFmt fmt) { return is_repacked(fmt) ? kRepackRows : 8; }

// The row blocks of all members end to end, split across threads in ONE parallel region:
// fn(i, n_begin, n_end) for each part of a chunk that lies in member i (n counts member i's
// rows; every part starts on one of its row blocks, as with one member). The chunk is sized by
// row_grain of the members' mean block bytes, so one member splits as quant_linear always has.
template <class Fn>
void for_member_blocks(const std::vector<LinearMember>& members, int64_t M, const Fn& fn) {
  std::vector<int64_t> first(members.size() + 1, 0);  // first block of each member
  int64_t bytes = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    const int64_t rb = row_block(members[i].fmt), blocks = (members[i].N + rb - 1) / rb;
    first[i + 1] = first[i] + blocks;
    bytes += blocks * rb * members[i].row_bytes;
  }
  const int64_t blocks = first.back();
  if (blocks == 0) return;
  at::parallel_for(0, blocks, row_grain(bytes / blocks, M), [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < members.size(); ++i) {
      const int64_t b = std::max(begin, first[i]), e = std::min(end, first[i + 1]);
      if (b >= e) continue;
      const int64_t rb = row_block(members[i].fmt);
      fn(i, (b - first[i]) * rb, std::min(members[i].N, (e - first[i]) * rb));
    }
  });
}

// Rows of x per parallel chunk of the activation quantization (~64 Ki values).
int64_t quantize_grain(int64_t K) { return std::max<int64_t>(1, (int64_t{1} << 16) / K); }

// x2 [M, K] quantized in 32-value blocks (the 32-weight formats) into per-thread buffers that
// only grow (a decode step calls this ~200 times: no allocation per call). Workers of the
// parallel regions of the same call only read them.
QuantizedX quantize_x(const at::Tensor& x2, QuantFmt fmt, Isa isa) {
  const int64_t M = x2.size(0), K = x2.size(1);
  const int64_t Kp = (K + 63) / 64 * 64;
  const int offset = int8_weight_offset(fmt);
  thread_local std::vector<int8_t> q_buf;
  thread_local std::vector<float> f_buf;
  thread_local std::vector<int32_t> neg_buf;
  const int64_t lanes = M * (Kp / 4);
  q_buf.resize(static_cast<size_t>(M * Kp));
  f_buf.resize(static_cast<size_t>(2 * lanes));
  neg_buf.resize(static_cast<size_t>(lanes));
  int8_t* q = q_buf.data();                  // [M, Kp]
  float* d = f_buf.data();                   // [M, Kp/4]
  float* d_sum = d + lanes;                  // [M, Kp/4]
  int32_t* neg_offset_sum = neg_buf.data();  // [M, Kp/4]
  const float* x = x2.const_data_ptr<float>();
  at::parallel_for(0, M, quantize_grain(K), [&](int64_t begin, int64_t end) {
#ifdef SPECDEC_BUILT_AVX512VNNI
    if (isa == Isa::AVX512) {
      quant_quantize_x_avx512vnni(x, K, offset, Kp, q, d, d_sum, neg_offset_sum, begin, end);
      return;
    }
#endif
    (void)isa;
    quantize_x_rows(x, K, offset, Kp, q, d, d_sum, neg_offset_sum, begin, end);
  });
  return {M, K, Kp, q, d, d_sum, neg_offset_sum};
}

// x2 [M, K] quantized in 256-value blocks (the K formats), buffers as quantize_x.
QuantizedXK quantize_xk(const at::Tensor& x2, Isa isa) {
  const int64_t M = x2.size(0), K = x2.size(1);
  thread_local std::vector<int8_t> q_buf;
  thread_local std::vector<float> f_buf;
  thread_local std::vector<int16_t> s_buf;
  q_buf.resize(static_cast<size_t>(M * K));
  f_buf.resize(static_cast<size_t>(M * (K / 256 + K / 32)));
  s_buf.resize(static_cast<size_t>(M * (K / 16 + K / 32)));
  int8_t* q = q_buf.data();                 // [M, K]
  float* d = f_buf.data();                  // [M, K/256]
  float* d_bsum32 = d + M * (K / 256);      // [M, K/32]
  int16_t* bsum16 = s_buf.data();           // [M, K/16]
  int16_t* bsum32 = bsum16 + M * (K / 16);  // [M, K/32]
  const float* x = x2.const_data_ptr<float>();
  at::parallel_for(0, M, quantize_grain(K), [&](int64_t begin, int64_t end) {
#ifdef SPECDEC_BUILT_AVX512VNNI
    if (isa == Isa::AVX512) {
      quant_quantize_xk_avx512vnni(x, K, q, d, d_bsum32, bsum16, bsum32, begin, end);
      return;
    }
#endif
    (void)isa;
    quantize_xk_rows(x, K, q, d, d_bsum32, bsum16, bsum32, begin, end);
  });
  return {M, K, q, d, d_bsum32, bsum16, bsum32};
}

// The FLOAT kernel of one row block on path `isa` (quant_path()).
void run_float_block(const QuantLinearBlock& part, Isa isa) {
#ifdef SPECDEC_BUILT_AVX512
  if (isa == Isa::AVX512) {
    quant_linear_avx512(part);
    return;
  }
#endif
#ifdef SPECDEC_BUILT_AVX2
  if (isa == Isa::AVX2) {
    quant_linear_avx2(part);
    return;
  }
#endif
  (void)isa;
  quant_linear_portable(part);
}

// The INT8 kernel of one row block on path `isa` (quant_int8_path(part.fmt)).
void run_int8_block(const QuantLinearInt8Block& part, Isa isa) {
  const bool repacked = is_repacked(part.fmt);
#ifdef SPECDEC_BUILT_AVX512VNNI
  if (isa == Isa::AVX512) {
    if (repacked)
      quant_linear_int8_r16_avx512vnni(part);
    else
      quant_linear_int8_avx512vnni(part);
    return;
  }
#endif
  if (repacked) {
    quant_linear_int8_r16_portable(part);
    return;
  }
#ifdef SPECDEC_BUILT_AVX2
  if (isa == Isa::AVX2) {
    quant_linear_int8k_avx2(part);
    return;
  }
#endif
  quant_linear_int8_portable(part);
}

// y [M, sum N] = x2 [M, K] W_i^T + b_i of every member with FLOAT activations. Returns the path.
Isa linear_float(const at::Tensor& x2, const std::vector<LinearMember>& members, at::Tensor& y) {
  const Isa isa = quant_path();
  const int64_t M = x2.size(0), K = x2.size(1);
  for_member_blocks(members, M, [&](size_t i, int64_t n_begin, int64_t n_end) {
    const LinearMember& mb = members[i];
    run_float_block({mb.fmt, M, K, x2.const_data_ptr<float>(), K, mb.w, mb.w_stride,
                     mb.bias.defined() ? mb.bias.const_data_ptr<float>() : nullptr,
                     y.data_ptr<float>() + mb.col, y.size(1), n_begin, n_end},
                    isa);
  });
  return isa;
}

// X with the lane sums of another weight offset (quant_isa.h) in `buf`: the exact integers
// quantize_x gives for a format of that offset (the quants do not depend on it).
QuantizedX with_offset(const QuantizedX& X, int offset, std::vector<int32_t>& buf) {
  const int64_t lanes = X.M * (X.Kp / 4);
  buf.resize(static_cast<size_t>(lanes));
  for (int64_t l = 0; l < lanes; ++l) {
    const int8_t* q = X.q + 4 * l;
    buf[l] = -offset * (q[0] + q[1] + q[2] + q[3]);
  }
  QuantizedX out = X;
  out.neg_offset_sum = buf.data();
  return out;
}

// y [M, sum N] = x2 [M, K] W_i^T + b_i of every member with INT8 activations (quant_isa.h). x2 is
// quantized once per block kind the members need (256 values for the K formats, 32 for the
// others, whose lane sums follow each weight offset), then every member's row blocks run in one
// parallel region. Returns the slowest member's path.
Isa linear_int8(const at::Tensor& x2, const std::vector<LinearMember>& members, at::Tensor& y) {
  thread_local std::map<int, std::vector<int32_t>> offset_bufs;  // only grow
  std::optional<QuantizedXK> xk;
  std::map<int, QuantizedX> x_by_offset;
  std::vector<QuantLinearInt8Block> blks;
  std::vector<Isa> isas;
  Isa slowest = Isa::AMX;
  for (const LinearMember& mb : members) {
    const Isa isa = quant_int8_path(mb.fmt);
    QuantLinearInt8Block blk{mb.fmt,
                             {},
                             {},
                             mb.w,
                             mb.w_stride,
                             mb.bias.defined() ? mb.bias.const_data_ptr<float>() : nullptr,
                             y.data_ptr<float>() + mb.col,
                             y.size(1),
                             0,
                             0};
    if (is_k_format(file_format(mb.fmt))) {
      if (!xk) xk = quantize_xk(x2, isa);
      blk.xk = *xk;
    } else {
      const int offset = int8_weight_offset(file_format(mb.fmt));
      if (x_by_offset.empty())
        x_by_offset.emplace(offset, quantize_x(x2, file_format(mb.fmt), isa));
      else if (!x_by_offset.count(offset))
        x_by_offset.emplace(offset,
                            with_offset(x_by_offset.begin()->second, offset, offset_bufs[offset]));
      blk.x = x_by_offset.at(offset);
    }
    blks.push_back(blk);
    isas.push_back(isa);
    slowest = std::min(slowest, isa);
  }
  // The R16 kernel of the 32-weight formats also reads x's block sums (one set for all members).
  const bool small_r16 = std::any_of(members.begin(), members.end(), [](const LinearMember& mb) {
    return is_repacked(mb.fmt) && !is_k_format(file_format(mb.fmt));
  });
  if (small_r16) {
    QuantizedX sums = x_by_offset.begin()->second;
    quant_block_sums(sums);
    for (QuantLinearInt8Block& blk : blks) {
      blk.x.bsum32 = sums.bsum32;
      blk.x.d_sum32 = sums.d_sum32;
    }
  }
  for_member_blocks(members, x2.size(0), [&](size_t i, int64_t n_begin, int64_t n_end) {
    QuantLinearInt8Block part = blks[i];
    part.n_begin = n_begin;
    part.n_end = n_end;
    run_int8_block(part, isas[i]);
  });
  return slowest;
}

void check_activation(int64_t activation) {
  TORCH_CHECK_VALUE(activation == 0 || activation == 1,
                    "argument 'activation' must be a QuantActivation (FLOAT=0, INT8=1), got ",
                    activation);
}

// x [..., K] of quant_linear / quant_linear_cat: float32 or bfloat16, any strides. Returns K.
int64_t check_x(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                   "argument 'x' must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1, "argument 'x' must have at least 1 dimension, got a scalar");
  return x.size(-1);
}

// The names a member's arguments go by in error messages.
struct MemberNames {
  std::string weight, fmt, bias;
};

// One (weight, fmt, bias) against x [..., K] (checked by check_x) and the activation: the
// member whose columns start at `col`.
LinearMember check_member(const at::Tensor& x, int64_t K, const at::Tensor& weight, int64_t fmt,
                          const std::optional<at::Tensor>& bias, int64_t activation, int64_t col,
                          const MemberNames& names) {
  const QuantFormatInfo info = check_fmt(fmt, names.fmt);
  TORCH_CHECK_VALUE(
      K % info.block_size == 0,
      "argument 'x' must have a last dimension (K) that is a multiple of the block size of '",
      names.fmt, "' (", info.block_size, "), got ", K);
  const int64_t row_bytes = K / info.block_size * info.block_bytes;  // of one weight row
  const int64_t G = info.group_rows;
  check_cpu(weight, names.weight.c_str());
  TORCH_CHECK_VALUE(weight.dim() == 2 && weight.size(1) == G * row_bytes, "argument '",
                    names.weight, "' must have shape [", G > 1 ? "N / 16" : "N", ", ",
                    G * row_bytes, "] (the bytes of K = ", K, " weights in this fmt), got ",
                    weight.sizes());
  check_weight(weight, info, names.weight);
  TORCH_CHECK_VALUE(G == 1 || activation == 1,
                    "argument 'activation' must be INT8 (1) for the repacked fmt ", fmt, " ('",
                    names.fmt, "', its only kernel), got ", activation);
  const int64_t N = weight.size(0) * G;
  at::Tensor b32;  // [N] fp32
  if (bias.has_value()) {
    check_cpu(*bias, names.bias.c_str());
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "argument '", names.bias,
                     "' must have x's dtype ", x.scalar_type(), ", got ", bias->scalar_type());
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, "argument '", names.bias,
                      "' must have shape [", N, "], got ", bias->sizes());
    b32 = bias->to(at::kFloat).contiguous();
  }
  return {static_cast<QuantFmt>(fmt),
          static_cast<const uint8_t*>(weight.const_data_ptr()),
          weight.size(0) > 1 ? weight.stride(0) : weight.size(1),
          row_bytes,
          N,
          col,
          b32};
}

// y [..., sum N] (x's dtype): every member's x W^T + b side by side. Sets *ran to the path
// that ran (linear_float / linear_int8), leaves it empty when no kernel ran (no rows, no
// outputs or K = 0).
at::Tensor run_members(const at::Tensor& x, int64_t K, const std::vector<LinearMember>& members,
                       int64_t activation, std::optional<Isa>* ran) {
  const int64_t N = members.back().col + members.back().N;
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  int64_t rows = 1;  // M
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  const at::Tensor x2 = x.reshape({rows, K}).to(at::kFloat).contiguous();  // [M, K] fp32
  at::Tensor y = at::empty({rows, N}, x.options().dtype(at::kFloat));      // [M, N] fp32
  if (rows > 0 && N > 0) {
    if (K == 0) {
      for (const LinearMember& mb : members) {
        at::Tensor cols = y.narrow(1, mb.col, mb.N);
        if (mb.bias.defined())
          cols.copy_(mb.bias.unsqueeze(0).expand({rows, mb.N}));
        else
          cols.zero_();
      }
    } else {
      *ran = activation == 1 ? linear_int8(x2, members, y) : linear_float(x2, members, y);
    }
  }
  // A bf16 result is rounded once, from the fp32 sum (bias included).
  if (x.scalar_type() != at::kFloat) y = y.to(x.scalar_type());
  return y.view(out_shape);
}

at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& weight, int64_t fmt,
                        const std::optional<at::Tensor>& bias, int64_t activation) {
  check_activation(activation);
  const int64_t K = check_x(x);
  const std::vector<LinearMember> members{
      check_member(x, K, weight, fmt, bias, activation, 0, {"weight", "fmt", "bias"})};
  std::optional<Isa> ran;
  at::Tensor y = run_members(x, K, members, activation, &ran);
  if (ran) {
    if (activation == 0)
      SPECDEC_RECORD_PATH("quant_linear", *ran);
    else if (is_repacked(members[0].fmt))
      SPECDEC_RECORD_PATH("quant_linear_int8_r16", *ran);
    else
      SPECDEC_RECORD_PATH("quant_linear_int8", *ran);
  }
  return y;
}

// quant_linear of each (weights[i], fmts[i], biases[i]) against x, side by side: x quantized
// once (INT8) and all members' row blocks in one parallel region; each output value bitwise
// quant_linear's for that member alone (same kernels on the same rows).
at::Tensor quant_linear_cat(const at::Tensor& x, at::TensorList weights, at::IntArrayRef fmts,
                            const c10::List<std::optional<at::Tensor>>& biases,
                            int64_t activation) {
  check_activation(activation);
  const int64_t K = check_x(x);
  TORCH_CHECK_VALUE(!weights.empty(), "argument 'weights' must hold at least one weight");
  TORCH_CHECK_VALUE(fmts.size() == weights.size(),
                    "argument 'fmts' must have one entry per weight (", weights.size(), "), got ",
                    fmts.size());
  TORCH_CHECK_VALUE(biases.size() == weights.size(),
                    "argument 'biases' must have one entry per weight (", weights.size(), "), got ",
                    biases.size());
  std::vector<LinearMember> members;
  int64_t col = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const std::string at = "[" + std::to_string(i) + "]";
    members.push_back(check_member(x, K, weights[i], fmts[i], biases.get(i), activation, col,
                                   {"weights" + at, "fmts" + at, "biases" + at}));
    col += members.back().N;
  }
  std::optional<Isa> ran;
  at::Tensor y = run_members(x, K, members, activation, &ran);
  if (ran) {
    if (activation == 0)
      SPECDEC_RECORD_PATH("quant_linear_cat", *ran);
    else
      SPECDEC_RECORD_PATH("quant_linear_cat_int8", *ran);
  }
  return y;
}

// Rows `ids` (all rows when ids is null) of the dequantized weight into out [R, K] fp32 (ids
// already range-checked). Returns the path that ran.
// A repacked layout gives each row back in the file's bytes first.
Isa dequantize_rows(const at::Tensor& weight, int64_t fmt, int64_t K, const int64_t* ids, int64_t R,
                    float* out) {
  const Isa isa = quant_path();
  const DequantizeRowFn fn = dequantize_row_for(isa);
  const QuantFmt f = static_cast<QuantFmt>(fmt), base = file_format(f);
  const uint8_t* w = static_cast<const uint8_t*>(weight.const_data_ptr());
  const int64_t ws = weight.size(0) > 1 ? weight.stride(0) : weight.size(1);
  const int64_t G = is_repacked(f) ? kRepackRows : 1, row_bytes = weight.size(1) / G;
  at::parallel_for(0, R, row_grain(row_bytes, 1), [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint8_t> file_row;
    file_row.resize(static_cast<size_t>(row_bytes));
    for (int64_t r = begin; r < end; ++r) {
      const int64_t n = ids ? ids[r] : r;
      if (G == 1) {
        fn(f, w + n * ws, K, out + r * K);
      } else {
        quant_unpack_group_row(base, w + (n / G) * ws, K, static_cast<int>(n % G), file_row.data());
        fn(base, file_row.data(), K, out + r * K);
      }
    }
  });
  return isa;
}

at::Tensor quant_dequantize(const at::Tensor& weight, int64_t fmt) {
  const QuantFormatInfo info = check_fmt(fmt);
  const int64_t K = check_weight(weight, info), N = weight.size(0) * info.group_rows;
  at::Tensor out = at::empty({N, K}, weight.options().dtype(at::kFloat));  // [N, K]
  if (N > 0 && K > 0) {
    SPECDEC_RECORD_PATH("quant_dequantize",
                        dequantize_rows(weight, fmt, K, nullptr, N, out.data_ptr<float>()));
  }
  return out;
}

at::Tensor quant_embedding(const at::Tensor& ids, const at::Tensor& weight, int64_t fmt,
                           std::optional<at::ScalarType> dtype) {
  const QuantFormatInfo info = check_fmt(fmt);
  check_cpu(ids, "ids");
  TORCH_CHECK_TYPE(ids.scalar_type() == at::kInt || ids.scalar_type() == at::kLong,
                   "argument 'ids' must be int32 or int64, got ", ids.scalar_type());
  const int64_t K = check_weight(weight, info), N = weight.size(0) * info.group_rows;
  const at::ScalarType out_dtype = dtype.value_or(at::kFloat);
  TORCH_CHECK_TYPE(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
                   "argument 'dtype' must be float32 or bfloat16, got ", out_dtype);
  const at::Tensor flat = ids.reshape({-1}).to(at::kLong).contiguous();  // [R]
  const int64_t R = flat.numel();
  const int64_t* id = flat.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK_INDEX(id[r] >= 0 && id[r] < N, "argument 'ids' must hold values in [0, ", N,
                      ") (rows of 'weight'), got ", id[r], " at flat position ", r);
  }
  std::vector<int64_t> out_shape(ids.sizes().begin(), ids.sizes().end());
  out_shape.push_back(K);
  at::Tensor out = at::empty({R, K}, weight.options().dtype(at::kFloat));  // [R, K]
  if (R > 0 && K > 0) {
    SPECDEC_RECORD_PATH("quant_embedding",
                        dequantize_rows(weight, fmt, K, id, R, out.data_ptr<float>()));
  }
  if (out_dtype != at::kFloat) out = out.to(out_dtype);
  return out.view(out_shape);
}

// A file-layout weight [N, row_bytes] of a format with a repacked layout (N a multiple of 16,
// K of 64 for the 32-weight formats) -> that layout [N / 16, 16 * row_bytes]; a repacked weight
// -> the file's rows [N, row_bytes], bitwise the bytes it was made from. The source is read
// once, group by group.
at::Tensor quant_repack(const at::Tensor& weight, int64_t fmt) {
  const QuantFormatInfo info = check_fmt(fmt);
  const QuantFmt f = static_cast<QuantFmt>(fmt), base = file_format(f);
  TORCH_CHECK_VALUE(
      repacked_format(base) != base,
      "argument 'fmt' must be one of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K (2, 3, 6, 7, 8, 12, 14) or their repacked layout (256 + the id), got ",
      fmt);
  const int64_t K = check_weight(weight, info);
  TORCH_CHECK_VALUE(K % repack_k_unit(base) == 0, "argument 'weight' must hold a multiple of ",
                    repack_k_unit(base), " weights per row to repack, got ", K);
  const int64_t G = kRepackRows, rows = weight.size(0);
  TORCH_CHECK_VALUE(is_repacked(f) || rows % G == 0, "argument 'weight' must have a multiple of ",
                    G, " rows to repack, got ", rows);
  const uint8_t* src = static_cast<const uint8_t*>(weight.const_data_ptr());
  const int64_t ws = rows > 1 ? weight.stride(0) : weight.size(1);
  QuantFormatInfo file_info{}, packed_info{};
  quant_format_info(static_cast<int>(base), &file_info);
  quant_format_info(static_cast<int>(repacked_format(base)), &packed_info);
  const int64_t file_row = K / file_info.block_size * file_info.block_bytes,
                group_bytes = G * K / packed_info.block_size * packed_info.block_bytes;
  const int64_t groups = is_repacked(f) ? rows : rows / G;
  at::Tensor out =
      is_repacked(f)
          ? at::empty({rows * G, file_row}, weight.options())    // [N, row_bytes]
          : at::empty({groups, group_bytes}, weight.options());  // [N / 16, 16 * row_bytes']
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups,
                   std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(1, group_bytes)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      if (is_repacked(f)) {
        for (int r = 0; r < G; ++r)
          quant_unpack_group_row(base, src + g * ws, K, r, dst + (g * G + r) * file_row);
      } else {
        quant_repack_group(base, src + g * G * ws, ws, K, dst + g * group_bytes);
      }
    }
  });
  return out;
}

}  // namespace

void bind_quant(pybind11::module& m) {
  m.def(
      "quant_int8_path",
      [](int64_t fmt) {
    check_fmt(fmt);
    return std::string(isa_name(quant_int8_path(static_cast<QuantFmt>(fmt))));
  }, pybind11::arg("fmt"),
      "Path of quant_linear with INT8 activations for ggml type `fmt` now: 'avx512' (VNNI), 'avx2' (K formats) or 'portable'.");
}

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def(
      "quant_linear(Tensor x, Tensor weight, int fmt, Tensor? bias=None, int activation=0) -> Tensor");
  m.def("quant_embedding(Tensor ids, Tensor weight, int fmt, ScalarType? dtype=None) -> Tensor");
  m.def("quant_dequantize(Tensor weight, int fmt) -> Tensor");
  m.def("quant_repack(Tensor weight, int fmt) -> Tensor");
  m.def(
      "quant_linear_cat(Tensor x, Tensor[] weights, int[] fmts, Tensor?[] biases, int activation=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("quant_embedding", &quant_embedding);
  m.impl("quant_dequantize", &quant_dequantize);
  m.impl("quant_repack", &quant_repack);
  m.impl("quant_linear_cat", &quant_linear_cat);
}

}  // namespace specdec
