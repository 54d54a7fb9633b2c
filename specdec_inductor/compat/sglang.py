"""SGLang-style entry points over the `specdec` ops: the caller passes preallocated outputs,
in the argument order of SGLang's speculative CPU kernels (sgl_kernel's
build_tree_kernel_efficient, verify_tree_greedy, reconstruct_indices_from_tree_mask,
tree_speculative_sampling_target_only, extend_attention_cpu, build_draft_decode_metadata_cpu,
copy_all_layer_kv_cache_cpu, rotate_input_ids_cpu and the slot helpers of its EAGLE worker,
also under sgl_kernel's `*_cpu` names at the end of this file), so a worker written for
SGLang's CPU backend can swap these in.

Conventions, and where they differ from SGLang's:
- Spelling: our argument names are `retrieve_*`; SGLang's keyword spelling `retrive_*` is
  accepted too (one of the two, never both). Positional calls are unaffected.
- Output buffers may be larger than needed (a `predicts` of B*N+1, a `tree_mask` or
  `out_cache_loc` preallocated at capacity): results are written at the front, the tail is left
  as it was. A buffer that is too small, or not contiguous, raises ValueError naming it.
  Outputs are written with `copy_`, so int32 or int64 buffers both work.
- Malformed trees raise ValueError (SGLang's kernels warn and stop the walk).
- Tree sampling draws its coins with our acceptance rule (kernels.md section 7): the coins have
  SGLang's shapes, but the same coins need not accept the same child (both rules are lossless).
- Raw pointers are never dereferenced: copy_all_layer_kv_cache_cpu resolves SGLang's
  `data_ptrs` through buffers registered with register_kv_buffers.
"""
from typing import Dict, Optional, Sequence

import torch
from torch import Tensor

from specdec_inductor import ops


# ---- helpers ------------------------------------------------------------------------------------

def _pick(ours: str, ours_value, theirs: str, theirs_value):
    """The one given of an argument that has our spelling and SGLang's (`retrive_*`)."""
    if ours_value is not None and theirs_value is not None:
        raise TypeError(f"got both '{ours}' and its SGLang spelling '{theirs}': pass one")
    value = ours_value if ours_value is not None else theirs_value
    if value is None:
        raise TypeError(f"missing argument '{ours}' (or its SGLang spelling '{theirs}')")
    return value


def _retrieve(retrieve_index, retrieve_next_token, retrieve_next_sibling, retrive_index,
              retrive_next_token, retrive_next_sibling):
    return (_pick("retrieve_index", retrieve_index, "retrive_index", retrive_index),
            _pick("retrieve_next_token", retrieve_next_token, "retrive_next_token",
                  retrive_next_token),
            _pick("retrieve_next_sibling", retrieve_next_sibling, "retrive_next_sibling",
                  retrive_next_sibling))


def _front(name: str, out: Tensor, needed: int) -> Tensor:
    """The first `needed` elements of the caller's buffer, as a flat view that writes through."""
    if not out.is_contiguous():
        raise ValueError(f"argument '{name}' must be contiguous (it is written in place)")
    if out.numel() < needed:
        raise ValueError(f"argument '{name}' has {out.numel()} elements, needs at least {needed}")
    return out.view(-1)[:needed]


def _write_front(name: str, out: Tensor, value: Tensor) -> None:
    _front(name, out, value.numel()).copy_(value.reshape(-1))


# ---- tree building and verification -----------------------------------------------------------

