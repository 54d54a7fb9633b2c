// KV-slot bookkeeping ops: assign_req_to_token, assign_draft_cache_locs,
// gather_extend_cache_locs, build_draft_decode_table, fill_bonus_tokens,
// compact_accepted_cache_locs, move_kv_slots. Contract: shared/spec/kernels.md section 5.
// ISA paths: compact_accepted_cache_locs has an AVX-512 path (masked gather + compress-store,
// kv_slots_avx512.cpp) chosen when active_isa() >= AVX512 and its inputs are dense; every op has
// the portable path. Mutating ops validate every index before their first write, so a bad call
// leaves the pool and the tables untouched.
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "checked_math.h"
#include "common.h"
#include "kv_slots_isa.h"

namespace specdec {
namespace {

void check_req_to_token(const at::Tensor& req_to_token) {
  check_dtype(req_to_token, at::kInt, "req_to_token");
  check_dim(req_to_token, 2, "req_to_token");
}

void check_rows(const IndexView& rows, int64_t bs, int64_t num_rows, const char* name) {
  for (int64_t i = 0; i < bs; ++i) {
    const int64_t r = rows(i);
    TORCH_CHECK_INDEX(r >= 0 && r < num_rows, "argument '", name, "' [", i, "] = ", r,
                      " is outside req_to_token's rows [0, ", num_rows, ")");
  }
}

// Checks 0 <= start <= end <= max_len per request and returns the exclusive prefix sums of the
// range lengths (size bs + 1).
std::vector<int64_t> check_ranges(const IndexView& start, const IndexView& end, int64_t bs,
                                  int64_t max_len) {
  std::vector<int64_t> offset(bs + 1, 0);
  for (int64_t i = 0; i < bs; ++i) {
    const int64_t s = start(i), e = end(i);
    TORCH_CHECK_INDEX(s >= 0 && s <= e && e <= max_len, "arguments 'start'/'end' [", i, "] = [", s,
                      ", ", e, ") must satisfy 0 <= start <= end <= ", max_len,
                      " (req_to_token width)");
    offset[i + 1] = offset[i] + (e - s);
  }
  return offset;
}

void assign_req_to_token(at::Tensor& req_to_token, const at::Tensor& req_rows,
                         const at::Tensor& start, const at::Tensor& end,
                         const at::Tensor& cache_loc) {
  check_req_to_token(req_to_token);
  check_index(req_rows, 1, "req_rows");
  const int64_t bs = req_rows.size(0);
  check_index(start, 1, "start");
  check_size(start, 0, bs, "start");
  check_index(end, 1, "end");
  check_size(end, 0, bs, "end");
  check_index(cache_loc, 1, "cache_loc");
  const int64_t R = req_to_token.size(0), L = req_to_token.size(1);
  const IndexView rows(req_rows), st(start), en(end), loc(cache_loc);
  check_rows(rows, bs, R, "req_rows");
  const std::vector<int64_t> offset = check_ranges(st, en, bs, L);
  TORCH_CHECK_VALUE(offset[bs] == cache_loc.size(0), "argument 'cache_loc' has ", cache_loc.size(0),
                    " slots but the ranges end - start need ", offset[bs]);
  for (int64_t k = 0; k < offset[bs]; ++k) {
    const int64_t slot = loc(k);
    TORCH_CHECK_INDEX(slot >= 0 && slot <= INT32_MAX, "argument 'cache_loc' [", k, "] = ", slot,
                      " is not a valid int32 slot");
  }
  int32_t* table = req_to_token.data_ptr<int32_t>();
  const int64_t ts0 = req_to_token.stride(0), ts1 = req_to_token.stride(1);
  at::parallel_for(0, bs, grain_for(offset[bs] / std::max<int64_t>(1, bs)),
                   [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int32_t* row = table + rows(i) * ts0;
      const int64_t s = st(i), n = offset[i + 1] - offset[i];
      for (int64_t k = 0; k < n; ++k) row[(s + k) * ts1] = static_cast<int32_t>(loc(offset[i] + k));
    }
  });
  SPECDEC_RECORD_PATH("assign_req_to_token", Isa::PORTABLE);
}

at::Tensor assign_draft_cache_locs(const at::Tensor& req_to_token, const at::Tensor& req_rows,
                                   const at::Tensor& seq_lens, int64_t topk, int64_t steps) {
  check_req_to_token(req_to_token);
  check_index(req_rows, 1, "req_rows");
  const int64_t bs = req_rows.size(0);
  check_index(seq_lens, 1, "seq_lens");
  check_size(seq_lens, 0, bs, "seq_lens");
  TORCH_CHECK_VALUE(topk >= 1, "argument 'topk' must be >= 1, got ", topk);
  TORCH_CHECK_VALUE(steps >= 1, "argument 'steps' must be >= 1, got ", steps);
  const int64_t R = req_to_token.size(0), L = req_to_token.size(1);
  const int64_t per_req = checked_mul(topk, steps, "argument 'topk' * argument 'steps'");
  TORCH_CHECK_VALUE(per_req <= L, "arguments 'topk' * 'steps' = ", per_req,
                    " draft slots per request exceed req_to_token's width ", L);
  const IndexView rows(req_rows), lens(seq_lens);
  check_rows(rows, bs, R, "req_rows");
  for (int64_t b = 0; b < bs; ++b) {
    // lens(b) <= L - per_req, not lens(b) + per_req <= L: the sum may overflow.
    TORCH_CHECK_INDEX(lens(b) >= 0 && lens(b) <= L - per_req, "argument 'seq_lens' [", b,
                      "] = ", lens(b), ": the ", per_req,
                      " draft slots after it exceed req_to_token's width ", L);
  }
  const int64_t total = checked_mul(bs, per_req, "batch * topk * steps");
  check_alloc(total, "the draft cache locations");
  at::Tensor out = at::empty({total}, at::kLong);  // [B*topk*steps], candidate-major
  int64_t* o = out.data_ptr<int64_t>();
  const int32_t* table = req_to_token.const_data_ptr<int32_t>();
  const int64_t ts0 = req_to_token.stride(0), ts1 = req_to_token.stride(1);
  at::parallel_for(0, bs, grain_for(per_req), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int32_t* row = table + rows(b) * ts0 + lens(b) * ts1;
      for (int64_t k = 0; k < per_req; ++k) o[b * per_req + k] = row[k * ts1];
    }
  });
  SPECDEC_RECORD_PATH("assign_draft_cache_locs", Isa::PORTABLE);
  return out;
}

