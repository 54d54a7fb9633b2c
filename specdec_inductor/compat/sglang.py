"""SGLang-style entry points over the `specdec` ops: the caller passes preallocated outputs,
in the argument order of SGLang's speculative kernels (sgl_kernel's build_tree_kernel_efficient,
verify_tree_greedy, reconstruct_indices_from_tree_mask and the slot helpers of its EAGLE
worker), so a worker written for SGLang's CPU backend can swap these in.

Argument names are spelled out (`retrieve_*`, not SGLang's `retrive_*`); positional calls
are unaffected. Outputs are written in place with `copy_`, so their dtypes may be int32 or
int64 as the caller allocated them.
"""
import torch
from torch import Tensor

from specdec_inductor import ops


def build_tree_kernel_efficient(parent_list: Tensor, selected_index: Tensor,
                                verified_seq_len: Tensor, tree_mask: Tensor, positions: Tensor,
                                retrieve_index: Tensor, retrieve_next_token: Tensor,
                                retrieve_next_sibling: Tensor, topk: int, depth: int,
                                draft_token_num: int, tree_mask_mode: int) -> None:
    """build_tree into the caller's buffers. `tree_mask` must have exactly the op's mask size
    (for FULL_MASK: sum(seq_len)*N + bs*N*N)."""
    mask, pos, ridx, nxt, sib = ops.build_tree(parent_list, selected_index, verified_seq_len,
                                               topk, depth, draft_token_num, tree_mask_mode)
    if tree_mask.numel() != mask.numel():
        raise ValueError(f"argument 'tree_mask' has {tree_mask.numel()} elements, the tree "
                         f"needs {mask.numel()}")
    if mask.dtype != tree_mask.dtype:  # bit-packed rows: same bits in the caller's integer type
        if mask.element_size() != tree_mask.element_size():
            raise ValueError(f"argument 'tree_mask' must be {mask.dtype} (or a same-size "
                             f"integer type), got {tree_mask.dtype}")
        mask = mask.view(tree_mask.dtype)
    tree_mask.view(-1).copy_(mask)
    positions.copy_(pos)
    retrieve_index.copy_(ridx)
    retrieve_next_token.copy_(nxt)
    retrieve_next_sibling.copy_(sib)


def verify_tree_greedy(predicts: Tensor, accept_index: Tensor, accept_token_num: Tensor,
                       candidates: Tensor, retrieve_index: Tensor, retrieve_next_token: Tensor,
                       retrieve_next_sibling: Tensor, target_predict: Tensor) -> None:
    """Greedy tree verification into int32 buffers; entries of `predicts` off the accepted path
    keep what the caller filled them with (no copy: the op writes in place)."""
    ops.verify_tree_greedy_out(predicts, accept_index, accept_token_num, candidates,
                               retrieve_index, retrieve_next_token, retrieve_next_sibling,
                               target_predict)


def reconstruct_indices_from_tree_mask(tree_mask: Tensor, verified_seq_len: Tensor,
                                       positions: Tensor, retrieve_index: Tensor,
                                       retrieve_next_token: Tensor, retrieve_next_sibling: Tensor,
                                       batch_size: int, draft_token_num: int) -> None:
    if verified_seq_len.shape[0] != batch_size:
        raise ValueError(f"argument 'batch_size' = {batch_size} but verified_seq_len has "
                         f"{verified_seq_len.shape[0]} rows")
    pos, ridx, nxt, sib = ops.reconstruct_tree_from_mask(tree_mask, verified_seq_len, draft_token_num)
    positions.copy_(pos)
    retrieve_index.copy_(ridx)
    retrieve_next_token.copy_(nxt)
    retrieve_next_sibling.copy_(sib)


def assign_req_to_token(req_pool_indices: Tensor, req_to_token: Tensor, start_offset: Tensor,
                        end_offset: Tensor, out_cache_loc: Tensor) -> None:
    """req_to_token[req_pool_indices[i], start:end] = the next end-start slots of out_cache_loc."""
    ops.assign_req_to_token(req_to_token, req_pool_indices, start_offset, end_offset, out_cache_loc)


def assign_draft_cache_locs(req_pool_indices: Tensor, req_to_token: Tensor, seq_lens: Tensor,
                            out_cache_loc: Tensor, topk: int, speculative_num_steps: int) -> None:
    """out_cache_loc[b*topk*steps + k*steps + s] = slot of position seq_len + k*steps + s."""
    out_cache_loc.copy_(ops.assign_draft_cache_locs(req_to_token, req_pool_indices, seq_lens,
                                                    topk, speculative_num_steps))


def get_target_cache_loc(req_pool_indices: Tensor, req_to_token: Tensor, start_offset: Tensor,
                         end_offset: Tensor, out_cache_loc: Tensor) -> None:
    """Dense concatenation of the slots of [start, end) per request (verify / move targets)."""
    out_cache_loc.copy_(ops.gather_extend_cache_locs(req_to_token, req_pool_indices, start_offset,
                                                     end_offset, out_cache_loc.numel()))


def fill_new_verified_id(accept_tokens: Tensor, accept_lens: Tensor, verified_id: Tensor) -> None:
    verified_id.copy_(ops.fill_bonus_tokens(accept_tokens, accept_lens))


def filter_finished_cache_loc(cache_loc: Tensor, accept_index: Tensor, out: Tensor) -> Tensor:
    """Accepted slots compacted into `out`; returns the count (a 0-d tensor)."""
    compacted, count = ops.compact_accepted_cache_locs(cache_loc, accept_index)
    out.copy_(compacted)
    return count


def move_kv_cache(k_buffers, v_buffers, src_cache_loc: Tensor, tgt_cache_loc: Tensor) -> None:
    """Move accepted KV rows of every layer from src to tgt slots (sources read first)."""
    ops.move_kv_slots(list(k_buffers), list(v_buffers), src_cache_loc, tgt_cache_loc)
