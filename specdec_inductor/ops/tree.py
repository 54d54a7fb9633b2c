"""Draft-tree ops: build_tree, verify_tree_greedy(_out), reconstruct_tree_from_mask.
Semantics: shared/spec/kernels.md sections 1-4. Each op: wrapper + docstring, then its fake."""
import enum
from typing import Tuple

import torch
from torch import Tensor

import specdec_inductor._library  # noqa: F401  (loads the schemas before register_fake)


class TreeMaskMode(enum.IntEnum):
    """Layout of build_tree's tree_mask (kernels.md section 2)."""

    FULL_MASK = 0  # bool, per request [N, seq_len + N] row-major blocks, prefix columns included
    QLEN_ONLY = 1  # bool [B*N*N]: draft i may attend draft j; the prefix is implicitly visible
    QLEN_ONLY_BITPACKING = 2  # one little-endian integer per query row, bit j = draft j visible


def bitpacked_mask_dtype(num_draft_tokens: int) -> torch.dtype:
    """Element type of a QLEN_ONLY_BITPACKING mask row for N draft tokens (N <= 64)."""
    if num_draft_tokens <= 8:
        return torch.uint8
    if num_draft_tokens <= 16:
        return torch.int16
    if num_draft_tokens <= 32:
        return torch.int32
    return torch.int64