at::Tensor gather_extend_cache_locs(const at::Tensor& req_to_token, const at::Tensor& req_rows,
                                    const at::Tensor& start, const at::Tensor& end,
                                    std::optional<int64_t> total) {
  check_req_to_token(req_to_token);
  check_index(req_rows, 1, "req_rows");
  const int64_t bs = req_rows.size(0);
  check_index(start, 1, "start");
  check_size(start, 0, bs, "start");
  check_index(end, 1, "end");
  check_size(end, 0, bs, "end");
  const int64_t R = req_to_token.size(0), L = req_to_token.size(1);
  const IndexView rows(req_rows), st(start), en(end);
  check_rows(rows, bs, R, "req_rows");
  const std::vector<int64_t> offset = check_ranges(st, en, bs, L);
  TORCH_CHECK_VALUE(!total.has_value() || *total == offset[bs],
                    "argument 'total' = ", total.value_or(-1),
                    " but the ranges end - start add up to ", offset[bs]);
  at::Tensor out = at::empty({offset[bs]}, at::kLong);  // [sum(end - start)]
  int64_t* o = out.data_ptr<int64_t>();
  const int32_t* table = req_to_token.const_data_ptr<int32_t>();
  const int64_t ts0 = req_to_token.stride(0), ts1 = req_to_token.stride(1);
  at::parallel_for(0, bs, grain_for(offset[bs] / std::max<int64_t>(1, bs)),
                   [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int32_t* row = table + rows(i) * ts0;
      for (int64_t k = 0, s = st(i); k < offset[i + 1] - offset[i]; ++k) {
        o[offset[i] + k] = row[(s + k) * ts1];
      }
    }
  });
  SPECDEC_RECORD_PATH("gather_extend_cache_locs", Isa::PORTABLE);
  return out;
}

