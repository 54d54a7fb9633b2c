"""Draft trees as the loop hands them to verify: the proposer's `DraftTree`, the cut to a
smaller verify size, and the bucket-sized verify inputs with padding requests' trees
(VerifyInputs, reused buffers)."""
from dataclasses import dataclass
from typing import Callable, List, NamedTuple, Optional, Tuple

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


class DraftProgram(NamedTuple):
    """A proposer's draft as a function to trace into the step program and its inputs
    (Proposer.draft_program): `drafter.tree_program(roots, seq_lens, *inputs)`, with the
    batch's roots and seq_lens [bucket] (the program's own inputs, which its commit then
    advances in place), returns the draft trees of the batch's whole bucket as (tokens
    [B, N], tree_mask [B*N*N], positions [B*N], retrieve_index, retrieve_next_token,
    retrieve_next_sibling [B, N]), rows past the batch's requests drafting nothing (a chain
    is the tree of a path), and may go on with outputs of its own (the proposer's, not
    verify's: StepResult.drafted). The drafter keys the compiled program. `read`, when given,
    takes those outputs after the step, before the proposer's commit."""
    drafter: object
    inputs: List[Optional[Tensor]]
    read: Optional[Callable[[Tuple[Tensor, ...]], None]] = None


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


class VerifyInputs:
    """Bucket-sized verify inputs of one tree size N, kept by a batch and refilled in place each
    step (no per-step allocation of fixed-size tensors): rows [0, B) take the real requests'
    drafts, the other rows are padding requests with a star tree at their seq_len and
    root-only linkage (greedy acceptance takes their root alone). Linkage is int64 with
    retrieve_index flat (row b's nodes are b * N + i), as the acceptance ops take it."""

    def __init__(self, bucket: int, n: int, seq_lens: Tensor):
        self.bucket, self.n = bucket, n
        star, self._depth = star_tree(n)
        self._star = star
        tokens = torch.zeros(bucket, n, dtype=torch.int64)  # [B, N]
        positions = seq_lens.view(bucket, 1) + self._depth.view(1, n)  # [B, N]
        self._flat = torch.arange(bucket * n, dtype=torch.int64).view(bucket, n)  # [B, N]
        none = torch.full((bucket, n), -1, dtype=torch.int64)  # [B, N]
        # tokens, positions, mask [B*N*N], retrieve_index, next_token, next_sibling
        self.buffers = [tokens, positions, star.repeat(bucket), self._flat.clone(), none,
                        none.clone()]
        self._filled = 0  # rows [0, _filled) of the buffers hold a real draft

    def fill(self, draft: DraftTree, seq_lens: Tensor) -> List[Tensor]:
        """The bucket's verify inputs for `draft` (seq_lens [bucket]): tokens, positions
        [B, N], tree_mask [B*N*N], retrieve_index, retrieve_next_token, retrieve_next_sibling
        [B, N]. A draft of the whole bucket is used as it is (laid out as the buffers are);
        otherwise it is copied into the buffers' first rows (rows that held drafts before and
        are padding now get their padding trees back)."""
        real, n = draft.tokens.shape
        if n != self.n:
            raise ValueError(f"a draft of {n} nodes for verify inputs of size {self.n}")
        parts = [draft.tokens, draft.positions.view(real, n), draft.tree_mask,
                 draft.retrieve_index, draft.retrieve_next_token, draft.retrieve_next_sibling]
        # Strides too: the compiled programs guard them (a [1, n] slice of a [1, N] tensor is
        # contiguous with another row stride).
        if real == self.bucket and all(p.dtype == b.dtype and p.stride() == b.stride()
                                       for p, b in zip(parts, self.buffers)):
            return parts
        self._pad(real, self._filled, seq_lens)
        self._filled = real
        for buffer, part in zip(self.buffers, parts):
            buffer[:part.shape[0]] = part
        return self.buffers

    def _pad(self, lo: int, hi: int, seq_lens: Tensor) -> None:
        if hi <= lo:
            return
        n = self.n
        tokens, positions, mask, index, next_token, next_sibling = self.buffers
        tokens[lo:hi] = 0
        positions[lo:hi] = seq_lens[lo:hi].view(hi - lo, 1) + self._depth.view(1, n)
        mask[lo * n * n:hi * n * n] = self._star.repeat(hi - lo)
        index[lo:hi] = self._flat[lo:hi]
        next_token[lo:hi] = -1
        next_sibling[lo:hi] = -1
