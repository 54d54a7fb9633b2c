// Attention over the paged KV pool: store_kv, extend_attention (prefill and tree verify),
// decode_attention. Contract: shared/spec/kernels.md section 6; readable references in
// specdec_inductor/ops/reference.py.
// ISA paths: the attention ops cut each call into chunks (request, KV head, query-row block, key
// range) run with at::parallel_for; every query head of a GQA group shares one pass over the KV
// rows. Kernel per call: AMX (attention_amx.cpp) when active_isa() == AMX, q is bf16,
// D % 32 == 0 and a chunk holds at least kAmxMinQueries queries (rows x GQA group; so decode
// with a group of 4 runs AVX-512, where it measured faster); else AVX-512
// (attention_avx512.cpp) when active_isa() >= AVX512 and D allows it (fp32: D % 16 == 0, bf16:
// D % 32 == 0) -- so fp32 on an AMX machine runs AVX-512; else AVX2 (attention_avx2.cpp) when
// active_isa() >= AVX2 and D % 8 == 0; else the portable kernel below. The
// path that ran is recorded per op. Key ranges are split (flash-decoding) and merged here: at
// fixed key indices (every 1024 keys) in calls of up to 64 rows per request, else only when
// there are fewer (request, head, row-block) items than 2x the threads (split_key_ranges).
// Row reproducibility: a verify row (causal, or a tree row whose mask shows its ancestors) runs
// the key sequence its decode step runs -- the prefix, then its ancestors -- in the same 64-key
// blocks and lanes, with key ranges cut at fixed key indices (split_key_ranges), so it equals
// the decode row bit for bit (plan_items; tests/test_attention.py
// test_verify_rows_reproduce_decode_rows_bitwise). The AVX2 kernel has one path for every
// chunk for the same reason.
// Sliding window with a tree mask: a draft's token position is prefix + its depth in the tree
// (derived from the mask: tree_depths), not its row; every kernel applies the same rule through
// query_pos / key_pos (attention_isa.h).
// store_kv is a row copy (portable path only; it converts k/v to the pool's dtype).
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_isa.h"
#include "common.h"

namespace specdec {

bool attention_avx512_supports(AttnDtype dtype, int64_t head_dim) {
  return dtype == AttnDtype::FLOAT32 ? head_dim % 16 == 0 : head_dim % 32 == 0;
}

namespace {

float bf16_to_float(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &w, 4);
  return f;
}

void load_row(const void* base, int64_t offset, AttnDtype dtype, int64_t D, float* out) {
  if (dtype == AttnDtype::FLOAT32) {
    std::memcpy(out, static_cast<const float*>(base) + offset, D * sizeof(float));
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + offset;
    for (int64_t d = 0; d < D; ++d) out[d] = bf16_to_float(p[d]);
  }
}

bool visible(const AttnChunk& c, int64_t t, int64_t p) {
  if (c.window > 0 && key_pos(c, p) <= query_pos(c, t) - c.window) return false;
  if (p < c.prefix) return true;
  const int64_t e = p - c.prefix;
  return c.tree == nullptr ? e <= t : c.tree[t * c.tree_stride + e] != 0;
}

}  // namespace

// Scalar online softmax, one key at a time: the readable version of the chunk contract.
void attention_chunk_portable(const AttnChunk& c) {
  const int64_t D = c.head_dim, M = c.rows * c.heads;
  std::vector<float> q(M * D), k(D), v(D);  // q [M, D]
  for (int64_t m = 0; m < M; ++m) {
    load_row(c.q, (m / c.heads) * c.q_stride_row + (m % c.heads) * c.q_stride_head, c.dtype, D,
             q.data() + m * D);
    c.max[m] = -std::numeric_limits<float>::infinity();
    c.sum[m] = 0.0f;
  }
  std::fill(c.acc, c.acc + M * D, 0.0f);
  // Key p (in slot `slot`) for queries [m0, m1).
  auto key = [&](int64_t p, int64_t slot, int64_t m0, int64_t m1) {
    load_row(c.k, slot * c.k_stride_slot, c.dtype, D, k.data());
    load_row(c.v, slot * c.v_stride_slot, c.dtype, D, v.data());
    for (int64_t m = m0; m < m1; ++m) {
      if (!(c.row_tail != nullptr ? tail_visible(c, m / c.heads, p)
                                  : visible(c, c.row0 + m / c.heads, p))) {
        continue;
      }
      const float* qm = q.data() + m * D;
      float dot = 0.0f;
      for (int64_t d = 0; d < D; ++d) dot += qm[d] * k[d];
      float s = dot * c.scale;
      if (c.logit_cap > 0) s = c.logit_cap * std::tanh(s / c.logit_cap);
      float* acc = c.acc + m * D;
      if (s > c.max[m]) {
        const float alpha = std::exp(c.max[m] - s);
        for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
        c.sum[m] *= alpha;
        c.max[m] = s;
      }
      const float w = std::exp(s - c.max[m]);
      c.sum[m] += w;
      for (int64_t d = 0; d < D; ++d) acc[d] += w * v[d];
    }
  };
  // Row tails (AttnChunk::row_tail): the prefix for every query, then each row's own keys.
  const int64_t shared_end = c.row_tail != nullptr ? std::min(c.key_end, c.tail_from) : c.key_end;
  for (int64_t p = c.key_begin; p < shared_end; ++p) key(p, c.slots[p * c.slot_stride], 0, M);
  for (int64_t r = 0; c.row_tail != nullptr && r < c.rows; ++r) {
    const int64_t end = std::min(c.key_end, c.row_end[r]);
    for (int64_t p = std::max(c.key_begin, c.tail_from); p < end; ++p) {
      key(p, c.row_tail[r][p - c.tail_from], r * c.heads, (r + 1) * c.heads);
    }
  }
}

