"""Prompt lookup in front of a draft model: each step, a request whose context ends in a
long repeat of an earlier stretch of its own context drafts that stretch's continuation (an
NGRAM trie lookup, free next to a target step); every other request drafts with the draft
model (EAGLE-3, EAGLE, STANDALONE, MTP).

Why: a trained head guesses a continuation from the target's features; a repeat in the context
states it. On structured output (a JSON or YAML that restates the prompt's fields, a table, a
rewrite, code edited in place) NGRAM accepts 4-6 tokens a step where a head trained on other
prompts accepts 1-2, and on free text the head wins: the choice is per request and per step.

Both proposers see every request's start, commits and finish, so either can draft any step: the
draft model catches up over the tokens committed while lookup drafted (its catch-up extend, as
after the acceptance gate's plain steps). Both trees have N nodes, so a step verifies the same
shape whichever drafted, and the merged tree's linkage is rebuilt from its ancestor mask."""
from typing import Dict, List, Optional

import torch
from torch import Tensor

from specdec_inductor import ops
from specdec_inductor.proposers.ngram import NgramProposer
from specdec_inductor.speculative import DraftTree, Proposer

# A lookup drafts when the context suffix it continues is at least this long and it offers at
# least this many drafts; shorter matches (a repeated newline or keyword) continue too seldom
# to beat the head.
MIN_MATCH = 3
MIN_DRAFTS = 2


class LookupFirstProposer(Proposer):
    """`model` (a draft-model proposer) drafting where `lookup` has no confident match.

    Args:
        model: the draft-model proposer; its N is this proposer's N.
        lookup: an NgramProposer with the same N.
        min_match / min_drafts: a request's lookup draft is used when its match length and its
            number of drafts reach these.
    """

    cheap_drafts = False  # the draft model's steps cost: the acceptance gate decides

    def __init__(self, model: Proposer, lookup: NgramProposer, min_match: int = MIN_MATCH,
                 min_drafts: int = MIN_DRAFTS):
        if lookup.num_draft_tokens != model.num_draft_tokens:
            raise ValueError(f"argument 'lookup' drafts N={lookup.num_draft_tokens} nodes, the "
                             f"model N={model.num_draft_tokens}: verify needs one tree size")
        for name, value in (("min_match", min_match), ("min_drafts", min_drafts)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"argument '{name}' must be an int >= 1, got {value!r}")
        self.model, self.lookup = model, lookup
        self.min_match, self.min_drafts = min_match, min_drafts
        self.num_draft_tokens = model.num_draft_tokens
        self.num_spec_steps = max(model.num_spec_steps, lookup.num_spec_steps)
        self.needs_target_hidden = model.needs_target_hidden
        self.engine = model.engine
        # Request-steps drafted by lookup / by the model, and the drafts they got accepted
        # (for reports: accepted per step of each source).
        self.lookup_drafts = self.model_drafts = 0
        self.lookup_accepted = self.model_accepted = 0
        self._source: Dict[int, bool] = {}  # request id -> its last draft came from lookup

    def start(self, request_ids: List[int], contexts: List[List[int]],
              hidden: Optional[List[Tensor]] = None) -> None:
        if self.needs_target_hidden:
            self.model.start(request_ids, contexts, hidden)
        else:
            self.model.start(request_ids, contexts)
        try:
            self.lookup.start(request_ids, contexts)
        except BaseException:
            self.model.finish(request_ids)
            raise

    def propose(self, request_ids: List[int], seq_lens: Tensor) -> DraftTree:
        found, match_len = self.lookup.propose_with_match(request_ids, seq_lens)
        use_lookup = (match_len >= self.min_match) & (found.num_drafts >= self.min_drafts)  # [B]
        model_rows = (~use_lookup).nonzero().flatten().tolist()
        for rid, looked in zip(request_ids, use_lookup.tolist()):
            self._source[rid] = looked
        self.lookup_drafts += len(request_ids) - len(model_rows)
        self.model_drafts += len(model_rows)
        if not model_rows:
            return found
        drafted = self.model.propose([request_ids[i] for i in model_rows], seq_lens[model_rows])
        if len(model_rows) == len(request_ids):
            return drafted
        return self._merge(found, drafted, model_rows, seq_lens)

    def commit(self, request_ids: List[int], emitted: List[List[int]],
               hidden: Optional[List[Tensor]] = None) -> None:
        if self.needs_target_hidden:
            self.model.commit(request_ids, emitted, hidden)
        else:
            self.model.commit(request_ids, emitted)
        self.lookup.commit(request_ids, emitted)
        for rid, toks in zip(request_ids, emitted):
            looked = self._source.pop(rid, None)
            if looked is not None and toks:
                if looked:
                    self.lookup_accepted += len(toks) - 1
                else:
                    self.model_accepted += len(toks) - 1

    def finish(self, request_ids: List[int]) -> None:
        for rid in request_ids:
            self._source.pop(rid, None)
        try:
            self.model.finish(request_ids)
        finally:
            self.lookup.finish(request_ids)

    def _merge(self, found: DraftTree, drafted: DraftTree, rows: List[int],
               seq_lens: Tensor) -> DraftTree:
        """`found` with rows `rows` replaced by `drafted`'s rows (in order); positions and
        linkage rebuilt from the merged ancestor mask."""
        bs, n = found.tokens.shape
        index = torch.tensor(rows, dtype=torch.int64)
        tokens = found.tokens.clone()
        tokens[index] = drafted.tokens
        mask = found.tree_mask.view(bs, n * n).clone()
        mask[index] = drafted.tree_mask.view(len(rows), n * n)
        mask = mask.flatten()
        num_drafts = found.num_drafts.clone()
        num_drafts[index] = (drafted.num_drafts.to(num_drafts.dtype)
                             if drafted.num_drafts is not None else n - 1)
        positions, ridx, nxt, sib = ops.reconstruct_tree_from_mask(mask, seq_lens, n)
        return DraftTree(tokens, mask, positions, ridx, nxt, sib, num_drafts)