def build_tree_kernel_efficient(parent_list: Tensor, selected_index: Tensor,
                                verified_seq_len: Tensor, tree_mask: Tensor, positions: Tensor,
                                retrieve_index: Optional[Tensor] = None,
                                retrieve_next_token: Optional[Tensor] = None,
                                retrieve_next_sibling: Optional[Tensor] = None,
                                topk: int = None, depth: int = None, draft_token_num: int = None,
                                tree_mask_mode: int = None, *,
                                retrive_index: Optional[Tensor] = None,
                                retrive_next_token: Optional[Tensor] = None,
                                retrive_next_sibling: Optional[Tensor] = None) -> None:
    """build_tree into the caller's buffers (each at least as large as the op's output; written
    at the front). A bit-packed `tree_mask` may use any integer type of the op's width."""
    ridx_out, nxt_out, sib_out = _retrieve(retrieve_index, retrieve_next_token,
                                           retrieve_next_sibling, retrive_index,
                                           retrive_next_token, retrive_next_sibling)
    for name, value in (("topk", topk), ("depth", depth), ("draft_token_num", draft_token_num),
                        ("tree_mask_mode", tree_mask_mode)):
        if value is None:
            raise TypeError(f"missing argument '{name}'")
    mask, pos, ridx, nxt, sib = ops.build_tree(parent_list, selected_index, verified_seq_len,
                                               topk, depth, draft_token_num, tree_mask_mode)
    if mask.dtype != tree_mask.dtype:  # bit-packed rows: same bits in the caller's integer type
        if mask.element_size() != tree_mask.element_size() or tree_mask.is_floating_point():
            raise ValueError(f"argument 'tree_mask' must be {mask.dtype} (or a same-size "
                             f"integer type), got {tree_mask.dtype}")
        mask = mask.view(tree_mask.dtype)
    _write_front("tree_mask", tree_mask, mask)
    _write_front("positions", positions, pos)
    _write_front("retrieve_index", ridx_out, ridx)
    _write_front("retrieve_next_token", nxt_out, nxt)
    _write_front("retrieve_next_sibling", sib_out, sib)


def verify_tree_greedy(predicts: Tensor, accept_index: Tensor, accept_token_num: Tensor,
                       candidates: Tensor, retrieve_index: Optional[Tensor] = None,
                       retrieve_next_token: Optional[Tensor] = None,
                       retrieve_next_sibling: Optional[Tensor] = None,
                       target_predict: Optional[Tensor] = None, *,
                       retrive_index: Optional[Tensor] = None,
                       retrive_next_token: Optional[Tensor] = None,
                       retrive_next_sibling: Optional[Tensor] = None) -> None:
    """Greedy tree verification into int32 buffers; `predicts` holds at least B*N entries (only
    the first B*N can be written) and its entries off the accepted path keep what the caller
    filled them with (the op writes in place)."""
    ridx, nxt, sib = _retrieve(retrieve_index, retrieve_next_token, retrieve_next_sibling,
                               retrive_index, retrive_next_token, retrive_next_sibling)
    if target_predict is None:
        raise TypeError("missing argument 'target_predict'")
    bs, n = candidates.shape
    ops.verify_tree_greedy_out(_front("predicts", predicts, bs * n), accept_index,
                               accept_token_num, candidates, ridx, nxt, sib, target_predict)


def tree_speculative_sampling_target_only(
        predicts: Tensor, accept_index: Tensor, accept_token_num: Tensor, candidates: Tensor,
        retrieve_index: Optional[Tensor] = None, retrieve_next_token: Optional[Tensor] = None,
        retrieve_next_sibling: Optional[Tensor] = None,
        uniform_samples: Optional[Tensor] = None,
        uniform_samples_for_final_sampling: Optional[Tensor] = None,
        target_probs: Optional[Tensor] = None, draft_probs: Optional[Tensor] = None,
        threshold_single: float = 1.0, threshold_acc: float = 1.0, deterministic: bool = True, *,
        retrive_index: Optional[Tensor] = None, retrive_next_token: Optional[Tensor] = None,
        retrive_next_sibling: Optional[Tensor] = None) -> None:
    """Lossless tree rejection sampling (our tree_speculative_sampling) into the caller's
    buffers, with SGLang's signature. Only the lossless setting is supported: thresholds of 1
    (anything else raises ValueError naming the threshold). Candidates are deterministic, so
    `draft_probs` is not read. Coins: uniform_samples [B, N] (one per child node) and
    uniform_samples_for_final_sampling [B] (the bonus draw), as SGLang shapes them; our
    acceptance rule spends them differently (module docstring). Entries of `predicts` off the
    accepted path keep the caller's values; accept_index [B, S] gives S = depth + 1."""
    ridx, nxt, sib = _retrieve(retrieve_index, retrieve_next_token, retrieve_next_sibling,
                               retrive_index, retrive_next_token, retrive_next_sibling)
    for name, value in (("uniform_samples", uniform_samples),
                        ("uniform_samples_for_final_sampling", uniform_samples_for_final_sampling),
                        ("target_probs", target_probs)):
        if value is None:
            raise TypeError(f"missing argument '{name}'")
    for name, value in (("threshold_single", threshold_single), ("threshold_acc", threshold_acc)):
        if value != 1.0:
            raise ValueError(f"argument '{name}' = {value}: only the lossless setting 1.0 is "
                             "supported")
    bs, n = candidates.shape
    steps = accept_index.shape[-1]
    if accept_index.numel() != bs * steps:
        raise ValueError(f"argument 'accept_index' must be [B, S] with B = {bs}, got shape "
                         f"{tuple(accept_index.shape)}")
    pred, acc, num = ops.tree_speculative_sampling(
        candidates, ridx, nxt, sib, uniform_samples.reshape(bs, n).float(),
        uniform_samples_for_final_sampling.reshape(bs).float(),
        target_probs.reshape(bs, n, -1).float(), steps)
    out = _front("predicts", predicts, bs * n)
    path = acc.reshape(-1)
    path = path[path >= 0].long()  # flat rows of the accepted paths (bonus row included)
    out[path] = pred[path].to(out.dtype)
    _write_front("accept_index", accept_index, acc)
    _write_front("accept_token_num", accept_token_num, num)


