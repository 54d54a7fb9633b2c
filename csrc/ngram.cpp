// Host-side n-gram index for NGRAM (prompt-lookup) drafting: one trie per request over the
// windows of its prompt + generated tokens, matched on the longest context suffix and expanded
// breadth-first into a draft tree of at most N nodes (root included), padded to N.
// Contract: shared/spec/algorithms.md "NGRAM". Portable C++ only (pointer chasing; no SIMD use).
// Thread-safe: the request map and each request's trie have their own mutex; the Python binding
// releases the GIL while it works. Memory is bounded per request (max_nodes_per_request): a
// trie that outgrows it is rebuilt from its most recent tokens.
#include <torch/extension.h>

#include <algorithm>
#include <deque>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "checked_math.h"
#include "cpu_features.h"

namespace specdec {
namespace {

struct TrieNode {
  int64_t token;
  int32_t depth;      // tokens from the root (the root has depth 0)
  int64_t count;      // occurrences of the path root..this node
  int64_t last_seen;  // logical time of the latest occurrence (recency tie-break)
  std::vector<int32_t> children;
};

class RequestTrie {
 public:
  RequestTrie(int64_t max_len, int64_t max_nodes) : max_len_(max_len), max_nodes_(max_nodes) {
    reset();
  }

  void append(const std::vector<int64_t>& tokens) {
    for (int64_t t : tokens) {
      history_.push_back(t);
      add_token(t);
      if (static_cast<int64_t>(nodes_.size()) > max_nodes_) rebuild();
    }
    // The history only needs what a rebuild could replay.
    const size_t keep = static_cast<size_t>(rebuild_tokens() * 2);
    if (history_.size() > keep) history_.erase(history_.begin(), history_.end() - keep);
  }

  const std::vector<int64_t>& history() const { return history_; }
  int64_t num_nodes() const { return static_cast<int64_t>(nodes_.size()); }

  // Node reached by walking `suffix` from the root, or -1.
  int32_t find(const int64_t* suffix, int64_t len) const {
    int32_t node = 0;
    for (int64_t i = 0; i < len; ++i) {
      auto it = edges_.find(key(node, suffix[i]));
      if (it == edges_.end()) return -1;
      node = it->second;
    }
    return node;
  }

  const TrieNode& node(int32_t i) const { return nodes_[i]; }

  std::mutex mutex;

 private:
  static uint64_t key(int32_t parent, int64_t token) {
    return (static_cast<uint64_t>(parent) << 32) ^ static_cast<uint64_t>(token & 0xffffffffLL);
  }

  void reset() {
    nodes_.assign(1, TrieNode{-1, 0, 0, 0, {}});
    edges_.clear();
    open_.clear();
  }

  // Every suffix window starting at one of the last max_len positions is an open path; the new
  // token extends each of them by one node, and starts a new one at the root.
  void add_token(int64_t token) {
    ++clock_;
    open_.push_back(0);
    for (auto it = open_.begin(); it != open_.end();) {
      const int32_t child = child_of(*it, token);
      if (nodes_[child].depth >= max_len_) {
        it = open_.erase(it);
      } else {
        *it++ = child;
      }
    }
  }

  int32_t child_of(int32_t parent, int64_t token) {
    const uint64_t k = key(parent, token);
    auto it = edges_.find(k);
    int32_t child;
    if (it == edges_.end()) {
      child = static_cast<int32_t>(nodes_.size());
      nodes_.push_back(TrieNode{token, nodes_[parent].depth + 1, 0, 0, {}});
      nodes_[parent].children.push_back(child);
      edges_.emplace(k, child);
    } else {
      child = it->second;
    }
    nodes_[child].count += 1;
    nodes_[child].last_seen = clock_;
    return child;
  }

  // Replaying R tokens adds at most R * max_len nodes: half the budget.
  int64_t rebuild_tokens() const { return max_nodes_ / (2 * max_len_); }

  // Bounded memory: start over from the most recent tokens (each adds at most max_len nodes).
  void rebuild() {
    const size_t keep = std::min<size_t>(history_.size(), static_cast<size_t>(rebuild_tokens()));
    std::vector<int64_t> recent(history_.end() - keep, history_.end());
    reset();
    for (int64_t t : recent) add_token(t);
  }

