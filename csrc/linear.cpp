// skinny_linear: y = x W^T (+ b) for a few rows of x (decode and verify steps), where a GEMM
// library spends its time packing and the call should instead stream each weight row once at
// memory bandwidth. Contract: shared/spec/kernels.md has no section for it; it is F.linear
// restricted to fp32/bf16, with W's rows dense.
// ISA paths: AVX-512 (linear_avx512.cpp) when active_isa() >= AVX512, AVX2 (linear_avx2.cpp)
// when it is AVX2; portable otherwise. AMX
// would not help: one weight element feeds only M <= 16 products, so the op is memory-bound.
// Output features are split across threads in blocks of 8 rows.
//
// Packed weights: a weight registered with linear_pack_register (the specdec backend registers
// the parameters of the graphs it compiles) is copied once, on its first skinny_linear call,
// into the blocked layout of linear_isa.h, and later calls on the AVX-512 and AVX2 paths read that
// copy instead ("skinny_linear_packed" in kernel_path_counts()): no horizontal sums, x broadcast
// against 16 outputs, one contiguous stream per block -- at M = 8 it runs at the memory
// bandwidth where the row kernel is compute-bound (benchmarks/bench_linear.py). The copy costs
// the weight's size again in memory. The registry keys on the weight's storage (held weakly:
// a freed weight's entry and copy are dropped) and its version counter: an in-place update
// (copy_, load_state_dict, optimizer steps) re-packs on the next call ("skinny_linear_repack").
// A write that bypasses the version counter (through `.data`, or to an inference tensor) is
// not seen: call linear_pack_release (and register again) after such a write.
#include <torch/extension.h>

#include <algorithm>
#include <map>
#include <shared_mutex>
#include <string>
#include <unordered_map>

#include "common.h"
#include "linear_isa.h"

namespace specdec {

void skinny_linear_portable(const LinearBlock& b) {
  const bool f32 = b.dtype == LinearDtype::FLOAT32;
  auto load = [f32](const void* p, int64_t i) -> float {
    return f32 ? static_cast<const float*>(p)[i]
               : static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
  };
  for (int64_t n = b.n_begin; n < b.n_end; ++n) {
    for (int64_t m = 0; m < b.M; ++m) {
      // Sums in double: a plain fp32 running sum over K = 576 errs more than twice torch's
      // blocked sums on some rows (STYLE.md's 2x rule); the portable path is for correctness.
      double acc = 0.0;
      for (int64_t k = 0; k < b.K; ++k) {
        acc += static_cast<double>(load(b.x, m * b.x_stride + k)) * load(b.w, n * b.w_stride + k);
      }
      if (b.bias) acc += load(b.bias, n);
      const float out = static_cast<float>(acc);
      if (f32)
        static_cast<float*>(b.y)[m * b.y_stride + n] = out;
      else
        static_cast<c10::BFloat16*>(b.y)[m * b.y_stride + n] = c10::BFloat16(out);
    }
  }
}

namespace {

constexpr int64_t kRowBlock = 8;
// Most rows the row kernels take; the packed kernel takes any M (the graph pass sends it up to
// lowerings/skinny_linear.PACKED_MAX_ROWS).
constexpr int64_t kRowKernelMaxRows = 16;

// ---- Packed-weight registry ----

struct PackEntry {
  explicit PackEntry(const at::Tensor& w)
      : storage(w.storage().getWeakStorageImpl()),
        sizes(w.sizes().vec()),
        strides(w.strides().vec()),
        offset(w.storage_offset()),
        dtype(w.scalar_type()) {}
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
  at::ScalarType dtype = at::kFloat;
  int64_t version = 0;
  at::Tensor packed;  // undefined until the first skinny_linear call
};

std::shared_mutex g_pack_mu;
std::unordered_map<const void*, PackEntry> g_packs;  // key: the weight's data pointer

int64_t version_of(const at::Tensor& w) { return w.is_inference() ? -1 : w._version(); }

bool describes(const PackEntry& e, const at::Tensor& w) {
  const c10::intrusive_ptr<c10::StorageImpl> live = e.storage.lock();  // null once freed
  return live && live.get() == w.storage().unsafeGetStorageImpl() && e.dtype == w.scalar_type() &&
         e.offset == w.storage_offset() && w.sizes().equals(e.sizes) &&
         w.strides().equals(e.strides);
}

void check_packable(const at::Tensor& w, const char* name) {
  check_cpu(w, name);
  TORCH_CHECK_TYPE(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "argument '",
                   name, "' must be float32 or bfloat16, got ", w.scalar_type());
  check_dim(w, 2, name);
}

// W [N, K] (any strides) into the blocked layout of linear_isa.h, reusing `out` if it fits.
at::Tensor pack_weight(const at::Tensor& w, at::Tensor out) {
  const int64_t N = w.size(0), K = w.size(1);
  const bool f32 = w.scalar_type() == at::kFloat;
  const int64_t P = f32 ? 1 : 2, Kp = (K + P - 1) / P, NB = (N + kPackLanes - 1) / kPackLanes;
  if (!out.defined() || out.sizes() != at::IntArrayRef({NB, Kp, kPackLanes * P}) ||
      out.scalar_type() != w.scalar_type()) {
    out = at::empty({NB, Kp, kPackLanes * P}, w.options());
  }
  const int64_t s0 = w.stride(0), s1 = w.stride(1);
  auto fill = [&](auto* dst, const auto* src) {
    at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t nb = b0; nb < b1; ++nb) {
        auto* d = dst + nb * Kp * kPackLanes * P;
        for (int64_t kk = 0; kk < Kp; ++kk) {
          for (int64_t lane = 0; lane < kPackLanes; ++lane) {
            const int64_t n = nb * kPackLanes + lane;
            for (int64_t p = 0; p < P; ++p) {
              const int64_t k = kk * P + p;
              *d++ = (n < N && k < K) ? src[n * s0 + k * s1] : 0;
            }
          }
        }
      }
    });
  };
  if (f32)
    fill(out.data_ptr<float>(), w.const_data_ptr<float>());
  else
    fill(reinterpret_cast<uint16_t*>(out.data_ptr()),
         reinterpret_cast<const uint16_t*>(w.const_data_ptr()));
  return out;
}

