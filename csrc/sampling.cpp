// Lossless sampling ops (temperature > 0): top_k_top_p_renorm, tree_speculative_sampling,
// chain_speculative_sampling. Contract: shared/spec/kernels.md section 7.
// ISA paths: the vocabulary passes (threshold search for top-k / top-p, masses, rescaling) have
// an AVX-512 path (sampling_avx512.cpp) used when active_isa() >= AVX512, an AVX2 path
// (sampling_avx2.cpp) when it is AVX2, and a portable path (vocab_passes()); the tree / chain
// walks themselves are scalar and shared.
// Uniforms are inputs in [0, 1) (as torch.rand draws them): a draft is accepted when
// u < accept-probability, so a zero-probability token is never accepted, a sure one always.
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "checked_math.h"
#include "common.h"
#include "sampling_isa.h"

namespace specdec {
namespace {

// ------------------------------------------------------------------ vocabulary passes

// Portable vocabulary passes: sum / count of p[i] >= t, and out[i] = p[i] >= t ? p[i] * scale : 0.
double mass_at_or_above_portable(const float* p, int64_t n, float t) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += p[i] >= t ? p[i] : 0.0f;
  return s;
}

int64_t count_at_or_above_portable(const float* p, int64_t n, float t) {
  int64_t c = 0;
  for (int64_t i = 0; i < n; ++i) c += p[i] >= t;
  return c;
}

void keep_and_scale_portable(const float* p, float* out, int64_t n, float t, float scale) {
  for (int64_t i = 0; i < n; ++i) out[i] = p[i] >= t ? p[i] * scale : 0.0f;
}

// The vocabulary passes of one path, chosen once per op call.
struct VocabPasses {
  Isa path;
  double (*mass_at_or_above)(const float* p, int64_t n, float t);
  int64_t (*count_at_or_above)(const float* p, int64_t n, float t);
  void (*keep_and_scale)(const float* p, float* out, int64_t n, float t, float scale);
};

// The widest SIMD passes built and active, else the portable ones.
const VocabPasses& vocab_passes() {
  static const VocabPasses portable{Isa::PORTABLE, mass_at_or_above_portable,
                                    count_at_or_above_portable, keep_and_scale_portable};
  const Isa isa = active_isa();
#ifdef SPECDEC_BUILT_AVX512
  static const VocabPasses avx512{Isa::AVX512, mass_at_or_above_avx512, count_at_or_above_avx512,
                                  keep_and_scale_avx512};
  if (isa >= Isa::AVX512) return avx512;
#endif
#ifdef SPECDEC_BUILT_AVX2
  static const VocabPasses avx2{Isa::AVX2, mass_at_or_above_avx2, count_at_or_above_avx2,
                                keep_and_scale_avx2};
  if (isa >= Isa::AVX2) return avx2;
#endif
  (void)isa;
  return portable;
}

float from_bits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// The values a threshold search still has to look at: first the whole row, later only those at
// or above the search's lower end (copied, in row order, into `scratch`).
struct Candidates {
  const float* vals;
  int64_t n;
  std::vector<float>& scratch;

  // Drops the values below t (none of the searches' predicates can count them again).
  void drop_below(float t) {
    if (vals != scratch.data()) scratch.resize(n);
    float* dst = scratch.data();
    int64_t m = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float x = vals[i];
      dst[m] = x;
      m += x >= t;
    }
    vals = dst;
    n = m;
  }
};

// Largest threshold t (a float >= lo) with pred(vals, n, t) true, where pred is true at lo and
// monotone (true then false) in t and only counts values >= t. Non-negative floats order like
// their bit patterns, so a binary search over the bits converges exactly to a value present in
// the row (a step of the count / mass). Each time the lower end rises, the values below it are
// dropped from `c`: with a peaked distribution the later passes read a few hundred values
// instead of the vocabulary (the same sums: a dropped value only ever added 0).
template <typename Pred>
float largest_threshold(float lo, Candidates& c, Pred pred) {
  uint32_t a, b = 0x7f800000u;  // +inf: pred(inf) is false for any non-empty keep set
  std::memcpy(&a, &lo, sizeof a);
  while (b - a > 1) {
    const uint32_t mid = a + (b - a) / 2;
    if (pred(c.vals, c.n, from_bits(mid))) {
      a = mid;
      c.drop_below(from_bits(a));
    } else {
      b = mid;
    }
  }
  return from_bits(a);
}