namespace {

// Rows of one (request, KV head, query-row block); its key range may be split into `splits`.
struct WorkItem {
  int64_t b, g, row0, rows, key_begin, key_end, splits, first_task;
  bool row_tails = false;  // rows of a request planned with row tails (plan_items)
};
struct Task {
  int64_t item, key_begin, key_end;
};

constexpr int64_t kMaxQueriesPerChunk = 128;  // rows * heads of a chunk (acc [M, D] stays in L2)
constexpr int64_t kSplitKeys = 1024;          // key-range cuts (split_key_ranges), a multiple of 64
constexpr int64_t kFixedSplitRows = 64;       // calls of at most this many rows: fixed cuts
constexpr int64_t kAmxMinQueries = 8;         // AMX kernel from this many queries per chunk

void check_pool(const at::Tensor& pool, const char* name) {
  check_cpu(pool, name);
  check_dim(pool, 3, name);
  TORCH_CHECK_VALUE(pool.stride(2) == 1, "argument '", name,
                    "' must be dense in its last (head_dim) dimension, got strides ",
                    pool.strides());
}

AttnDtype attn_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "argument '",
                   name, "' must be float32 or bfloat16, got ", t.scalar_type());
  return t.scalar_type() == at::kFloat ? AttnDtype::FLOAT32 : AttnDtype::BFLOAT16;
}

// Tree mask as uint8 visibility [B, T, T]: a bool QLEN_ONLY mask is used in place, a bit-packed
// one (one integer per query row, bit j = new key j) is expanded into `storage`.
const uint8_t* tree_visibility(const at::Tensor& tree_mask, int64_t bs, int64_t T,
                               at::Tensor& holder, std::vector<uint8_t>& storage) {
  check_cpu(tree_mask, "tree_mask");
  const at::ScalarType st = tree_mask.scalar_type();
  if (st == at::kBool) {
    TORCH_CHECK_VALUE(tree_mask.numel() == bs * T * T,
                      "argument 'tree_mask' (bool QLEN_ONLY) must have B*T*T = ", bs * T * T,
                      " elements, got shape ", tree_mask.sizes());
    holder = tree_mask.contiguous();
    return reinterpret_cast<const uint8_t*>(holder.const_data_ptr<bool>());
  }
  int bits = 0;
  switch (st) {
    case at::kByte: bits = 8; break;
    case at::kShort: bits = 16; break;
    case at::kInt: bits = 32; break;
    case at::kLong: bits = 64; break;
    default:
      TORCH_CHECK_TYPE(
          false,
          "argument 'tree_mask' must be bool (QLEN_ONLY) or a bit-packed uint8/int16/int32/int64, got ",
          st);
  }
  TORCH_CHECK_VALUE(tree_mask.numel() == bs * T,
                    "argument 'tree_mask' (bit-packed) must have B*T = ", bs * T,
                    " elements, got shape ", tree_mask.sizes());
  TORCH_CHECK_VALUE(T <= bits, "argument 'tree_mask' is bit-packed in ", bits,
                    "-bit integers, which hold at most ", bits, " new tokens, but q has T = ", T);
  const at::Tensor flat = tree_mask.to(at::kLong).contiguous();  // [B*T], sign extension keeps bits
  const int64_t* w = flat.const_data_ptr<int64_t>();
  storage.assign(bs * T * T, 0);
  for (int64_t r = 0; r < bs * T; ++r) {
    for (int64_t j = 0; j < T; ++j) storage[r * T + j] = (static_cast<uint64_t>(w[r]) >> j) & 1;
  }
  return storage.data();
}

// Depth of every new token of a tree draft, [B*T]: the number of new tokens its mask row shows,
// minus one (itself). Positions must not run ahead of rows -- depth(e) <= e, which holds for a
// tree whose parents precede their children (SGLang's and ours) -- since the kernels' windowed
// key ranges are cut by index; a mask that breaks this raises.
std::vector<int32_t> tree_depths(const uint8_t* tree, int64_t bs, int64_t T,
                                 const std::vector<int64_t>& extend) {
  std::vector<int32_t> depth(bs * T, 0);
  for (int64_t b = 0; b < bs; ++b) {
    for (int64_t e = 0; e < extend[b]; ++e) {
      const uint8_t* row = tree + (b * T + e) * T;
      int64_t shown = 0;
      for (int64_t j = 0; j < extend[b]; ++j) shown += row[j] != 0;
      TORCH_CHECK_VALUE(shown - 1 <= e, "argument 'tree_mask': with sliding_window, row ", e,
                        " of request ", b, " shows ", shown, " new tokens, but a draft's depth "
                        "(tokens shown minus itself) must not exceed its row index (parents "
                        "before children)");
      depth[b * T + e] = static_cast<int32_t>(std::max<int64_t>(0, shown - 1));
    }
  }
  return depth;
}

