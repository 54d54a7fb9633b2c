// Draft-tree ops: build_tree, verify_tree_greedy (functional and SGLang-style out variant),
// reconstruct_tree_from_mask. Contract: shared/spec/kernels.md sections 1-4.
// ISA paths: portable only -- these are pointer-chasing walks over at most N <= a few hundred
// nodes per request, with no data-parallel inner loop worth vectorizing; they parallelize over
// the batch instead.
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "checked_math.h"
#include "common.h"

namespace specdec {
namespace {

enum class TreeMaskMode : int64_t { FULL_MASK = 0, QLEN_ONLY = 1, QLEN_ONLY_BITPACKING = 2 };

// Writes bit-packed mask rows (one little-endian integer per query row) of the element type
// the spec gives for N: uint8 (N<=8), 16-bit (N<=16), 32-bit (N<=32), 64-bit (N<=64).
at::ScalarType bitpack_dtype(int64_t n) {
  if (n <= 8) return at::kByte;
  if (n <= 16) return at::kShort;
  if (n <= 32) return at::kInt;
  return at::kLong;
}

void store_bits(void* base, at::ScalarType dtype, int64_t row, uint64_t bits) {
  switch (dtype) {
    case at::kByte: static_cast<uint8_t*>(base)[row] = static_cast<uint8_t>(bits); break;
    case at::kShort: static_cast<uint16_t*>(base)[row] = static_cast<uint16_t>(bits); break;
    case at::kInt: static_cast<uint32_t*>(base)[row] = static_cast<uint32_t>(bits); break;
    default: static_cast<uint64_t*>(base)[row] = bits; break;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> build_tree(
    const at::Tensor& parent_list, const at::Tensor& selected_index, const at::Tensor& seq_lens,
    int64_t topk, int64_t depth, int64_t num_draft_tokens, int64_t tree_mask_mode) {
  const int64_t N = num_draft_tokens;
  TORCH_CHECK_VALUE(topk >= 1, "argument 'topk' must be >= 1, got ", topk);
  TORCH_CHECK_VALUE(depth >= 1, "argument 'depth' must be >= 1, got ", depth);
  TORCH_CHECK_VALUE(N >= 1, "argument 'num_draft_tokens' must be >= 1, got ", N);
  checked_mul(N, N, "argument 'num_draft_tokens' squared");
  TORCH_CHECK_VALUE(
      tree_mask_mode >= 0 && tree_mask_mode <= 2,
      "argument 'tree_mask_mode' must be FULL_MASK (0), QLEN_ONLY (1) or QLEN_ONLY_BITPACKING (2), got ",
      tree_mask_mode);
  const auto mode = static_cast<TreeMaskMode>(tree_mask_mode);
  TORCH_CHECK_VALUE(mode != TreeMaskMode::QLEN_ONLY_BITPACKING || N <= 64,
                    "argument 'num_draft_tokens' must be <= 64 for QLEN_ONLY_BITPACKING, got ", N);
  check_index(seq_lens, 1, "seq_lens");
  const int64_t bs = seq_lens.size(0);
  check_index(selected_index, 2, "selected_index");
  check_size(selected_index, 0, bs, "selected_index");
  check_size(selected_index, 1, N - 1, "selected_index");
  check_index(parent_list, 2, "parent_list");
  check_size(parent_list, 0, bs, "parent_list");
  // parent_list is a real tensor, so its width bounds topk * (depth - 1) before the products
  // below are formed (checked anyway: huge topk / depth must be a named error, never a wrap).
  const int64_t parent_width =
      depth == 1 ? 0
                 : checked_add(checked_mul(topk, depth - 1, "argument 'topk' * ('depth' - 1)"), 1,
                               "the parent_list width");
  check_size(parent_list, 1, parent_width, "parent_list");
  // Global draft ids: topk from step 0, topk*topk from each later step.
  const int64_t num_ids =
      checked_add(topk,
                  checked_mul(checked_mul(topk, topk, "argument 'topk' squared"), depth - 1,
                              "argument 'topk' squared * ('depth' - 1)"),
                  "the draft candidate count");
  TORCH_CHECK_VALUE(N - 1 <= num_ids, "argument 'num_draft_tokens' (", N,
                    ") exceeds 1 + the number of draft candidates (", num_ids, ")");

  const IndexView sel(selected_index), par(parent_list), lens(seq_lens);
  // Request b's FULL_MASK block starts at sum_{c<b}(seq_len_c*N + N*N).
  std::vector<int64_t> mask_offset(bs + 1, 0);
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t len = lens(b);
    TORCH_CHECK_VALUE(len >= 0, "argument 'seq_lens' must be >= 0, got ", len, " at row ", b);
    const int64_t block =
        checked_add(checked_mul(len, N, "seq_lens * num_draft_tokens"),
                    checked_mul(N, N, "num_draft_tokens squared"), "a FULL_MASK block");
    mask_offset[b + 1] = checked_add(mask_offset[b], block, "the FULL_MASK size");
  }
  const int64_t bsN = checked_mul(bs, N, "batch * argument 'num_draft_tokens'");
  check_alloc(checked_mul(bsN, N, "batch * num_draft_tokens squared"), "the tree mask");
  check_alloc(mask_offset[bs], "the FULL_MASK tree mask");

  const auto long_opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor positions = at::empty({bs * N}, long_opts);             // [B*N]
  at::Tensor retrieve_index = at::empty({bs, N}, long_opts);         // [B, N]
  at::Tensor retrieve_next_token = at::empty({bs, N}, long_opts);    // [B, N]
  at::Tensor retrieve_next_sibling = at::empty({bs, N}, long_opts);  // [B, N]
  at::Tensor tree_mask;
  switch (mode) {
    case TreeMaskMode::FULL_MASK: tree_mask = at::empty({mask_offset[bs]}, at::kBool); break;
    case TreeMaskMode::QLEN_ONLY: tree_mask = at::empty({bs * N * N}, at::kBool); break;
    case TreeMaskMode::QLEN_ONLY_BITPACKING:
      tree_mask = at::empty({bs * N}, bitpack_dtype(N));  // [B*N] one integer per query row
      break;
  }
  int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* ridx = retrieve_index.data_ptr<int64_t>();
  int64_t* next_tok = retrieve_next_token.data_ptr<int64_t>();
  int64_t* next_sib = retrieve_next_sibling.data_ptr<int64_t>();
  bool* mask_bool =
      mode == TreeMaskMode::QLEN_ONLY_BITPACKING ? nullptr : tree_mask.data_ptr<bool>();
  void* mask_bits = mode == TreeMaskMode::QLEN_ONLY_BITPACKING ? tree_mask.data_ptr() : nullptr;
  const at::ScalarType bits_dtype = tree_mask.scalar_type();

  at::parallel_for(0, bs, grain_for(mask_offset[bs] / std::max<int64_t>(1, bs)),
                   [&](int64_t b0, int64_t b1) {
    std::vector<int64_t> parent(N), node_depth(N), first_child(N);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t len = lens(b);
      // Resolve each selected node's parent. Ids are sorted ascending, so a parent (smaller id)
      // is always an earlier node and the binary search only looks at nodes before j.
      parent[0] = -1;
      node_depth[0] = 0;
      for (int64_t j = 0; j < N - 1; ++j) {
        const int64_t s = sel(b, j);
        TORCH_CHECK_INDEX(s >= 0 && s < num_ids, "argument 'selected_index' [", b, ", ", j,
                          "] = ", s, " is outside [0, ", num_ids, ")");
        TORCH_CHECK_VALUE(j == 0 || s > sel(b, j - 1), "argument 'selected_index' row ", b,
                          " must be strictly ascending (malformed tree)");
        const int64_t p = s / topk;
        int64_t parent_node = 0;
        if (p != 0) {
          const int64_t target = par(b, p);
          int64_t lo = 0, hi = j;  // search selected_index[b, 0:j] for target
          while (lo < hi) {
            const int64_t mid = (lo + hi) / 2;
            if (sel(b, mid) < target)
              lo = mid + 1;
            else
              hi = mid;
          }
          TORCH_CHECK_VALUE(lo < j && sel(b, lo) == target,
                            "malformed tree: argument 'selected_index' [", b, ", ", j, "] = ", s,
                            " names parent id ", target, " (parent_list[", b, ", ", p,
                            "]), which is not selected before it");
          parent_node = lo + 1;
        }
        parent[j + 1] = parent_node;
        node_depth[j + 1] = node_depth[parent_node] + 1;
      }
      // Linkage: walking nodes in descending order, first_child[p] is always the smallest child
      // seen so far, i.e. the next larger-numbered sibling of the node being visited.
      std::fill(first_child.begin(), first_child.end(), -1);
      for (int64_t i = N - 1; i >= 0; --i) {
        next_sib[b * N + i] = i == 0 ? -1 : first_child[parent[i]];
        if (i > 0) first_child[parent[i]] = i;
      }
      for (int64_t i = 0; i < N; ++i) {
        next_tok[b * N + i] = first_child[i];
        ridx[b * N + i] = b * N + i;
        pos[b * N + i] = len + node_depth[i];
      }
      // Masks: a node's row is its parent's row plus itself (parents come first).
      if (mode == TreeMaskMode::QLEN_ONLY_BITPACKING) {
        std::vector<uint64_t> bits(N);
        for (int64_t i = 0; i < N; ++i) {
          bits[i] = (i == 0 ? 0 : bits[parent[i]]) | (uint64_t{1} << i);
          store_bits(mask_bits, bits_dtype, b * N + i, bits[i]);
        }
      } else {
        const bool full = mode == TreeMaskMode::FULL_MASK;
        const int64_t prefix = full ? len : 0;
        const int64_t width = prefix + N;
        bool* block = mask_bool + (full ? mask_offset[b] : b * N * N);
        for (int64_t i = 0; i < N; ++i) {
          bool* row = block + i * width;
          std::fill(row, row + prefix, true);
          if (i == 0) {
            std::fill(row + prefix, row + width, false);
          } else {
            std::copy(block + parent[i] * width + prefix, block + parent[i] * width + width,
                      row + prefix);
          }
          row[prefix + i] = true;
        }
      }
    }
  });
  SPECDEC_RECORD_PATH("build_tree", Isa::PORTABLE);
  return {tree_mask, positions, retrieve_index, retrieve_next_token, retrieve_next_sibling};
}

// Shared by the functional and the out variant. Validates all inputs before any write.
void verify_tree_greedy_impl(int32_t* predicts, int32_t* accept_index, int64_t acc_s0,
                             int64_t acc_s1, int32_t* accept_token_num, int64_t num_s0,
                             const at::Tensor& candidates, const at::Tensor& retrieve_index,
                             const at::Tensor& retrieve_next_token,
                             const at::Tensor& retrieve_next_sibling,
                             const at::Tensor& target_predict, int64_t num_spec_steps,
                             int64_t predicts_stride) {
  const int64_t bs = candidates.size(0), N = candidates.size(1), S = num_spec_steps;
  const IndexView cand(candidates), ridx(retrieve_index), next_tok(retrieve_next_token),
      next_sib(retrieve_next_sibling), target(target_predict);
  // Validate the linkage up front so a malformed tree can neither hang the walk nor write out
  // of bounds; each request may only touch its own block of `predicts`.
  for (int64_t b = 0; b < bs; ++b) {
    for (int64_t i = 0; i < N; ++i) {
      const int64_t r = ridx(b, i);
      TORCH_CHECK_INDEX(r >= b * N && r < (b + 1) * N, "argument 'retrieve_index' [", b, ", ", i,
                        "] = ", r, " is outside request ", b, "'s rows [", b * N, ", ", (b + 1) * N,
                        ")");
      const int64_t c = next_tok(b, i), s = next_sib(b, i);
      TORCH_CHECK_INDEX(c == -1 || (c >= 1 && c < N), "argument 'retrieve_next_token' [", b, ", ",
                        i, "] = ", c, " is not -1 or a non-root node in [1, ", N, ")");
      TORCH_CHECK_INDEX(s == -1 || (s >= 1 && s < N), "argument 'retrieve_next_sibling' [", b, ", ",
                        i, "] = ", s, " is not -1 or a non-root node in [1, ", N, ")");
    }
  }
  at::parallel_for(0, bs, grain_for(N * S), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t last = ridx(b, 0);
      int64_t node = 0, accepted = 0;
      accept_index[b * acc_s0] = static_cast<int32_t>(last);
      for (int64_t level = 1; level < S; ++level) {
        // The target's token after `node` is what a child must carry to be accepted.
        const int64_t want = target(last / N, last % N);
        int64_t child = next_tok(b, node), hops = 0, found = -1;
        while (child != -1) {
          if (cand(b, child) == want) {
            found = child;
            break;
          }
          child = next_sib(b, child);
          TORCH_CHECK_VALUE(
              ++hops < N,
              "malformed tree: argument 'retrieve_next_sibling' has a cycle in request ", b);
        }
        if (found < 0) break;
        predicts[last * predicts_stride] = static_cast<int32_t>(want);
        last = ridx(b, found);
        node = found;
        ++accepted;
        accept_index[b * acc_s0 + accepted * acc_s1] = static_cast<int32_t>(last);
      }
      for (int64_t k = accepted + 1; k < S; ++k) accept_index[b * acc_s0 + k * acc_s1] = -1;
      predicts[last * predicts_stride] = static_cast<int32_t>(target(last / N, last % N));  // bonus
      accept_token_num[b * num_s0] = static_cast<int32_t>(accepted);
    }
  });
  SPECDEC_RECORD_PATH("verify_tree_greedy", Isa::PORTABLE);
}