def reconstruct_indices_from_tree_mask(tree_mask: Tensor, verified_seq_len: Tensor,
                                       positions: Tensor,
                                       retrieve_index: Optional[Tensor] = None,
                                       retrieve_next_token: Optional[Tensor] = None,
                                       retrieve_next_sibling: Optional[Tensor] = None,
                                       batch_size: int = None, draft_token_num: int = None, *,
                                       retrive_index: Optional[Tensor] = None,
                                       retrive_next_token: Optional[Tensor] = None,
                                       retrive_next_sibling: Optional[Tensor] = None) -> None:
    """Linkage of a QLEN_ONLY ancestor mask (n-gram drafts) into the caller's buffers; a mask
    that is not a tree raises ValueError naming `tree_mask`."""
    ridx_out, nxt_out, sib_out = _retrieve(retrieve_index, retrieve_next_token,
                                           retrieve_next_sibling, retrive_index,
                                           retrive_next_token, retrive_next_sibling)
    if batch_size is None or draft_token_num is None:
        raise TypeError("missing argument 'batch_size' or 'draft_token_num'")
    if verified_seq_len.shape[0] != batch_size:
        raise ValueError(f"argument 'batch_size' = {batch_size} but verified_seq_len has "
                         f"{verified_seq_len.shape[0]} rows")
    pos, ridx, nxt, sib = ops.reconstruct_tree_from_mask(tree_mask, verified_seq_len,
                                                         draft_token_num)
    _write_front("positions", positions, pos)
    _write_front("retrieve_index", ridx_out, ridx)
    _write_front("retrieve_next_token", nxt_out, nxt)
    _write_front("retrieve_next_sibling", sib_out, sib)


# ---- KV slot bookkeeping ----------------------------------------------------------------------

def assign_req_to_token(req_pool_indices: Tensor, req_to_token: Tensor, start_offset: Tensor,
                        end_offset: Tensor, out_cache_loc: Tensor) -> None:
    """req_to_token[req_pool_indices[i], start:end] = the next end-start slots of out_cache_loc
    (which may hold more slots than that: the tail is not read)."""
    needed = int((end_offset.long() - start_offset.long()).sum())
    ops.assign_req_to_token(req_to_token, req_pool_indices, start_offset, end_offset,
                            _front("out_cache_loc", out_cache_loc, needed))


def assign_draft_cache_locs(req_pool_indices: Tensor, req_to_token: Tensor, seq_lens: Tensor,
                            out_cache_loc: Tensor, topk: int, speculative_num_steps: int) -> None:
    """out_cache_loc[b*topk*steps + k*steps + s] = slot of position seq_len + k*steps + s."""
    _write_front("out_cache_loc", out_cache_loc,
                 ops.assign_draft_cache_locs(req_to_token, req_pool_indices, seq_lens, topk,
                                             speculative_num_steps))


def get_target_cache_loc(req_pool_indices: Tensor, req_to_token: Tensor, start_offset: Tensor,
                         end_offset: Tensor, out_cache_loc: Tensor) -> None:
    """Dense concatenation of the slots of [start, end) per request (verify / move targets),
    at the front of out_cache_loc (which may be sized at capacity)."""
    needed = int((end_offset.long() - start_offset.long()).sum())
    _write_front("out_cache_loc", out_cache_loc,
                 ops.gather_extend_cache_locs(req_to_token, req_pool_indices, start_offset,
                                              end_offset, needed))