// Writes rows normalised by their softmax sums into out [B, T, H, D] (contiguous); rows that saw
// no key are zero.
void write_rows(const WorkItem& it, const float* acc, const float* sum, int64_t hpg, int64_t T,
                int64_t H, int64_t D, at::Tensor& out) {
  const int64_t M = it.rows * hpg;
  for (int64_t m = 0; m < M; ++m) {
    const int64_t t = it.row0 + m / hpg, h = it.g * hpg + m % hpg;
    const int64_t off = ((it.b * T + t) * H + h) * D;
    const float inv = sum[m] > 0 ? 1.0f / sum[m] : 0.0f;
    const float* a = acc + m * D;
    if (out.scalar_type() == at::kFloat) {
      float* o = out.data_ptr<float>() + off;
      for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
    } else {
      at::BFloat16* o = out.data_ptr<at::BFloat16>() + off;
      for (int64_t d = 0; d < D; ++d) o[d] = at::BFloat16(a[d] * inv);
    }
  }
}

// Checks the pools, the scalars and every slot the call reads against q [B, T, H, D].
void check_attention_inputs(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& req_to_token, const std::vector<int64_t>& rows,
                            const std::vector<int64_t>& prefix, const std::vector<int64_t>& extend,
                            double scale, double logit_cap) {
  check_pool(k_pool, "k_pool");
  check_pool(v_pool, "v_pool");
  TORCH_CHECK_TYPE(k_pool.scalar_type() == q.scalar_type(),
                   "argument 'k_pool' must have q's dtype ", q.scalar_type(), ", got ",
                   k_pool.scalar_type());
  TORCH_CHECK_TYPE(v_pool.scalar_type() == q.scalar_type(),
                   "argument 'v_pool' must have q's dtype ", q.scalar_type(), ", got ",
                   v_pool.scalar_type());
  TORCH_CHECK_VALUE(v_pool.sizes() == k_pool.sizes(), "argument 'v_pool' must have k_pool's shape ",
                    k_pool.sizes(), ", got ", v_pool.sizes());
  const int64_t B = q.size(0), H = q.size(2), D = q.size(3);
  const int64_t num_slots = k_pool.size(0), Hkv = k_pool.size(1);
  TORCH_CHECK_VALUE(k_pool.size(2) == D, "argument 'k_pool' must have head_dim ", D,
                    " (q's last dimension), got shape ", k_pool.sizes());
  TORCH_CHECK_VALUE(Hkv >= 1 && H % Hkv == 0, "argument 'q' has ", H,
                    " heads, which is not a multiple of k_pool's ", Hkv, " KV heads");
  TORCH_CHECK_VALUE(D >= 1, "argument 'q' must have head_dim >= 1, got shape ", q.sizes());
  check_dtype(req_to_token, at::kInt, "req_to_token");
  check_dim(req_to_token, 2, "req_to_token");
  TORCH_CHECK_VALUE(std::isfinite(scale), "argument 'scale' must be finite, got ", scale);
  TORCH_CHECK_VALUE(std::isfinite(logit_cap) && logit_cap >= 0,
                    "argument 'logit_cap' must be >= 0 (0 disables the soft cap), got ", logit_cap);
  const int64_t R = req_to_token.size(0), L = req_to_token.size(1);
  const int32_t* table = req_to_token.const_data_ptr<int32_t>();
  const int64_t ts0 = req_to_token.stride(0), ts1 = req_to_token.stride(1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_INDEX(rows[b] >= 0 && rows[b] < R, "argument 'req_rows' [", b, "] = ", rows[b],
                      " is outside req_to_token's rows [0, ", R, ")");
    const int64_t n = prefix[b] + extend[b];
    TORCH_CHECK_INDEX(n <= L, "request ", b, ": prefix + new tokens = ", n,
                      " exceeds req_to_token's width ", L);
    for (int64_t p = 0; p < n; ++p) {
      const int64_t slot = table[rows[b] * ts0 + p * ts1];
      TORCH_CHECK_INDEX(slot >= 0 && slot < num_slots, "argument 'req_to_token' [", rows[b], ", ",
                        p, "] = ", slot, " (request ", b, ") is outside the pool's ", num_slots,
                        " slots");
    }
  }
}

using ChunkKernel = void (*)(const AttnChunk&);

// The chunk kernel of this call (see the file comment); *ran records its ISA.
// path_rows: the call has PATH rows (plan_items), run with row tails, which the AMX kernel does
// not read (decode never runs AMX either).
ChunkKernel choose_kernel(AttnDtype dtype, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                          bool path_rows, Isa* ran) {
  const Isa isa = active_isa();
  ChunkKernel kernel = attention_chunk_portable;
  *ran = Isa::PORTABLE;
#ifdef SPECDEC_BUILT_AVX2
  if (isa >= Isa::AVX2 && D % 8 == 0) {
    kernel = attention_chunk_avx2;
    *ran = Isa::AVX2;
  }
#endif
#ifdef SPECDEC_BUILT_AVX512
  if (isa >= Isa::AVX512 && attention_avx512_supports(dtype, D)) {
    kernel = attention_chunk_avx512;
    *ran = Isa::AVX512;
  }
#endif
#ifdef SPECDEC_BUILT_AMX
  // AMX pads each chunk's queries to 16 tile rows; below kAmxMinQueries per chunk (decode:
  // one row times the GQA group) the AVX-512 kernel is faster.
  if (isa == Isa::AMX && !path_rows && dtype == AttnDtype::BFLOAT16 && D % 32 == 0 &&
      std::min(T, std::max<int64_t>(1, kMaxQueriesPerChunk / (H / Hkv))) * (H / Hkv) >=
          kAmxMinQueries) {
    kernel = attention_chunk_amx;
    *ran = Isa::AMX;
  }
#endif
  (void)isa;
  (void)path_rows;
  return kernel;
}

