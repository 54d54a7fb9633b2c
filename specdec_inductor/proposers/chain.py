"""Pieces shared by the proposers that draft chains with a draft model of their own
(standalone.py, eagle.py): admitting requests into the draft's KV pool and packing a chain of
drafts as a DraftTree."""
from typing import List, Sequence

import torch
from torch import Tensor

from specdec_inductor import ops
from specdec_inductor.speculative import DraftTree


def admit_draft_requests(pool, contexts: Sequence[Sequence[int]], num_draft_tokens: int) -> List:
    """One draft-pool request per context (prompt + first token), reserving the whole row:
    the draft writes KV for every committed position plus up to N speculative ones."""
    longest = max(len(c) for c in contexts)
    budget = pool.max_len - longest
    if budget < num_draft_tokens:
        raise ValueError(f"draft engine max_len {pool.max_len} leaves no room for drafts "
                         f"after a context of {longest} tokens")
    return pool.admit([len(c) - 1 for c in contexts], budget)


def finish_draft_requests(states: dict, request_ids: Sequence[int], pool, tree) -> None:
    """Release the draft-pool rows of the given requests (their virtual tree rows, then their
    request), every one of them even when one release raises (the first error is re-raised
    at the end): a failed cleanup must not leak the others' rows."""
    first = None
    for rid in request_ids:
        st = states.pop(rid, None)
        if st is None:
            continue
        for release in ((lambda: tree.release_rows(st.virtual_rows)) if st.virtual_rows else None,
                        lambda: pool.release(st.request)):
            if release is None:
                continue
            try:
                release()
            except Exception as exc:  # noqa: BLE001 -- re-raised below, after the rest
                first = first or exc
    if first is not None:
        raise first


def chain_tree(roots: Tensor, chain: Tensor, seq_lens: Tensor) -> DraftTree:
    """roots [B] and drafts chain [B, K] as a DraftTree of N = K + 1 nodes per request."""
    bs, k = chain.shape
    n = k + 1
    tokens = torch.cat([roots.view(bs, 1), chain], dim=1)  # [B, N]
    mask = torch.ones(n, n, dtype=torch.bool).tril().flatten().repeat(bs)  # [B*N*N]
    positions, ridx, nxt, sib = ops.reconstruct_tree_from_mask(mask, seq_lens, n)
    return DraftTree(tokens, mask, positions, ridx, nxt, sib, torch.full((bs,), k, dtype=torch.int64))
