"""Attention over the paged KV pool: store_kv, extend_attention (prefill / tree verify) and
decode_attention. Semantics: shared/spec/kernels.md section 6; references in reference.py.
Each op: wrapper + docstring, then its fake.

Layouts: k_pool / v_pool [S, Hkv, D] (one row per slot); req_to_token [R, L] int32 maps
(request row, position) -> slot; q [B, T, H, D] with H a multiple of Hkv (GQA)."""
from typing import Optional

import torch
from torch import Tensor

import specdec_inductor._library  # noqa: F401  (loads the schemas before register_fake)


def store_kv(k_pool: Tensor, v_pool: Tensor, k: Tensor, v: Tensor, slots: Tensor) -> None:
    """In place: k_pool[slots[b, t]] = k[b, t] and v_pool[slots[b, t]] = v[b, t] for every
    slot >= 0 (-1 marks padding and is skipped).

    k, v [B, T, Hkv, D] of any strides (Hugging Face's [B, Hkv, T, D] passed as
    .transpose(1, 2) works without a copy); slots [B, T] int32 or int64. k/v may be float32,
    bfloat16 or float16 and are converted to the pool's dtype (round to nearest even). Every
    slot is checked (range, no slot named twice) before the first write."""
    torch.ops.specdec.store_kv.default(k_pool, v_pool, k, v, slots)


@torch.library.register_fake("specdec::store_kv")
def _(k_pool, v_pool, k, v, slots):
    return None


def extend_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    req_to_token: Tensor,
    req_rows: Tensor,
    prefix_lens: Tensor,
    extend_lens: Tensor,
    tree_mask: Optional[Tensor],
    scale: float,
    sliding_window: int = -1,
    logit_cap: float = 0.0,
) -> Tensor:
    """Attention of each request's new tokens over its prefix plus the new tokens.

    q [B, T, H, D] (any strides; float32 or bfloat16, the pools' dtype). Request b's keys are
    the slots req_to_token[req_rows[b], 0 : prefix_lens[b] + extend_lens[b]] (store the new
    tokens' K/V with store_kv first). Query t < extend_lens[b] sees every prefix key, plus new
    token j when tree_mask allows it -- QLEN_ONLY bool [B*T*T] (row t, column j) or bit-packed
    integers [B*T] (bit j) -- or, without a mask, when j <= t (causal). In verify, drafts sit at
    positions [seq_len, seq_len + N) and prefix_lens must be exactly seq_len.
    sliding_window > 0 keeps a key only if its token position is > the query's - window
    (transformers' rule), on top of the causal / tree rule. Token positions: prefix key p sits
    at p; without a mask new token t at prefix + t; with a tree_mask draft t sits at prefix +
    depth(t), depth(t) = the new tokens its mask row shows minus itself (a tree whose parents
    precede their children, so depth(t) <= t; a row showing more raises ValueError).
    logit_cap > 0 maps scores s -> cap * tanh(s / cap).
    Returns out [B, T, H, D] contiguous in q's dtype; rows t >= extend_lens[b] are zero, and so
    is a row that sees no key (a tree row with no visible token and no prefix).
    Row reproducibility (calls of at most 64 rows per request): a causal row, or a tree row whose
    mask shows exactly its ancestors, equals bit for bit the decode_attention row of the same
    position over the same keys (the prefix, then its ancestors in order), at any thread count
    and alone or in a batch -- so greedy speculation reproduces plain greedy decoding even where
    INT8 activations magnify last bits. Exception: bf16 on AMX, where a chain verify of 8+ query
    rows per chunk runs AMX tiles and decode AVX-512 (both within the 2x rule)."""
    return torch.ops.specdec.extend_attention.default(
        q, k_pool, v_pool, req_to_token, req_rows, prefix_lens, extend_lens, tree_mask, scale,
        sliding_window, logit_cap)


@torch.library.register_fake("specdec::extend_attention")
def _(q, k_pool, v_pool, req_to_token, req_rows, prefix_lens, extend_lens, tree_mask, scale,
      sliding_window=-1, logit_cap=0.0):
    return q.new_empty(q.shape)  # [B, T, H, D], contiguous


def decode_attention(
    q: Tensor,
    k_pool: Tensor,
    v_pool: Tensor,
    req_to_token: Tensor,
    req_rows: Tensor,
    kv_lens: Tensor,
    scale: float,
    sliding_window: int = -1,
    logit_cap: float = 0.0,
) -> Tensor:
    """One query per row: q [B, H, D] attends the slots req_to_token[req_rows[b], 0:kv_lens[b]]
    (the current token's K/V included, so kv_lens >= 1). Long contexts are split over the key
    range across threads and merged (flash-decoding). For topk draft branches pass the table of
    build_draft_decode_table with req_rows = arange(B*topk). Returns out [B, H, D] in q's dtype."""
    return torch.ops.specdec.decode_attention.default(
        q, k_pool, v_pool, req_to_token, req_rows, kv_lens, scale, sliding_window, logit_cap)


@torch.library.register_fake("specdec::decode_attention")
def _(q, k_pool, v_pool, req_to_token, req_rows, kv_lens, scale, sliding_window=-1,
      logit_cap=0.0):
    return q.new_empty(q.shape)  # [B, H, D], contiguous
