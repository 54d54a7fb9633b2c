"""Draft trees as the loop hands them to verify: the proposer's `DraftTree`, the trees of
padding requests and plain decode steps, and the cut to a smaller verify size."""
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from specdec_inductor import ops


@dataclass
class DraftTree:
    """A proposer's draft for the real requests of a batch (padding rows are added here)."""
    tokens: Tensor  # [B, N] int64, node 0 = the root (the last emitted, not yet cached token)
    tree_mask: Tensor  # [B*N*N] bool QLEN_ONLY ancestor mask
    positions: Tensor  # [B*N] int64, seq_len + depth
    retrieve_index: Tensor  # [B, N]
    retrieve_next_token: Tensor  # [B, N]
    retrieve_next_sibling: Tensor  # [B, N]
    num_drafts: Optional[Tensor] = None  # [B] real (unpadded) drafts, for metrics


def star_tree(n: int) -> Tuple[Tensor, Tensor]:
    """A tree of n nodes that are all children of the root: (QLEN_ONLY mask [n*n] bool,
    depth [n] int64). Padding requests and compile warm-ups verify it."""
    mask = torch.eye(n, dtype=torch.bool)
    mask[:, 0] = True
    depth = torch.ones(n, dtype=torch.int64)
    depth[0] = 0
    return mask.flatten(), depth


def root_only_draft(roots: Tensor, seq_lens: Tensor) -> DraftTree:
    """Trees of the root alone (roots [B]): verifying them is a plain decode step."""
    bs = roots.shape[0]
    row = torch.arange(bs, dtype=torch.int64).view(bs, 1)  # [B, 1] flat node rows
    none = torch.full((bs, 1), -1, dtype=torch.int64)  # [B, 1]
    return DraftTree(roots.view(bs, 1).long(), torch.ones(bs, dtype=torch.bool), seq_lens.clone(),
                     row, none, none.clone(), torch.zeros(bs, dtype=torch.int64))


def truncate_draft(draft: DraftTree, size: int, seq_lens: Tensor) -> DraftTree:
    """The first `size` nodes of every tree (a valid tree: proposers number nodes parents
    first, padding last)."""
    bs, n = draft.tokens.shape
    if size == n:
        return draft
    mask = draft.tree_mask.view(bs, n, n)[:, :size, :size].reshape(-1)  # [B*size*size]
    positions, ridx, nxt, sib = ops.reconstruct_tree_from_mask(mask, seq_lens, size)
    drafts = draft.num_drafts.clamp(max=size - 1) if draft.num_drafts is not None else None
    return DraftTree(draft.tokens[:, :size].contiguous(), mask, positions, ridx, nxt, sib, drafts)


def pad_draft(draft: DraftTree, bucket: int, seq_lens: Tensor
              ) -> Tuple[Tensor, Tensor, Tensor, List[Tensor]]:
    """Bucket-sized verify inputs (tokens [B, N], mask [B*N*N], positions [B, N], the real
    requests' linkage as int64): padding rows get a star tree at their seq_len."""
    real, n = draft.tokens.shape
    pad = bucket - real
    tokens = torch.cat([draft.tokens, torch.zeros(pad, n, dtype=torch.int64)])  # [B, N]
    star, depth = star_tree(n)  # every padding node is a child of the root
    mask = torch.cat([draft.tree_mask, star.repeat(pad)])  # [B*N*N]
    positions = torch.cat([draft.positions.view(real, n),
                           seq_lens[real:].view(pad, 1) + depth.view(1, n)])  # [B, N]
    linkage = [t.to(torch.int64) for t in (draft.retrieve_index, draft.retrieve_next_token,
                                           draft.retrieve_next_sibling)]
    return tokens, mask, positions, linkage
