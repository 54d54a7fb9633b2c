// One attention "chunk" over the paged KV pool, as a plain struct, plus the per-ISA kernels that
// compute it. The dispatcher (attention.cpp) cuts every call into chunks -- (request, KV head,
// query-row block, key range) -- runs them with at::parallel_for and merges key-range splits.
// No ATen types cross this boundary: attention_<isa>.cpp are compiled with that ISA's flags.
#pragma once
#include <cstdint>

namespace specdec {

enum class AttnDtype : int { FLOAT32 = 0, BFLOAT16 = 1 };

// Query vectors of a chunk: M = rows * heads, vector m = (row r = m / heads, head hh = m % heads),
// i.e. query row t = row0 + r and query head g * heads + hh, all of which share KV head g.
// Keys: positions [key_begin, key_end) of one request's req_to_token row; position p lives in pool
// slot slots[p * slot_stride] (validated by the dispatcher). Positions < prefix are the committed
// prefix; position prefix + e is new token e, visible to row t when
// tree == nullptr ? e <= t : tree[t * tree_stride + e] != 0 (prefix keys are always visible).
// Sliding window (window > 0), transformers' rule kv_pos > q_pos - window on token positions:
// new token e sits at token position prefix + depth(e), depth(e) = depth[e] when depth is set
// (a tree draft's depth) and e otherwise (causal rows); a prefix key's token position is its
// index. A key is visible only if it passes the window as well as the tree / causal rule.
// query_pos / key_pos below are the definitions every kernel uses.
struct AttnChunk {
  AttnDtype dtype;
  int64_t head_dim;                     // D
  const void* q;                        // &q[b, row0, g * heads, 0]
  int64_t q_stride_row, q_stride_head;  // elements; q's last dimension is dense
  int64_t rows, heads, row0;
  const void* k;                         // &k_pool[0, g, 0]
  const void* v;                         // &v_pool[0, g, 0]
  int64_t k_stride_slot, v_stride_slot;  // elements; rows of D are dense
  const int32_t* slots;
  int64_t slot_stride;
  // Row tails (every kernel but AMX; nullptr when unused): keys [key_begin, tail_from) are prefix
  // keys every row sees; past tail_from row r (of this chunk) reads keys [tail_from, row_end[r])
  // with slots row_tail[r][p - tail_from], all visible to it (its token position is
  // row_end[r] - 1, key positions are indices) -- the decode step of its position, with the
  // prefix blocks computed once for all rows. tail_from is a multiple of 64.
  int64_t tail_from = 0;
  const int32_t* const* row_tail = nullptr;
  const int64_t* row_end = nullptr;
  int64_t key_begin, key_end, prefix;
  // Keys up to here may be prefetched (the key range's split continues there, usually on the
  // same thread: its first block is then warm); at most key_end when 0.
  int64_t prefetch_end = 0;
  const uint8_t* tree;  // [T, T] visibility of new keys for this request, or nullptr (causal)
  int64_t tree_stride;
  const int32_t* depth;  // [T] token-position offsets of this request's new tokens, or nullptr
  int64_t window;        // <= 0: none
  float scale;           // applied to q.k before the cap
  float logit_cap;       // <= 0: none; else s = cap * tanh(s / cap)
  // Outputs, fp32: acc [M, D] = sum_j exp(s_mj - max_m) v_j (unnormalized), max [M], sum [M] =
  // sum_j exp(s_mj - max_m). A row that sees no key gets max = -inf, sum = 0, acc = 0.
  float* acc;
  float* max;
  float* sum;
};

// Token position of query row t and of key index p (see the struct comment). In an anonymous
// namespace so that each translation unit keeps its own copy, compiled with its own ISA flags.
namespace {
inline int64_t query_pos(const AttnChunk& c, int64_t t) {
  return c.prefix + (c.depth != nullptr ? c.depth[t] : t);
}
// Row r of a row-tail chunk sees every key below its row_end, inside its window (its token
// position is row_end - 1; key positions are indices).
inline bool tail_visible(const AttnChunk& c, int64_t r, int64_t p) {
  return p < c.row_end[r] && !(c.window > 0 && p <= c.row_end[r] - 1 - c.window);
}
inline int64_t prefetch_limit(const AttnChunk& c) {
  return c.prefetch_end > c.key_end ? c.prefetch_end : c.key_end;
}
inline int64_t key_pos(const AttnChunk& c, int64_t p) {
  return p < c.prefix || c.depth == nullptr ? p : c.prefix + c.depth[p - c.prefix];
}
}  // namespace

// Plain C++ (attention.cpp); any head_dim.
void attention_chunk_portable(const AttnChunk& c);

// AVX2 + FMA (attention_avx2.cpp): fp32 arithmetic (bf16 K/V widened), head_dim % 8 == 0.
void attention_chunk_avx2(const AttnChunk& c);

// AVX-512 (attention_avx512.cpp): fp32 FMA, bf16 products via avx512_bf16 dot products.
// Requires head_dim % 16 == 0 (fp32) or head_dim % 32 == 0 (bf16): attention_avx512_supports
// (defined in attention.cpp).
bool attention_avx512_supports(AttnDtype dtype, int64_t head_dim);
void attention_chunk_avx512(const AttnChunk& c);

// AMX (attention_amx.cpp): bf16 only, head_dim % 32 == 0; both products on AMX tiles.
void attention_chunk_amx(const AttnChunk& c);

}  // namespace specdec