at::Tensor build_draft_decode_table(const at::Tensor& req_to_token, const at::Tensor& req_rows,
                                    const at::Tensor& seq_lens, int64_t topk, int64_t steps) {
  check_req_to_token(req_to_token);
  check_index(req_rows, 1, "req_rows");
  const int64_t bs = req_rows.size(0);
  check_index(seq_lens, 1, "seq_lens");
  check_size(seq_lens, 0, bs, "seq_lens");
  TORCH_CHECK_VALUE(topk >= 1, "argument 'topk' must be >= 1, got ", topk);
  TORCH_CHECK_VALUE(steps >= 1, "argument 'steps' must be >= 1, got ", steps);
  const int64_t R = req_to_token.size(0), L = req_to_token.size(1);
  const int64_t per_req = checked_mul(topk, steps, "argument 'topk' * argument 'steps'");
  TORCH_CHECK_VALUE(per_req <= L, "arguments 'topk' * 'steps' = ", per_req,
                    " draft slots per request exceed req_to_token's width ", L);
  const IndexView rows(req_rows), lens(seq_lens);
  check_rows(rows, bs, R, "req_rows");
  for (int64_t b = 0; b < bs; ++b) {
    // lens(b) <= L - per_req, not lens(b) + per_req <= L: the sum may overflow.
    TORCH_CHECK_INDEX(lens(b) >= 0 && lens(b) <= L - per_req, "argument 'seq_lens' [", b,
                      "] = ", lens(b), ": the ", per_req,
                      " draft slots after it exceed req_to_token's width ", L);
  }
  const int64_t rows_out = checked_mul(bs, topk, "batch * argument 'topk'");
  check_alloc(checked_mul(rows_out, L, "batch * topk * req_to_token's width"),
              "the draft decode table");
  // Row b*topk+k: request b's prefix slots, then candidate k's `steps` draft slots, then -1.
  at::Tensor table_out = at::empty({rows_out, L}, at::kInt);  // [B*topk, L]
  int32_t* out = table_out.data_ptr<int32_t>();
  const int32_t* table = req_to_token.const_data_ptr<int32_t>();
  const int64_t ts0 = req_to_token.stride(0), ts1 = req_to_token.stride(1);
  at::parallel_for(0, rows_out, grain_for(L), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / topk, k = r % topk, len = lens(b);
      const int32_t* src = table + rows(b) * ts0;
      int32_t* dst = out + r * L;
      if (ts1 == 1) {
        std::memcpy(dst, src, len * sizeof(int32_t));
        std::memcpy(dst + len, src + len + k * steps, steps * sizeof(int32_t));
      } else {
        for (int64_t j = 0; j < len; ++j) dst[j] = src[j * ts1];
        for (int64_t j = 0; j < steps; ++j) dst[len + j] = src[(len + k * steps + j) * ts1];
      }
      std::fill(dst + len + steps, dst + L, -1);
    }
  });
  SPECDEC_RECORD_PATH("build_draft_decode_table", Isa::PORTABLE);
  return table_out;
}

at::Tensor fill_bonus_tokens(const at::Tensor& accept_tokens, const at::Tensor& accept_lens) {
  check_index(accept_tokens, 2, "accept_tokens");
  const int64_t bs = accept_tokens.size(0), S = accept_tokens.size(1);
  check_index(accept_lens, 1, "accept_lens");
  check_size(accept_lens, 0, bs, "accept_lens");
  const IndexView tokens(accept_tokens), lens(accept_lens);
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK_INDEX(lens(b) >= 1 && lens(b) <= S, "argument 'accept_lens' [", b, "] = ", lens(b),
                      " must be in [1, ", S, "] (it counts the bonus token)");
  }
  at::Tensor bonus = at::empty({bs}, accept_tokens.scalar_type());  // [B]
  if (bonus.scalar_type() == at::kLong) {
    int64_t* o = bonus.data_ptr<int64_t>();
    for (int64_t b = 0; b < bs; ++b) o[b] = tokens(b, lens(b) - 1);
  } else {
    int32_t* o = bonus.data_ptr<int32_t>();
    for (int64_t b = 0; b < bs; ++b) o[b] = static_cast<int32_t>(tokens(b, lens(b) - 1));
  }
  SPECDEC_RECORD_PATH("fill_bonus_tokens", Isa::PORTABLE);
  return bonus;
}