// Threshold keeping the top-k (ties at the k-th value kept) and then the smallest top
// probabilities whose mass reaches top_p of the kept mass (ties kept). 0 keeps everything.
float keep_threshold(const float* p, int64_t V, int64_t top_k, double top_p, const VocabPasses& vp,
                     std::vector<float>& scratch) {
  Candidates c{p, V, scratch};
  float t = 0.0f;
  if (top_k > 0 && top_k < V) {
    t = largest_threshold(0.0f, c, [&](const float* v, int64_t n, float x) {
      return vp.count_at_or_above(v, n, x) >= top_k;
    });
  }
  if (top_p < 1.0) {
    const double target = top_p * vp.mass_at_or_above(c.vals, c.n, t);
    t = largest_threshold(t, c, [&](const float* v, int64_t n, float x) {
      return vp.mass_at_or_above(v, n, x) >= target;
    });
  }
  return t;
}

// Inverse-CDF draw of u in [0, 1) from weights w (only those with keep(i) true), total mass
// `total`. Float round-off can leave the scan without a pick: then the last positive weight.
template <typename Weight>
int64_t draw(int64_t V, double total, float u, Weight w) {
  const double target = static_cast<double>(u) * total;
  double cum = 0;
  int64_t last_positive = -1;
  for (int64_t i = 0; i < V; ++i) {
    const double wi = w(i);
    if (wi <= 0) continue;
    cum += wi;
    last_positive = i;
    if (cum > target) return i;
  }
  return last_positive;
}

void check_probs(const at::Tensor& t, int64_t dim, const char* name) {
  check_dtype(t, at::kFloat, name);
  check_dim(t, dim, name);
  TORCH_CHECK_VALUE(t.size(dim - 1) >= 1, "argument '", name, "' must have a non-empty vocabulary");
}

void check_uniforms(const at::Tensor& u, const char* name) {
  const float* p = u.const_data_ptr<float>();
  for (int64_t i = 0; i < u.numel(); ++i) {
    TORCH_CHECK_VALUE(p[i] >= 0.0f && p[i] < 1.0f, "argument '", name, "' must lie in [0, 1), got ",
                      p[i], " at flat index ", i);
  }
}

// uniform_samples [bs, cols] and uniform_final [bs], float32 in [0, 1); returned contiguous.
std::pair<at::Tensor, at::Tensor> checked_uniforms(const at::Tensor& uniform_samples,
                                                   const at::Tensor& uniform_final, int64_t bs,
                                                   int64_t cols) {
  check_dtype(uniform_samples, at::kFloat, "uniform_samples");
  check_dim(uniform_samples, 2, "uniform_samples");
  check_size(uniform_samples, 0, bs, "uniform_samples");
  check_size(uniform_samples, 1, cols, "uniform_samples");
  check_dtype(uniform_final, at::kFloat, "uniform_final");
  check_dim(uniform_final, 1, "uniform_final");
  check_size(uniform_final, 0, bs, "uniform_final");
  at::Tensor us = uniform_samples.contiguous(), uf = uniform_final.contiguous();
  check_uniforms(us, "uniform_samples");
  check_uniforms(uf, "uniform_final");
  return {us, uf};
}

// ------------------------------------------------------------------ ops

