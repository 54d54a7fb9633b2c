"""The one seam between the engine and attention over the KV pool: store_kv, extend and decode
attention behind a named backend. Which backend runs is explicit (`Engine.attention_backend`,
printed by the CLI and benchmarks) and never changes behind the caller's back.

Backends:
- OPS: `torch.ops.specdec.store_kv / extend_attention / decode_attention` (C++ kernels,
  traceable by torch.compile; compiled steps store with aten index_copy_, see store_kv). The
  default whenever those ops are registered.
- TORCH: the same semantics in vectorized plain PyTorch over a static-width slot table
  (gather every row's `max_len` slots, mask, SDPA). Traceable; reads `max_len` keys per query
  whatever the real length is. Used when the OPS kernels are not built into this package.
- REFERENCE: `ops/reference.py` (`*_ref`), Python loops over requests; eager only.
"""
import enum
import logging
import os
from typing import Optional

import torch
from torch import Tensor

from specdec_inductor.ops import reference

log = logging.getLogger(__name__)

ENV_VAR = "SPECDEC_ATTENTION"


class AttentionBackend(enum.Enum):
    OPS = "ops"
    TORCH = "torch"
    REFERENCE = "reference"

    @property
    def traceable(self) -> bool:
        """Whether torch.compile(fullgraph=True) can trace this backend."""
        return self is not AttentionBackend.REFERENCE


def ops_available() -> bool:
    """True when the C++ attention ops are registered in `torch.ops.specdec`."""
    return all(hasattr(torch.ops.specdec, name)
               for name in ("store_kv", "extend_attention", "decode_attention"))


def resolve_backend(requested: Optional[str] = None) -> AttentionBackend:
    """`requested`, else $SPECDEC_ATTENTION, else OPS when registered, else TORCH (logged)."""
    name = requested or os.environ.get(ENV_VAR)
    if name:
        backend = AttentionBackend(name.lower())
        if backend is AttentionBackend.OPS and not ops_available():
            raise RuntimeError("attention backend 'ops' requested but torch.ops.specdec has no "
                               "extend_attention/decode_attention/store_kv in this build")
        return backend
    if ops_available():
        return AttentionBackend.OPS
    log.warning("torch.ops.specdec attention kernels are not built; using the TORCH backend")
    return AttentionBackend.TORCH


def _padding_as_sink(slots: Tensor, k_pool: Tensor) -> Tensor:
    """Slots with -1 (padding) redirected to the pool's last row, the padding sink."""
    return torch.where(slots >= 0, slots, k_pool.shape[0] - 1).reshape(-1).long()  # [B*T]


def store_kv(backend: AttentionBackend, k_pool: Tensor, v_pool: Tensor, k: Tensor, v: Tensor,
             slots: Tensor) -> None:
    """k_pool[slots[b, t]] = k[b, t] (and v); k, v [B, T, H_kv, D]; slot -1 = padding.

    Under torch.compile the OPS backend writes with aten `index_copy_` (padding into the sink
    row), not `specdec::store_kv`: the engine compiles each decoder layer once as a nested
    compile region (hf.compile_layers_once), and torch functionalizes a region's body in C++,
    which rejects a custom op that mutates its inputs. Inductor fuses the copy into the RoPE
    kernel of the step, so nothing is lost; eager OPS steps call the op."""
    if backend is AttentionBackend.OPS and not torch.compiler.is_compiling():
        torch.ops.specdec.store_kv(k_pool, v_pool, k, v, slots)
    elif backend is not AttentionBackend.REFERENCE:
        index = _padding_as_sink(slots, k_pool)  # [B*T]
        k_pool.index_copy_(0, index, k.reshape(-1, *k.shape[2:]).to(k_pool.dtype))
        v_pool.index_copy_(0, index, v.reshape(-1, *v.shape[2:]).to(v_pool.dtype))
    else:
        reference.store_kv_ref(k_pool, v_pool, k, v, slots)