// How plan_items runs one new row of a request.
enum class RowKind : uint8_t {
  CAUSAL,  // sees new keys [0, t] exactly (no tree, or a tree row on the first chain)
  PATH,    // a tree row whose visible new keys are its ancestors, depth i at the i-th of them
  OTHER,   // any other mask row: all new keys are read, the mask decides
};

// Each row's kind; for PATH rows, path[b * T + t] = the first index of its ancestors in
// `ancestors` (which holds them in order, the row itself last), else -1.
std::vector<RowKind> row_kinds(const uint8_t* tree, int64_t B, int64_t T,
                               const std::vector<int64_t>& extend, std::vector<int64_t>& path,
                               std::vector<int64_t>& ancestors) {
  std::vector<RowKind> kinds(B * T, RowKind::CAUSAL);
  path.assign(B * T, -1);
  if (tree == nullptr) return kinds;
  std::vector<int64_t> count(T);
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* tb = tree + b * T * T;
    for (int64_t t = 0; t < extend[b]; ++t) {
      count[t] = 0;
      for (int64_t e = 0; e < extend[b]; ++e) count[t] += tb[t * T + e] != 0;
    }
    for (int64_t t = 0; t < extend[b]; ++t) {
      const uint8_t* row = tb + t * T;
      bool causal = true;
      for (int64_t e = 0; e < extend[b] && causal; ++e) causal = (row[e] != 0) == (e <= t);
      if (causal) continue;
      // A path: the i-th visible key (in index order) sees exactly i + 1 keys, the last is t.
      const int64_t start = static_cast<int64_t>(ancestors.size());
      bool is_path = row[t] != 0;
      for (int64_t e = 0; e <= t && is_path; ++e) {
        if (!row[e]) continue;
        is_path = count[e] == static_cast<int64_t>(ancestors.size()) - start + 1;
        ancestors.push_back(e);
      }
      for (int64_t e = t + 1; e < extend[b] && is_path; ++e) is_path = row[e] == 0;
      if (is_path) {
        kinds[b * T + t] = RowKind::PATH;
        path[b * T + t] = start;
      } else {
        ancestors.resize(start);
        kinds[b * T + t] = RowKind::OTHER;
      }
    }
  }
  return kinds;
}

// First key index a chunk reads when its first query sits at token position `pos`: the window
// start (a key's position never exceeds its index, so the cut by index is safe), rounded down
// to a 64-key boundary so that every kernel's key blocks fall at the same
// key indices whichever call a row comes in (the extra keys are outside the window, masked).
int64_t first_key(int64_t pos, int64_t sliding_window) {
  if (sliding_window <= 0) return 0;
  return std::max<int64_t>(0, pos - sliding_window + 1) / 64 * 64;
}

// What row-tail items read besides the items: each row's slots past its request's tail_from
// (`row_slots`, reached through row_tail [B*T]) and its key end (row_end [B*T]).
struct PlanData {
  std::vector<int32_t> row_slots;
  std::vector<const int32_t*> row_tail;
  std::vector<int64_t> row_end;
  std::vector<int64_t> tail_from;  // [B]
};

// The work items of a call, per (request, KV head). A tree row runs as the decode step of its
// position would run -- the prefix, then its ancestors as the next keys, in the same key
// blocks and lanes -- so it reproduces its decode row bit for bit whatever else the tree holds
// (decode_attention is the one-row causal case):
//  - row tails (requests with PATH rows and no OTHER row): blocks of up to rows_per_item rows
//    share the prefix's 64-key blocks, then each row continues over its own keys
//    (AttnChunk::row_tail);
//  - otherwise CAUSAL runs (every row of a call without a tree) and OTHER rows in blocks of up to
//    rows_per_item rows, with the key range their rows can see (up to the block's last row for
//    CAUSAL rows, all new keys for OTHER ones).
// Every item starts at its rows' first in-window position, rounded down to 64 keys (first_key).
std::vector<WorkItem> plan_items(
    int64_t B, int64_t T, int64_t Hkv, int64_t hpg, const std::vector<int64_t>& prefix,
    const std::vector<int64_t>& extend, const std::vector<RowKind>& kinds,
    const std::vector<int64_t>& path, const std::vector<int64_t>& ancestors,
    const std::vector<int32_t>& depth, int64_t sliding_window, const int32_t* table, int64_t ts0,
    int64_t ts1, const std::vector<int64_t>& rows, PlanData& pd) {
  const int64_t rows_per_item = std::max<int64_t>(1, kMaxQueriesPerChunk / hpg);
  auto slot = [&](int64_t b, int64_t p) { return table[rows[b] * ts0 + p * ts1]; };
  // A row's new keys in order (CAUSAL: 0..t; PATH: its ancestors), t last.
  auto new_keys = [&](int64_t b, int64_t t, std::vector<int64_t>& out) {
    out.clear();
    if (kinds[b * T + t] == RowKind::CAUSAL) {
      for (int64_t e = 0; e <= t; ++e) out.push_back(e);
      return;
    }
    for (const int64_t* a = ancestors.data() + path[b * T + t];; ++a) {
      out.push_back(*a);
      if (*a == t) return;
    }
  };
  std::vector<bool> tails_of(B, false);  // requests planned with row tails
  pd.tail_from.assign(B, 0);
  pd.row_end.assign(B * T, 0);
  std::vector<int64_t> offset(B * T, -1), keys;
  for (int64_t b = 0; b < B; ++b) {
    bool has_path = false, has_other = false;
    for (int64_t t = 0; t < extend[b]; ++t) {
      has_path |= kinds[b * T + t] == RowKind::PATH;
      has_other |= kinds[b * T + t] == RowKind::OTHER;
    }
    tails_of[b] = has_path && !has_other;
    pd.tail_from[b] = prefix[b] / 64 * 64;
    for (int64_t t = 0; t < extend[b] && tails_of[b]; ++t) {
      new_keys(b, t, keys);
      pd.row_end[b * T + t] = prefix[b] + static_cast<int64_t>(keys.size());
      offset[b * T + t] = static_cast<int64_t>(pd.row_slots.size());
      for (int64_t p = pd.tail_from[b]; p < prefix[b]; ++p) pd.row_slots.push_back(slot(b, p));
      for (int64_t e : keys) pd.row_slots.push_back(slot(b, prefix[b] + e));
    }
  }
  pd.row_tail.assign(B * T, nullptr);
  for (int64_t i = 0; i < B * T; ++i) {
    if (offset[i] >= 0) pd.row_tail[i] = pd.row_slots.data() + offset[i];
  }
  std::vector<WorkItem> items;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < Hkv; ++g) {
      for (int64_t r0 = 0; r0 < extend[b];) {
        const RowKind kind = kinds[b * T + r0];
        if (tails_of[b]) {
          const int64_t nr = std::min(rows_per_item, extend[b] - r0);
          const int64_t* end = pd.row_end.data() + b * T + r0;
          const int64_t kbeg = first_key(*std::min_element(end, end + nr) - 1, sliding_window);
          WorkItem it{b, g, r0, nr, kbeg, *std::max_element(end, end + nr), 1, 0};
          it.row_tails = true;
          items.push_back(it);
          r0 += nr;
          continue;
        }
        int64_t nr = 1;
        while (nr < rows_per_item && r0 + nr < extend[b] && kinds[b * T + r0 + nr] == kind) ++nr;
        const int64_t kend = kind == RowKind::OTHER ? prefix[b] + extend[b] : prefix[b] + r0 + nr;
        // Tree rows: the window starts from the block's least depth.
        int64_t first_pos = prefix[b] + r0;
        if (!depth.empty()) {
          first_pos = prefix[b] + *std::min_element(depth.begin() + b * T + r0,
                                                    depth.begin() + b * T + r0 + nr);
        }
        items.push_back({b, g, r0, nr, first_key(first_pos, sliding_window), kend, 1, 0});
        r0 += nr;
      }
    }
  }
  return items;
}