void check_verify_inputs(const at::Tensor& candidates, const at::Tensor& retrieve_index,
                         const at::Tensor& retrieve_next_token,
                         const at::Tensor& retrieve_next_sibling, const at::Tensor& target_predict,
                         int64_t num_spec_steps) {
  check_index(candidates, 2, "candidates");
  const int64_t bs = candidates.size(0), N = candidates.size(1);
  TORCH_CHECK_VALUE(N >= 1, "argument 'candidates' must have at least one node per request");
  const std::pair<const at::Tensor*, const char*> same_shape[] = {
      {&retrieve_index, "retrieve_index"},
      {&retrieve_next_token, "retrieve_next_token"},
      {&retrieve_next_sibling, "retrieve_next_sibling"},
      {&target_predict, "target_predict"}};
  for (const auto& [t, name] : same_shape) {
    check_index(*t, 2, name);
    check_size(*t, 0, bs, name);
    check_size(*t, 1, N, name);
  }
  TORCH_CHECK_VALUE(num_spec_steps >= 1, "argument 'num_spec_steps' must be >= 1, got ",
                    num_spec_steps);
  checked_mul(N, num_spec_steps, "candidates' N * argument 'num_spec_steps'");
  check_alloc(checked_mul(bs, num_spec_steps, "batch * argument 'num_spec_steps'"), "accept_index");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> verify_tree_greedy(
    const at::Tensor& candidates, const at::Tensor& retrieve_index,
    const at::Tensor& retrieve_next_token, const at::Tensor& retrieve_next_sibling,
    const at::Tensor& target_predict, int64_t num_spec_steps) {
  check_verify_inputs(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                      target_predict, num_spec_steps);
  const int64_t bs = candidates.size(0), N = candidates.size(1);
  at::Tensor predicts = at::full({bs * N}, -1, at::kInt);               // [B*N]
  at::Tensor accept_index = at::empty({bs, num_spec_steps}, at::kInt);  // [B, S]
  at::Tensor accept_token_num = at::empty({bs}, at::kInt);              // [B]
  verify_tree_greedy_impl(predicts.data_ptr<int32_t>(), accept_index.data_ptr<int32_t>(),
                          num_spec_steps, 1, accept_token_num.data_ptr<int32_t>(), 1, candidates,
                          retrieve_index, retrieve_next_token, retrieve_next_sibling,
                          target_predict, num_spec_steps, 1);
  return {predicts, accept_index, accept_token_num};
}

// SGLang-style: outputs preallocated by the caller; entries of `predicts` off the accepted path
// keep whatever the caller filled them with. num_spec_steps is accept_index.size(1).
void verify_tree_greedy_out(at::Tensor& predicts, at::Tensor& accept_index,
                            at::Tensor& accept_token_num, const at::Tensor& candidates,
                            const at::Tensor& retrieve_index, const at::Tensor& retrieve_next_token,
                            const at::Tensor& retrieve_next_sibling,
                            const at::Tensor& target_predict) {
  check_dtype(accept_index, at::kInt, "accept_index");
  check_dim(accept_index, 2, "accept_index");
  const int64_t S = accept_index.size(1);
  check_verify_inputs(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                      target_predict, S);
  const int64_t bs = candidates.size(0), N = candidates.size(1);
  check_size(accept_index, 0, bs, "accept_index");
  check_dtype(predicts, at::kInt, "predicts");
  check_dim(predicts, 1, "predicts");
  check_size(predicts, 0, bs * N, "predicts");
  check_dtype(accept_token_num, at::kInt, "accept_token_num");
  check_dim(accept_token_num, 1, "accept_token_num");
  check_size(accept_token_num, 0, bs, "accept_token_num");
  verify_tree_greedy_impl(predicts.data_ptr<int32_t>(), accept_index.data_ptr<int32_t>(),
                          accept_index.stride(0), accept_index.stride(1),
                          accept_token_num.data_ptr<int32_t>(), accept_token_num.stride(0),
                          candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                          target_predict, S, predicts.stride(0));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> reconstruct_tree_from_mask(
    const at::Tensor& tree_mask, const at::Tensor& seq_lens, int64_t num_draft_tokens) {
  const int64_t N = num_draft_tokens;
  TORCH_CHECK_VALUE(N >= 1, "argument 'num_draft_tokens' must be >= 1, got ", N);
  checked_mul(checked_mul(N, N, "argument 'num_draft_tokens' squared"), 2,
              "argument 'num_draft_tokens' squared * 2");
  check_index(seq_lens, 1, "seq_lens");
  const int64_t bs = seq_lens.size(0);
  check_dtype(tree_mask, at::kBool, "tree_mask");
  check_dim(tree_mask, 1, "tree_mask");
  check_size(tree_mask, 0,
             checked_mul(checked_mul(bs, N, "batch * argument 'num_draft_tokens'"), N,
                         "batch * num_draft_tokens squared"),
             "tree_mask");
  const IndexView lens(seq_lens);
  const bool* mask = tree_mask.const_data_ptr<bool>();
  const int64_t ms = tree_mask.stride(0);
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK_VALUE(lens(b) >= 0, "argument 'seq_lens' must be >= 0, got ", lens(b), " at row ",
                      b);
  }
  const auto long_opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor positions = at::empty({bs * N}, long_opts);             // [B*N]
  at::Tensor retrieve_index = at::empty({bs, N}, long_opts);         // [B, N]
  at::Tensor retrieve_next_token = at::empty({bs, N}, long_opts);    // [B, N]
  at::Tensor retrieve_next_sibling = at::empty({bs, N}, long_opts);  // [B, N]
  int64_t* pos = positions.data_ptr<int64_t>();
  int64_t* ridx = retrieve_index.data_ptr<int64_t>();
  int64_t* next_tok = retrieve_next_token.data_ptr<int64_t>();
  int64_t* next_sib = retrieve_next_sibling.data_ptr<int64_t>();

  at::parallel_for(0, bs, grain_for(N * N * 2), [&](int64_t b0, int64_t b1) {
    std::vector<int64_t> parent(N), node_depth(N), first_child(N);
    for (int64_t b = b0; b < b1; ++b) {
      auto m = [&](int64_t t, int64_t j) { return mask[((b * N + t) * N + j) * ms]; };
      for (int64_t t = 0; t < N; ++t) {
        // A well-formed row is its parent's row plus the node itself: the root is visible,
        // nothing after t is, and the ancestors are exactly the parent's ancestors.
        TORCH_CHECK_VALUE(m(t, 0) && m(t, t), "malformed tree: argument 'tree_mask' row ", t,
                          " of request ", b, " must see the root and itself");
        int64_t p = -1;
        for (int64_t j = t - 1; j >= 0; --j) {
          if (m(t, j)) {
            p = j;
            break;
          }
        }
        for (int64_t j = 0; j < N; ++j) {
          const bool expected = j == t || (p >= 0 && j < t && m(p, j));
          TORCH_CHECK_VALUE(m(t, j) == expected, "malformed tree: argument 'tree_mask' row ", t,
                            " of request ", b, " is not its parent's row plus itself (column ", j,
                            ")");
        }
        parent[t] = p;
        node_depth[t] = p < 0 ? 0 : node_depth[p] + 1;
      }
      std::fill(first_child.begin(), first_child.end(), -1);
      for (int64_t i = N - 1; i >= 0; --i) {
        next_sib[b * N + i] = i == 0 ? -1 : first_child[parent[i]];
        if (i > 0) first_child[parent[i]] = i;
      }
      for (int64_t i = 0; i < N; ++i) {
        next_tok[b * N + i] = first_child[i];
        ridx[b * N + i] = b * N + i;
        pos[b * N + i] = lens(b) + node_depth[i];
      }
    }
  });
  SPECDEC_RECORD_PATH("reconstruct_tree_from_mask", Isa::PORTABLE);
  return {positions, retrieve_index, retrieve_next_token, retrieve_next_sibling};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def(
      "build_tree(Tensor parent_list, Tensor selected_index, Tensor seq_lens, int topk, "
      "int depth, int num_draft_tokens, int tree_mask_mode) -> (Tensor tree_mask, "
      "Tensor positions, Tensor retrieve_index, Tensor retrieve_next_token, "
      "Tensor retrieve_next_sibling)");
  m.def(
      "verify_tree_greedy(Tensor candidates, Tensor retrieve_index, Tensor retrieve_next_token, "
      "Tensor retrieve_next_sibling, Tensor target_predict, int num_spec_steps) -> "
      "(Tensor predicts, Tensor accept_index, Tensor accept_token_num)");
  m.def(
      "verify_tree_greedy_out(Tensor(a!) predicts, Tensor(b!) accept_index, "
      "Tensor(c!) accept_token_num, Tensor candidates, Tensor retrieve_index, "
      "Tensor retrieve_next_token, Tensor retrieve_next_sibling, Tensor target_predict) -> ()");
  m.def(
      "reconstruct_tree_from_mask(Tensor tree_mask, Tensor seq_lens, int num_draft_tokens) -> "
      "(Tensor positions, Tensor retrieve_index, Tensor retrieve_next_token, "
      "Tensor retrieve_next_sibling)");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("build_tree", &build_tree);
  m.impl("verify_tree_greedy", &verify_tree_greedy);
  m.impl("verify_tree_greedy_out", &verify_tree_greedy_out);
  m.impl("reconstruct_tree_from_mask", &reconstruct_tree_from_mask);
}

}  // namespace specdec