  int64_t max_len_, max_nodes_;
  int64_t clock_ = 0;
  std::vector<TrieNode> nodes_;
  std::unordered_map<uint64_t, int32_t> edges_;
  std::deque<int32_t> open_;
  std::vector<int64_t> history_;
};

class NgramIndex {
 public:
  NgramIndex(int64_t min_window, int64_t max_window, int64_t max_depth,
             int64_t max_nodes_per_request)
      : min_window_(min_window),
        max_window_(max_window),
        max_depth_(max_depth),
        max_nodes_(max_nodes_per_request) {
    TORCH_CHECK_VALUE(min_window >= 1, "argument 'min_window' must be >= 1, got ", min_window);
    TORCH_CHECK_VALUE(max_window >= min_window, "argument 'max_window' must be >= min_window (",
                      min_window, "), got ", max_window);
    TORCH_CHECK_VALUE(max_depth >= 1, "argument 'max_depth' must be >= 1, got ", max_depth);
    const int64_t min_nodes = checked_mul(
        64, checked_add(max_window, max_depth, "argument 'max_window' + argument 'max_depth'"),
        "64 * (max_window + max_depth)");
    TORCH_CHECK_VALUE(max_nodes_per_request >= min_nodes,
                      "argument 'max_nodes_per_request' must be >= ", min_nodes, ", got ",
                      max_nodes_per_request);
  }

  void add_request(int64_t rid) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK_VALUE(!requests_.count(rid), "argument 'request_id' ", rid, " is already present");
    requests_.emplace(rid, std::make_shared<RequestTrie>(max_window_ + max_depth_, max_nodes_));
  }

  void remove_request(int64_t rid) {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK_INDEX(requests_.erase(rid) == 1, "argument 'request_id' ", rid, " is unknown");
  }

  int64_t num_requests() {
    std::lock_guard<std::mutex> lock(mutex_);
    return static_cast<int64_t>(requests_.size());
  }

  int64_t num_nodes(int64_t rid) {
    auto trie = get(rid);
    std::lock_guard<std::mutex> lock(trie->mutex);
    return trie->num_nodes();
  }

  void append(int64_t rid, const std::vector<int64_t>& tokens) {
    auto trie = get(rid);
    std::lock_guard<std::mutex> lock(trie->mutex);
    trie->append(tokens);
  }