// The tasks of the work items. Calls of at most kFixedSplitRows rows per request (decode,
// verify, chunked prefill) cut every key range at the key indices that are multiples of
// kSplitKeys: the cuts depend neither on the call's key count nor on the thread count, so a row
// sums the same partials, merged in the same order, in its decode step and in any verify that
// holds it, at any thread count (a row's empty partials add exact zeros). Larger calls (prefill)
// are split only when there are fewer items than 2x the threads (flash-decoding, no split below
// kSplitKeys keys) so that every thread gets work. A split task keeps its partial acc / max / sum
// at offset[task] of a shared workspace of `split_floats` floats for merge_splits, the others
// (offset -1) write their rows directly.
struct TaskPlan {
  std::vector<Task> tasks;
  std::vector<int64_t> offset;
  int64_t split_floats = 0;
};

TaskPlan split_key_ranges(std::vector<WorkItem>& items, int64_t T, int64_t hpg, int64_t D) {
  const int64_t threads = at::get_num_threads();
  const int64_t n_items = static_cast<int64_t>(items.size());
  const bool fixed_cuts = T <= kFixedSplitRows;
  TaskPlan plan;
  for (int64_t i = 0; i < n_items; ++i) {
    WorkItem& it = items[i];
    it.first_task = static_cast<int64_t>(plan.tasks.size());
    int64_t made = 0;
    if (fixed_cuts) {
      for (int64_t k0 = it.key_begin; k0 < it.key_end || made == 0; ++made) {
        const int64_t k1 = std::min(it.key_end, (k0 / kSplitKeys + 1) * kSplitKeys);
        plan.tasks.push_back({i, k0, k1});
        k0 = k1;
      }
    } else {
      const int64_t keys = it.key_end - it.key_begin;
      if (n_items < 2 * threads) {
        const int64_t want = (2 * threads + n_items - 1) / n_items;
        it.splits = std::max<int64_t>(1, std::min(want, keys / kSplitKeys));
      }
      const int64_t step = ((keys + it.splits - 1) / it.splits + 63) / 64 * 64;
      for (int64_t k0 = it.key_begin; k0 < it.key_end || made == 0; k0 += step, ++made) {
        plan.tasks.push_back({i, k0, std::min(it.key_end, k0 + step)});
      }
    }
    it.splits = made;
  }
  plan.offset.assign(plan.tasks.size(), -1);
  for (size_t t = 0; t < plan.tasks.size(); ++t) {
    const WorkItem& it = items[plan.tasks[t].item];
    if (it.splits > 1) {
      plan.offset[t] = plan.split_floats;
      plan.split_floats += it.rows * hpg * (D + 2);  // acc [M, D] + max [M] + sum [M]
    }
  }
  return plan;
}

// What every chunk of one call shares: q and the pools as byte pointers with their strides, the
// request table and the per-request tree / depth data.
struct AttnCall {
  AttnDtype dtype;
  const at::Tensor& q;
  const at::Tensor& k_pool;
  const at::Tensor& v_pool;
  const int32_t* table;
  int64_t ts0, ts1, T, hpg;
  const std::vector<int64_t>& rows;
  const std::vector<int64_t>& prefix;
  const uint8_t* tree;
  const std::vector<int32_t>& depth;
  int64_t sliding_window;
  float scale, logit_cap;
  const PlanData& plan;
};