def build_draft_decode_metadata_cpu(req_to_token: Tensor, req_pool_indices: Tensor,
                                    seq_lens: Tensor, topk: int, num_steps: int,
                                    pool_len: int) -> Tensor:
    """Per-branch slot table for draft decode [B*topk, pool_len] int32 (our
    build_draft_decode_table): row b*topk+k = request b's prefix slots, then candidate k's
    num_steps draft slots; entries past them are -1 (SGLang leaves them undefined)."""
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len:
        raise ValueError(f"argument 'pool_len' = {pool_len} must equal req_to_token's width, got "
                         f"shape {tuple(req_to_token.shape)}")
    return ops.build_draft_decode_table(req_to_token, req_pool_indices, seq_lens, topk, num_steps)


def fill_new_verified_id(accept_tokens: Tensor, accept_lens: Tensor, verified_id: Tensor) -> None:
    """verified_id[b] = accept_tokens[b, accept_lens[b] - 1] (front of the buffer)."""
    _write_front("verified_id", verified_id, ops.fill_bonus_tokens(accept_tokens, accept_lens))


def filter_finished_cache_loc(cache_loc: Tensor, accept_index: Tensor, out: Tensor) -> Tensor:
    """Accepted slots compacted into the front of `out`; its tail (from the count on) is left
    untouched. Returns the count (a 0-d int64 tensor)."""
    compacted, count = ops.compact_accepted_cache_locs(cache_loc, accept_index)
    n = int(count)
    _front("out", out, n).copy_(compacted[:n])
    return count


_KV_BUFFERS: Dict[int, Tensor] = {}


def register_kv_buffers(buffers: Sequence[Tensor]) -> None:
    """Make KV pool buffers known to copy_all_layer_kv_cache_cpu by their data pointers (SGLang's
    pool builds its `data_ptrs` from the same buffers). Registering again replaces the set."""
    _KV_BUFFERS.clear()
    for b in buffers:
        _KV_BUFFERS[b.data_ptr() % (1 << 64)] = b


def copy_all_layer_kv_cache_cpu(data_ptrs: Tensor, strides: Tensor, tgt_loc: Tensor,
                                src_loc: Tensor) -> None:
    """For every buffer named in data_ptrs ([2*layers] uint64: the K buffers, then the V
    buffers, as SGLang lays them out): slot tgt_loc[i] <- slot src_loc[i], sources read before
    any write (our move_kv_slots). The pointers are only looked up among the buffers passed to
    register_kv_buffers -- an unknown one raises ValueError naming 'data_ptrs' -- and strides
    [2*layers] int64 must be each buffer's bytes per slot."""
    ptrs = [int(p) for p in data_ptrs.reshape(-1).tolist()]
    row_bytes = [int(s) for s in strides.reshape(-1).tolist()]
    if len(row_bytes) != len(ptrs):
        raise ValueError(f"argument 'strides' has {len(row_bytes)} entries, data_ptrs has "
                         f"{len(ptrs)}")
    if len(ptrs) % 2:
        raise ValueError(f"argument 'data_ptrs' must list K then V buffers (an even count), got "
                         f"{len(ptrs)}")
    buffers = []
    for i, (p, s) in enumerate(zip(ptrs, row_bytes)):
        # data_ptrs is uint64; tolist() may give negative ints for addresses past 2^63.
        b = _KV_BUFFERS.get(p % (1 << 64))
        if b is None:
            raise ValueError(f"argument 'data_ptrs' [{i}] = {p:#x} is not a registered KV buffer: "
                             "call register_kv_buffers(k_buffers + v_buffers) first")
        if s != b.stride(0) * b.element_size():
            raise ValueError(f"argument 'strides' [{i}] = {s} bytes per slot, the buffer has "
                             f"{b.stride(0) * b.element_size()}")
        buffers.append(b)
    if tgt_loc.numel() != src_loc.numel():
        raise ValueError(f"argument 'tgt_loc' has {tgt_loc.numel()} slots, src_loc has "
                         f"{src_loc.numel()}")
    if not buffers or tgt_loc.numel() == 0:
        return
    half = len(buffers) // 2
    ops.move_kv_slots(buffers[:half], buffers[half:], src_loc.reshape(-1), tgt_loc.reshape(-1))


def move_kv_cache(k_buffers, v_buffers, src_cache_loc: Tensor, tgt_cache_loc: Tensor) -> None:
    """Move accepted KV rows of every layer from src to tgt slots (sources read first)."""
    ops.move_kv_slots(list(k_buffers), list(v_buffers), src_cache_loc, tgt_cache_loc)