// The current packed copy of `w`, packing or re-packing it first if needed; undefined when `w`
// is not registered.
at::Tensor packed_for(const at::Tensor& w) {
  const int64_t version = version_of(w);
  {
    std::shared_lock<std::shared_mutex> lock(g_pack_mu);
    auto it = g_packs.find(w.const_data_ptr());
    if (it == g_packs.end() || !describes(it->second, w)) return at::Tensor();
    if (it->second.packed.defined() && it->second.version == version) return it->second.packed;
  }
  std::unique_lock<std::shared_mutex> lock(g_pack_mu);
  auto it = g_packs.find(w.const_data_ptr());
  if (it == g_packs.end() || !describes(it->second, w)) return at::Tensor();
  PackEntry& e = it->second;
  if (!e.packed.defined() || e.version != version) {
    if (e.packed.defined())
      SPECDEC_RECORD_PATH("skinny_linear_repack", Isa::PORTABLE);
    else
      SPECDEC_RECORD_PATH("skinny_linear_pack", Isa::PORTABLE);
    e.packed = pack_weight(w, e.packed);
    e.version = version;
  }
  return e.packed;
}

// Packed copies of weight groups (skinny_linear_cat): the blocks of each weight end to end.
// Keyed by the weights' data pointers; built only from weights that are registered
// individually, and valid while each of them is (same storage, layout and version).
struct GroupEntry {
  std::vector<PackEntry> parts;
  at::Tensor packed;
};
std::map<std::vector<const void*>, GroupEntry> g_groups;

bool group_describes(const GroupEntry& g, at::TensorList ws) {
  if (g.parts.size() != ws.size()) return false;
  for (size_t i = 0; i < ws.size(); ++i) {
    if (!describes(g.parts[i], ws[i]) || g.parts[i].version != version_of(ws[i])) return false;
  }
  return true;
}