std::tuple<at::Tensor, at::Tensor> compact_accepted_cache_locs(const at::Tensor& cache_loc,
                                                               const at::Tensor& accept_index) {
  check_index(cache_loc, 1, "cache_loc");
  check_index(accept_index, accept_index.dim(), "accept_index");
  TORCH_CHECK_VALUE(accept_index.dim() == 1 || accept_index.dim() == 2,
                    "argument 'accept_index' must have 1 or 2 dimensions, got shape ",
                    accept_index.sizes());
  const int64_t n = accept_index.numel(), num_slots = cache_loc.size(0);
  at::Tensor out = at::empty({n}, at::kLong);   // [numel(accept_index)], -1 padded
  at::Tensor count = at::empty({}, at::kLong);  // [] accepted entries
  int64_t* o = out.data_ptr<int64_t>();
  const bool dense = accept_index.is_contiguous() && cache_loc.is_contiguous() &&
                     cache_loc.scalar_type() == at::kLong;
#ifdef SPECDEC_BUILT_AVX512
  if (dense && active_isa() >= Isa::AVX512) {
    const int64_t bad = accept_index.scalar_type() == at::kInt
                            ? compact_locs_i32_avx512(accept_index.const_data_ptr<int32_t>(), n,
                                                      cache_loc.const_data_ptr<int64_t>(),
                                                      num_slots, o, count.data_ptr<int64_t>())
                            : compact_locs_i64_avx512(accept_index.const_data_ptr<int64_t>(), n,
                                                      cache_loc.const_data_ptr<int64_t>(),
                                                      num_slots, o, count.data_ptr<int64_t>());
    TORCH_CHECK_INDEX(bad < 0, "argument 'accept_index' (flat) [", bad,
                      "] = ", accept_index.reshape({-1})[bad].item<int64_t>(),
                      " is outside cache_loc's ", num_slots, " entries");
    SPECDEC_RECORD_PATH("compact_accepted_cache_locs", Isa::AVX512);
    return {out, count};
  }
#endif
  const IndexView loc(cache_loc), acc(accept_index);
  const int64_t cols = accept_index.dim() == 2 ? accept_index.size(1) : 1;
  int64_t k = 0;
  for (int64_t f = 0; f < n; ++f) {
    const int64_t a = accept_index.dim() == 2 ? acc(f / cols, f % cols) : acc(f);
    if (a < 0) continue;
    TORCH_CHECK_INDEX(a < num_slots, "argument 'accept_index' (flat) [", f, "] = ", a,
                      " is outside cache_loc's ", num_slots, " entries");
    o[k++] = loc(a);
  }
  std::fill(o + k, o + n, -1);
  count.fill_(k);
  SPECDEC_RECORD_PATH("compact_accepted_cache_locs", Isa::PORTABLE);
  return {out, count};
}

// Bytes of one slot row of a pool buffer [num_slots, ...]; rows must be dense (any stride(0)).
int64_t row_bytes(const at::Tensor& buf, const char* name, int64_t i) {
  check_cpu(buf, name);
  TORCH_CHECK_VALUE(buf.dim() >= 1, "argument '", name, "' [", i, "] must have a slot dimension");
  int64_t expected = 1;
  for (int64_t d = buf.dim() - 1; d >= 1; --d) {
    TORCH_CHECK_VALUE(buf.size(d) == 1 || buf.stride(d) == expected, "argument '", name, "' [", i,
                      "] must have dense slot rows (dims 1.. contiguous), got strides ",
                      buf.strides());
    expected *= buf.size(d);
  }
  return expected * buf.element_size();
}