at::Tensor top_k_top_p_renorm(const at::Tensor& probs, const at::Tensor& top_k,
                              const at::Tensor& top_p) {
  check_probs(probs, 2, "probs");
  const int64_t R = probs.size(0), V = probs.size(1);
  check_index(top_k, 1, "top_k");
  check_size(top_k, 0, R, "top_k");
  check_dtype(top_p, at::kFloat, "top_p");
  check_dim(top_p, 1, "top_p");
  check_size(top_p, 0, R, "top_p");
  const IndexView ks(top_k);
  const at::Tensor tp = top_p.contiguous();
  const float* tps = tp.const_data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK_VALUE(tps[r] > 0.0f && tps[r] <= 1.0f, "argument 'top_p' [", r, "] = ", tps[r],
                      " must lie in (0, 1]");
  }
  const at::Tensor p = probs.contiguous();         // rows are scanned linearly
  at::Tensor out = at::empty({R, V}, at::kFloat);  // [R, V]
  const VocabPasses& vp = vocab_passes();
  at::parallel_for(0, R, grain_for(V * 40), [&](int64_t r0, int64_t r1) {
    std::vector<float> scratch;
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = p.const_data_ptr<float>() + r * V;
      const float t = keep_threshold(row, V, ks(r), tps[r], vp, scratch);
      const double kept = vp.mass_at_or_above(row, V, t);
      TORCH_CHECK_VALUE(kept > 0 && std::isfinite(kept), "argument 'probs' row ", r,
                        " has no positive finite mass");
      vp.keep_and_scale(row, out.data_ptr<float>() + r * V, V, t, static_cast<float>(1.0 / kept));
    }
  });
  SPECDEC_RECORD_PATH("top_k_top_p_renorm", vp.path);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> tree_speculative_sampling(
    const at::Tensor& candidates, const at::Tensor& retrieve_index,
    const at::Tensor& retrieve_next_token, const at::Tensor& retrieve_next_sibling,
    const at::Tensor& uniform_samples, const at::Tensor& uniform_final,
    const at::Tensor& target_probs, int64_t num_spec_steps) {
  check_index(candidates, 2, "candidates");
  const int64_t bs = candidates.size(0), N = candidates.size(1), S = num_spec_steps;
  const std::pair<const at::Tensor*, const char*> linkage[] = {
      {&retrieve_index, "retrieve_index"},
      {&retrieve_next_token, "retrieve_next_token"},
      {&retrieve_next_sibling, "retrieve_next_sibling"}};
  for (const auto& [t, name] : linkage) {
    check_index(*t, 2, name);
    check_size(*t, 0, bs, name);
    check_size(*t, 1, N, name);
  }
  TORCH_CHECK_VALUE(S >= 1, "argument 'num_spec_steps' must be >= 1, got ", S);
  check_alloc(checked_mul(bs, S, "batch * argument 'num_spec_steps'"), "accept_index");
  const auto [us, uf] = checked_uniforms(uniform_samples, uniform_final, bs, N);
  check_probs(target_probs, 3, "target_probs");
  check_size(target_probs, 0, bs, "target_probs");
  check_size(target_probs, 1, N, "target_probs");
  const int64_t V = target_probs.size(2);
  const IndexView cand(candidates), ridx(retrieve_index), next_tok(retrieve_next_token),
      next_sib(retrieve_next_sibling);
  for (int64_t b = 0; b < bs; ++b) {
    for (int64_t i = 0; i < N; ++i) {
      const int64_t r = ridx(b, i), c = next_tok(b, i), s = next_sib(b, i), tok = cand(b, i);
      TORCH_CHECK_INDEX(r >= b * N && r < (b + 1) * N, "argument 'retrieve_index' [", b, ", ", i,
                        "] = ", r, " is outside request ", b, "'s rows");
      TORCH_CHECK_INDEX(c == -1 || (c >= 1 && c < N), "argument 'retrieve_next_token' [", b, ", ",
                        i, "] = ", c, " is not -1 or a non-root node");
      TORCH_CHECK_INDEX(s == -1 || (s >= 1 && s < N), "argument 'retrieve_next_sibling' [", b, ", ",
                        i, "] = ", s, " is not -1 or a non-root node");
      TORCH_CHECK_INDEX(tok >= 0 && tok < V, "argument 'candidates' [", b, ", ", i, "] = ", tok,
                        " is outside the vocabulary of target_probs (", V, ")");
    }
  }
  const at::Tensor probs = target_probs.contiguous();
  const float* P = probs.const_data_ptr<float>();
  const float* U = us.const_data_ptr<float>();
  const float* UF = uf.const_data_ptr<float>();
  at::Tensor predicts = at::full({bs * N}, -1, at::kInt);     // [B*N]
  at::Tensor accept_index = at::full({bs, S}, -1, at::kInt);  // [B, S]
  at::Tensor accept_token_num = at::zeros({bs}, at::kInt);    // [B]
  int32_t* pred = predicts.data_ptr<int32_t>();
  int32_t* acc = accept_index.data_ptr<int32_t>();
  int32_t* num = accept_token_num.data_ptr<int32_t>();
  const VocabPasses& vp = vocab_passes();

  at::parallel_for(0, bs, grain_for(N * V), [&](int64_t b0, int64_t b1) {
    std::vector<int64_t> rejected;
    for (int64_t b = b0; b < b1; ++b) {
      int64_t last = ridx(b, 0), node = 0, accepted = 0;
      acc[b * S] = static_cast<int32_t>(last);
      const float* p = nullptr;
      double remaining = 0;
      for (int64_t level = 0;; ++level) {
        // Residual at `node`: its target distribution without the rejected siblings' mass.
        p = P + (b * N + node) * V;
        remaining = vp.mass_at_or_above(p, V, 0.0f);
        TORCH_CHECK_VALUE(remaining > 0 && std::isfinite(remaining), "argument 'target_probs' [", b,
                          ", ", node, "] has no positive finite mass");
        rejected.clear();
        if (level == S - 1) break;
        int64_t child = next_tok(b, node), hops = 0, found = -1;
        while (child != -1) {
          const int64_t tok = cand(b, child);
          bool seen = false;
          for (int64_t r : rejected) seen |= r == tok;
          const double pr = seen ? 0.0 : p[tok];
          // Deterministic candidate (q = 1): accept with probability residual(tok) / remaining.
          if (pr > 0 && static_cast<double>(U[b * N + child]) * remaining < pr) {
            found = child;
            break;
          }
          if (pr > 0) {
            rejected.push_back(tok);
            remaining -= pr;
          }
          child = next_sib(b, child);
          TORCH_CHECK_VALUE(
              ++hops < N,
              "malformed tree: argument 'retrieve_next_sibling' has a cycle in request ", b);
        }
        if (found < 0) break;
        pred[last] = static_cast<int32_t>(cand(b, found));
        last = ridx(b, found);
        node = found;
        acc[b * S + ++accepted] = static_cast<int32_t>(last);
      }
      // Bonus token from the residual at the last accepted node.
      auto weight = [&](int64_t i) -> double {
        for (int64_t r : rejected)
          if (r == i) return 0.0;
        return p[i];
      };
      int64_t bonus = draw(V, remaining, UF[b], weight);
      if (bonus < 0)
        bonus = draw(V, vp.mass_at_or_above(p, V, 0.0f), UF[b],
                     [&](int64_t i) -> double { return p[i]; });
      pred[last] = static_cast<int32_t>(bonus);
      num[b] = static_cast<int32_t>(accepted);
    }
  });
  SPECDEC_RECORD_PATH("tree_speculative_sampling", vp.path);
  return {predicts, accept_index, accept_token_num};
}