// The packed copy of `ws` side by side, packing it first if needed; undefined unless every
// weight is registered and every N but the last is a multiple of kPackLanes (so the blocks of
// one weight never hold another's outputs).
at::Tensor packed_group_for(at::TensorList ws) {
  std::vector<const void*> key;
  for (size_t i = 0; i < ws.size(); ++i) {
    if (i + 1 < ws.size() && ws[i].size(0) % kPackLanes != 0) return at::Tensor();
    key.push_back(ws[i].const_data_ptr());
  }
  auto registered = [&] {
    for (const at::Tensor& w : ws) {
      auto it = g_packs.find(w.const_data_ptr());
      if (it == g_packs.end() || !describes(it->second, w)) return false;
    }
    return true;
  };
  {
    std::shared_lock<std::shared_mutex> lock(g_pack_mu);
    if (!registered()) return at::Tensor();
    auto it = g_groups.find(key);
    if (it != g_groups.end() && group_describes(it->second, ws)) return it->second.packed;
  }
  std::unique_lock<std::shared_mutex> lock(g_pack_mu);
  if (!registered()) return at::Tensor();
  auto it = g_groups.find(key);
  if (it != g_groups.end() && group_describes(it->second, ws)) return it->second.packed;
  if (it == g_groups.end())
    SPECDEC_RECORD_PATH("skinny_linear_cat_pack", Isa::PORTABLE);
  else
    SPECDEC_RECORD_PATH("skinny_linear_cat_repack", Isa::PORTABLE);
  GroupEntry g;
  std::vector<at::Tensor> blocks;
  for (const at::Tensor& w : ws) {
    g.parts.emplace_back(w);
    g.parts.back().version = version_of(w);
    blocks.push_back(pack_weight(w, at::Tensor()));
  }
  g.packed = blocks.size() == 1 ? blocks[0] : at::cat(blocks, 0);
  at::Tensor out = g.packed;
  g_groups[key] = std::move(g);
  return out;
}

bool group_expired(const GroupEntry& g) {
  for (const PackEntry& e : g.parts) {
    if (e.storage.expired()) return true;
  }
  return false;
}

// Drops the groups that hold data pointer `p` (a weight released or re-registered).
void drop_groups_with_locked(const void* p) {
  for (auto it = g_groups.begin(); it != g_groups.end();) {
    if (std::find(it->first.begin(), it->first.end(), p) != it->first.end())
      it = g_groups.erase(it);
    else
      ++it;
  }
}

void sweep_expired_locked() {
  for (auto it = g_packs.begin(); it != g_packs.end();) {
    if (it->second.storage.expired())
      it = g_packs.erase(it);
    else
      ++it;
  }
  for (auto it = g_groups.begin(); it != g_groups.end();) {
    if (group_expired(it->second))
      it = g_groups.erase(it);
    else
      ++it;
  }
}

// The path skinny_linear runs on: AVX-512 or AVX2 when built and active (AMX runs AVX-512: the
// op is memory-bound), else portable.
Isa linear_path() {
#ifdef SPECDEC_BUILT_AVX512
  if (active_isa() >= Isa::AVX512) return Isa::AVX512;
#endif
#ifdef SPECDEC_BUILT_AVX2
  if (active_isa() >= Isa::AVX2) return Isa::AVX2;
#endif
  return Isa::PORTABLE;
}

// The packed-weight kernel of a path from linear_path(); nullptr for portable.
void (*packed_kernel_for(Isa isa))(const PackedLinearBlock&) {
#ifdef SPECDEC_BUILT_AVX512
  if (isa == Isa::AVX512) return packed_linear_avx512;
#endif
#ifdef SPECDEC_BUILT_AVX2
  if (isa == Isa::AVX2) return packed_linear_avx2;
#endif
  (void)isa;
  return nullptr;
}

