"""The proposer of every method that drafts with a model of its own -- STANDALONE (a small
causal LM), EAGLE, EAGLE-3 and MTP (one-layer heads over the target's hidden states) -- as one
base class: admission into the draft Engine's KV pool, the catch-up extend over what the
target committed, greedy chains and EAGLE-2 top-k trees (tree_draft.py). Subclasses supply the
draft model (in the draft Engine) and whether it reads the target's hidden states; a draft
model is EAGLE without hidden states (vLLM's DraftModelProposer, SGLang's StandaloneWorker).

Draft KV bookkeeping. A model that reads hidden states caches pairs (x_{p+1}, h_p) at
position p: the token after p with the target's feature of p (EAGLE's layout), so its first
pending token is the prompt's second. A plain draft model caches x_p at position p. Either
way, before drafting each request's draft KV covers every committed position, the root's
included: a step extends the draft over its pending tokens (the prompt at the first step;
later the bonus token and the accepted drafts), then decodes the chain or expands the tree
past them. Speculative positions are overwritten by the next step's extend, with one
exception: a chain from a draft model without hidden states wrote the exact KV of its drafts
d1..d(K-1), so the accepted ones among them stay cached (commit) and the next catch-up is the
bonus plus at most one draft.
"""
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from specdec_inductor import ops
from specdec_inductor.proposers.tree_draft import TreeDrafter, as_inference, check_tree_shape
from specdec_inductor.speculative import DraftProgram, DraftTree, Proposer

# Tokens a KV-reusing chain leaves to catch up after a step: the bonus, plus the last draft
# when all K were accepted (its KV was never written). One small T keeps one extend graph.
CATCH_UP_TOKENS = 2


def admit_draft_requests(pool, contexts: Sequence[Sequence[int]], num_draft_tokens: int) -> List:
    """One draft-pool request per context (prompt + first token), reserving the whole row:
    the draft writes KV for every committed position plus up to N speculative ones."""
    longest = max(len(c) for c in contexts)
    budget = pool.max_len - longest
    if budget < num_draft_tokens:
        raise ValueError(f"draft engine max_len {pool.max_len} leaves no room for drafts "
                         f"after a context of {longest} tokens")
    return pool.admit([len(c) - 1 for c in contexts], budget)


def finish_draft_requests(states: dict, request_ids: Sequence[int], pool, tree) -> None:
    """Release the draft-pool rows of the given requests (their virtual tree rows, then their
    request), every one of them even when one release raises (the first error is re-raised
    at the end): a failed cleanup must not leak the others' rows."""
    first = None
    for rid in request_ids:
        st = states.pop(rid, None)
        if st is None:
            continue
        for release in ((lambda: tree.release_rows(st.virtual_rows)) if st.virtual_rows else None,
                        lambda: pool.release(st.request)):
            if release is None:
                continue
            try:
                release()
            except Exception as exc:  # noqa: BLE001 -- re-raised below, after the rest
                first = first or exc
    if first is not None:
        raise first


def chain_tree_tensors(roots: Tensor, chain: Tensor, seq_lens: Tensor):
    """roots [B] and drafts chain [B, K] as the trees of N = K + 1 nodes a step verifies:
    (tokens [B, N], tree_mask [B*N*N], positions [B*N], retrieve_index, retrieve_next_token,
    retrieve_next_sibling [B, N])."""
    bs, k = chain.shape
    n = k + 1
    tokens = torch.cat([roots.view(bs, 1), chain], dim=1)  # [B, N]
    mask = torch.ones(n, n, dtype=torch.bool).tril().flatten().repeat(bs)  # [B*N*N]
    positions, ridx, nxt, sib = ops.reconstruct_tree_from_mask(mask, seq_lens, n)
    return tokens, mask, positions, ridx, nxt, sib


def chain_tree(roots: Tensor, chain: Tensor, seq_lens: Tensor,
               num_drafts: Optional[Tensor] = None) -> DraftTree:
    """roots [B] and drafts chain [B, K] as a DraftTree of N = K + 1 nodes per request, of which
    each request offers its first num_drafts [B] drafts (default all K)."""
    bs, k = chain.shape
    offered = torch.full((bs,), k, dtype=torch.int64) if num_drafts is None else num_drafts
    return DraftTree(*chain_tree_tensors(roots, chain, seq_lens), offered)


