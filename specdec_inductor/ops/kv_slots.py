"""KV-slot bookkeeping ops over `req_to_token` [R, L] int32 (request row, position) -> slot.
Semantics: shared/spec/kernels.md section 5. Each op: wrapper + docstring, then its fake."""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

import specdec_inductor._library  # noqa: F401  (loads the schemas before register_fake)


def assign_req_to_token(
    req_to_token: Tensor, req_rows: Tensor, start: Tensor, end: Tensor, cache_loc: Tensor
) -> None:
    """In place: req_to_token[req_rows[i], start[i]:end[i]] = cache_loc[off[i]:off[i+1]] where
    off is the exclusive prefix sum of end - start in batch order. Every index is checked
    before the first write, so a bad call leaves the table untouched."""
    torch.ops.specdec.assign_req_to_token.default(req_to_token, req_rows, start, end, cache_loc)


@torch.library.register_fake("specdec::assign_req_to_token")
def _(req_to_token, req_rows, start, end, cache_loc):
    return None


def assign_draft_cache_locs(
    req_to_token: Tensor, req_rows: Tensor, seq_lens: Tensor, topk: int, steps: int
) -> Tensor:
    """The topk*steps draft slots reserved after each request's committed prefix, as an int64
    vector [B*topk*steps], candidate-major: out[b*topk*steps + k*steps + s] =
    req_to_token[req_rows[b], seq_lens[b] + k*steps + s]."""
    return torch.ops.specdec.assign_draft_cache_locs.default(req_to_token, req_rows, seq_lens, topk, steps)


@torch.library.register_fake("specdec::assign_draft_cache_locs")
def _(req_to_token, req_rows, seq_lens, topk, steps):
    _check_draft_slots(topk, steps, req_to_token.shape[1])
    return req_to_token.new_empty((req_rows.shape[0] * topk * steps,), dtype=torch.int64)


def _check_draft_slots(topk: int, steps: int, width: int) -> None:
    """The kernels' argument checks, in the fakes too (a traced call must fail as the eager one
    does, not with a negative or overflowing size): topk * steps draft slots fit in a row."""
    if topk < 1:
        raise ValueError(f"argument 'topk' must be >= 1, got {topk}")
    if steps < 1:
        raise ValueError(f"argument 'steps' must be >= 1, got {steps}")
    if topk * steps > width:
        raise ValueError(f"arguments 'topk' * 'steps' = {topk * steps} draft slots per request "
                         f"exceed req_to_token's width {width}")


def gather_extend_cache_locs(
    req_to_token: Tensor, req_rows: Tensor, start: Tensor, end: Tensor, total: Optional[int] = None
) -> Tensor:
    """Concatenation of req_to_token[req_rows[i], start[i]:end[i]] over the batch, int64.

    `total` (sum of end - start) makes the output size static for torch.compile (verify passes
    B*N); without it the size is data-dependent. A wrong `total` raises ValueError."""
    return torch.ops.specdec.gather_extend_cache_locs.default(req_to_token, req_rows, start, end, total)


@torch.library.register_fake("specdec::gather_extend_cache_locs")
def _(req_to_token, req_rows, start, end, total=None):
    size = total if total is not None else torch.library.get_ctx().new_dynamic_size()
    return req_to_token.new_empty((size,), dtype=torch.int64)


def build_draft_decode_table(
    req_to_token: Tensor, req_rows: Tensor, seq_lens: Tensor, topk: int, steps: int
) -> Tensor:
    """Per-branch slot table for draft decode attention, [B*topk, L] int32: row b*topk+k holds
    request b's seq_lens[b] prefix slots, then candidate k's `steps` draft slots
    (positions [seq_len + k*steps, seq_len + (k+1)*steps) of its row), then -1."""
    return torch.ops.specdec.build_draft_decode_table.default(req_to_token, req_rows, seq_lens, topk, steps)


@torch.library.register_fake("specdec::build_draft_decode_table")
def _(req_to_token, req_rows, seq_lens, topk, steps):
    _check_draft_slots(topk, steps, req_to_token.shape[1])
    return req_to_token.new_empty((req_rows.shape[0] * topk, req_to_token.shape[1]), dtype=torch.int32)


def fill_bonus_tokens(accept_tokens: Tensor, accept_lens: Tensor) -> Tensor:
    """bonus[b] = accept_tokens[b, accept_lens[b] - 1]; accept_lens count the bonus token, so
    each must lie in [1, S]."""
    return torch.ops.specdec.fill_bonus_tokens.default(accept_tokens, accept_lens)


@torch.library.register_fake("specdec::fill_bonus_tokens")
def _(accept_tokens, accept_lens):
    return accept_tokens.new_empty((accept_tokens.shape[0],))


def compact_accepted_cache_locs(cache_loc: Tensor, accept_index: Tensor) -> Tuple[Tensor, Tensor]:
    """Stream compaction of cache_loc[accept_index] over the non-negative entries of the flat
    accept_index: returns (out [accept_index.numel()] int64 padded with -1, count [] int64)."""
    return torch.ops.specdec.compact_accepted_cache_locs.default(cache_loc, accept_index)


@torch.library.register_fake("specdec::compact_accepted_cache_locs")
def _(cache_loc, accept_index):
    return (
        cache_loc.new_empty((accept_index.numel(),), dtype=torch.int64),
        cache_loc.new_empty((), dtype=torch.int64),
    )


def move_kv_slots(k_buffers: List[Tensor], v_buffers: List[Tensor], src: Tensor, dst: Tensor) -> None:
    """In place, for every layer's K and V buffer [num_slots, ...]: slot dst[i] <- slot src[i].
    All sources are read before any write, so chains (dst[i] == src[i+1]) are safe; a slot
    named twice in dst is ambiguous and raises ValueError. Indices are checked first."""
    torch.ops.specdec.move_kv_slots.default(k_buffers, v_buffers, src, dst)


@torch.library.register_fake("specdec::move_kv_slots")
def _(k_buffers, v_buffers, src, dst):
    return None