def rotate_input_ids_cpu(input_ids: Tensor, extend_start_loc: Tensor, extend_seq_lens: Tensor,
                         topk_index: Tensor, select_index: Optional[Tensor] = None) -> None:
    """In place on input_ids [num_tokens] int64: each request's segment [start, start + len)
    shifts left by one and the new token topk_index[b] goes to its last position (or to the
    flat position select_index[b]; the segment's last entry then keeps its old value). Plain
    torch indexing: there is no op for this bookkeeping."""
    if input_ids.dtype != torch.int64 or input_ids.dim() != 1:
        raise ValueError(f"argument 'input_ids' must be 1-D int64, got {input_ids.dtype} "
                         f"shape {tuple(input_ids.shape)}")
    bs = extend_seq_lens.numel()
    for name, t in (("extend_start_loc", extend_start_loc), ("topk_index", topk_index)) + (
            (("select_index", select_index),) if select_index is not None else ()):
        if t.numel() != bs:
            raise ValueError(f"argument '{name}' has {t.numel()} entries, extend_seq_lens has {bs}")
    start = extend_start_loc.reshape(-1).long()
    lens = extend_seq_lens.reshape(-1).long()
    if bs and (int((start + lens).max()) > input_ids.numel() or int(start.min()) < 0
               or int(lens.min()) < 0):
        raise ValueError("argument 'extend_start_loc' / 'extend_seq_lens' reach outside input_ids")
    shifted = (lens - 1).clamp(min=0)  # [B] tokens that move left in each segment
    seg_start = torch.repeat_interleave(start, shifted)  # [M]
    seg_first = torch.repeat_interleave(torch.cumsum(shifted, 0) - shifted, shifted)  # [M]
    dst = seg_start + torch.arange(seg_start.numel()) - seg_first  # [M]: start .. start+len-2
    input_ids[dst] = input_ids[dst + 1].clone()  # every source read before any write
    has = lens > 0
    where = select_index.reshape(-1).long() if select_index is not None else start + lens - 1
    input_ids[where[has]] = topk_index.reshape(-1).long()[has]


# ---- attention ----------------------------------------------------------------------------------

def extend_attention_cpu(q_extend: Tensor, k_extend: Tensor, v_extend: Tensor, o_extend: Tensor,
                         k_buffer: Tensor, v_buffer: Tensor, req_to_token: Tensor,
                         req_pool_indices: Tensor, seq_lens: Tensor, extend_seq_lens: Tensor,
                         extend_start_loc: Tensor, max_len_extend: int, sm_scale: float,
                         logit_cap: float = 0.0, is_cross_attn: bool = False,
                         sliding_window_size: int = 0, encoder_lens: Optional[Tensor] = None,
                         sinks: Optional[Tensor] = None,
                         tree_mask: Optional[Tensor] = None) -> None:
    """Ragged extend attention into o_extend [num_tokens, H, D] (our extend_attention).

    Request b's queries are q_extend[extend_start_loc[b] : + extend_seq_lens[b]] over its
    seq_lens[b] keys: the prefix (seq_lens - extend_seq_lens) and the new tokens, causal, or as
    the QLEN_ONLY bool tree_mask [B*T*T] (T = max_len_extend) allows. Convention: all keys,
    the new tokens' included, are read from k_buffer / v_buffer through req_to_token -- SGLang's
    backend stores them (set_kv_buffer) before the call; k_extend / v_extend are only
    shape-checked. sliding_window_size > 0 keeps keys at positions > query position - size
    (SGLang passes its layer's size + 1, i.e. the model's window). Cross attention, encoder
    lengths, attention sinks and a V head dim other than K's raise NotImplementedError."""
    if is_cross_attn or encoder_lens is not None or sinks is not None:
        raise NotImplementedError("extend_attention_cpu: cross attention, encoder_lens and "
                                  "attention sinks are not supported")
    if v_buffer.shape != k_buffer.shape:
        raise NotImplementedError(f"argument 'v_buffer' must have k_buffer's shape "
                                  f"{tuple(k_buffer.shape)} (no separate V head dim), got "
                                  f"{tuple(v_buffer.shape)}")
    num_tokens, h, d = q_extend.shape
    if k_extend.shape[0] != num_tokens or v_extend.shape[0] != num_tokens:
        raise ValueError(f"argument 'k_extend' / 'v_extend' must have {num_tokens} rows "
                         f"(q_extend's), got {k_extend.shape[0]} and {v_extend.shape[0]}")
    if tuple(o_extend.shape) != (num_tokens, h, d):
        raise ValueError(f"argument 'o_extend' must be {(num_tokens, h, d)}, got "
                         f"{tuple(o_extend.shape)}")
    bs = seq_lens.numel()
    ext = extend_seq_lens.reshape(-1).long()
    start = extend_start_loc.reshape(-1).long()
    t = int(max_len_extend)
    if ext.numel() != bs or start.numel() != bs:
        raise ValueError(f"argument 'extend_seq_lens' / 'extend_start_loc' must have {bs} entries")
    if bs and int(ext.max()) > t:
        raise ValueError(f"argument 'max_len_extend' = {t} is below the longest extend "
                         f"{int(ext.max())}")
    # Ragged -> padded [B, T, H, D]: row (b, i) is token start[b] + i.
    rows = torch.arange(t).view(1, t)  # [1, T]
    valid = rows < ext.view(bs, 1)  # [B, T]
    flat = (start.view(bs, 1) + rows)[valid]  # [num_valid]
    q = q_extend.new_zeros(bs, t, h, d)  # [B, T, H, D]
    q[valid] = q_extend[flat]
    out = ops.extend_attention(q, k_buffer, v_buffer, req_to_token, req_pool_indices,
                               seq_lens.long() - ext, ext, tree_mask, float(sm_scale),
                               int(sliding_window_size) if sliding_window_size > 0 else -1,
                               float(logit_cap))
    o_extend[flat] = out[valid].to(o_extend.dtype)


