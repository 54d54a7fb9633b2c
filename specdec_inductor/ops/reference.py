"""Readable pure-PyTorch references of every `torch.ops.specdec` op: `<op>_ref` computes what
kernels.md says the op computes, nothing more. Tests check each C++ kernel against its
reference before anything is timed; benchmarks time the references as the eager baseline.

They are written for clarity, not speed. Tree walks use Python loops over requests; the
attention references build the explicit prefix + tree mask and call SDPA in fp32.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from specdec_inductor.ops.tree import TreeMaskMode, bitpacked_mask_dtype


# ---------------------------------------------------------------------------------------------
# Draft trees (kernels.md sections 1-4)
# ---------------------------------------------------------------------------------------------


def tree_parents_ref(parent_list: Tensor, selected_index: Tensor, topk: int) -> List[List[int]]:
    """Parent node of every node (root: -1) per request, from the draft numbering of section 1."""
    parents = []
    for b in range(selected_index.shape[0]):
        sel = selected_index[b].tolist()
        node_of_id = {s: j + 1 for j, s in enumerate(sel)}
        row = [-1]
        for j, s in enumerate(sel):
            p = s // topk
            if p == 0:
                row.append(0)
                continue
            parent_id = int(parent_list[b, p])
            if parent_id not in node_of_id or node_of_id[parent_id] > j:
                raise ValueError(f"malformed tree: selected_index[{b}, {j}] has no selected parent")
            row.append(node_of_id[parent_id])
        parents.append(row)
    return parents


def _linkage_from_parents(parents: List[List[int]], seq_lens: Tensor):
    """positions, retrieve_index, next_token, next_sibling from per-request parent lists."""
    bs, n = len(parents), len(parents[0])
    positions = torch.empty(bs * n, dtype=torch.int64)  # [B*N]
    retrieve_index = torch.arange(bs * n, dtype=torch.int64).view(bs, n)  # [B, N]
    next_token = torch.full((bs, n), -1, dtype=torch.int64)  # [B, N]
    next_sibling = torch.full((bs, n), -1, dtype=torch.int64)  # [B, N]
    for b, par in enumerate(parents):
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[par[i]] + 1
        for i in range(n):
            positions[b * n + i] = int(seq_lens[b]) + depth[i]
            children = [c for c in range(i + 1, n) if par[c] == i]
            if children:
                next_token[b, i] = children[0]
            if i > 0:
                later = [c for c in range(i + 1, n) if par[c] == par[i]]
                if later:
                    next_sibling[b, i] = later[0]
    return positions, retrieve_index, next_token, next_sibling


def _ancestor_rows(par: List[int]) -> List[List[bool]]:
    n = len(par)
    rows = []
    for i in range(n):
        row = [False] * n
        j = i
        while j >= 0:
            row[j] = True
            j = par[j]
        rows.append(row)
    return rows


def build_tree_ref(parent_list, selected_index, seq_lens, topk, depth, num_draft_tokens,
                   tree_mask_mode=TreeMaskMode.QLEN_ONLY):
    n = num_draft_tokens
    parents = tree_parents_ref(parent_list, selected_index, topk)
    positions, retrieve_index, next_token, next_sibling = _linkage_from_parents(parents, seq_lens)
    chunks = []
    for b, par in enumerate(parents):
        rows = _ancestor_rows(par)
        if tree_mask_mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
            dtype = bitpacked_mask_dtype(n)
            width = torch.iinfo(dtype).bits
            words = [sum(1 << j for j in range(n) if r[j]) for r in rows]
            if dtype.is_signed:  # same bits, two's-complement value
                words = [w - (1 << width) if w >> (width - 1) else w for w in words]
            chunks.append(torch.tensor(words, dtype=dtype))
            continue
        tree = torch.tensor(rows, dtype=torch.bool)  # [N, N]
        if tree_mask_mode == TreeMaskMode.FULL_MASK:
            prefix = torch.ones(n, int(seq_lens[b]), dtype=torch.bool)  # [N, seq_len]
            tree = torch.cat([prefix, tree], dim=1)
        chunks.append(tree.flatten())
    mask = torch.cat(chunks)
    return mask, positions, retrieve_index, next_token, next_sibling


def verify_tree_greedy_ref(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                           target_predict, num_spec_steps):
    bs, n = candidates.shape
    predicts = torch.full((bs * n,), -1, dtype=torch.int32)  # [B*N]
    accept_index = torch.full((bs, num_spec_steps), -1, dtype=torch.int32)  # [B, S]
    accept_token_num = torch.zeros(bs, dtype=torch.int32)  # [B]
    flat_target = target_predict.reshape(-1)
    for b in range(bs):
        last = int(retrieve_index[b, 0])
        node = 0
        accept_index[b, 0] = last
        for level in range(1, num_spec_steps):
            want = int(flat_target[last])  # the target's token after `node`
            child = int(retrieve_next_token[b, node])
            while child != -1 and int(candidates[b, child]) != want:
                child = int(retrieve_next_sibling[b, child])
            if child == -1:
                break
            predicts[last] = want
            node, last = child, int(retrieve_index[b, child])
            accept_index[b, level] = last
            accept_token_num[b] += 1
        predicts[last] = int(flat_target[last])  # bonus token
    return predicts, accept_index, accept_token_num


def reconstruct_tree_from_mask_ref(tree_mask, seq_lens, num_draft_tokens):
    n = num_draft_tokens
    mask = tree_mask.view(-1, n, n)  # [B, N, N]
    parents = []
    for b in range(mask.shape[0]):
        par = [-1]
        for t in range(1, n):
            above = [j for j in range(t) if bool(mask[b, t, j])]
            par.append(above[-1] if above else -1)
        if _ancestor_rows(par) != mask[b].tolist():
            raise ValueError(f"malformed tree: tree_mask of request {b} is not an ancestor mask")
        parents.append(par)
    return _linkage_from_parents(parents, seq_lens)


# ---------------------------------------------------------------------------------------------
# KV-slot bookkeeping (kernels.md section 5)
# ---------------------------------------------------------------------------------------------


def _ranges(start, end):
    return [(int(s), int(e)) for s, e in zip(start.tolist(), end.tolist())]


def assign_req_to_token_ref(req_to_token, req_rows, start, end, cache_loc):
    offset = 0
    for row, (s, e) in zip(req_rows.tolist(), _ranges(start, end)):
        req_to_token[row, s:e] = cache_loc[offset:offset + e - s].to(torch.int32)
        offset += e - s


def assign_draft_cache_locs_ref(req_to_token, req_rows, seq_lens, topk, steps):
    out = [req_to_token[row, n:n + topk * steps] for row, n in zip(req_rows.tolist(), seq_lens.tolist())]
    return torch.cat(out).to(torch.int64)  # [B*topk*steps], candidate-major


def gather_extend_cache_locs_ref(req_to_token, req_rows, start, end, total=None):
    out = [req_to_token[row, s:e] for row, (s, e) in zip(req_rows.tolist(), _ranges(start, end))]
    return torch.cat(out).to(torch.int64) if out else torch.empty(0, dtype=torch.int64)


def build_draft_decode_table_ref(req_to_token, req_rows, seq_lens, topk, steps):
    width = req_to_token.shape[1]
    table = torch.full((len(req_rows) * topk, width), -1, dtype=torch.int32)  # [B*topk, L]
    for b, (row, n) in enumerate(zip(req_rows.tolist(), seq_lens.tolist())):
        for k in range(topk):
            table[b * topk + k, :n] = req_to_token[row, :n]
            table[b * topk + k, n:n + steps] = req_to_token[row, n + k * steps:n + (k + 1) * steps]
    return table


def fill_bonus_tokens_ref(accept_tokens, accept_lens):
    rows = torch.arange(accept_tokens.shape[0])
    return accept_tokens[rows, accept_lens.long() - 1]


def compact_accepted_cache_locs_ref(cache_loc, accept_index):
    flat = accept_index.reshape(-1).long()
    kept = cache_loc.long()[flat[flat >= 0]]
    out = torch.full((flat.numel(),), -1, dtype=torch.int64)
    out[:kept.numel()] = kept
    return out, torch.tensor(kept.numel(), dtype=torch.int64)


def move_kv_slots_ref(k_buffers, v_buffers, src, dst):
    for buf in list(k_buffers) + list(v_buffers):
        rows = buf[src.long()].clone()  # every source read before any write
        buf[dst.long()] = rows


# ---------------------------------------------------------------------------------------------
# Lossless sampling (kernels.md section 7)
# ---------------------------------------------------------------------------------------------


def top_k_top_p_renorm_ref(probs, top_k, top_p):
    out = torch.empty_like(probs, dtype=torch.float32)  # [R, V]
    for r in range(probs.shape[0]):
        row = probs[r].float()
        ordered = row.sort(descending=True).values
        keep_from = 0.0
        k = int(top_k[r])
        if 0 < k < row.numel():
            keep_from = float(ordered[k - 1])  # k-th largest; ties with it are kept
        kept = ordered[ordered >= keep_from]
        if float(top_p[r]) < 1.0:
            cum = kept.double().cumsum(0)
            first = int((cum >= float(top_p[r]) * float(kept.double().sum())).nonzero()[0])
            keep_from = float(kept[first])
        mask = row >= keep_from
        out[r] = torch.where(mask, row, 0.0) / row[mask].double().sum().float()
    return out


def _draw_ref(weights: Tensor, u: float) -> int:
    """Inverse CDF: the first index whose cumulative weight exceeds u * total."""
    w = weights.double().clamp(min=0)
    cum = w.cumsum(0)
    hits = (cum > u * float(w.sum())) & (w > 0)
    return int(hits.nonzero()[0]) if bool(hits.any()) else int((w > 0).nonzero()[-1])


def tree_speculative_sampling_ref(candidates, retrieve_index, retrieve_next_token,
                                  retrieve_next_sibling, uniform_samples, uniform_final,
                                  target_probs, num_spec_steps):
    bs, n = candidates.shape
    predicts = torch.full((bs * n,), -1, dtype=torch.int32)  # [B*N]
    accept_index = torch.full((bs, num_spec_steps), -1, dtype=torch.int32)  # [B, S]
    accept_token_num = torch.zeros(bs, dtype=torch.int32)  # [B]
    for b in range(bs):
        last, node = int(retrieve_index[b, 0]), 0
        accept_index[b, 0] = last
        for level in range(num_spec_steps):
            residual = target_probs[b, node].double().clone()
            if level == num_spec_steps - 1:
                break
            child, found = int(retrieve_next_token[b, node]), -1
            while child != -1:
                token = int(candidates[b, child])
                if float(uniform_samples[b, child]) * float(residual.sum()) < float(residual[token]):
                    found = child
                    break
                residual[token] = 0.0  # rejected: its mass leaves the residual
                child = int(retrieve_next_sibling[b, child])
            if found < 0:
                break
            predicts[last] = int(candidates[b, found])
            node, last = found, int(retrieve_index[b, found])
            accept_token_num[b] += 1
            accept_index[b, level + 1] = last
        predicts[last] = _draw_ref(residual, float(uniform_final[b]))
    return predicts, accept_index, accept_token_num


def chain_speculative_sampling_ref(draft_tokens, draft_probs, target_probs, uniform_samples,
                                   uniform_final):
    bs, k = draft_tokens.shape
    tokens = torch.full((bs, k + 1), -1, dtype=torch.int64)  # [B, K+1]
    accept_token_num = torch.zeros(bs, dtype=torch.int32)  # [B]
    for b in range(bs):
        i = 0
        while i < k:
            x = int(draft_tokens[b, i])
            p, q = float(target_probs[b, i, x]), float(draft_probs[b, i, x])
            if not float(uniform_samples[b, i]) * q < p:
                break
            tokens[b, i] = x
            i += 1
        accept_token_num[b] = i
        p = target_probs[b, i].double()
        weights = (p - draft_probs[b, i].double()).clamp(min=0) if i < k else p
        if float(weights.sum()) <= 0:
            weights = p
        tokens[b, i] = _draw_ref(weights, float(uniform_final[b]))
    return tokens, accept_token_num


# ---------------------------------------------------------------------------------------------
# Attention over the slot pool (kernels.md section 6)
# ---------------------------------------------------------------------------------------------
# Layouts: k_pool / v_pool [S, Hkv, D]; q [B, T, H, D] (rows t >= extend_lens[b] are padding);
# req_to_token [R, L] int32; the new tokens' K/V are already stored at positions
# [prefix_lens[b], prefix_lens[b] + extend_lens[b]) of row req_rows[b].


def store_kv_ref(k_pool, v_pool, k, v, slots):
    """k_pool[slots[b, t]] = k[b, t] (and v) for every slot >= 0; -1 marks padding."""
    flat_slots = slots.reshape(-1).long()
    keep = flat_slots >= 0
    k_pool[flat_slots[keep]] = k.reshape(-1, *k.shape[2:])[keep].to(k_pool.dtype)
    v_pool[flat_slots[keep]] = v.reshape(-1, *v.shape[2:])[keep].to(v_pool.dtype)


def unpack_tree_mask_ref(tree_mask: Tensor, bs: int, n: int) -> Tensor:
    """[B, N, N] bool from a QLEN_ONLY bool mask [B*N*N] or a bit-packed one [B*N]."""
    if tree_mask.dtype == torch.bool:
        return tree_mask.view(bs, n, n)
    bits = tree_mask.to(torch.int64).view(bs, n, 1)  # [B, N, 1] (sign extension keeps low bits)
    return (bits >> torch.arange(n).view(1, 1, n)) & 1 == 1


def extend_attention_ref(q, k_pool, v_pool, req_to_token, req_rows, prefix_lens, extend_lens,
                         tree_mask: Optional[Tensor], scale: float, sliding_window: int = -1,
                         logit_cap: float = 0.0):
    """Each request's new tokens attend its prefix (all of it) plus the new tokens the tree
    mask allows (causal without a mask), in fp32 SDPA with an explicit bool mask."""
    bs, t_max, h, d = q.shape
    h_kv = k_pool.shape[1]
    out = torch.zeros(bs, t_max, h, d, dtype=q.dtype)  # [B, T, H, D]
    tree = unpack_tree_mask_ref(tree_mask, bs, t_max) if tree_mask is not None else None
    for b in range(bs):
        prefix, ext = int(prefix_lens[b]), int(extend_lens[b])
        if ext == 0:
            continue
        slots = req_to_token[int(req_rows[b]), :prefix + ext].long()
        k = k_pool[slots].float().repeat_interleave(h // h_kv, dim=1)  # [K, H, D]
        v = v_pool[slots].float().repeat_interleave(h // h_kv, dim=1)  # [K, H, D]
        new = tree[b, :ext, :ext] if tree is not None else torch.ones(ext, ext, dtype=torch.bool).tril()
        mask = torch.cat([torch.ones(ext, prefix, dtype=torch.bool), new], dim=1)  # [ext, K]
        if sliding_window > 0:
            # A new token sits at prefix + its depth: the drafts its mask row shows, itself
            # excluded (its row index when causal); prefix keys at their index.
            depth = new.sum(1) - 1 if tree is not None else torch.arange(ext)  # [ext]
            qpos = (prefix + depth).view(-1, 1)
            kpos = torch.cat([torch.arange(prefix), prefix + depth]).view(1, -1)
            mask &= kpos > qpos - sliding_window
        qb = q[b, :ext].float().transpose(0, 1)  # [H, ext, D]
        scores = (qb @ k.permute(1, 2, 0)) * scale  # [H, ext, K]
        if logit_cap > 0:
            scores = logit_cap * torch.tanh(scores / logit_cap)
        scores = scores.masked_fill(~mask, float("-inf"))
        out[b, :ext] = (scores.softmax(-1) @ v.transpose(0, 1)).transpose(0, 1).to(q.dtype)
    return out


def decode_attention_ref(q, k_pool, v_pool, req_to_token, req_rows, kv_lens, scale: float,
                         sliding_window: int = -1, logit_cap: float = 0.0):
    """One query per row [B, H, D] over req_to_token[req_rows[b], :kv_lens[b]] (the current
    token's K/V included)."""
    bs = q.shape[0]
    ones = torch.zeros(bs, dtype=torch.int64) + 1
    out = extend_attention_ref(q.unsqueeze(1), k_pool, v_pool, req_to_token, req_rows,
                               kv_lens.long() - 1, ones, None, scale, sliding_window, logit_cap)
    return out.squeeze(1)  # [B, H, D]


# ---------------------------------------------------------------------------------------------
# Linear layers of few rows (csrc/linear.cpp)
# ---------------------------------------------------------------------------------------------


def skinny_linear_ref(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x @ weight.T + bias computed in fp32, rounded once to x's dtype."""
    y = x.float() @ weight.float().T  # [..., N]
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def skinny_linear_cat_ref(x: Tensor, weights, biases) -> Tensor:
    """The skinny_linear of each (weight, bias) against x, side by side: [..., sum N_i]."""
    return torch.cat([skinny_linear_ref(x, w, b) for w, b in zip(weights, biases)], dim=-1)


def _f16_field(blocks: Tensor, offset: int) -> Tensor:
    """The fp16 field at byte `offset` of each block ([B, bytes] uint8) as fp32 [B, 1]."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _k_scale_min(scales: Tensor) -> Tuple[Tensor, Tensor]:
    """The 8 6-bit scales and 8 6-bit mins packed in the 12 scale bytes of Q4_K / Q5_K blocks
    ([B, 12] int32) -> two [B, 8] float32."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 6) << 4)], 1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 6) << 4)], 1)
    return sc.float(), mn.float()


def quant_dequantize_ref(weight: Tensor, fmt) -> Tensor:
    """The fp32 weight [N, K] of uint8 [N, row_bytes] ggml blocks (layouts: csrc/quant_isa.h),
    written out per format. Every product is exact in fp32; the one rounding per weight is that of
    the file's definition (the "+ m" / "- dmin * mn" step). A repacked fmt: its file rows'."""
    from specdec_inductor.ops.quant import QuantFormat, quant_block

    weight, fmt = _file_layout(weight, QuantFormat(int(fmt)))
    size, nbytes = quant_block(fmt)
    n = weight.shape[0]
    blocks = weight.reshape(-1, nbytes)  # [B, bytes], B = N * K / size
    b = blocks.to(torch.int32)  # [B, bytes]
    nibbles = lambda qs: torch.cat([qs & 15, qs >> 4], 1)  # noqa: E731  [B, 16] -> [B, 32]
    if fmt == QuantFormat.Q4_0:
        w = _f16_field(blocks, 0) * (nibbles(b[:, 2:18]) - 8).float()
    elif fmt == QuantFormat.Q4_1:
        w = _f16_field(blocks, 0) * nibbles(b[:, 4:20]).float() + _f16_field(blocks, 2)
    elif fmt == QuantFormat.Q5_0:
        bits = (b[:, 2:6, None] >> torch.arange(8)) & 1  # [B, 4, 8]: bit j of the u32 qh
        w = _f16_field(blocks, 0) * ((nibbles(b[:, 6:22]) | bits.reshape(-1, 32) << 4) - 16).float()
    elif fmt == QuantFormat.Q5_1:
        bits = (b[:, 4:8, None] >> torch.arange(8)) & 1  # [B, 4, 8]: bit j of the u32 qh
        w = _f16_field(blocks, 0) * (nibbles(b[:, 8:24]) | bits.reshape(-1, 32) << 4).float() + _f16_field(blocks, 2)
    elif fmt == QuantFormat.Q8_0:
        w = _f16_field(blocks, 0) * blocks[:, 2:34].view(torch.int8).float()
    elif fmt in (QuantFormat.Q4_K, QuantFormat.Q5_K):
        sc, mn = _k_scale_min(b[:, 4:16])  # [B, 8] each
        qs = b[:, 16:144] if fmt == QuantFormat.Q4_K else b[:, 48:176]  # [B, 128]
        q = torch.stack([qs.reshape(-1, 4, 32) & 15, qs.reshape(-1, 4, 32) >> 4], 2)  # [B, 4, 2, 32]
        q = q.reshape(-1, 8, 32)  # [B, 8 sub-blocks, 32]
        if fmt == QuantFormat.Q5_K:
            q = q | ((b[:, None, 16:48] >> torch.arange(8)[:, None]) & 1) << 4
        ds = (_f16_field(blocks, 0) * sc)[:, :, None]  # [B, 8, 1]
        dm = (_f16_field(blocks, 2) * mn)[:, :, None]
        w = ds * q.float() - dm
    else:  # Q6_K
        q = (_q6_quants(b) - 32).float()  # [B, 256]
        scales = blocks[:, 192:208].contiguous().view(torch.int8).float()  # [B, 16]
        w = (_f16_field(blocks, 208) * scales).repeat_interleave(16, 1) * q
    return w.reshape(n, -1)


def _q6_quants(b: Tensor) -> Tensor:
    """The 256 6-bit quants u (0..63) of Q6_K blocks ([B, 210] int) as [B, 256]."""
    ql, qh = b[:, 0:128], b[:, 128:192]
    groups = []
    for g in range(8):  # 32 weights each
        h, t = divmod(g, 4)
        lo = (ql[:, 64 * h + 32 * (t % 2):][:, :32] >> 4 * (t // 2)) & 15
        hi = (qh[:, 32 * h:32 * h + 32] >> 2 * t) & 3
        groups.append(lo | hi << 4)
    return torch.cat(groups, 1)


def _q6_file_quants(u: Tensor) -> Tensor:
    """Q6_K's ql [128] and qh [64] bytes from u [B, 256] (the inverse of _q6_quants): [B, 192]."""
    out = torch.zeros(u.shape[0], 192, dtype=torch.int64)
    for g in range(8):
        h, t = divmod(g, 4)
        ug = u[:, 32 * g:32 * g + 32].long()
        at = 64 * h + 32 * (t % 2)
        out[:, at:at + 32] |= (ug & 15) << 4 * (t // 2)
        out[:, 128 + 32 * h:160 + 32 * h] |= (ug >> 4) << 2 * t
    return out


def _r16_chunks(weight: Tensor, nbytes: int) -> Tensor:
    """File rows [N, row_bytes] (N a multiple of 16) as blocks [G, 16, nb, nbytes] int64."""
    return weight.reshape(weight.shape[0] // 16, 16, -1, nbytes).long()


def _lanes(field: Tensor) -> Tensor:
    """[G, 16, nb, *rest] -> [G, nb, 16, *rest]: a per-row field laid out lane by lane."""
    return field.transpose(1, 2)


def _pairs(values: Tensor) -> Tensor:
    """Per-row values [G, 16, nb, 2P] as the R16 pair layout [G, nb, P, 16, 2]."""
    g, r, nb, n = values.shape
    return values.reshape(g, r, nb, n // 2, 2).permute(0, 2, 3, 1, 4)


def _quads(values: Tensor, outer: int) -> Tensor:
    """Per-row bytes [G, 16, nb, outer * 32] (outer x 8 quads x 4) as [G, nb, outer, 8, 16, 4]."""
    g, r, nb, _ = values.shape
    return values.reshape(g, r, nb, outer, 8, 4).permute(0, 2, 3, 4, 1, 5)


def _small_fields(fmt):
    """A 32-weight format's file block: (bytes, has m, has qh, offset of qh, offset of qs,
    64-byte qs vectors per block in the R16 chunk)."""
    from specdec_inductor.ops.quant import QuantFormat, quant_block

    has_min = fmt in (QuantFormat.Q4_1, QuantFormat.Q5_1)
    has_qh = fmt in (QuantFormat.Q5_0, QuantFormat.Q5_1)
    qh_at = 4 if has_min else 2
    return (quant_block(fmt)[1], has_min, has_qh, qh_at, qh_at + 4 * has_qh,
            8 if fmt == QuantFormat.Q8_0 else 4)


def _quant_flip(fmt) -> int:
    """What the R16 layout xors into a 32-weight format's quant bytes: Q8_0's are stored as
    q + 128 (the unsigned byte vpdpbusd takes), the nibbles as they are."""
    from specdec_inductor.ops.quant import QuantFormat

    return 0x80 if fmt == QuantFormat.Q8_0 else 0


def _small_repack_ref(weight: Tensor, fmt) -> Tensor:
    """The R16 pair chunks (csrc/quant_repack.h) of 32-weight-format file rows [N, row_bytes]."""
    nbytes, has_min, has_qh, qh_at, qs_at, vectors = _small_fields(fmt)
    g = weight.shape[0] // 16
    c = weight.reshape(g, 16, -1, 2, nbytes).long()  # [G, 16, P, block, bytes]
    by_lane = lambda f: f.permute(0, 2, 3, 1, 4)  # noqa: E731  [G, P, block, 16, n]
    parts = [by_lane(c[..., 0:2])]
    if has_min:
        parts.append(by_lane(c[..., 2:4]))
    if has_qh:
        qh = sum(c[..., qh_at + i, None] << 8 * i for i in range(4))  # [G, 16, P, block, 1]
        bits = (qh >> torch.arange(32)) & 1  # [G, 16, P, block, 32]: j = 16h + 4t + i
        bits = bits.reshape(*bits.shape[:4], 2, 4, 4).permute(0, 2, 3, 5, 4, 1, 6)  # [G, P, block, t, h, 16, 4]
        bits = bits.reshape(*bits.shape[:5], 8, 8)  # mask bit 4r + i as (byte, bit)
        parts.append((bits << torch.arange(8)).sum(-1))
    qs = c[..., qs_at:qs_at + 4 * vectors].reshape(g, 16, c.shape[2], 2, vectors, 4)
    parts.append(qs.permute(0, 2, 3, 4, 1, 5) ^ _quant_flip(fmt))  # [G, P, block, t, 16, 4]
    out = torch.cat([p.reshape(g, c.shape[2], -1) for p in parts], -1)  # [G, P, chunk]
    return out.reshape(g, -1).to(torch.uint8)


def _small_unpack_ref(weight: Tensor, fmt) -> Tensor:
    """The file rows [N, row_bytes] of 32-weight-format R16 pair chunks (the inverse of
    _small_repack_ref, read field by field)."""
    from specdec_inductor.ops.quant import file_format, quant_block

    base = file_format(fmt)
    nbytes, has_min, has_qh, _, _, vectors = _small_fields(base)
    g = weight.shape[0]
    ch = weight.reshape(g, -1, 16 * quant_block(fmt)[1]).long()  # [G, P, chunk]
    pairs = ch.shape[1]
    by_row = lambda f: f.reshape(g, pairs, 2, 16, -1).permute(0, 3, 1, 2, 4)  # noqa: E731  [G, 16, P, block, n]
    fields, at = [by_row(ch[..., 0:64])], 64
    if has_min:
        fields.append(by_row(ch[..., 64:128]))
        at = 128
    if has_qh:
        bits = (ch[..., at:at + 128, None] >> torch.arange(8)) & 1  # [G, P, 128 bytes, 8]
        bits = bits.reshape(g, pairs, 2, 4, 2, 16, 4).permute(0, 5, 1, 2, 4, 3, 6)  # [G, 16, P, block, h, t, i]
        qh = (bits.reshape(g, 16, pairs, 2, 32) << torch.arange(32)).sum(-1, keepdim=True)
        fields.append((qh >> 8 * torch.arange(4)) & 255)
        at += 128
    qs = ch[..., at:].reshape(g, pairs, 2, vectors, 16, 4).permute(0, 4, 1, 2, 3, 5) ^ _quant_flip(base)
    fields.append(qs.reshape(g, 16, pairs, 2, -1))
    blocks = torch.cat(fields, -1)  # [G, 16, P, block, bytes]
    return blocks.reshape(g * 16, -1).to(torch.uint8)


def quant_repack_ref(weight: Tensor, fmt) -> Tensor:
    """The R16 layout (csrc/quant_repack.h) of file rows uint8 [N, row_bytes] of a format with one
    (Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0, Q4_K / Q6_K), built from the decoded fields:
    uint8 [N / 16, 16 * R16 row_bytes]."""
    from specdec_inductor.ops.quant import QuantFormat, quant_block

    fmt = QuantFormat(int(fmt))
    if quant_block(fmt)[0] == 32:
        return _small_repack_ref(weight, fmt)
    c = _r16_chunks(weight, 144 if fmt == QuantFormat.Q4_K else 210)  # [G, 16, nb, bytes]
    g, _, nb, nbytes = c.shape
    flat = c.reshape(-1, nbytes)  # [B, bytes]
    if fmt == QuantFormat.Q4_K:
        sc, mn = (v.long().reshape(g, 16, nb, 8) for v in _k_scale_min(flat[:, 4:16]))
        parts = [_lanes(c[..., 0:2]), _lanes(c[..., 2:4]), _pairs(sc), _pairs(mn),
                 _quads(c[..., 16:144], 4)]
    else:
        u = _q6_quants(flat).reshape(g, 16, nb, 16, 4, 4)  # [G, 16, nb, group, slot, i]
        split = u[..., 3, :]  # slot 3, its bits over the top bits of slots 0-2's bytes
        q = torch.stack([u[..., v, :] | ((split >> 2 * v) & 3) << 6 for v in range(3)], -2)  # [G, 16, nb, group, v, i]
        parts = [_lanes(c[..., 208:210]), torch.zeros(g, nb, 32, dtype=torch.int64),  # padding
                 _pairs(c[..., 192:208]), _quads(q.reshape(g, 16, nb, -1), 6)]
    out = torch.cat([p.reshape(g, nb, -1) for p in parts], -1)  # [G, nb, chunk]
    return out.reshape(g, -1).to(torch.uint8)


def quant_unpack_ref(weight: Tensor, fmt) -> Tensor:
    """The file rows uint8 [N, row_bytes] of an R16 weight [N / 16, 16 * R16 row_bytes] (fmt an
    *_R16 format): its fields read back and encoded as the file's blocks."""
    from specdec_inductor.ops.quant import QuantFormat, quant_block

    fmt = QuantFormat(int(fmt))
    if quant_block(fmt)[0] == 64:
        return _small_unpack_ref(weight, fmt)
    q4 = fmt == QuantFormat.Q4_K_R16
    g = weight.shape[0]
    ch = weight.reshape(g, -1, 16 * (148 if q4 else 212)).long()  # [G, nb, chunk]
    nb = ch.shape[1]
    rows = lambda x: x.reshape(g, nb, 16, -1).transpose(1, 2)  # noqa: E731  [G, nb, 16, n] -> [G, 16, nb, n]
    unquads = lambda x, outer: x.reshape(g, nb, outer, 8, 16, 4).permute(0, 4, 1, 2, 3, 5).reshape(g, 16, nb, -1)  # noqa: E731
    unpairs = lambda x, n: x.reshape(g, nb, n // 2, 16, 2).permute(0, 3, 1, 2, 4).reshape(g, 16, nb, n)  # noqa: E731
    if q4:
        d, dmin = rows(ch[..., 0:32]), rows(ch[..., 32:64])
        sc, mn = unpairs(ch[..., 64:192], 8), unpairs(ch[..., 192:320], 8)
        scales = torch.cat([sc[..., :4] | (sc[..., 4:] >> 4) << 6, mn[..., :4] | (mn[..., 4:] >> 4) << 6,
                            (sc[..., 4:] & 15) | (mn[..., 4:] & 15) << 4], -1)
        blocks = torch.cat([d, dmin, scales, unquads(ch[..., 320:2368], 4)], -1)
    else:
        d, sc = rows(ch[..., 0:32]), unpairs(ch[..., 64:320], 16)
        q = unquads(ch[..., 320:3392], 6).reshape(g, 16, nb, 16, 3, 4)  # [G, 16, nb, group, v, i]
        split = sum((q[..., v, :] >> 6) << 2 * v for v in range(3))  # slot 3: [G, 16, nb, group, i]
        u = torch.cat([q & 63, split[..., None, :]], -2).reshape(-1, 256)  # [.., group, slot, i]
        blocks = torch.cat([_q6_file_quants(u).reshape(g, 16, nb, 192), sc, d], -1)
    return blocks.reshape(g * 16, -1).to(torch.uint8)


def _file_layout(weight: Tensor, fmt):
    """(file rows, file format) of a weight in any layout."""
    from specdec_inductor.ops.quant import file_format, is_repacked

    if is_repacked(fmt):
        return quant_unpack_ref(weight, fmt), file_format(fmt)
    return weight, fmt


def _k_int_parts(blocks: Tensor, fmt) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The integer form of K-format blocks ([B, bytes] uint8): wq [B, 256] int64 (Q6_K: q - 32),
    isc [B, 16] int64 (the integer scale of each 16 weights: Q4_K / Q5_K's 6-bit sub-block scale
    twice, Q6_K's int8 scale), d [B, 1] float64 (the fp16 d) and minimum [B, 8] float64
    (-dmin * mn per 32-weight sub-block, exact; 0 for Q6_K). w = d * isc * wq + minimum."""
    from specdec_inductor.ops.quant import QuantFormat

    b = blocks.to(torch.int64)  # [B, bytes]
    if fmt in (QuantFormat.Q4_K, QuantFormat.Q5_K):
        sc, mn = _k_scale_min(b[:, 4:16])  # [B, 8] each
        qs = b[:, 16:144] if fmt == QuantFormat.Q4_K else b[:, 48:176]  # [B, 128]
        wq = torch.stack([qs.reshape(-1, 4, 32) & 15, qs.reshape(-1, 4, 32) >> 4], 2).reshape(-1, 8, 32)
        if fmt == QuantFormat.Q5_K:
            wq = wq | ((b[:, None, 16:48] >> torch.arange(8)[:, None]) & 1) << 4
        isc = sc.long().repeat_interleave(2, 1)  # [B, 16]
        d = _f16_field(blocks, 0).double()
        minimum = -(_f16_field(blocks, 2) * mn).double()  # [B, 8]
    else:  # Q6_K
        wq = _q6_quants(b) - 32
        isc = blocks[:, 192:208].contiguous().view(torch.int8).long()  # [B, 16]
        d = _f16_field(blocks, 208).double()
        minimum = torch.zeros(blocks.shape[0], 8, dtype=torch.float64)
    return wq.reshape(-1, 256), isc, d, minimum


def quant_int8_parts_ref(weight: Tensor, fmt) -> Tuple[Tensor, Tensor, Tensor]:
    """The integer form of uint8 [N, row_bytes] ggml blocks used by INT8 activations:
    w[n, k] = scale[n, k // 16] * wq[n, k] + minimum[n, k // 32] (exact). Returns wq [N, K] int64,
    scale [N, K / 16] float64, minimum [N, K / 32] float64."""
    from specdec_inductor.ops.quant import QuantFormat, quant_block

    fmt = QuantFormat(int(fmt))
    size, nbytes = quant_block(fmt)
    n = weight.shape[0]
    blocks = weight.reshape(-1, nbytes)  # [B, bytes]
    if size == 256:
        wq, isc, d, minimum = _k_int_parts(blocks, fmt)
        return wq.reshape(n, -1), (d * isc).reshape(n, -1), minimum.reshape(n, -1)
    b = blocks.to(torch.int64)  # [B, bytes]
    nibbles = lambda qs: torch.cat([qs & 15, qs >> 4], 1)  # noqa: E731  [B, 16] -> [B, 32]
    minimum = torch.zeros(blocks.shape[0], 1, dtype=torch.float64)  # [B, 1]
    d = _f16_field(blocks, 0).double()  # [B, 1]
    if fmt == QuantFormat.Q4_0:
        wq = nibbles(b[:, 2:18]) - 8
    elif fmt == QuantFormat.Q4_1:
        wq = nibbles(b[:, 4:20])
        minimum = _f16_field(blocks, 2).double()
    elif fmt == QuantFormat.Q5_0:
        bits = (b[:, 2:6, None] >> torch.arange(8)) & 1  # [B, 4, 8]: bit j of the u32 qh
        wq = (nibbles(b[:, 6:22]) | bits.reshape(-1, 32) << 4) - 16
    elif fmt == QuantFormat.Q5_1:
        bits = (b[:, 4:8, None] >> torch.arange(8)) & 1
        wq = nibbles(b[:, 8:24]) | bits.reshape(-1, 32) << 4
        minimum = _f16_field(blocks, 2).double()
    else:
        wq = blocks[:, 2:34].view(torch.int8).long()
    scale = d.expand(-1, 2)  # [B, 2]
    return wq.reshape(n, -1), scale.reshape(n, -1), minimum.reshape(n, -1)


def quantize_activation_int8_ref(x: Tensor, block: int = 32) -> Tuple[Tensor, Tensor]:
    """Rows of x [M, K] (K a multiple of `block`: 32, or 256 for the K formats) in `block`-value
    blocks: d = max|x| / 127 and q = round-half-to-even(x / d) clamped to [-127, 127], both
    divisions in fp32; an all-zero block has d = 0, q = 0. Returns q [M, K] int64 and
    d [M, K / block] float32."""
    xb = x.float().reshape(x.shape[0], -1, block)  # [M, K / block, block]
    d = xb.abs().amax(-1) / 127  # [M, K / block] fp32
    safe = torch.where(d == 0, torch.ones_like(d), d)
    q = torch.round(xb / safe[..., None]).clamp(-127, 127)  # torch.round: half to even
    q = torch.where(d[..., None] == 0, torch.zeros_like(q), q)
    return q.long().reshape(x.shape[0], -1), d


def _int8k_terms_ref(x: Tensor, weight: Tensor, fmt):
    """The K formats' INT8 definition (ops/quant.py) in fp64: per 256-weight block the exact
    integer I = sum of isc * (16-weight dots of wq and q), y = sum_b d * d_x * I + the mins'
    sum_s minimum * d_x * (sum of the sub-block's q); and the sum of |terms| at the product level.
    Returns (y [M, N], magnitude [M, N]) float64."""
    from specdec_inductor.ops.quant import quant_block

    nbytes = quant_block(fmt)[1]
    n = weight.shape[0]
    wq, isc, dw, minimum = _k_int_parts(weight.reshape(-1, nbytes), fmt)
    wq, isc = wq.reshape(n, -1).double(), isc.reshape(n, -1).double()  # [N, K], [N, K / 16]
    dw, minimum = dw.reshape(n, -1), minimum.reshape(n, -1)  # [N, K / 256], [N, K / 32]
    q, d = quantize_activation_int8_ref(x, 256)  # [M, K], [M, K / 256]
    m, k = q.shape
    qd = q.double()
    dx = d.double()
    dots = torch.einsum("mgj,ngj->mng", qd.reshape(m, -1, 16), wq.reshape(n, -1, 16))  # [M, N, K/16]
    absdots = torch.einsum("mgj,ngj->mng", qd.abs().reshape(m, -1, 16), wq.abs().reshape(n, -1, 16))
    blocks = (dots * isc[None]).reshape(m, n, -1, 16).sum(-1)  # [M, N, K/256] exact integers
    absblocks = (absdots * isc.abs()[None]).reshape(m, n, -1, 16).sum(-1)
    dx32 = dx.repeat_interleave(8, 1)  # [M, K / 32]
    sums = qd.reshape(m, -1, 32).sum(-1)  # [M, K / 32]
    abssums = qd.abs().reshape(m, -1, 32).sum(-1)
    y = (blocks * dw[None] * dx[:, None]).sum(-1) + (dx32 * sums) @ minimum.T  # [M, N]
    mag = (absblocks * dw.abs()[None] * dx[:, None]).sum(-1) + (dx32 * abssums) @ minimum.abs().T
    return y, mag


def quant_linear_int8_terms_ref(x: Tensor, weight: Tensor, fmt, bias: Optional[Tensor] = None):
    """quant_linear with INT8 activations in fp64 from exact integer dots (the definition in
    ops/quant.py), and the sum of the absolute values of every term at the product level
    (|scale * d * wq * q| per weight, |min * d * q|, |bias|): the scale of fp32 rounding error.
    Returns (y [M, N] float64, magnitude [M, N] float64) for x [M, K]. A repacked fmt: the
    definition over its file rows (the same value in exact arithmetic)."""
    from specdec_inductor.ops.quant import quant_block

    weight, fmt = _file_layout(weight, fmt)
    if quant_block(fmt)[0] == 256:
        y, mag = _int8k_terms_ref(x, weight, fmt)
    else:
        wq, scale, minimum = quant_int8_parts_ref(weight, fmt)  # [N, K], [N, K/16], [N, K/32]
        q, d = quantize_activation_int8_ref(x)  # [M, K], [M, K / 32]
        m, k = q.shape
        n = wq.shape[0]
        qd, wqd = q.double(), wq.double()
        dots = torch.einsum("mgj,ngj->mng", qd.reshape(m, -1, 16), wqd.reshape(n, -1, 16))  # [M, N, K/16]
        absdots = torch.einsum("mgj,ngj->mng", qd.abs().reshape(m, -1, 16), wqd.abs().reshape(n, -1, 16))
        d16 = d.double().repeat_interleave(2, 1)  # [M, K / 16]
        sums = qd.reshape(m, -1, 32).sum(-1)  # [M, K / 32]
        abssums = qd.abs().reshape(m, -1, 32).sum(-1)
        y = (dots * scale[None] * d16[:, None]).sum(-1) + (d.double() * sums) @ minimum.T  # [M, N]
        mag = (absdots * scale.abs()[None] * d16[:, None]).sum(-1) + (d.double() * abssums) @ minimum.abs().T
    if bias is not None:
        y = y + bias.double()
        mag = mag + bias.double().abs()
    return y, mag


def quant_linear_ref(x: Tensor, weight: Tensor, fmt, bias: Optional[Tensor] = None,
                     activation=0) -> Tensor:
    """x @ dequantize(weight).T + bias computed in fp64, rounded once to x's dtype. With
    activation=INT8, x is first quantized to 8 bits per 32-value block (256 for the K formats)
    and the products are the exact integer dots of the definition in ops/quant.py
    (quant_linear_int8_terms_ref)."""
    if int(activation) == 1:
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        y, _ = quant_linear_int8_terms_ref(x2, weight, fmt, bias)
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)
    y = x.double() @ quant_dequantize_ref(weight, fmt).double().T  # [..., N]
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def quant_linear_cat_ref(x: Tensor, weights, fmts, biases, activation=0) -> Tensor:
    """The quant_linear_ref of each (weight, fmt, bias) against x, side by side: [..., sum N_i]."""
    return torch.cat([quant_linear_ref(x, w, f, b, activation)
                      for w, f, b in zip(weights, fmts, biases)], dim=-1)


def quant_embedding_ref(ids: Tensor, weight: Tensor, fmt, dtype=torch.float32) -> Tensor:
    """Rows `ids` of the dequantized weight: [*ids.shape, K] in `dtype`."""
    return quant_dequantize_ref(weight, fmt)[ids.long()].to(dtype)