// The checks of one (weight, bias) pair against x; `w_name` / `b_name` name them in errors.
void check_weight(const at::Tensor& x, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias, const std::string& w_name,
                  const std::string& b_name) {
  check_cpu(weight, w_name.c_str());
  TORCH_CHECK_TYPE(weight.scalar_type() == x.scalar_type(), "argument '", w_name,
                   "' must have x's dtype ", x.scalar_type(), ", got ", weight.scalar_type());
  check_dim(weight, 2, w_name.c_str());
  const int64_t K = x.size(-1), N = weight.size(0);
  TORCH_CHECK_VALUE(weight.size(1) == K, "argument '", w_name, "' must have shape [N, ", K,
                    "] (x's last dimension), got ", weight.sizes());
  if (bias.has_value()) {
    check_cpu(*bias, b_name.c_str());
    TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "argument '", b_name,
                     "' must have x's dtype ", x.scalar_type(), ", got ", bias->scalar_type());
    TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == N, "argument '", b_name,
                      "' must have shape [", N, "], got ", bias->sizes());
  }
}

void check_x(const at::Tensor& x) {
  check_cpu(x, "x");
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                   "argument 'x' must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1, "argument 'x' must have at least 1 dimension, got a scalar");
}

// y[:, col0 : col0 + N] = x2 wp^T (+ bias) through a packed kernel: x2 [M, K] dense, wp packed
// ([NB, Kp, 16 P]), bias [N] dense or undefined, y [M, *] dense.
void run_packed(void (*kernel)(const PackedLinearBlock&), const at::Tensor& x2,
                const at::Tensor& wp, int64_t N, const at::Tensor& bias_c, at::Tensor& y,
                int64_t col0) {
  const int64_t M = x2.size(0), K = x2.size(1);
  const bool f32 = x2.scalar_type() == at::kFloat;
  const int64_t Kp = wp.size(1), P = f32 ? 1 : 2;
  // bf16 pairs: an odd K gets a zero column so the last pair reads no foreign memory.
  const at::Tensor xp = Kp * P == K ? x2 : at::constant_pad_nd(x2, {0, Kp * P - K});
  PackedLinearBlock pb{f32 ? LinearDtype::FLOAT32 : LinearDtype::BFLOAT16,
                       M,
                       Kp,
                       N,
                       xp.const_data_ptr(),
                       Kp * P,
                       wp.const_data_ptr(),
                       bias_c.defined() ? bias_c.const_data_ptr() : nullptr,
                       static_cast<char*>(y.data_ptr()) + col0 * y.element_size(),
                       y.size(1),
                       0,
                       0};
  const int64_t groups = (wp.size(0) + kPackGroupBlocks - 1) / kPackGroupBlocks;
  const int64_t per_group = kPackGroupBlocks * kPackLanes * K * M;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, per_group));
  at::parallel_for(0, groups, grain, [&](int64_t begin, int64_t end) {
    PackedLinearBlock part = pb;
    part.g_begin = begin;
    part.g_end = end;
    kernel(part);
  });
}