AttnChunk make_chunk(const AttnCall& a, const WorkItem& it, const Task& task, float* ws) {
  const int64_t elem = a.q.element_size(), M = it.rows * a.hpg;
  AttnChunk c;
  c.dtype = a.dtype;
  c.head_dim = a.q.size(3);
  c.q = static_cast<const char*>(a.q.const_data_ptr()) +
        (it.b * a.q.stride(0) + it.row0 * a.q.stride(1) + it.g * a.hpg * a.q.stride(2)) * elem;
  c.q_stride_row = a.q.stride(1);
  c.q_stride_head = a.q.stride(2);
  c.rows = it.rows;
  c.heads = a.hpg;
  c.row0 = it.row0;
  c.k = static_cast<const char*>(a.k_pool.const_data_ptr()) + it.g * a.k_pool.stride(1) * elem;
  c.v = static_cast<const char*>(a.v_pool.const_data_ptr()) + it.g * a.v_pool.stride(1) * elem;
  c.k_stride_slot = a.k_pool.stride(0);
  c.v_stride_slot = a.v_pool.stride(0);
  c.slots = a.table + a.rows[it.b] * a.ts0;
  c.slot_stride = a.ts1;
  c.key_begin = task.key_begin;
  c.key_end = task.key_end;
  c.prefetch_end = it.key_end;
  c.prefix = a.prefix[it.b];
  c.tree = a.tree ? a.tree + it.b * a.T * a.T : nullptr;
  c.tree_stride = a.T;
  c.depth = a.depth.empty() ? nullptr : a.depth.data() + it.b * a.T;
  if (it.row_tails) {  // the prefix's blocks shared, then each row's own keys
    c.tree = nullptr;
    c.depth = nullptr;
    c.tail_from = a.plan.tail_from[it.b];
    c.row_tail = a.plan.row_tail.data() + it.b * a.T + it.row0;
    c.row_end = a.plan.row_end.data() + it.b * a.T + it.row0;
  }
  c.window = a.sliding_window;
  c.scale = a.scale;
  c.logit_cap = a.logit_cap;
  c.acc = ws;
  c.max = ws + M * a.q.size(3);
  c.sum = c.max + M;
  return c;
}

// Merges each split item's partial sums, rescaled to the common row max, into its output rows.
void merge_splits(const std::vector<WorkItem>& items, const TaskPlan& plan,
                  const std::vector<float>& workspace, int64_t hpg, at::Tensor& out) {
  const int64_t T = out.size(1), H = out.size(2), D = out.size(3);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> acc, sum;
    for (int64_t i = i0; i < i1; ++i) {
      const WorkItem& it = items[i];
      if (it.splits == 1) continue;
      const int64_t M = it.rows * hpg;
      acc.assign(M * D, 0.0f);
      sum.assign(M, 0.0f);
      for (int64_t m = 0; m < M; ++m) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < it.splits; ++s) {
          mx = std::max(mx, workspace[plan.offset[it.first_task + s] + M * D + m]);
        }
        if (mx == -std::numeric_limits<float>::infinity()) continue;
        for (int64_t s = 0; s < it.splits; ++s) {
          const float* ws = workspace.data() + plan.offset[it.first_task + s];
          if (ws[M * D + M + m] == 0.0f) continue;
          const float w = std::exp(ws[M * D + m] - mx);
          sum[m] += w * ws[M * D + M + m];
          for (int64_t d = 0; d < D; ++d) acc[m * D + d] += w * ws[m * D + d];
        }
      }
      write_rows(it, acc.data(), sum.data(), hpg, T, H, D, out);
    }
  });
}

