"""Multi-step top-k draft trees (EAGLE-2 dynamic trees) over a draft `Engine`, shared by the
draft-model proposers (draft_model.py). Not here: the proposers' own KV catch-up (draft extend) and
their request state; this file only turns the draft's logits at each root into a DraftTree.

The rule (kernels.md section 1): step 0 takes the root's topk children, scored by their draft
log-probs; each later step decodes the topk kept beams, expands each by its topk children
(score = beam score + child log-prob) and keeps the topk best of those topk*topk; after `depth`
steps the N-1 best scores overall are selected, sorted by global id (ancestors first) and
`ops.build_tree` makes the verify tree. Ties rank the lower global id first (a stable sort),
and a child's score never exceeds its parent's (log-probs are <= 0), so every selected node's
parent is selected too, even among equal or -inf scores.

Draft decode attention: beam k of request b decodes through its own virtual row of the draft
pool (rows from `KVPool.take_rows`) whose slot table is the request's committed prefix followed
by its beam's ancestors' draft slots and its own (build_draft_decode_table semantics). Each
(beam index, step) owns one slot: position base + k*(depth-1) + step of the request's own row,
a position past the committed prefix that the next catch-up extend overwrites, so drafting
allocates nothing. One `Engine.decode` per depth runs all beams of all requests (B*topk rows).
"""
from typing import List, Optional, Sequence

import torch
from torch import Tensor

from specdec_inductor import ops
from specdec_inductor.engine.kv_pool import PoolExhaustedError
from specdec_inductor.ops.tree import TreeMaskMode
from specdec_inductor.speculative import DraftTree


def check_tree_shape(num_draft_tokens: int, topk: int, depth: int) -> None:
    """Raise ValueError naming the argument unless (N, topk, depth) makes a valid tree."""
    if topk < 1:
        raise ValueError(f"argument 'topk' must be >= 1, got {topk}")
    if depth < 1:
        raise ValueError(f"argument 'depth' must be >= 1, got {depth}")
    if num_draft_tokens < 2:
        raise ValueError(f"argument 'num_draft_tokens' must be >= 2 (root + drafts), got "
                         f"{num_draft_tokens}")
    if depth > num_draft_tokens - 1:
        raise ValueError(f"argument 'depth' ({depth}) exceeds num_draft_tokens - 1 "
                         f"({num_draft_tokens - 1}): a tree of N nodes is at most N-1 drafts deep")
    if topk == 1 and depth != num_draft_tokens - 1:
        raise ValueError(f"argument 'depth' must be num_draft_tokens - 1 = {num_draft_tokens - 1} "
                         f"for a chain (topk=1), got {depth}")
    candidates = topk + topk * topk * (depth - 1)
    if num_draft_tokens - 1 > candidates:
        raise ValueError(f"argument 'num_draft_tokens' ({num_draft_tokens}) needs "
                         f"{num_draft_tokens - 1} drafts but topk={topk}, depth={depth} "
                         f"score only {candidates} candidates")