// y[:, col0 : col0 + N] = x2 weight^T (+ bias), N = weight.size(0): x2 [M, K] dense, bias [N]
// dense or undefined, y [M, *] dense. Records the path that ran.
void linear_into(const at::Tensor& x2, const at::Tensor& weight, const at::Tensor& bias_c,
                 at::Tensor& y, int64_t col0) {
  const int64_t M = x2.size(0), K = x2.size(1), N = weight.size(0);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    at::Tensor part = y.narrow(1, col0, N);
    if (bias_c.defined())
      part.copy_(bias_c.unsqueeze(0).expand({M, N}));
    else
      part.zero_();
    return;
  }
  // The widest SIMD path that is built and active; a registered weight (any strides) runs on
  // its packed copy there.
  const Isa isa = linear_path();
  void (*packed_kernel)(const PackedLinearBlock&) = packed_kernel_for(isa);
  if (packed_kernel != nullptr) {
    const at::Tensor wp = packed_for(weight);
    if (wp.defined()) {
      run_packed(packed_kernel, x2, wp, N, bias_c, y, col0);
      SPECDEC_RECORD_PATH("skinny_linear_packed", isa);
      return;
    }
  }
  // Past kRowKernelMaxRows the row kernels lose to a GEMM library (benchmarks/bench_linear.py):
  // an unpacked weight goes to aten's linear, counted as "skinny_linear_gemm".
  if (M > kRowKernelMaxRows) {
    SPECDEC_RECORD_PATH("skinny_linear_gemm", Isa::PORTABLE);
    y.narrow(1, col0, N)
        .copy_(at::linear(x2, weight,
                          bias_c.defined() ? std::optional<at::Tensor>(bias_c) : std::nullopt));
    return;
  }
  // The fast path needs dense weight rows; any other layout is copied once (and counted, so a
  // caller that hits it every step shows up in kernel_path_counts()).
  at::Tensor w = weight;
  if (weight.stride(1) != 1) {
    w = weight.contiguous();
    SPECDEC_RECORD_PATH("skinny_linear_weight_copy", Isa::PORTABLE);
  }
  LinearBlock blk{x2.scalar_type() == at::kFloat ? LinearDtype::FLOAT32 : LinearDtype::BFLOAT16,
                  M,
                  K,
                  x2.const_data_ptr(),
                  K,
                  w.const_data_ptr(),
                  w.stride(0),
                  bias_c.defined() ? bias_c.const_data_ptr() : nullptr,
                  static_cast<char*>(y.data_ptr()) + col0 * y.element_size(),
                  y.size(1),
                  0,
                  0};
  const int64_t blocks = (N + kRowBlock - 1) / kRowBlock;
  // A chunk gets at least ~64K multiply-adds: splitting a small layer costs more in the thread
  // pool's wake-up than it saves.
  const int64_t grain =
      std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, kRowBlock * K * M));
  at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
    LinearBlock part = blk;
    part.n_begin = begin * kRowBlock;
    part.n_end = std::min(N, end * kRowBlock);
#ifdef SPECDEC_BUILT_AVX512
    if (isa == Isa::AVX512) {
      skinny_linear_avx512(part);
      return;
    }
#endif
#ifdef SPECDEC_BUILT_AVX2
    if (isa == Isa::AVX2) {
      skinny_linear_avx2(part);
      return;
    }
#endif
    skinny_linear_portable(part);
  });
  SPECDEC_RECORD_PATH("skinny_linear", isa);
}

// x's leading dimensions flattened: [M, K], dense (x is small).
at::Tensor rows_of(const at::Tensor& x, int64_t* M) {
  *M = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) *M *= x.size(d);
  return x.reshape({*M, x.size(-1)}).contiguous();
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias) {
  check_x(x);
  check_weight(x, weight, bias, "weight", "bias");
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = weight.size(0);
  int64_t M = 0;
  const at::Tensor x2 = rows_of(x, &M);                        // [M, K]
  at::Tensor y = at::empty({M, weight.size(0)}, x.options());  // [M, N]
  linear_into(x2, weight, bias.has_value() ? bias->contiguous() : at::Tensor(), y, 0);
  return y.view(out_shape);
}