def _torch_extend_attention(q, k_pool, v_pool, req_to_token, req_rows, prefix_lens, extend_lens,
                            tree_mask, scale, sliding_window, logit_cap):
    bs, t_max, h, d = q.shape
    h_kv = k_pool.shape[1]
    width = req_to_token.shape[1]
    table = req_to_token[req_rows.long()].long()  # [B, L]
    table = torch.where(table >= 0, table, k_pool.shape[0] - 1)
    k = k_pool[table].transpose(1, 2)  # [B, H_kv, L, D]
    v = v_pool[table].transpose(1, 2)  # [B, H_kv, L, D]
    prefix = prefix_lens.long().view(bs, 1, 1)
    t = torch.arange(t_max).view(1, t_max, 1)
    j = torch.arange(width).view(1, 1, width)
    qpos = prefix + t  # [B, T, 1]
    kpos = j  # [1, 1, L]: token positions of the keys (a tree draft's is prefix + its depth)
    if tree_mask is None:
        mask = j <= qpos  # [B, T, L]
    else:
        tree = reference.unpack_tree_mask_ref(tree_mask, bs, t_max)  # [B, T, T]
        rel = (j - prefix).clamp(0, t_max - 1).expand(bs, t_max, width)  # [B, T, L]
        in_tree = torch.gather(tree, 2, rel) & (j >= prefix) & (j < prefix + t_max)
        mask = (j < prefix) | in_tree
        if sliding_window > 0:
            # Depth of draft e = the drafts its ancestor row shows, minus itself (the kernels'
            # rule, csrc/attention.cpp tree_depths). Padding rows' depths are never used.
            depth = (tree.sum(-1) - 1).clamp(min=0)  # [B, T]
            qpos = prefix + depth.unsqueeze(-1)  # [B, T, 1]
            key_depth = torch.gather(depth, 1, rel[:, 0]).unsqueeze(1)  # [B, 1, L]
            kpos = torch.where(j < prefix, j, prefix + key_depth)  # [B, 1, L]
    if sliding_window > 0:
        mask = mask & (kpos > qpos - sliding_window)
    valid_row = t < extend_lens.long().view(bs, 1, 1)  # [B, T, 1]
    # Padding rows see key 0 only, so softmax stays finite; their output is zeroed below.
    mask = torch.where(valid_row, mask, j == 0)
    qh = q.transpose(1, 2)  # [B, H, T, D]
    if logit_cap > 0:
        kr = k.repeat_interleave(h // h_kv, dim=1)  # [B, H, L, D]
        vr = v.repeat_interleave(h // h_kv, dim=1)
        scores = (qh.float() @ kr.float().transpose(-1, -2)) * scale  # [B, H, T, L]
        scores = logit_cap * torch.tanh(scores / logit_cap)
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        out = (scores.softmax(-1) @ vr.float()).to(q.dtype)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            qh, k, v, attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=h != h_kv)
    out = out.transpose(1, 2)  # [B, T, H, D]
    return torch.where(valid_row.unsqueeze(-1), out, 0.0)


def extend_attention(backend: AttentionBackend, q, k_pool, v_pool, req_to_token, req_rows,
                     prefix_lens, extend_lens, tree_mask, scale: float, sliding_window: int = -1,
                     logit_cap: float = 0.0) -> Tensor:
    """New tokens q [B, T, H, D] attend their request's prefix plus the new tokens (causal, or
    as tree_mask allows); out [B, T, H, D], zero rows past extend_lens[b]."""
    if backend is AttentionBackend.OPS:
        return torch.ops.specdec.extend_attention(q, k_pool, v_pool, req_to_token, req_rows,
                                                  prefix_lens, extend_lens, tree_mask, scale,
                                                  sliding_window, logit_cap)
    if backend is AttentionBackend.TORCH:
        return _torch_extend_attention(q, k_pool, v_pool, req_to_token, req_rows, prefix_lens,
                                       extend_lens, tree_mask, scale, sliding_window, logit_cap)
    return reference.extend_attention_ref(q, k_pool, v_pool, req_to_token, req_rows, prefix_lens,
                                          extend_lens, tree_mask, scale, sliding_window, logit_cap)


def decode_attention(backend: AttentionBackend, q, k_pool, v_pool, req_to_token, req_rows,
                     kv_lens, scale: float, sliding_window: int = -1,
                     logit_cap: float = 0.0) -> Tensor:
    """One query per row, q [B, H, D], over req_to_token[req_rows[b], :kv_lens[b]]."""
    if backend is AttentionBackend.OPS:
        return torch.ops.specdec.decode_attention(q, k_pool, v_pool, req_to_token, req_rows,
                                                  kv_lens, scale, sliding_window, logit_cap)
    if backend is AttentionBackend.TORCH:
        ones = torch.ones_like(kv_lens)
        out = _torch_extend_attention(q.unsqueeze(1), k_pool, v_pool, req_to_token, req_rows,
                                      kv_lens - 1, ones, None, scale, sliding_window, logit_cap)
        return out.squeeze(1)  # [B, H, D]
    return reference.decode_attention_ref(q, k_pool, v_pool, req_to_token, req_rows, kv_lens,
                                          scale, sliding_window, logit_cap)