std::tuple<at::Tensor, at::Tensor> chain_speculative_sampling(const at::Tensor& draft_tokens,
                                                              const at::Tensor& draft_probs,
                                                              const at::Tensor& target_probs,
                                                              const at::Tensor& uniform_samples,
                                                              const at::Tensor& uniform_final) {
  check_index(draft_tokens, 2, "draft_tokens");
  const int64_t bs = draft_tokens.size(0), K = draft_tokens.size(1);
  check_probs(draft_probs, 3, "draft_probs");
  check_size(draft_probs, 0, bs, "draft_probs");
  check_size(draft_probs, 1, K, "draft_probs");
  const int64_t V = draft_probs.size(2);
  check_probs(target_probs, 3, "target_probs");
  check_size(target_probs, 0, bs, "target_probs");
  check_size(target_probs, 1, K + 1, "target_probs");
  check_size(target_probs, 2, V, "target_probs");
  const auto [us, uf] = checked_uniforms(uniform_samples, uniform_final, bs, K);
  const IndexView toks(draft_tokens);
  for (int64_t b = 0; b < bs; ++b) {
    for (int64_t i = 0; i < K; ++i) {
      TORCH_CHECK_INDEX(toks(b, i) >= 0 && toks(b, i) < V, "argument 'draft_tokens' [", b, ", ", i,
                        "] = ", toks(b, i), " is outside the vocabulary (", V, ")");
    }
  }
  const at::Tensor q_all = draft_probs.contiguous(), p_all = target_probs.contiguous();
  const float* Q = q_all.const_data_ptr<float>();
  const float* P = p_all.const_data_ptr<float>();
  const float* U = us.const_data_ptr<float>();
  const float* UF = uf.const_data_ptr<float>();
  at::Tensor out = at::full({bs, K + 1}, -1, at::kLong);  // [B, K+1] accepted drafts + 1, -1 after
  at::Tensor accept_token_num = at::zeros({bs}, at::kInt);  // [B]
  int64_t* o = out.data_ptr<int64_t>();
  int32_t* num = accept_token_num.data_ptr<int32_t>();
  const VocabPasses& vp = vocab_passes();
  at::parallel_for(0, bs, grain_for((K + 1) * V), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t i = 0;
      for (; i < K; ++i) {
        const int64_t x = toks(b, i);
        const double p = P[(b * (K + 1) + i) * V + x], q = Q[(b * K + i) * V + x];
        if (!(static_cast<double>(U[b * K + i]) * q < p)) break;  // accept w.p. min(1, p/q)
        o[b * (K + 1) + i] = x;
      }
      num[b] = static_cast<int32_t>(i);
      const float* p = P + (b * (K + 1) + i) * V;
      int64_t token;
      if (i < K) {
        // Rejected: draw from the residual max(p - q, 0), renormalized.
        const float* q = Q + (b * K + i) * V;
        auto residual = [&](int64_t j) -> double { return std::max(0.0f, p[j] - q[j]); };
        double total = 0;
        for (int64_t j = 0; j < V; ++j) total += residual(j);
        token = total > 0 ? draw(V, total, UF[b], residual) : -1;
        if (token < 0)
          token = draw(V, vp.mass_at_or_above(p, V, 0.0f), UF[b],
                       [&](int64_t j) -> double { return p[j]; });
      } else {
        token = draw(V, vp.mass_at_or_above(p, V, 0.0f), UF[b],
                     [&](int64_t j) -> double { return p[j]; });
      }
      TORCH_CHECK_VALUE(token >= 0, "argument 'target_probs' row ", b, " has no positive mass");
      o[b * (K + 1) + i] = token;
    }
  });
  SPECDEC_RECORD_PATH("chain_speculative_sampling", vp.path);
  return {out, accept_token_num};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("top_k_top_p_renorm(Tensor probs, Tensor top_k, Tensor top_p) -> Tensor");
  m.def(
      "tree_speculative_sampling(Tensor candidates, Tensor retrieve_index, "
      "Tensor retrieve_next_token, Tensor retrieve_next_sibling, Tensor uniform_samples, "
      "Tensor uniform_final, Tensor target_probs, int num_spec_steps) -> "
      "(Tensor predicts, Tensor accept_index, Tensor accept_token_num)");
  m.def(
      "chain_speculative_sampling(Tensor draft_tokens, Tensor draft_probs, Tensor target_probs, Tensor uniform_samples, Tensor uniform_final) -> (Tensor tokens, Tensor accept_token_num)");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("top_k_top_p_renorm", &top_k_top_p_renorm);
  m.impl("tree_speculative_sampling", &tree_speculative_sampling);
  m.impl("chain_speculative_sampling", &chain_speculative_sampling);
}

}  // namespace specdec