// skinny_linear of several weights against one x, their outputs side by side: y [..., sum N_i].
// Registered weights whose every N_i but the last is a multiple of 16 are packed together once
// (their blocks end to end) and stream as one weight ("skinny_linear_cat_packed"): one thread
// fork, one stream ramp-up and one tail instead of one per weight. Grouping q/k/v and gate/up
// this way is the backend's linear_cat pass (benchmarks/bench_linear.py, "grouped" column).
// Otherwise each weight runs as skinny_linear would, into its columns (paths recorded per
// weight, plus "skinny_linear_cat_split").
at::Tensor skinny_linear_cat(const at::Tensor& x, at::TensorList weights,
                             const c10::List<std::optional<at::Tensor>>& biases) {
  check_x(x);
  TORCH_CHECK_VALUE(!weights.empty(), "argument 'weights' must hold at least one weight");
  TORCH_CHECK_VALUE(biases.size() == weights.size(),
                    "argument 'biases' must have one entry per weight (", weights.size(), "), got ",
                    biases.size());
  std::vector<at::Tensor> bias_c(weights.size());
  int64_t n_total = 0;
  bool any_bias = false;
  for (size_t i = 0; i < weights.size(); ++i) {
    const std::optional<at::Tensor> b = biases.get(i);
    check_weight(x, weights[i], b, "weights[" + std::to_string(i) + "]",
                 "biases[" + std::to_string(i) + "]");
    if (b.has_value()) {
      bias_c[i] = b->contiguous();
      any_bias = true;
    }
    n_total += weights[i].size(0);
  }
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = n_total;
  int64_t M = 0;
  const at::Tensor x2 = rows_of(x, &M);                 // [M, K]
  at::Tensor y = at::empty({M, n_total}, x.options());  // [M, sum N]
  const Isa isa = linear_path();
  void (*packed_kernel)(const PackedLinearBlock&) = packed_kernel_for(isa);
  if (packed_kernel != nullptr && M > 0 && n_total > 0 && x2.size(1) > 0) {
    const at::Tensor wp = packed_group_for(weights);
    if (wp.defined()) {
      at::Tensor bias_all;
      if (any_bias) {
        std::vector<at::Tensor> parts;
        for (size_t i = 0; i < weights.size(); ++i) {
          parts.push_back(bias_c[i].defined() ? bias_c[i]
                                              : at::zeros({weights[i].size(0)}, x.options()));
        }
        bias_all = at::cat(parts);
      }
      run_packed(packed_kernel, x2, wp, n_total, bias_all, y, 0);
      SPECDEC_RECORD_PATH("skinny_linear_cat_packed", isa);
      return y.view(out_shape);
    }
  }
  int64_t col = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    linear_into(x2, weights[i], bias_c[i], y, col);
    col += weights[i].size(0);
  }
  SPECDEC_RECORD_PATH("skinny_linear_cat_split", Isa::PORTABLE);
  return y.view(out_shape);
}

}  // namespace

void bind_linear_pack(pybind11::module& m) {
  m.def(
      "linear_pack_register",
      [](const at::Tensor& w) {
    check_packable(w, "weight");
    std::unique_lock<std::shared_mutex> lock(g_pack_mu);
    sweep_expired_locked();
    auto it = g_packs.find(w.const_data_ptr());
    if (it != g_packs.end() && describes(it->second, w)) return;  // already registered
    if (it != g_packs.end()) {  // another tensor at a reused address
      g_packs.erase(it);
      drop_groups_with_locked(w.const_data_ptr());
    }
    g_packs.emplace(w.const_data_ptr(), PackEntry(w));
  }, pybind11::arg("weight"),
      "Let skinny_linear pack `weight` (2-D fp32/bf16) on its first call and read the packed copy from then on (idempotent).");
  m.def("linear_pack_release", [](const at::Tensor& w) {
    std::unique_lock<std::shared_mutex> lock(g_pack_mu);
    auto it = g_packs.find(w.const_data_ptr());
    if (it == g_packs.end() || !describes(it->second, w)) return false;
    g_packs.erase(it);
    drop_groups_with_locked(w.const_data_ptr());
    return true;
  }, pybind11::arg("weight"), "Forget `weight` and free its packed copy; False if not registered.");
  m.def("linear_pack_clear", [] {
    std::unique_lock<std::shared_mutex> lock(g_pack_mu);
    g_packs.clear();
    g_groups.clear();
  }, "Forget every registered weight and free the packed copies.");
  m.def("linear_pack_stats", [] {
    std::unique_lock<std::shared_mutex> lock(g_pack_mu);
    sweep_expired_locked();
    int64_t packed = 0, bytes = 0;
    for (const auto& kv : g_packs) {
      if (kv.second.packed.defined()) {
        ++packed;
        bytes += kv.second.packed.nbytes();
      }
    }
    for (const auto& kv : g_groups) bytes += kv.second.packed.nbytes();
    return std::map<std::string, int64_t>{{"registered", static_cast<int64_t>(g_packs.size())},
                                          {"packed", packed},
                                          {"groups", static_cast<int64_t>(g_groups.size())},
                                          {"bytes", bytes}};
  }, "Registered weights, how many have a packed copy, how many weight groups (skinny_linear_cat) have one, and all the copies' bytes (live weights only).");
}

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("skinny_linear_cat(Tensor x, Tensor[] weights, Tensor?[] biases) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("skinny_linear_cat", &skinny_linear_cat);
}

}  // namespace specdec
