"""NGRAM (prompt lookup) drafts: no draft model. A C++ n-gram trie per request (csrc/ngram.cpp)
matches the longest suffix of the context and expands the continuations seen after it
breadth-first into a tree of N nodes (root = last committed token), padded to N so verify
shapes stay static; reconstruct_tree_from_mask turns its ancestor mask into positions and
linkage for verification."""
from typing import Iterable, List, Sequence, Tuple

import torch
from torch import Tensor

from specdec_inductor import ops
from specdec_inductor._library import _C
from specdec_inductor.speculative import DraftTree, Proposer

# The window the CLI and benchmarks use (the class keeps the general defaults 1..4). Matches of
# one token (a newline, a space) seldom continue for long: with confident_window=2 they offer
# one draft and verify at size 2, which costs what a decode step costs, so they are kept. On
# SmolLM2-135M, N=8, breadth (2, 1), greedy, 128 tokens, the verify steps counted and priced
# at the measured cost of each size over the bench's two prompts and the 18 held-out prompts
# of train/corpus.py: window 1-8 beat 2-8 (with the old acceptance gate) on all 20, e.g.
# chat 1.04x against 0.99x our AR, the rewrite prompt 2.39x against 2.37x. (With verify(8) at
# ~2 decode steps, before packed weights, 1-token matches had cost more than they brought.)
RECOMMENDED_WINDOW = (1, 8)


def parse_window(text: str, name: str = "ngram_window"):
    """'MIN,MAX' -> (min, max), with a clear error naming the argument."""
    try:
        lo, hi = (int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"argument '{name}' must be MIN,MAX (two integers), got {text!r}") from None
    if not 1 <= lo <= hi:
        raise ValueError(f"argument '{name}' needs 1 <= MIN <= MAX, got {text!r}")
    return lo, hi


class NgramProposer(Proposer):
    """Proposes NGRAM draft trees for a batch of requests.

    Args:
        num_draft_tokens: N, nodes per tree including the root.
        min_window / max_window: suffix lengths tried, longest first.
        max_depth: longest draft chain (defaults to N - 1).
        breadth: children kept per node at each draft level (the last entry repeats);
            (1,) gives a chain.
        max_nodes_per_request: memory bound of each request's trie.
        confident_window: a draft continuing a context suffix shorter than this offers only
            its first node (num_drafts <= 1). Such matches (a lone newline or space) seldom
            continue for long; cut to one draft they verify at size 2, which costs what a
            plain decode step costs on a CPU, so they can only add tokens.
    """

    cheap_drafts = True  # a trie lookup: the loop sizes verifies adaptively (speculative.py)

    def __init__(self, num_draft_tokens: int, min_window: int = 1, max_window: int = 4,
                 max_depth: int = None, breadth: Sequence[int] = (4, 2, 1),
                 max_nodes_per_request: int = 1 << 18, confident_window: int = 2):
        if confident_window < 1:
            raise ValueError(f"argument 'confident_window' must be >= 1, got {confident_window}")
        self.num_draft_tokens = num_draft_tokens
        self.confident_window = confident_window
        self.breadth = list(breadth)
        depth = max_depth if max_depth is not None else max(1, num_draft_tokens - 1)
        self.num_spec_steps = depth + 1
        self._index = _C.NgramIndex(min_window, max_window, depth, max_nodes_per_request)
        self._started: set = set()  # request ids start added (finish removes only those)

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
            self._started.add(rid)

    def commit(self, request_ids: List[int], emitted: List[List[int]]) -> None:
        for rid, tokens in zip(request_ids, emitted):
            if tokens:
                self.append(rid, tokens)

    def finish(self, request_ids: List[int]) -> None:
        """Forgets the requests start added (the loop calls this even after a start that failed
        midway, so requests start never reached are skipped)."""
        for rid in request_ids:
            if rid in self._started:
                self._started.discard(rid)
                self.remove_request(rid)

    def num_requests(self) -> int:
        return self._index.num_requests()

    def num_trie_nodes(self, request_id: int) -> int:
        return self._index.num_nodes(request_id)

    def propose(self, request_ids: List[int], seq_lens: Tensor) -> DraftTree:
        """Draft trees for `request_ids`; seq_lens [B] are their committed lengths (the root's
        position), as the verify step uses them."""
        return self.propose_with_match(request_ids, seq_lens)[0]

    def propose_with_match(self, request_ids: List[int],
                           seq_lens: Tensor) -> Tuple[DraftTree, Tensor]:
        """propose's trees and match_len [B] int32: the length of the context suffix each
        request's drafts continue (0: no match, no drafts)."""
        tokens, mask, num_drafts, match_len = self._index.propose(
            list(request_ids), self.num_draft_tokens, self.breadth)
        num_drafts = torch.where(match_len < self.confident_window, num_drafts.clamp(max=1), num_drafts)
        positions, ridx, nxt, sib = ops.reconstruct_tree_from_mask(mask, seq_lens, self.num_draft_tokens)
        return DraftTree(tokens, mask, positions, ridx, nxt, sib, num_drafts), match_len