class ChainDrafter:
    """Greedy chains of K = N - 1 drafts from `engine` (the draft Engine) as tensors only, for
    the step program that drafts, verifies, accepts and commits in one graph
    (commit.DraftedStep; the DraftProgram protocol's tree_program). The same chain as
    DraftModelProposer's host loop without stop_below: the first draft from the catch-up
    extend's last row, K - 1 decodes on the request's own draft row (fed back the draft's
    hidden output when it reads hidden states), so the drafts' KV lands where the host loop
    writes it and a model without hidden states keeps the accepted drafts' KV."""

    def __init__(self, engine, num_draft_tokens: int, token_map: Optional[Tensor] = None):
        self.engine, self.num_draft_tokens = engine, num_draft_tokens
        self.token_map = token_map
        self._compiled = None  # tree_program compiled by the draft Engine, at the first draft
        self.compiled_drafts = 0  # draft calls that ran it (tests assert the path)

    def draft(self, roots: Tensor, seq_lens: Tensor, extend: Sequence[Tensor]) -> DraftTree:
        """The chains of B requests (roots / seq_lens [B]) on a compiled draft Engine:
        tree_program as one graph of the draft Engine (the catch-up extend and every draft
        decode), where the host loop (DraftModelProposer._chain) calls the extend and K - 1
        decode graphs one by one. `extend` (Engine.extend's inputs) spans the draft Engine's
        bucket Bb >= B and the roots are padded to it, so one graph serves every live count
        of the bucket."""
        bs, bucket, n = roots.shape[0], extend[2].shape[0], self.num_draft_tokens
        roots_b = torch.cat([roots.long(), roots.new_zeros(bucket - bs, dtype=torch.int64)])
        lens_b = torch.cat([seq_lens.long(), seq_lens.new_ones(bucket - bs, dtype=torch.int64)])
        if self._compiled is None:
            self._compiled = self.engine.compile_program(self.tree_program)
        self.compiled_drafts += 1
        tokens, mask, positions, ridx, nxt, sib = self.engine.run_program(
            self._compiled, *[as_inference(t) for t in (roots_b, lens_b, *extend)])
        return DraftTree(tokens[:bs], mask[:bs * n * n], positions[:bs * n], ridx[:bs],
                         nxt[:bs], sib[:bs], torch.full((bs,), n - 1, dtype=torch.int64))

    def tree_program(self, roots, seq_lens, ext_ids, ext_positions, ext_rows, ext_prefix,
                     ext_lens, ext_aux=None):
        """The chain trees of the bucket (roots / seq_lens [B]) after the catch-up extend
        (Engine.extend's inputs over the draft Engine's bucket Bb >= B; a row extending nothing
        drafts nothing: it decodes at position 1 of its row, the padding row's sink), as
        chain_tree_tensors."""
        eng, bs = self.engine, roots.shape[0]
        _, ext_logits, g = eng.extend_step(ext_ids, ext_positions, ext_rows, ext_prefix,
                                           ext_lens, None, ext_aux, last_only=True)
        at = torch.arange(ext_rows.shape[0])
        last = (ext_lens - 1).clamp(min=0)  # [Bb]; a row with nothing: row 0
        logits = ext_logits[:, 0] if ext_logits.shape[1] == 1 else ext_logits[at, last]
        aux = None if g is None else g[at, last]  # [Bb, A]
        live = ext_lens > 0  # [Bb]
        position = torch.where(live, ext_prefix + ext_lens, 1)  # [Bb] the next draft's
        tok = self._target_ids(logits.argmax(-1))  # [Bb] d1
        drafts = [tok]
        for _ in range(self.num_draft_tokens - 2):
            out = eng.decode_step(tok, ext_rows, position, aux)
            tok = self._target_ids(out.argmax)
            aux = None if aux is None else out.hidden
            position = torch.where(live, position + 1, 1)
            drafts.append(tok)
        return chain_tree_tensors(roots, torch.stack(drafts, dim=1)[:bs], seq_lens)

    def _target_ids(self, columns: Tensor) -> Tensor:
        return columns if self.token_map is None else self.token_map[columns]


def logits_and_hidden(out) -> Tuple[Tensor, Optional[Tensor]]:
    """(logits [B, T, V], captured hidden [B, T, A] or None) of an Engine step's StepOutput."""
    return out.logits, out.hidden