def build_tree(
    parent_list: Tensor,
    selected_index: Tensor,
    seq_lens: Tensor,
    topk: int,
    depth: int,
    num_draft_tokens: int,
    tree_mask_mode: TreeMaskMode = TreeMaskMode.QLEN_ONLY,
) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Turns a multi-step top-k draft into the verify tree of every request.

    Args:
        parent_list: [B, topk*(depth-1)+1] (or [B, 0] when depth == 1) global ids of the beams
            kept at each step; entry 0 is -1 (the root). int32 or int64.
        selected_index: [B, N-1] global ids of the N-1 best cumulative scores, sorted ascending.
        seq_lens: [B] committed tokens per request (the root's position).
        topk, depth, num_draft_tokens (N, root included), tree_mask_mode: see TreeMaskMode.

    Returns (tree_mask, positions [B*N], retrieve_index [B, N], retrieve_next_token [B, N],
    retrieve_next_sibling [B, N]), index outputs int64. Node 0 is the root; node j+1 is
    selected_index[:, j]. A malformed tree (a parent id not selected earlier, unsorted ids)
    raises ValueError naming `selected_index`.
    """
    return torch.ops.specdec.build_tree.default(
        parent_list, selected_index, seq_lens, topk, depth, num_draft_tokens, int(tree_mask_mode)
    )


@torch.library.register_fake("specdec::build_tree")
def _(parent_list, selected_index, seq_lens, topk, depth, num_draft_tokens, tree_mask_mode):
    bs, n = seq_lens.shape[0], num_draft_tokens
    # The kernel's checks on the ints (a traced call must fail as the eager one does, not with
    # a negative or overflowing size); the tensors' shapes bound them.
    for name, value in (("topk", topk), ("depth", depth), ("num_draft_tokens", n)):
        if value < 1:
            raise ValueError(f"argument '{name}' must be >= 1, got {value}")
    width = 0 if depth == 1 else topk * (depth - 1) + 1
    if parent_list.shape[1] != width:
        raise ValueError(f"argument 'parent_list' must have size {width} in dimension 1, got "
                         f"shape {tuple(parent_list.shape)}")
    if selected_index.shape[1] != n - 1:
        raise ValueError(f"argument 'selected_index' must have size {n - 1} in dimension 1, got "
                         f"shape {tuple(selected_index.shape)}")
    if tree_mask_mode == TreeMaskMode.FULL_MASK:
        # sum(seq_lens) * N + B * N * N depends on the data: an unbacked size.
        tree_mask = seq_lens.new_empty((torch.library.get_ctx().new_dynamic_size(),), dtype=torch.bool)
    elif tree_mask_mode == TreeMaskMode.QLEN_ONLY:
        tree_mask = seq_lens.new_empty((bs * n * n,), dtype=torch.bool)
    else:
        tree_mask = seq_lens.new_empty((bs * n,), dtype=bitpacked_mask_dtype(n))
    positions = seq_lens.new_empty((bs * n,), dtype=torch.int64)
    linkage = [seq_lens.new_empty((bs, n), dtype=torch.int64) for _ in range(3)]
    return (tree_mask, positions, *linkage)


def verify_tree_greedy(
    candidates: Tensor,
    retrieve_index: Tensor,
    retrieve_next_token: Tensor,
    retrieve_next_sibling: Tensor,
    target_predict: Tensor,
    num_spec_steps: int,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Greedy verification: walks each request's tree from the root, accepting at every level
    the first child (in sibling order) whose token equals the target's argmax at the current
    node, for at most num_spec_steps - 1 levels.

    Args:
        candidates: [B, N] verify tokens in node order (root first).
        retrieve_index / retrieve_next_token / retrieve_next_sibling: [B, N] from build_tree.
        target_predict: [B, N] target argmax at each node.
        num_spec_steps: S = depth + 1.

    Returns (predicts [B*N] int32: the accepted tokens and the bonus token at the flat rows of
    the accepted path, -1 elsewhere; accept_index [B, S] int32 flat rows of the accepted path
    padded with -1; accept_token_num [B] int32 accepted drafts, bonus excluded).
    """
    return torch.ops.specdec.verify_tree_greedy.default(
        candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_predict,
        num_spec_steps,
    )


@torch.library.register_fake("specdec::verify_tree_greedy")
def _(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_predict,
      num_spec_steps):
    bs, n = candidates.shape
    return (
        candidates.new_empty((bs * n,), dtype=torch.int32),
        candidates.new_empty((bs, num_spec_steps), dtype=torch.int32),
        candidates.new_empty((bs,), dtype=torch.int32),
    )


def verify_tree_greedy_out(
    predicts: Tensor,
    accept_index: Tensor,
    accept_token_num: Tensor,
    candidates: Tensor,
    retrieve_index: Tensor,
    retrieve_next_token: Tensor,
    retrieve_next_sibling: Tensor,
    target_predict: Tensor,
) -> None:
    """verify_tree_greedy into preallocated int32 outputs (SGLang's calling convention).

    num_spec_steps is accept_index.shape[1]. Entries of `predicts` off the accepted path keep
    what the caller filled them with; accept_index is padded with -1 past the accepted path.
    """
    torch.ops.specdec.verify_tree_greedy_out.default(
        predicts, accept_index, accept_token_num, candidates, retrieve_index,
        retrieve_next_token, retrieve_next_sibling, target_predict,
    )


@torch.library.register_fake("specdec::verify_tree_greedy_out")
def _(predicts, accept_index, accept_token_num, candidates, retrieve_index, retrieve_next_token,
      retrieve_next_sibling, target_predict):
    return None


def reconstruct_tree_from_mask(
    tree_mask: Tensor, seq_lens: Tensor, num_draft_tokens: int
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Recovers positions and linkage from a QLEN_ONLY ancestor mask (n-gram drafts).

    Args:
        tree_mask: [B*N*N] bool, row t of request b true at t's ancestors (root included) and t.
        seq_lens: [B] committed tokens per request.

    Returns (positions [B*N], retrieve_index [B, N], retrieve_next_token [B, N],
    retrieve_next_sibling [B, N]), int64. A row that is not its parent's row plus itself
    raises ValueError naming `tree_mask`.
    """
    return torch.ops.specdec.reconstruct_tree_from_mask.default(tree_mask, seq_lens, num_draft_tokens)


@torch.library.register_fake("specdec::reconstruct_tree_from_mask")
def _(tree_mask, seq_lens, num_draft_tokens):
    bs, n = seq_lens.shape[0], num_draft_tokens
    positions = seq_lens.new_empty((bs * n,), dtype=torch.int64)
    return (positions, *[seq_lens.new_empty((bs, n), dtype=torch.int64) for _ in range(3)])
