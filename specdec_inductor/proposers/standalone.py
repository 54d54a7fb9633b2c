"""STANDALONE drafts: a separate (smaller) causal LM with the target's vocabulary proposes a
chain of K = N - 1 tokens by greedy multi-step decoding (or, with topk > 1, an EAGLE-2 top-k
tree) through its own `Engine` (own KV pool, own compiled extend and decode graphs).

Draft KV bookkeeping: for each request the draft caches a prefix of the committed tokens.
A step first extends the draft over the committed tokens it has not cached (the last step's
accepted drafts' KV is already there; usually only the bonus token is new), then decodes K - 1
more tokens, writing KV for d1..d(K-1) at positions L..L+K-2 (L = committed length). After
verification, the cached prefix is L + min(a, K - 1), where a is how many emitted tokens
match the proposal: those positions hold KV of exactly the committed tokens; later positions
are overwritten by the next step.

Trees (topk > 1, proposers/tree_draft.py): after the catch-up, `depth` draft steps expand
topk beams through the beams' virtual rows, writing KV only past the committed prefix. After
verification the cached prefix is the committed length before the step (root included): the
next step catches up over the accepted drafts and the bonus (depth + 1 tokens at most, one
extend of T = depth + 1); the accepted branch's draft KV is not reused."""
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import Tensor

from specdec_inductor.proposers.chain import (admit_draft_requests, chain_tree,
                                              finish_draft_requests)
from specdec_inductor.proposers.tree_draft import TreeDrafter, check_tree_shape
from specdec_inductor.speculative import DraftTree, Proposer


CATCH_UP_TOKENS = 2


def check_draft_vocabulary(draft_model, target_model, draft_name: str) -> None:
    """A STANDALONE draft and its target exchange token ids both ways (the draft reads the
    target's tokens, the target verifies the draft's), so their vocabularies must be the same
    size; raises ValueError naming the draft otherwise (else an embedding lookup fails later
    with a bare IndexError)."""
    draft_v = draft_model.get_input_embeddings().weight.shape[0]
    target_v = target_model.get_input_embeddings().weight.shape[0]
    if draft_v != target_v:
        raise ValueError(f"the draft model {draft_name} has a vocabulary of {draft_v} tokens, the "
                         f"target {target_v}: a STANDALONE draft needs the target's tokenizer "
                         "and vocabulary")


@dataclass
class _DraftRequest:
    request: object  # the draft pool's Request
    tokens: List[int]  # committed tokens (prompt + emitted)
    cached: int  # tokens[:cached] have KV in the draft pool
    base: int = 0  # committed length when the last proposal was made
    proposed: List[int] = field(default_factory=list)
    virtual_rows: List[int] = field(default_factory=list)  # trees: one draft-pool row per beam


