"""NGRAM (prompt lookup) drafts: no draft model. A C++ n-gram trie per request (csrc/ngram.cpp)
matches the longest suffix of the context and expands the continuations seen after it
breadth-first into a tree of N nodes (root = last committed token), padded to N so verify
shapes stay static; reconstruct_tree_from_mask turns its ancestor mask into positions and
linkage for verification."""
from typing import Iterable, List, Sequence

import torch
from torch import Tensor

from specdec_inductor import ops
from specdec_inductor._library import _C
from specdec_inductor.speculative import DraftTree

# The window the CLI and benchmarks use (the class keeps the general defaults 1..4). A 1-token
# suffix match (a newline, a space) drafts poorly and its verify costs ~2 decode steps on a
# small CPU: on SmolLM2-135M, N=8, breadth (2, 1), greedy, 128 tokens, one run,
# `min_window 1, max 4` gave code 1.48x / chat 1.04x over our compiled AR, `2, 8` gave
# 1.69x / 1.11x (code: 35 of 52 steps became plain decodes, each verify emitted 5.5 tokens
# instead of 3.2). See benchmarks/bench_spec.py --ngram-window.
RECOMMENDED_WINDOW = (2, 8)


def parse_window(text: str, name: str = "ngram_window"):
    """'MIN,MAX' -> (min, max), with a clear error naming the argument."""
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"argument '{name}' must be MIN,MAX (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"argument '{name}' needs 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


class NgramProposer:
    """Proposes NGRAM draft trees for a batch of requests.

    Args:
        num_draft_tokens: N, nodes per tree including the root.
        min_window / max_window: suffix lengths tried, longest first.
        max_depth: longest draft chain (defaults to N - 1).
        breadth: children kept per node at each draft level (the last entry repeats);
            (1,) gives a chain.
        max_nodes_per_request: memory bound of each request's trie.
    """

    def __init__(self, num_draft_tokens: int, min_window: int = 1, max_window: int = 4,
                 max_depth: int = None, breadth: Sequence[int] = (4, 2, 1),
                 max_nodes_per_request: int = 1 << 18):
        self.num_draft_tokens = num_draft_tokens
        self.breadth = list(breadth)
        depth = max_depth if max_depth is not None else max(1, num_draft_tokens - 1)
        self.num_spec_steps = depth + 1
        self._index = _C.NgramIndex(min_window, max_window, depth, max_nodes_per_request)

    def add_request(self, request_id: int, prompt: Iterable[int]) -> None:
        self._index.add_request(request_id)
        self._index.append(request_id, [int(t) for t in prompt])

    def remove_request(self, request_id: int) -> None:
        self._index.remove_request(request_id)

    def append(self, request_id: int, tokens: Iterable[int]) -> None:
        """Committed tokens (accepted drafts + bonus) of one request, in order."""
        self._index.append(request_id, [int(t) for t in tokens])

    # -- the Proposer protocol (specdec_inductor/speculative.py) ------------------------------
    def start(self, request_ids: List[int], contexts: List[List[int]]) -> None:
        for rid, ctx in zip(request_ids, contexts):
            self.add_request(rid, ctx)

    def commit(self, request_ids: List[int], emitted: List[List[int]]) -> None:
        for rid, tokens in zip(request_ids, emitted):
            if tokens:
                self.append(rid, tokens)

    def finish(self, request_ids: List[int]) -> None:
        for rid in request_ids:
            self.remove_request(rid)

    def num_requests(self) -> int:
        return self._index.num_requests()

    def num_trie_nodes(self, request_id: int) -> int:
        return self._index.num_nodes(request_id)

    def propose(self, request_ids: List[int], seq_lens: Tensor) -> DraftTree:
        """Draft trees for `request_ids`; seq_lens [B] are their committed lengths (the root's
        position), as the verify step uses them."""
        tokens, mask, num_drafts = self._index.propose(list(request_ids), self.num_draft_tokens, self.breadth)
        positions, ridx, nxt, sib = ops.reconstruct_tree_from_mask(mask, seq_lens, self.num_draft_tokens)
        return DraftTree(tokens, mask, positions, ridx, nxt, sib, num_drafts)