def draft_log_probs(logits: Tensor) -> Tensor:
    """log_softmax in fp32 over the last dim; -inf logits (e.g. outside an EAGLE-3 draft
    vocabulary) give -inf, and a row with no finite logit gives -inf everywhere, never NaN."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.masked_fill(torch.isnan(logp), float("-inf"))


def top_children(logp: Tensor, topk: int):
    """(scores, tokens) [..., topk] of the topk best log-probs of each row (descending).

    A row with fewer than topk finite log-probs fills up with -inf entries whose index is
    arbitrary: those take the row's best token instead, a duplicate of their best sibling that
    verify never prefers (it accepts the first match in sibling order), so no -inf token is
    ever drafted."""
    scores, tokens = logp.topk(topk, dim=-1)
    tokens = torch.where(torch.isneginf(scores), tokens[..., :1], tokens)
    return scores, tokens


def best_first(scores: Tensor, count: int) -> Tensor:
    """Column indices [R, count] of the `count` best scores of each row [R, C]; equal scores
    rank the lower index first."""
    return torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :count]


def as_inference(t: Optional[Tensor]) -> Optional[Tensor]:
    """t as an inference tensor (a copy made in draft's inference mode when it is not one):
    the tree program's inputs must be, as every Engine step's (Engine.compile_program)."""
    return t if t is None or t.is_inference() else t.clone()


class TreeDrafter:
    """EAGLE-2 top-k trees of N nodes from `engine` (the draft Engine).

    Args:
        engine: the draft Engine. Its max_batch must hold the decode batch of B*topk beams
            and its pool B*(1+topk) rows (the requests plus their virtual rows).
        num_draft_tokens: N, nodes per tree including the root.
        topk: branching; depth: draft steps (the deepest node's depth).
        token_map: the target id [Vd] of each column of the draft's logits when they cover a
            reduced vocabulary (an EAGLE-3 head's draft_to_target); None: the columns are the
            target's ids. Log-probs and top-k run over the logits' own columns.
    """

    def __init__(self, engine, num_draft_tokens: int, topk: int, depth: int,
                 token_map: Optional[Tensor] = None):
        check_tree_shape(num_draft_tokens, topk, depth)
        self.engine = engine
        self.num_draft_tokens, self.topk, self.depth = num_draft_tokens, topk, depth
        if token_map is not None and (token_map.dim() != 1 or token_map.is_floating_point()
                                      or token_map.numel() < topk):
            raise ValueError(f"argument 'token_map' must be a 1-D integer tensor of at least "
                             f"topk={topk} target ids, got {token_map.dtype} "
                             f"{tuple(token_map.shape)}")
        self.token_map = None if token_map is None else token_map.to(torch.int64)
        # Row positions past a request's committed prefix that drafting writes.
        self.draft_positions = topk * (depth - 1)
        self._compiled = None  # tree_program compiled by the draft Engine, at the first draft
        self.compiled_drafts = 0  # draft calls that ran the compiled tree_program

    def _children(self, logits: Tensor):
        """(scores, target ids) [R, topk] of each row of draft logits [R, V]: top_children of
        the draft log-probs, each kept column mapped through token_map when there is one."""
        if self.token_map is not None and logits.shape[-1] != self.token_map.numel():
            raise ValueError(f"argument 'logits': the draft's logits are {logits.shape[-1]} "
                             f"wide, its token_map names {self.token_map.numel()} columns")
        scores, idx = top_children(draft_log_probs(logits), self.topk)
        return (scores, idx) if self.token_map is None else (scores, self.token_map[idx])

    def reserve_rows(self, count: int) -> List[List[int]]:
        """topk virtual rows of the draft pool for each of `count` requests."""
        need = count * self.topk
        if need > self.engine.max_batch:
            raise ValueError(f"draft engine max_batch {self.engine.max_batch} cannot decode "
                             f"{count} requests x topk {self.topk} = {need} beams: make the draft "
                             f"Engine with max_batch >= batch * (1 + topk)")
        try:
            rows = self.engine.pool.take_rows(need)
        except PoolExhaustedError as exc:
            raise ValueError(f"draft engine max_batch {self.engine.max_batch} has no room for "
                             f"{need} virtual rows next to its requests: make the draft Engine "
                             f"with max_batch >= batch * (1 + topk) ({exc})") from exc
        return [rows[i * self.topk:(i + 1) * self.topk] for i in range(count)]

    def release_rows(self, rows: Sequence[int]) -> None:
        self.engine.pool.return_rows(rows)

    @torch.inference_mode()
    def draft(self, roots: Tensor, seq_lens: Tensor, logits: Tensor, rows: Sequence[Optional[int]],
              bases: Sequence[int], virtual_rows: Sequence[Sequence[int]],
              aux: Optional[Tensor] = None, extend: Optional[Sequence] = None) -> DraftTree:
        """The tree of every request.

        Args:
            roots [B]: each tree's root token; seq_lens [B]: the target's committed tokens (the
                root's position); logits [B, V]: the draft's logits at the root, or None with
                `extend`.
            rows: each request's draft-pool row, None for a request that drafts nothing (its
                beams decode on the padding row; its tree is never verified).
            bases: draft KV cached per request: the beams' first decode position.
            virtual_rows: the request's topk rows from reserve_rows.
            aux [B, A]: the root's auxiliary output (EAGLE's g), fed to the depth-1 beams; each
                deeper beam gets its parent's (the draft Engine then returns it from decode).
            extend: a draft extend to run first, in the same graph, as Engine.extend takes it:
                (input_ids [Bb, T], positions [Bb, T], req_rows [Bb], prefix_lens [Bb],
                extend_lens [Bb], aux [Bb, T, A] or None), Bb the draft Engine's bucket. The
                root's logits (and, when the draft Engine captures hidden, aux) are then those
                of each request's last extended row; `bases` count the extended rows.

        The checks and the tables' inputs are made here (program_inputs); the tree itself is
        `tree_program`, one compiled graph on a compiled draft Engine (every draft decode,
        top-k and the tree build: `compiled_drafts` counts its calls), the same code run op
        by op otherwise.
        """
        inputs = self.program_inputs(roots, seq_lens, logits, rows, bases, virtual_rows, aux,
                                     extend)
        if self._compiled is None and getattr(self.engine, "compiled", False):
            self._compiled = self.engine.compile_program(self.tree_program)
        if self._compiled is not None:
            self.compiled_drafts += 1
            out = self.engine.run_program(self._compiled, *inputs)
        else:
            out = self.tree_program(*inputs)
        return DraftTree(*out, torch.full((roots.shape[0],), self.num_draft_tokens - 1,
                                          dtype=torch.int64))

    def program_inputs(self, roots: Tensor, seq_lens: Tensor, logits: Optional[Tensor],
                       rows: Sequence[Optional[int]], bases: Sequence[int],
                       virtual_rows: Sequence[Sequence[int]], aux: Optional[Tensor] = None,
                       extend: Optional[Sequence] = None) -> List[Optional[Tensor]]:
        """tree_program's inputs for draft's arguments (checked here: room for the draft-tree
        slots, the extend's arity). Rows past len(rows) (roots and seq_lens may be longer: a
        whole batch bucket) are padding requests that draft nothing: their beams decode on the
        padding row and their virtual rows are the padding row, whose table entries stay the
        sink (a step program verifies their trees on the target's padding row)."""
        k, depth = self.topk, self.depth
        bs = roots.shape[0]
        pool = self.engine.pool
        padding = bs - len(rows)
        live = [r is not None for r in rows] + [False] * padding
        # A request that drafts nothing reads no prefix (base 0 from the padding row); its
        # virtual rows, still its own, take harmless table writes that nobody reads.
        req = torch.tensor([r if r is not None else pool.padding_row for r in rows] +
                           [pool.padding_row] * padding, dtype=torch.int64)  # [B]
        base = torch.tensor([b if ok else 0 for b, ok in zip(bases, live)] + [0] * padding,
                            dtype=torch.int64)  # [B]
        vrows = torch.tensor([r for v in virtual_rows for r in v] +
                             [pool.padding_row] * (padding * k), dtype=torch.int64)  # [B*k]
        live_t = torch.tensor(live, dtype=torch.bool)  # [B]
        own = None
        if depth > 1:
            top = max((b for b, ok in zip(bases, live) if ok), default=0)
            if top + self.draft_positions > pool.max_len:
                raise ValueError(f"draft engine max_len {pool.max_len}: a request at position "
                                 f"{top} has no room for its {self.draft_positions} "
                                 "draft-tree slots; make the draft Engine's max_len larger")
            own = ops.assign_draft_cache_locs(pool.req_to_token, req, base, k, depth - 1)
            own = own.view(bs, k, depth - 1)  # [B, k, depth-1] slot of beam k's node per depth
            if bool((own[live_t] < 0).any()):  # past the slots the request reserved
                raise ValueError(f"draft engine max_len {pool.max_len}: a request at position "
                                 f"{top} has no reserved room for its "
                                 f"{self.draft_positions} draft-tree slots; make the draft "
                                 "Engine's max_len larger")
            # Beams that draft nothing write the sink: the padding row's entries stay the sink.
            own = own.masked_fill(~live_t.view(bs, 1, 1), pool.padding_slot)
        if (logits is None) == (extend is None):
            raise ValueError("TreeDrafter.draft: pass the root's logits or an extend, not both")
        if extend is not None and len(extend) != 6:
            raise ValueError(f"argument 'extend' must hold Engine.extend's 6 inputs (input_ids, "
                             f"positions, req_rows, prefix_lens, extend_lens, aux), got "
                             f"{len(extend)}")
        return [as_inference(t) for t in (roots.long(), seq_lens.long(), logits, live_t, req,
                                           base, vrows, own, aux,
                                           *(extend if extend is not None else [None] * 6))]

    def tree_program(self, roots, seq_lens, logits, live, req, base, vrows, own, aux,
                     ext_ids=None, ext_positions=None, ext_rows=None, ext_prefix=None,
                     ext_lens=None, ext_aux=None):
        """draft's tree as tensors only (traced whole on a compiled Engine, alone or inside a
        step program of the target's: commit.DraftedStep) from program_inputs: (tokens
        [B, N], mask, positions, retrieve_index, retrieve_next_token,
        retrieve_next_sibling)."""
        k, depth, n = self.topk, self.depth, self.num_draft_tokens
        bs = roots.shape[0]
        if ext_ids is not None:  # the draft extend; its last row per request is the root's
            # Only each request's last row's logits feed the tree: the LM head runs on that
            # row alone where the draft model can keep rows (an EAGLE-3 head); g stays whole.
            _, ext_logits, g = self.engine.extend_step(ext_ids, ext_positions, ext_rows,
                                                       ext_prefix, ext_lens, None, ext_aux,
                                                       last_only=True)  # [Bb, T or 1, V]
            at = torch.arange(bs)
            last = (ext_lens[:bs] - 1).clamp(min=0)  # [B]; a request with nothing: row 0
            # One row per request when kept (with T = 1 that row is also the last row).
            logits = (ext_logits[:bs, 0] if ext_logits.shape[1] == 1
                      else ext_logits[at, last])  # [B, V]
            if g is not None:
                aux = g[at, last]  # [B, A]
        scores, tokens = self._children(logits)  # [B, k]
        score_list, token_list = [scores], [tokens]
        parents = [torch.full((bs, 1), -1, dtype=torch.int64),
                   torch.arange(k, dtype=torch.int64).expand(bs, k)]
        if depth > 1:
            self._expand(scores, tokens, live, req, base, vrows, own, aux, score_list,
                         token_list, parents)
        all_scores = torch.cat(score_list, dim=1)  # [B, k + k*k*(depth-1)]
        all_tokens = torch.cat(token_list, dim=1)
        selected = best_first(all_scores, n - 1).sort(dim=1).values  # [B, N-1] ascending ids
        parent_list = (torch.cat(parents, dim=1) if depth > 1
                       else torch.empty(bs, 0, dtype=torch.int64))  # [B, k*(depth-1)+1]
        mask, positions, ridx, nxt, sib = ops.build_tree(
            parent_list, selected, seq_lens, k, depth, n, TreeMaskMode.QLEN_ONLY)
        draft_tokens = torch.gather(all_tokens, 1, selected)  # [B, N-1]
        tree_tokens = torch.cat([roots.view(bs, 1), draft_tokens], dim=1)  # [B, N]
        return tree_tokens, mask, positions, ridx, nxt, sib

    def _expand(self, beam_scores, beam_tokens, live, req, base, vrows, own, aux, score_list,
                token_list, parents):
        """Draft steps 1..depth-1: one batched decode of every kept beam per step. Beams of a
        request that drafts nothing (live False) decode on the padding row."""
        eng, k, depth = self.engine, self.topk, self.depth
        bs = beam_scores.shape[0]
        bucket = eng.bucket_for(bs * k)
        pad = bucket - bs * k
        table = eng.pool.req_to_token
        live_k = live.repeat_interleave(k)  # [B*k]
        # Step 1's tables: prefix + beam k's first draft slot; later steps rewrite the draft
        # part from the beam's ancestry.
        fresh = ops.build_draft_decode_table(table, req, base, k, depth - 1)  # [B*k, L]
        table[vrows] = torch.where(live_k.view(-1, 1), fresh, table[vrows])
        path = own  # [B, k, depth-1]: slot of beam k's node at each depth
        padding = torch.full((pad,), eng.pool.padding_row, dtype=torch.int64)
        beam_rows = torch.cat([torch.where(live_k, vrows, eng.pool.padding_row), padding])  # [Bd]
        base_k = base.repeat_interleave(k)  # [B*k]
        if aux is not None:
            beam_aux = aux.unsqueeze(1).expand(bs, k, aux.shape[-1])  # [B, k, A]: the root's
        for step in range(1, depth):
            if step > 1:
                ops.assign_req_to_token(table, vrows, base_k, base_k + step,
                                        path[:, :, :step].reshape(-1))
            # Padding beams decode at position 1.
            positions = torch.cat([torch.where(live_k, base_k + step - 1, 1),
                                   torch.ones(pad, dtype=torch.int64)])  # [Bd]
            tok_in = torch.cat([beam_tokens.reshape(-1), torch.zeros(pad, dtype=torch.int64)])
            if aux is None:
                out = eng.decode_step(tok_in, beam_rows, positions)
            else:
                aux_in = torch.cat([beam_aux.reshape(bs * k, -1),
                                    aux.new_zeros(pad, aux.shape[-1])])  # [Bd, A]
                out = eng.decode_step(tok_in, beam_rows, positions, aux_in)
            child_scores, child_tokens = self._children(out.logits[:bs * k])  # [B*k, k]
            child_scores, child_tokens = child_scores.view(bs, k, k), child_tokens.view(bs, k, k)
            child_scores = (beam_scores.unsqueeze(-1) + child_scores).view(bs, k * k)
            child_tokens = child_tokens.reshape(bs, k * k)
            score_list.append(child_scores)
            token_list.append(child_tokens)
            if step == depth - 1:
                break
            best = best_first(child_scores, k)  # [B, k] ids within this step
            parent = best // k  # [B, k] the kept beam's parent among this step's beams
            beam_scores = torch.gather(child_scores, 1, best)
            beam_tokens = torch.gather(child_tokens, 1, best)
            parents.append(k + k * k * (step - 1) + best)
            if aux is not None:
                g = out.hidden[:bs * k].view(bs, k, -1)  # [B, k, A] this step's outputs
                beam_aux = torch.gather(g, 1, parent.unsqueeze(-1).expand_as(g))
            # A kept beam inherits its parent's path and adds its own next slot.
            inherited = torch.gather(path, 1, parent.unsqueeze(-1).expand_as(path))
            path = torch.cat([inherited[:, :, :step], own[:, :, step:]], dim=2)