# ---- SGLang's `*_cpu` names ---------------------------------------------------------------------
# sgl_kernel also exports the CPU kernels under their own names, some with a redundant pool_len /
# accept_stride argument (checked against the tensors here, then dropped).

verify_tree_greedy_cpu = verify_tree_greedy
build_tree_kernel_efficient_cpu = build_tree_kernel_efficient
reconstruct_indices_from_tree_mask_cpu = reconstruct_indices_from_tree_mask


def _check_pool_len(req_to_token: Tensor, pool_len: int) -> None:
    if req_to_token.dim() != 2 or req_to_token.shape[1] != pool_len:
        raise ValueError(f"argument 'pool_len' = {pool_len} must equal req_to_token's width, got "
                         f"shape {tuple(req_to_token.shape)}")


def assign_req_to_token_pool_cpu(req_pool_indices: Tensor, req_to_token: Tensor,
                                 start_offset: Tensor, end_offset: Tensor, out_cache_loc: Tensor,
                                 pool_len: int) -> None:
    _check_pool_len(req_to_token, pool_len)
    assign_req_to_token(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: Tensor, req_to_token: Tensor,
                                           seq_lens: Tensor, out_cache_loc: Tensor, pool_len: int,
                                           topk: int, num_steps: int) -> None:
    _check_pool_len(req_to_token, pool_len)
    assign_draft_cache_locs(req_pool_indices, req_to_token, seq_lens, out_cache_loc, topk,
                            num_steps)


def assign_extend_cache_locs_cpu(req_pool_indices: Tensor, req_to_token: Tensor,
                                 start_offset: Tensor, end_offset: Tensor, out_cache_loc: Tensor,
                                 pool_len: int) -> None:
    _check_pool_len(req_to_token, pool_len)
    get_target_cache_loc(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc)


def fill_bonus_tokens_cpu(accept_tokens: Tensor, accept_lens: Tensor, bonus_tokens: Tensor,
                          accept_stride: int) -> None:
    """bonus_tokens[b] = accept_tokens[b, accept_lens[b] - 1] over rows of accept_stride."""
    bs = accept_lens.numel()
    if accept_tokens.numel() != bs * accept_stride:
        raise ValueError(f"argument 'accept_stride' = {accept_stride}: accept_tokens has "
                         f"{accept_tokens.numel()} elements for {bs} requests")
    fill_new_verified_id(accept_tokens.reshape(bs, accept_stride), accept_lens, bonus_tokens)


def fill_accept_out_cache_loc_cpu(accept_index: Tensor, out_cache_loc: Tensor,
                                  accept_out_cache_loc: Tensor) -> None:
    """Accepted slots out_cache_loc[accept_index[i] >= 0] compacted to the front of
    accept_out_cache_loc (its tail untouched)."""
    filter_finished_cache_loc(out_cache_loc, accept_index.reshape(-1), accept_out_cache_loc)