// Shared body of extend_attention and decode_attention. q [B, T, H, D]; per request b the keys
// are positions [0, prefix[b] + extend[b]) of row rows[b]; query row t < extend[b] is new token t.
// Phases: check, choose the chunk kernel, plan work items and their key-range tasks, run every
// task's chunk in one parallel region, merge split key ranges.
at::Tensor attention_forward(Isa* ran, const at::Tensor& q_in, const at::Tensor& k_pool,
                             const at::Tensor& v_pool, const at::Tensor& req_to_token,
                             const std::vector<int64_t>& rows, const std::vector<int64_t>& prefix,
                             const std::vector<int64_t>& extend,
                             const std::optional<at::Tensor>& tree_mask, double scale,
                             int64_t sliding_window, double logit_cap) {
  const AttnDtype dtype = attn_dtype(q_in, "q");
  check_attention_inputs(q_in, k_pool, v_pool, req_to_token, rows, prefix, extend, scale,
                         logit_cap);
  const int64_t B = q_in.size(0), T = q_in.size(1), H = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_pool.size(1), hpg = H / Hkv;
  at::Tensor tree_holder;
  std::vector<uint8_t> tree_storage;
  const uint8_t* tree = tree_mask.has_value()
                            ? tree_visibility(*tree_mask, B, T, tree_holder, tree_storage)
                            : nullptr;
  // With a window, a tree draft's token position is prefix + its depth (kernels.md section 6).
  const std::vector<int32_t> depth = tree != nullptr && sliding_window > 0
                                         ? tree_depths(tree, B, T, extend)
                                         : std::vector<int32_t>();

  // q rows must be dense in D for the kernels; any other strides are read in place.
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  at::Tensor out = at::zeros({B, T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (B == 0 || T == 0 || H == 0) return out;  // [B, T, H, D]

  std::vector<int64_t> path, ancestors;
  const std::vector<RowKind> kinds = row_kinds(tree, B, T, extend, path, ancestors);
  const bool path_rows = std::find(kinds.begin(), kinds.end(), RowKind::PATH) != kinds.end();
  const ChunkKernel kernel = choose_kernel(dtype, T, H, Hkv, D, path_rows, ran);
  PlanData pd;
  const int32_t* table = req_to_token.const_data_ptr<int32_t>();
  std::vector<WorkItem> items =
      plan_items(B, T, Hkv, hpg, prefix, extend, kinds, path, ancestors, depth, sliding_window,
                 table, req_to_token.stride(0), req_to_token.stride(1), rows, pd);
  const TaskPlan plan = split_key_ranges(items, T, hpg, D);
  std::vector<float> workspace(plan.split_floats);
  const AttnCall call{dtype,
                      q,
                      k_pool,
                      v_pool,
                      table,
                      req_to_token.stride(0),
                      req_to_token.stride(1),
                      T,
                      hpg,
                      rows,
                      prefix,
                      tree,
                      depth,
                      sliding_window,
                      static_cast<float>(scale),
                      static_cast<float>(logit_cap),
                      pd};
  at::parallel_for(0, static_cast<int64_t>(plan.tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> local;
    for (int64_t t = t0; t < t1; ++t) {
      const WorkItem& it = items[plan.tasks[t].item];
      float* ws;
      if (plan.offset[t] >= 0) {
        ws = workspace.data() + plan.offset[t];
      } else {
        local.resize(it.rows * hpg * (D + 2));
        ws = local.data();
      }
      const AttnChunk c = make_chunk(call, it, plan.tasks[t], ws);
      kernel(c);
      if (it.splits == 1) write_rows(it, c.acc, c.sum, hpg, T, H, D, out);
    }
  });
  // No split, no second parallel region: decode at short context pays one per layer otherwise.
  if (plan.split_floats > 0) merge_splits(items, plan, workspace, hpg, out);
  return out;  // [B, T, H, D]
}

std::vector<int64_t> read_lengths(const at::Tensor& t, int64_t bs, const char* name) {
  check_index(t, 1, name);
  check_size(t, 0, bs, name);
  const IndexView view(t);
  std::vector<int64_t> out(bs);
  for (int64_t b = 0; b < bs; ++b) {
    out[b] = view(b);
    TORCH_CHECK_VALUE(out[b] >= 0, "argument '", name, "' [", b, "] = ", out[b], " must be >= 0");
  }
  return out;
}

at::Tensor extend_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& req_to_token, const at::Tensor& req_rows,
                            const at::Tensor& prefix_lens, const at::Tensor& extend_lens,
                            const std::optional<at::Tensor>& tree_mask, double scale,
                            int64_t sliding_window, double logit_cap) {
  check_cpu(q, "q");
  check_dim(q, 4, "q");
  const int64_t B = q.size(0), T = q.size(1);
  const std::vector<int64_t> rows = read_lengths(req_rows, B, "req_rows");
  const std::vector<int64_t> prefix = read_lengths(prefix_lens, B, "prefix_lens");
  const std::vector<int64_t> extend = read_lengths(extend_lens, B, "extend_lens");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(extend[b] <= T, "argument 'extend_lens' [", b, "] = ", extend[b],
                      " exceeds q's ", T, " rows per request");
  }
  Isa ran = Isa::PORTABLE;
  at::Tensor out = attention_forward(&ran, q, k_pool, v_pool, req_to_token, rows, prefix, extend,
                                     tree_mask, scale, sliding_window, logit_cap);
  SPECDEC_RECORD_PATH("extend_attention", ran);
  return out;
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& req_to_token, const at::Tensor& req_rows,
                            const at::Tensor& kv_lens, double scale, int64_t sliding_window,
                            double logit_cap) {
  check_cpu(q, "q");
  check_dim(q, 3, "q");
  const int64_t B = q.size(0);
  const std::vector<int64_t> rows = read_lengths(req_rows, B, "req_rows");
  std::vector<int64_t> prefix = read_lengths(kv_lens, B, "kv_lens");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(prefix[b] >= 1, "argument 'kv_lens' [", b, "] = ", prefix[b],
                      " must be >= 1 (the current token's K/V is included)");
    prefix[b] -= 1;  // the current token is the one new token, causal over the prefix
  }
  const std::vector<int64_t> extend(B, 1);
  Isa ran = Isa::PORTABLE;
  at::Tensor out =
      attention_forward(&ran, q.unsqueeze(1), k_pool, v_pool, req_to_token, rows, prefix, extend,
                        std::nullopt, scale, sliding_window, logit_cap);
  SPECDEC_RECORD_PATH("decode_attention", ran);
  return out.squeeze(1);  // [B, H, D]
}

// ---- store_kv ---------------------------------------------------------------------------------