class StandaloneProposer(Proposer):
    """Greedy chain (topk = 1) or top-k tree drafts from `draft_engine` (an Engine over the
    draft model).

    Args:
        draft_engine: its max_len must cover the target's positions (prompt + new tokens + N)
            plus topk*(depth-1) tree slots; its max_batch the target's batch, times 1 + topk
            for trees (the requests plus one virtual row per beam).
        num_draft_tokens: N, nodes per tree including the root.
        topk: branching of the draft tree (1: a chain, today's code path).
        depth: draft steps, the deepest node's depth (default N - 1; a chain needs N - 1).
    """

    def __init__(self, draft_engine, num_draft_tokens: int, topk: int = 1,
                 depth: Optional[int] = None):
        if num_draft_tokens < 2:
            raise ValueError(f"num_draft_tokens must be >= 2 (root + drafts), got {num_draft_tokens}")
        depth = num_draft_tokens - 1 if depth is None else depth
        check_tree_shape(num_draft_tokens, topk, depth)
        self.engine = draft_engine
        self.num_draft_tokens = num_draft_tokens
        self.topk, self.depth = topk, depth
        self.num_spec_steps = depth + 1
        self.k = num_draft_tokens - 1
        self._tree = TreeDrafter(draft_engine, num_draft_tokens, topk, depth) if topk > 1 else None
        self._requests: Dict[int, _DraftRequest] = {}

    def _rows(self, request_ids: List[int]) -> Tensor:
        bucket = self.engine.bucket_for(len(request_ids))
        rows = [self._requests[r].request.row for r in request_ids]
        rows += [self.engine.pool.padding_row] * (bucket - len(rows))
        return torch.tensor(rows, dtype=torch.int64)  # [B]

    # -- the Proposer protocol (specdec_inductor/speculative.py) ------------------------------
    def start(self, request_ids: List[int], contexts: List[List[int]]) -> None:
        # The prompt (all but the root) is prefilled now; the root is the first catch-up token.
        reserve = max(self.num_draft_tokens, self.topk * (self.depth - 1) + 1)
        requests = admit_draft_requests(self.engine.pool, contexts, reserve)
        for rid, req, ctx in zip(request_ids, requests, contexts):
            self._requests[rid] = _DraftRequest(req, list(ctx), 0)
        try:
            if self._tree is not None:
                for rid, rows in zip(request_ids, self._tree.reserve_rows(len(request_ids))):
                    self._requests[rid].virtual_rows = rows
            self.engine.prefill([c[:-1] for c in contexts], self._rows(request_ids))
        except BaseException:
            self.finish(request_ids)
            raise
        for rid, ctx in zip(request_ids, contexts):
            self._requests[rid].cached = len(ctx) - 1

    def propose(self, request_ids: List[int], seq_lens: Tensor) -> DraftTree:
        bs, eng = len(request_ids), self.engine
        states = [self._requests[r] for r in request_ids]
        for st in states:  # a finished request emits nothing: re-feed its last token
            st.cached = min(st.cached, len(st.tokens) - 1)
        req_rows = self._rows(request_ids)
        # Catch-up is 1 or 2 tokens per step for a chain (the bonus, plus the last accepted
        # draft when all K were accepted: its KV was never written), up to depth + 1 for a
        # tree (every accepted draft and the bonus), so one small T keeps one graph.
        pending = max(len(st.tokens) - st.cached for st in states)
        bucket = req_rows.shape[0]
        small = CATCH_UP_TOKENS if self._tree is None else self.depth + 1
        # After decode-only steps (the acceptance gate) more is pending: take prefill chunks.
        chunk = small if pending <= small else eng.prefill_chunk
        last_logits = [None] * bs
        while any(st.cached < len(st.tokens) for st in states):  # catch-up extends
            ids = torch.zeros(bucket, chunk, dtype=torch.int64)  # [B, T]
            prefix = torch.zeros(bucket, dtype=torch.int64)  # [B]
            ext = torch.zeros(bucket, dtype=torch.int64)  # [B]
            for b, st in enumerate(states):
                todo = st.tokens[st.cached:st.cached + chunk]
                ids[b, :len(todo)] = torch.tensor(todo, dtype=torch.int64)
                prefix[b], ext[b] = st.cached, len(todo)
            positions = prefix.view(-1, 1) + torch.arange(chunk).view(1, -1)  # [B, T]
            logits = eng.extend(ids, positions, req_rows, prefix, ext).logits  # [B, T, V]
            for b, st in enumerate(states):
                if ext[b] > 0:
                    st.cached += int(ext[b])
                    if st.cached == len(st.tokens):
                        last_logits[b] = logits[b, int(ext[b]) - 1]
        if self._tree is not None:  # the draft KV stays the committed prefix (see commit)
            roots = torch.tensor([st.tokens[-1] for st in states])  # [bs]
            return self._tree.draft(roots, seq_lens, torch.stack(last_logits),
                                    [st.request.row for st in states],
                                    [st.cached for st in states],
                                    [st.virtual_rows for st in states])
        drafts = [torch.stack(last_logits).argmax(-1)]  # [bs] d1
        seq = torch.tensor([st.cached for st in states] + [1] * (bucket - bs))  # [B] = L
        for st in states:
            st.base = st.cached
        tok = torch.cat([drafts[0], torch.zeros(bucket - bs, dtype=torch.int64)])  # [B]
        for _ in range(self.k - 1):
            tok = eng.decode(tok, req_rows, seq).argmax
            seq = seq + 1
            drafts.append(tok[:bs])
        chain = torch.stack(drafts, dim=1)  # [bs, K]
        for b, st in enumerate(states):
            st.proposed = chain[b].tolist()
        roots = torch.tensor([st.tokens[-1] for st in states])  # [bs]
        return chain_tree(roots, chain, seq_lens)

    def commit(self, request_ids: List[int], emitted: List[List[int]]) -> None:
        for rid, tokens in zip(request_ids, emitted):
            st = self._requests[rid]
            if not tokens:
                continue
            # No chain proposal: the step ran without a draft, or drafted a tree (whose KV lies
            # past the committed prefix): the cache is unchanged.
            if st.proposed:
                match = 0
                while match < min(len(tokens), len(st.proposed)) and tokens[match] == st.proposed[match]:
                    match += 1
                st.cached = st.base + min(match, self.k - 1)
                st.proposed = []
            st.tokens.extend(tokens)

    def finish(self, request_ids: List[int]) -> None:
        finish_draft_requests(self._requests, request_ids, self.engine.pool, self._tree)