  // Returns (tokens [B, N] int64: root = last context token, then the drafts, padded with the
  // root token; tree_mask [B*N*N] bool QLEN_ONLY ancestor mask; num_drafts [B] int32 real
  // drafts before padding; match_len [B] int32 length of the context suffix the drafts
  // continue, 0 without a match). breadth[l] bounds the children kept per node at draft level l+1.
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> propose(
      const std::vector<int64_t>& rids, int64_t num_draft_tokens,
      const std::vector<int64_t>& breadth) {
    const int64_t N = num_draft_tokens, bs = static_cast<int64_t>(rids.size());
    TORCH_CHECK_VALUE(N >= 1, "argument 'num_draft_tokens' must be >= 1, got ", N);
    TORCH_CHECK_VALUE(!breadth.empty(), "argument 'breadth' must name at least one level");
    for (int64_t b : breadth) {
      TORCH_CHECK_VALUE(b >= 1, "argument 'breadth' entries must be >= 1, got ", b);
    }
    check_alloc(checked_mul(checked_mul(bs, N, "batch * argument 'num_draft_tokens'"), N,
                            "batch * num_draft_tokens squared"),
                "the tree mask");
    std::vector<std::shared_ptr<RequestTrie>> tries;
    for (int64_t rid : rids) tries.push_back(get(rid));
    at::Tensor tokens = at::empty({bs, N}, at::kLong);     // [B, N]
    at::Tensor mask = at::zeros({bs * N * N}, at::kBool);  // [B*N*N]
    at::Tensor num_drafts = at::empty({bs}, at::kInt);     // [B]
    at::Tensor match_len = at::zeros({bs}, at::kInt);      // [B]
    int64_t* tok = tokens.data_ptr<int64_t>();
    bool* m = mask.data_ptr<bool>();
    int32_t* nd = num_drafts.data_ptr<int32_t>();
    int32_t* ml = match_len.data_ptr<int32_t>();
    std::vector<int32_t> parent(N), trie_node(N), order;
    for (int64_t b = 0; b < bs; ++b) {
      RequestTrie& trie = *tries[b];
      std::lock_guard<std::mutex> lock(trie.mutex);
      const auto& hist = trie.history();
      TORCH_CHECK_VALUE(!hist.empty(), "request ", rids[b],
                        " has no tokens: append its prompt first");
      int64_t* row_tok = tok + b * N;
      bool* block = m + b * N * N;
      row_tok[0] = hist.back();
      int64_t n = 1;
      // Longest matching suffix first.
      int32_t match = -1;
      for (int64_t w = std::min<int64_t>(max_window_, hist.size()); w >= min_window_ && match < 0;
           --w) {
        const int32_t found = trie.find(hist.data() + hist.size() - w, w);
        if (found >= 0 && !trie.node(found).children.empty()) {
          match = found;
          ml[b] = static_cast<int32_t>(w);
        }
      }
      if (match >= 0) {
        // Breadth-first: level by level, each node's children by count, then recency.
        trie_node[0] = match;
        parent[0] = -1;
        int64_t level_begin = 0, level_end = 1;
        for (int64_t level = 1; level <= max_depth_ && n < N && level_begin < level_end; ++level) {
          const int64_t limit = breadth[std::min<size_t>(level - 1, breadth.size() - 1)];
          for (int64_t p = level_begin; p < level_end && n < N; ++p) {
            const auto& kids = trie.node(trie_node[p]).children;
            order.assign(kids.begin(), kids.end());
            std::sort(order.begin(), order.end(), [&](int32_t a, int32_t c) {
              const TrieNode &x = trie.node(a), &y = trie.node(c);
              return x.count != y.count ? x.count > y.count : x.last_seen > y.last_seen;
            });
            for (int64_t k = 0; k < static_cast<int64_t>(order.size()) && k < limit && n < N; ++k) {
              trie_node[n] = order[k];
              parent[n] = static_cast<int32_t>(p);
              row_tok[n] = trie.node(order[k]).token;
              ++n;
            }
          }
          level_begin = level_end;
          level_end = n;
        }
      }
      nd[b] = static_cast<int32_t>(n - 1);
      // Padding: extra children of the root carrying the root token (verified like any draft).
      for (int64_t i = n; i < N; ++i) {
        parent[i] = 0;
        row_tok[i] = row_tok[0];
      }
      for (int64_t i = 0; i < N; ++i) {
        bool* row = block + i * N;
        if (i > 0) std::copy(block + parent[i] * N, block + parent[i] * N + i, row);
        row[i] = true;
      }
    }
    SPECDEC_RECORD_PATH("ngram_propose", Isa::PORTABLE);
    return {tokens, mask, num_drafts, match_len};
  }

 private:
  std::shared_ptr<RequestTrie> get(int64_t rid) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = requests_.find(rid);
    TORCH_CHECK_INDEX(it != requests_.end(), "argument 'request_id' ", rid, " is unknown");
    return it->second;
  }

  int64_t min_window_, max_window_, max_depth_, max_nodes_;
  std::mutex mutex_;
  std::unordered_map<int64_t, std::shared_ptr<RequestTrie>> requests_;
};

}  // namespace

void bind_ngram(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<NgramIndex>(m, "NgramIndex")
      .def(py::init<int64_t, int64_t, int64_t, int64_t>(), py::arg("min_window"),
           py::arg("max_window"), py::arg("max_depth"), py::arg("max_nodes_per_request"))
      .def("add_request", &NgramIndex::add_request, py::arg("request_id"))
      .def("remove_request", &NgramIndex::remove_request, py::arg("request_id"))
      .def("num_requests", &NgramIndex::num_requests)
      .def("num_nodes", &NgramIndex::num_nodes, py::arg("request_id"))
      .def("append", &NgramIndex::append, py::arg("request_id"), py::arg("tokens"),
           py::call_guard<py::gil_scoped_release>())
      .def("propose", &NgramIndex::propose, py::arg("request_ids"), py::arg("num_draft_tokens"),
           py::arg("breadth"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace specdec