@dataclass
class _DraftRequest:
    request: object  # the draft pool's Request
    cached: int  # draft KV covers positions [0, cached)
    pending: List[int]  # tokens to extend next, at positions cached, cached + 1, ...
    hidden: Optional[Tensor]  # their target features [len(pending), A]; None without
    root: int  # the last committed token: the next tree's root
    done: bool = False  # emitted nothing at the last commit: drafts nothing more
    proposed: List[int] = field(default_factory=list)  # the last chain, when its KV is kept
    # The last chain was drafted as a program (ChainDrafter) and not read back: every emitted
    # token but the last is one of its accepted drafts (their KV kept as `proposed`'s).
    chain_unread: bool = False
    virtual_rows: List[int] = field(default_factory=list)  # trees: one draft-pool row per beam


class DraftModelProposer(Proposer):
    """Greedy chains of K = N - 1 drafts (topk = 1) or EAGLE-2 top-k trees from
    `draft_engine`, an Engine over the draft model.

    Args:
        draft_engine: its max_len must cover the target's positions (prompt + new tokens + N)
            plus topk*(depth-1) tree slots; its max_batch the target's batch, times 1 + topk
            for trees (the requests plus one virtual row per beam): registry.draft_engine_size.
            A draft that reads hidden states needs it made with capture_hidden=[-1] (its own
            output g is fed back down a chain), and the target Engine captures what it reads.
        num_draft_tokens: N, nodes per tree including the root.
        topk: branching (1: a chain); depth: draft steps, the deepest node's depth (default
            N - 1, as a chain needs).
        stop_below: chains only: a request's chain ends at a draft whose probability under
            the draft (softmax of its logits) is below this, and the batch's drafting stops
            once every chain has ended (0: chains of K drafts). The shorter chains pay where
            the loop verifies them at a smaller compiled size (SpeculativeGenerator
            tree_sizes).
    """

    # Subclasses whose draft reads the target's hidden states set this: the loop then passes
    # them to start / commit (speculative.Proposer).
    needs_target_hidden = False

    def __init__(self, draft_engine, num_draft_tokens: int, topk: int = 1,
                 depth: Optional[int] = None, stop_below: float = 0.0):
        if not (isinstance(stop_below, (int, float)) and 0.0 <= stop_below < 1.0) \
                or isinstance(stop_below, bool):
            raise ValueError(f"argument 'stop_below' must be a probability in [0, 1), got "
                             f"{stop_below!r}")
        if stop_below and topk > 1:
            raise ValueError("argument 'stop_below' applies to chains (topk 1), not trees")
        self.stop_below = float(stop_below)
        self.variable_drafts = self.stop_below > 0
        if num_draft_tokens < 2:
            raise ValueError(f"argument 'num_draft_tokens' must be >= 2 (root + drafts), got "
                             f"{num_draft_tokens}")
        depth = num_draft_tokens - 1 if depth is None else depth
        check_tree_shape(num_draft_tokens, topk, depth)
        if self.needs_target_hidden and draft_engine.capture_hidden != [-1]:
            raise ValueError("argument 'draft_engine' must be made with capture_hidden=[-1]")
        self.engine = draft_engine
        self.num_draft_tokens = num_draft_tokens
        self.topk, self.depth = topk, depth
        self.num_spec_steps = depth + 1
        self.k = num_draft_tokens - 1
        self._token_map = self.draft_token_map()
        self._tree = (TreeDrafter(draft_engine, num_draft_tokens, topk, depth, self._token_map)
                      if topk > 1 else None)
        self._chain_drafter = (ChainDrafter(draft_engine, num_draft_tokens, self._token_map)
                               if topk == 1 else None)
        self._requests: Dict[int, _DraftRequest] = {}

    # -- what subclasses supply ----------------------------------------------------------------
    def draft_token_map(self) -> Optional[Tensor]:
        """The target id [Vd] of each column of the draft's logits when they cover a reduced
        vocabulary; None: the columns are the target's ids."""
        return None

    def target_features(self, hidden: Tensor) -> Tensor:
        """What the draft reads of the target's captured hidden rows [n, k*H] (as they come)."""
        return hidden

    def catch_up_tokens(self) -> int:
        """T of the extend that catches the draft up each step: the pending tokens of a normal
        step fit it; more (the prompt, or after decode-only steps) take prefill chunks."""
        if self.keeps_chain_kv and self._tree is None:
            return CATCH_UP_TOKENS
        return self.depth + 1  # every accepted draft and the bonus

    @property
    def keeps_chain_kv(self) -> bool:
        """Whether a chain's draft KV is exact for the drafted tokens (no target hidden states
        to replace), so accepted drafts need no second extend."""
        return not self.needs_target_hidden

    # -- the Proposer protocol (speculative.py) ------------------------------------------------
    def start(self, request_ids: List[int], contexts: List[List[int]],
              hidden: Optional[List[Tensor]] = None) -> None:
        if self.needs_target_hidden and hidden is None:
            raise ValueError(f"{type(self).__name__}.start needs the target's hidden states "
                             "(argument 'hidden')")
        # Features first: a refused one must leave nothing admitted behind.
        feats = [None] * len(contexts) if hidden is None else [self.target_features(h)
                                                                for h in hidden]
        reserve = max(self.num_draft_tokens, self.topk * (self.depth - 1) + 1)
        requests = admit_draft_requests(self.engine.pool, contexts, reserve)
        shift = 1 if self.needs_target_hidden else 0  # pairs (x_{p+1}, h_p) start at x_1
        for rid, req, ctx, f in zip(request_ids, requests, contexts, feats):
            self._requests[rid] = _DraftRequest(req, 0, list(ctx[shift:]), f, root=ctx[-1])
        if self._tree is not None:
            try:
                virtual = self._tree.reserve_rows(len(request_ids))
            except BaseException:
                self.finish(request_ids)
                raise
            for rid, rows in zip(request_ids, virtual):
                self._requests[rid].virtual_rows = rows

    def propose(self, request_ids: List[int], seq_lens: Tensor) -> DraftTree:
        states = [self._requests[r] for r in request_ids]
        roots = torch.tensor([st.root for st in states])  # [bs]
        if self._tree is not None:
            # beams at depth 1 take the root's g, deeper ones their parent's
            rows, bases, virtual, extend = self._draft_arguments(states, len(states))
            return self._tree.draft(roots, seq_lens, None, rows, bases, virtual, None,
                                    extend=extend)
        if not self.variable_drafts and getattr(self.engine, "compiled", False):
            _, _, _, extend = self._draft_arguments(states, len(states))
            self._chains_unread(states)
            return self._chain_drafter.draft(roots, seq_lens, extend)
        req_rows = self._rows(states)
        last_logits, last_hidden = self._catch_up(states, req_rows, self.catch_up_tokens(), 0)
        chain, offered = self._chain(states, req_rows, last_logits, last_hidden)
        return chain_tree(roots, chain, seq_lens, offered)

    def draft_program(self, request_ids: List[int], seq_lens: Tensor,
                      roots: Tensor) -> Optional[DraftProgram]:
        """This step's trees (TreeDrafter.tree_program) or chains (ChainDrafter.tree_program)
        and their inputs over the batch's whole bucket (seq_lens / roots [bucket]; rows past
        the requests draft nothing), for the step program that drafts, verifies, accepts and
        commits in one graph (commit.DraftedStep). The request state advances as propose
        advances it. None for chains that may end early (stop_below): their drafts vary."""
        if self.variable_drafts:
            return None
        states = [self._requests[r] for r in request_ids]
        # A request that finished drafts nothing; its tree (and the padding rows') is never
        # accepted from: the target verifies it on its padding row.
        rows, bases, virtual, extend = self._draft_arguments(states, roots.shape[0])
        if self._tree is None:
            self._chains_unread(states)
            return DraftProgram(self._chain_drafter, [as_inference(t) for t in extend])
        inputs = self._tree.program_inputs(roots, seq_lens, None, rows, bases, virtual, None,
                                           extend)
        return DraftProgram(self._tree, inputs[2:])  # the program passes roots and seq_lens

    def _chains_unread(self, states) -> None:
        """The live requests' chains are drafted by ChainDrafter and not read back: commit
        counts their kept drafts from the emitted tokens."""
        for st in states:
            st.chain_unread = self.keeps_chain_kv and not st.done

    def _draft_arguments(self, states, rows: int):
        """The drafters' per-request arguments once every live request is caught up on its
        pending tokens (a prompt, or the tokens decoded while the acceptance gate rested) in
        the draft Engine's extend graphs but for the last catch_up_tokens(), which the tree's
        or chain's own extend takes (its inputs padded to the draft Engine's bucket of `rows` rows):
        (draft-pool rows, None for a finished request; cached lengths; virtual rows; the
        extend's inputs)."""
        if any(not st.pending for st in states if not st.done):
            raise RuntimeError(f"{type(self).__name__}: a live request has nothing committed to "
                               "extend (commit after every step)")
        req_rows = self._rows(states, rows)
        small = self.catch_up_tokens()
        self._catch_up(states, req_rows, small, small)
        take = [0 if st.done else len(st.pending) for st in states]
        extend = self._extend_inputs(states, take, req_rows, small)
        return ([None if st.done else st.request.row for st in states],
                [st.cached for st in states], [st.virtual_rows for st in states], extend)

    def discard_drafts(self, request_ids: List[int]) -> None:
        for rid in request_ids:  # their next catch-up extends every emitted token
            st = self._requests[rid]
            st.proposed, st.chain_unread = [], False

    def commit(self, request_ids: List[int], emitted: List[List[int]],
               hidden: Optional[List[Tensor]] = None) -> None:
        for i, (rid, toks) in enumerate(zip(request_ids, emitted)):
            st = self._requests[rid]
            kept = self._kept_drafts(st, toks)
            st.proposed, st.chain_unread = [], False
            if not toks:
                st.done = True
                continue
            st.cached += kept
            st.pending = st.pending + list(toks[kept:])
            if st.hidden is not None:
                # emitted[j] = x_{p+1} for the path position p whose target hidden is hidden[j]
                rows = self.target_features(hidden[i][:len(toks)])
                st.hidden = torch.cat([st.hidden, rows])
            st.root = toks[-1]

    def finish(self, request_ids: List[int]) -> None:
        finish_draft_requests(self._requests, request_ids, self.engine.pool, self._tree)

    # -- drafting ------------------------------------------------------------------------------
    def _rows(self, states, rows: Optional[int] = None) -> Tensor:
        """Each request's draft-pool row (the padding row once done), padded to the draft
        Engine's bucket of `rows` rows (default: one per request)."""
        pad = self.engine.pool.padding_row
        out = [pad if st.done else st.request.row for st in states]
        out += [pad] * (self.engine.bucket_for(rows or len(out)) - len(out))
        return torch.tensor(out, dtype=torch.int64)  # [B]

    def _catch_up(self, states, req_rows: Tensor, small: int, keep: int):
        """Extend each live request over its pending tokens but the last `keep`, in chunks of
        `small` tokens when they fit one, else of the Engine's prefill_chunk. Returns the
        draft's logits [V] and captured hidden [A] (or None) at the last extended row of each
        request whose pending tokens are all extended (None elsewhere)."""
        bs = len(states)
        last_logits: List[Optional[Tensor]] = [None] * bs
        last_hidden: List[Optional[Tensor]] = [None] * bs
        excess = max((len(st.pending) - keep for st in states if not st.done), default=0)
        chunk = small if excess <= small else self.engine.prefill_chunk
        while any(len(st.pending) > keep and not st.done for st in states):
            take = [0 if st.done else max(0, min(chunk, len(st.pending) - keep)) for st in states]
            args = self._extend_inputs(states, take, req_rows, chunk)
            logits, hidden = logits_and_hidden(self.engine.extend(*args[:5], None, args[5]))
            for b, st in enumerate(states):
                if take[b] and not st.pending:
                    last_logits[b] = logits[b, take[b] - 1]
                    last_hidden[b] = None if hidden is None else hidden[b, take[b] - 1]
        return last_logits, last_hidden

    def _extend_inputs(self, states, take: List[int], req_rows: Tensor, chunk: int):
        """Engine.extend's inputs for the next take[b] pending tokens of each request, which
        leave `pending` (the request's `cached` advances): (input_ids [B, T], positions [B, T],
        req_rows, prefix_lens [B], extend_lens [B], aux [B, T, A] or None), B the bucket and
        T = chunk."""
        bucket = req_rows.shape[0]
        ids = torch.zeros(bucket, chunk, dtype=torch.int64)  # [B, T]
        prefix = torch.zeros(bucket, dtype=torch.int64)  # [B]
        ext = torch.zeros(bucket, dtype=torch.int64)  # [B]
        aux = None
        if self.needs_target_hidden:
            feats = states[0].hidden
            aux = torch.zeros(bucket, chunk, feats.shape[-1], dtype=feats.dtype)  # [B, T, A]
        for b, st in enumerate(states):
            m = take[b]
            if m == 0:
                continue
            ids[b, :m] = torch.tensor(st.pending[:m], dtype=torch.int64)
            prefix[b], ext[b] = st.cached, m
            st.cached += m
            st.pending = st.pending[m:]
            if aux is not None:
                aux[b, :m] = st.hidden[:m]
                st.hidden = st.hidden[m:]
        positions = prefix.view(-1, 1) + torch.arange(chunk).view(1, -1)  # [B, T]
        return ids, positions, req_rows, prefix, ext, aux

    def _chain(self, states, req_rows: Tensor, last_logits, last_hidden) -> Tuple[Tensor, Tensor]:
        """The greedy chain [bs, K] of each request and how many of its drafts it offers [bs]:
        its first draft from the catch-up's last logits, up to K - 1 more by decode steps (fed
        back the draft's own hidden output when it reads hidden states), fewer where
        stop_below ends every chain early (the rest of the chain: zeros)."""
        bs, eng = len(states), self.engine
        pad = req_rows.shape[0] - bs
        for b, st in enumerate(states):  # finished requests: placeholders (never verified)
            if last_logits[b] is None:
                last_logits[b] = torch.zeros(eng.vocab_size, dtype=eng.dtype)
                if self.needs_target_hidden:
                    last_hidden[b] = torch.zeros(st.hidden.shape[-1], dtype=st.hidden.dtype)
        logits = torch.stack(last_logits)  # [bs, V]
        tok = self._target_ids(logits.argmax(-1))  # [bs] d1
        drafts = [tok]
        offered = torch.full((bs,), self.k, dtype=torch.int64)  # [bs]
        self._end_unsure(offered, logits, 1)
        seq = torch.tensor([st.cached for st in states] + [1] * pad)  # [B]
        tok = torch.cat([tok, torch.zeros(pad, dtype=torch.int64)])  # [B]
        g = None
        if self.needs_target_hidden:
            g = torch.stack(last_hidden)  # [bs, A]
            g = torch.cat([g, g.new_zeros(pad, g.shape[-1])])  # [B, A]
        while len(drafts) < self.k and bool((offered > len(drafts)).any()):
            out = eng.decode(tok, req_rows, seq, g)
            tok = self._target_ids(out.argmax)
            if g is not None:
                g = out.hidden
            seq = seq + 1
            drafts.append(tok[:bs])
            self._end_unsure(offered, out.logits[:bs], len(drafts))
        chain = torch.stack(drafts, dim=1)  # [bs, s]
        decoded = chain.shape[1]  # drafts whose KV the decodes wrote: all K, or the first s - 1
        if decoded < self.k:
            decoded -= 1
            chain = torch.cat([chain, chain.new_zeros(bs, self.k - chain.shape[1])], dim=1)
        if self.keeps_chain_kv:
            for b, st in enumerate(states):
                st.proposed = chain[b, :decoded].tolist()
        return chain, offered

    def _end_unsure(self, offered: Tensor, logits: Tensor, drafted: int) -> None:
        """Ends (offered = drafted) each still-running chain whose latest draft, the argmax of
        `logits` [bs, V], has a probability below stop_below."""
        if not self.stop_below:
            return
        sure = logits.float().softmax(-1).amax(-1) >= self.stop_below  # [bs]
        offered[(offered == self.k) & ~sure] = drafted

    def _target_ids(self, columns: Tensor) -> Tensor:
        """Target ids of the draft logits' argmax columns."""
        return columns if self._token_map is None else self._token_map[columns]

    def _kept_drafts(self, st: _DraftRequest, toks: List[int]) -> int:
        """How many of the committed tokens `toks` already have their draft KV: the leading
        ones equal to the last chain's drafts d1..d(K-1), whose KV the chain wrote at exactly
        these positions (only a chain that keeps its KV records a proposal). A chain of the
        program (ChainDrafter) is not read back: the tokens before the bonus are its accepted
        drafts."""
        if st.chain_unread:
            return max(0, min(len(toks) - 1, self.k - 1))
        kept = 0
        while (kept < min(len(toks), len(st.proposed), self.k - 1)
               and toks[kept] == st.proposed[kept]):
            kept += 1
        return kept