template <typename Src, typename Dst>
void copy_rows(const at::Tensor& src, at::Tensor& pool, const IndexView& slots, int64_t B,
               int64_t T) {
  const int64_t Hkv = pool.size(1), D = pool.size(2);
  const Src* s = src.const_data_ptr<Src>();
  Dst* p = pool.data_ptr<Dst>();
  const int64_t s0 = src.stride(0), s1 = src.stride(1), s2 = src.stride(2), s3 = src.stride(3);
  const int64_t p0 = pool.stride(0), p1 = pool.stride(1), p2 = pool.stride(2);
  at::parallel_for(0, B * T, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / T, t = r % T, slot = slots(b, t);
      if (slot < 0) continue;
      for (int64_t h = 0; h < Hkv; ++h) {
        const Src* in = s + b * s0 + t * s1 + h * s2;
        Dst* o = p + slot * p0 + h * p1;
        if constexpr (std::is_same_v<Src, Dst>) {
          if (s3 == 1 && p2 == 1) {
            std::memcpy(o, in, D * sizeof(Dst));
            continue;
          }
        }
        for (int64_t d = 0; d < D; ++d)
          o[d * p2] = static_cast<Dst>(static_cast<float>(in[d * s3]));
      }
    }
  });
}

template <typename Dst>
void copy_into(const at::Tensor& src, at::Tensor& pool, const IndexView& slots, int64_t B,
               int64_t T) {
  switch (src.scalar_type()) {
    case at::kFloat: copy_rows<float, Dst>(src, pool, slots, B, T); break;
    case at::kBFloat16: copy_rows<at::BFloat16, Dst>(src, pool, slots, B, T); break;
    case at::kHalf: copy_rows<at::Half, Dst>(src, pool, slots, B, T); break;
    default: TORCH_CHECK(false, "unreachable");
  }
}

void store_one(const at::Tensor& src, at::Tensor& pool, const IndexView& slots, int64_t B,
               int64_t T) {
  switch (pool.scalar_type()) {
    case at::kFloat: copy_into<float>(src, pool, slots, B, T); break;
    case at::kBFloat16: copy_into<at::BFloat16>(src, pool, slots, B, T); break;
    case at::kHalf: copy_into<at::Half>(src, pool, slots, B, T); break;
    default: TORCH_CHECK(false, "unreachable");
  }
}

void check_float(const at::Tensor& t, const char* name) {
  const at::ScalarType st = t.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kBFloat16 || st == at::kHalf, "argument '", name,
                   "' must be float32, bfloat16 or float16, got ", st);
}

void store_kv(at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slots) {
  check_cpu(k_pool, "k_pool");
  check_dim(k_pool, 3, "k_pool");
  check_float(k_pool, "k_pool");
  check_cpu(v_pool, "v_pool");
  check_dim(v_pool, 3, "v_pool");
  check_float(v_pool, "v_pool");
  TORCH_CHECK_VALUE(v_pool.sizes() == k_pool.sizes(), "argument 'v_pool' must have k_pool's shape ",
                    k_pool.sizes(), ", got ", v_pool.sizes());
  const auto check_new = [&](const at::Tensor& t, const char* name) {
    check_cpu(t, name);
    check_dim(t, 4, name);
    check_float(t, name);
    TORCH_CHECK_VALUE(t.size(2) == k_pool.size(1) && t.size(3) == k_pool.size(2), "argument '",
                      name, "' must be [B, T, ", k_pool.size(1), ", ", k_pool.size(2),
                      "] to match the pool, got shape ", t.sizes());
  };
  check_new(k, "k");
  check_new(v, "v");
  TORCH_CHECK_VALUE(v.sizes() == k.sizes(), "argument 'v' must have k's shape ", k.sizes(),
                    ", got ", v.sizes());
  check_index(slots, 2, "slots");
  const int64_t B = k.size(0), T = k.size(1), S = k_pool.size(0);
  TORCH_CHECK_VALUE(slots.size(0) == B && slots.size(1) == T, "argument 'slots' must be [B, T] = [",
                    B, ", ", T, "], got shape ", slots.sizes());
  const IndexView sv(slots);
  std::vector<int64_t> used;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = sv(b, t);
      TORCH_CHECK_INDEX(s >= -1 && s < S, "argument 'slots' [", b, ", ", t, "] = ", s,
                        " is outside the pool's ", S, " slots (-1 marks padding)");
      if (s >= 0) used.push_back(s);
    }
  }
  std::sort(used.begin(), used.end());
  const auto dup = std::adjacent_find(used.begin(), used.end());
  TORCH_CHECK_VALUE(dup == used.end(), "argument 'slots' names slot ",
                    dup == used.end() ? -1 : *dup, " more than once");
  store_one(k, k_pool, sv, B, T);
  store_one(v, v_pool, sv, B, T);
  SPECDEC_RECORD_PATH("store_kv", Isa::PORTABLE);
}

// specdec::_probe_throw: always raises ValueError("specdec exception probe"). Run once per build,
// in a subprocess, by specdec_inductor.cpp_exceptions_work(): with some compiler / torch pairings
// (seen: Ubuntu g++ 13.3 with torch 2.11.0+cu130) a C++ exception thrown by an extension aborts
// the process instead of reaching Python, and every bad-input check of this library is one.
// It sits here, beside the attention checks, only because an op family file must hold it.
void probe_throw() { TORCH_CHECK_VALUE(false, "specdec exception probe"); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("_probe_throw() -> ()", &probe_throw);
  m.def("store_kv(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor k, Tensor v, Tensor slots) -> ()");
  m.def("extend_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor req_to_token, "
        "Tensor req_rows, Tensor prefix_lens, Tensor extend_lens, Tensor? tree_mask, float scale, "
        "int sliding_window=-1, float logit_cap=0.0) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor req_to_token, "
        "Tensor req_rows, Tensor kv_lens, float scale, int sliding_window=-1, "
        "float logit_cap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("store_kv", &store_kv);
  m.impl("extend_attention", &extend_attention);
  m.impl("decode_attention", &decode_attention);
}

}  // namespace specdec