void move_kv_slots(at::TensorList k_buffers, at::TensorList v_buffers, const at::Tensor& src,
                   const at::Tensor& dst) {
  TORCH_CHECK_VALUE(
      k_buffers.size() == v_buffers.size(),
      "arguments 'k_buffers' and 'v_buffers' must have the same number of layers, got ",
      k_buffers.size(), " and ", v_buffers.size());
  check_index(src, 1, "src");
  check_index(dst, 1, "dst");
  TORCH_CHECK_VALUE(src.size(0) == dst.size(0),
                    "arguments 'src' and 'dst' must have the same length, got ", src.size(0),
                    " and ", dst.size(0));
  const int64_t n = src.size(0);
  std::vector<at::Tensor> bufs;
  std::vector<int64_t> bytes;
  int64_t num_slots = -1;
  for (size_t i = 0; i < k_buffers.size() * 2; ++i) {
    const bool is_k = i < k_buffers.size();
    const at::Tensor& buf = is_k ? k_buffers[i] : v_buffers[i - k_buffers.size()];
    const char* name = is_k ? "k_buffers" : "v_buffers";
    bytes.push_back(row_bytes(buf, name, is_k ? i : i - k_buffers.size()));
    if (num_slots < 0) num_slots = buf.size(0);
    TORCH_CHECK_VALUE(buf.size(0) == num_slots, "argument '", name, "' buffers must all have ",
                      num_slots, " slots, got ", buf.size(0));
    bufs.push_back(buf);
  }
  const IndexView s(src), d(dst);
  std::vector<int64_t> dst_sorted(n);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK_INDEX(s(i) >= 0 && s(i) < num_slots, "argument 'src' [", i, "] = ", s(i),
                      " is outside the pool's ", num_slots, " slots");
    TORCH_CHECK_INDEX(d(i) >= 0 && d(i) < num_slots, "argument 'dst' [", i, "] = ", d(i),
                      " is outside the pool's ", num_slots, " slots");
    dst_sorted[i] = d(i);
  }
  std::sort(dst_sorted.begin(), dst_sorted.end());
  const auto dup = std::adjacent_find(dst_sorted.begin(), dst_sorted.end());
  TORCH_CHECK_VALUE(dup == dst_sorted.end(), "argument 'dst' names slot ",
                    dup == dst_sorted.end() ? -1 : *dup,
                    " more than once: overlapping moves into one slot are ambiguous");
  // Sources are read before any write: when some source is also a destination, rows go
  // through a staging buffer; otherwise they are copied directly.
  bool overlap = false;
  for (int64_t i = 0; i < n && !overlap; ++i) {
    overlap = std::binary_search(dst_sorted.begin(), dst_sorted.end(), s(i));
  }
  if (bufs.empty() || n == 0) {
    SPECDEC_RECORD_PATH("move_kv_slots", Isa::PORTABLE);
    return;
  }
  // Work per buffer in bytes/8 (a memcpy step moves about 8 bytes per element-op).
  at::parallel_for(0, static_cast<int64_t>(bufs.size()),
                   grain_for(n * bytes[0] / 8 * (overlap ? 2 : 1)), [&](int64_t b0, int64_t b1) {
    std::vector<char> staging;
    for (int64_t bi = b0; bi < b1; ++bi) {
      char* base = static_cast<char*>(bufs[bi].data_ptr());
      const int64_t row = bytes[bi], stride = bufs[bi].stride(0) * bufs[bi].element_size();
      if (overlap) {
        staging.resize(n * row);
        for (int64_t i = 0; i < n; ++i)
          std::memcpy(staging.data() + i * row, base + s(i) * stride, row);
        for (int64_t i = 0; i < n; ++i)
          std::memcpy(base + d(i) * stride, staging.data() + i * row, row);
      } else {
        for (int64_t i = 0; i < n; ++i) {
          if (s(i) != d(i)) std::memcpy(base + d(i) * stride, base + s(i) * stride, row);
        }
      }
    }
  });
  SPECDEC_RECORD_PATH("move_kv_slots", Isa::PORTABLE);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def(
      "assign_req_to_token(Tensor(a!) req_to_token, Tensor req_rows, Tensor start, Tensor end, Tensor cache_loc) -> ()");
  m.def(
      "assign_draft_cache_locs(Tensor req_to_token, Tensor req_rows, Tensor seq_lens, int topk, int steps) -> Tensor");
  m.def(
      "gather_extend_cache_locs(Tensor req_to_token, Tensor req_rows, Tensor start, Tensor end, SymInt? total=None) -> Tensor");
  m.def(
      "build_draft_decode_table(Tensor req_to_token, Tensor req_rows, Tensor seq_lens, int topk, int steps) -> Tensor");
  m.def("fill_bonus_tokens(Tensor accept_tokens, Tensor accept_lens) -> Tensor");
  m.def(
      "compact_accepted_cache_locs(Tensor cache_loc, Tensor accept_index) -> (Tensor out, Tensor count)");
  m.def(
      "move_kv_slots(Tensor(a!)[] k_buffers, Tensor(b!)[] v_buffers, Tensor src, Tensor dst) -> ()");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("assign_req_to_token", &assign_req_to_token);
  m.impl("assign_draft_cache_locs", &assign_draft_cache_locs);
  m.impl("gather_extend_cache_locs", &gather_extend_cache_locs);
  m.impl("build_draft_decode_table", &build_draft_decode_table);
  m.impl("fill_bonus_tokens", &fill_bonus_tokens);
  m.impl("compact_accepted_cache_locs", &compact_accepted_cache_locs);
  m.impl("move_kv_slots", &move_kv_slots);
}

}  // namespace specdec
