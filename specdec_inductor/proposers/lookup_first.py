"""Prompt lookup in front of a draft model: each step, a request whose context ends in a
long repeat of an earlier stretch of its own context drafts that stretch's continuation (an
NGRAM trie lookup, free next to a target step); every other request drafts with the draft
model (EAGLE-3, EAGLE, STANDALONE, MTP), while the model's drafts pay for that request.

Why: a trained head guesses a continuation from the target's features; a repeat in the context
states it. On structured output (a JSON or YAML that restates the prompt's fields, a table, a
rewrite, code edited in place) NGRAM accepts 4-6 tokens a step where a head trained on other
prompts accepts 0-2, and on free text the head wins: the choice is per request and per step.

Which source drafts follows what each has been accepted lately, per request: a request's
lookup drafts while their running mean of accepted drafts is at least the model's. A short
match (two tokens, GRAFT_BELOW) is weak evidence, common in free text: unless one source leads
by GRAFT_MARGIN accepted drafts, both draft that step, the lookup's first path grafted into the
model's tree in place of the tree's last (deepest) nodes, so an early two-token repeat in a
chat answer no longer takes the step from the head (`graft`). The lookup's drafts cost nothing
to make, so on a step it does not draft alone, its match (when it had one) is scored against
the tokens the step emitted, as if it had been verified: a lookup that keeps guessing a chat
answer wrong hands the request to the model, and one whose repeats start to hold (a code block
restated) takes it back.

The model's drafts are gated per request, not per batch: a request whose model drafts do not
pay (from its MIN_STEPS-th model draft on, a mean over all its model drafts below the break-even
of a model-drafted step, policies.break_even: the verify's and the draft's measured cost in
decode steps, less one; at least MODEL_MIN_ACCEPTED accepted drafts a step) offers no model
draft for PROBE_EVERY steps, then probes again,
twice as many steps after each further probe that leaves the mean below (at most 64): the
AcceptanceGate's rule (speculative/policies.py) per request, while its lookup drafts still run
every step. The mean is over every model draft, not a recent few: acceptance comes in bursts
(a chat answer's set phrases, then free text), and a gate on the last two steps rested heads
that paid overall. The loop's acceptance gate, which switches drafting off for the whole batch,
lookup included, judges this proposer's steps only from bucket 2 on (`gates_own_drafts`): at
bucket 1 it would throw away the repeats of a request whose head drafts miss; in a larger
bucket every row pays for a verify's N rows, which one request's drafts rarely pay alone.

Both proposers see every request's start, commits and finish, so either can draft any step: the
draft model catches up over the tokens committed while it did not draft (its catch-up extend, as
after the acceptance gate's plain steps). Both trees have N nodes, so a step verifies one shape
whichever drafted, and the merged tree's linkage is rebuilt from its ancestor mask. A step where
any request drafts with the model drafts inside the step program, as the model alone does
(draft_program): the rows that draft with both, with the lookup alone or not at all take their
trees from the model's there, as tensor ops (MixedDrafter); a step without model drafts
verifies the lookup's trees (propose)."""
import functools
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
from torch import Tensor

from specdec_inductor import ops
from specdec_inductor.proposers.ngram import NgramProposer
from specdec_inductor.speculative import DraftProgram, DraftTree, Proposer
from specdec_inductor.speculative.policies import (StepCosts, break_even, fails_to_pay, rest_after,
                                                   running_draft_s)
from specdec_inductor.speculative.stats import graphs_compiled

# A lookup drafts when the context suffix it continues is at least this long and it offers at
# least this many drafts. One-token matches (a repeated newline or keyword) continue too seldom;
# two-token ones pay on rewrites and math, and where they keep missing the request's running
# means hand it back to the model (benchmarks/bench_styles.py --lookup 1,2,3).
MIN_MATCH = 2
MIN_DRAFTS = 2
# A request's model drafts stop below a mean of accepted drafts per step over all of them,
# judged from its MIN_STEPS-th model draft (one step's count is mostly noise), and are probed
# again after PROBE_EVERY steps, twice as many after each further miss, at most 64
# (policies.MAX_REST). The mean is the break-even of the loop's measured step costs and the
# model's timed drafts (the loop's own gate's rule) where they are known, and never below
# MODEL_MIN_ACCEPTED. The floor and the first rest follow the loop's gate on the dense target:
# heads on short and chat answers accept in bursts after a slow start, and a stricter gate
# resting longer missed the bursts (docs/decisions.md; benchmarks/bench_styles.py --lookup
# 2,2/0.5/8); where a verify costs more decode steps (a quantized target) the break-even rises.
MODEL_MIN_ACCEPTED = 0.3
MIN_STEPS = 4
PROBE_EVERY = 4
# A match shorter than GRAFT_BELOW tokens (a two-token repeat, common in free text) where
# neither source's running mean leads the other's by GRAFT_MARGIN accepted drafts drafts with
# both: the lookup's first path grafted into the model's tree in place of the tree's last
# (deepest) nodes, at most `graft` of them and N - 2 (0: never both). Longer matches keep the
# plain rule. Five of the seven drafts at N = 8: the head's first two stay, and a grafted path
# holds as much as a lookup drafting alone accepts on rewrites (benchmarks/bench_styles.py
# --lookup 2+graft0,2+graft3,2+graft5).
GRAFT = 5
GRAFT_MARGIN = 1.0
GRAFT_BELOW = 3

# Who drafted a request's last step: the lookup, the model, both (a graft), nobody.
LOOKUP, MODEL, BOTH, NONE = "lookup", "model", "both", "none"


@dataclass
class _Source:
    last: str = NONE
    model_mean: float = 1.0  # running mean of the model drafts it accepted (optimistic start)
    model_steps: int = 0  # its model drafts and their accepted drafts (the gate's mean)
    model_accepted: int = 0
    failures: int = 0  # probes in a row that left the gate's mean below its threshold
    # Running mean of the lookup drafts it accepted, or would have: a match not drafted is
    # scored against the emitted tokens. Starts level with the model's: the first match drafts.
    lookup_mean: float = 1.0
    rest: int = 0  # steps left without model drafts
    model_before: bool = False  # the model drafted its previous step (no catch-up to price)
    shadow: Optional[tuple] = None  # _path_table of this step's lookup match not drafted alone
    model_table: Optional[tuple] = None  # _path_table of the model's tree a graft cut


class LookupFirstProposer(Proposer):
    """`model` (a draft-model proposer) drafting where `lookup` has no confident match.

    Args:
        model: the draft-model proposer; its N is this proposer's N.
        lookup: an NgramProposer with the same N.
        min_match / min_drafts: a request's lookup draft is used when its match length and its
            number of drafts reach these.
        model_min_accepted / min_steps / probe_every: the per-request gate of the model's
            drafts (its least threshold, the model drafts before it judges, its first rest).
        graft: at most this many nodes of the lookup's path (and N - 2) replace the model
            tree's last nodes where a short match leaves neither source ahead (0: one source a
            step).
    """

    # Times the model's drafts (tests swap in a scripted clock).
    clock = staticmethod(time.perf_counter)

    # Per request: the model's drafts rest while they miss, the lookup's run whenever they
    # match; the loop's batch gate would silence both for every request.
    gates_own_drafts = True

    # Steps with model drafts where some request drafts otherwise (a graft; lookup or resting
    # rows beside model rows) draft inside the step program (MixedDrafter); False: before it,
    # in propose (the comparisons: benchmarks/bench_styles.py --lookup 2+hostgraft,
    # benchmarks/bench_step.py --mixed-ab).
    mixed_in_program = True
    # The model's program, and MixedDrafter's (use_program_variant(1): every step with model
    # drafts takes it, for a warm-up to compile it at each bucket).
    program_variants = 2

    def __init__(self, model: Proposer, lookup: NgramProposer, min_match: int = MIN_MATCH,
                 min_drafts: int = MIN_DRAFTS, model_min_accepted: float = MODEL_MIN_ACCEPTED,
                 min_steps: int = MIN_STEPS, probe_every: int = PROBE_EVERY,
                 graft: int = GRAFT):
        if lookup.num_draft_tokens != model.num_draft_tokens:
            raise ValueError(f"argument 'lookup' drafts N={lookup.num_draft_tokens} nodes, the "
                             f"model N={model.num_draft_tokens}: verify needs one tree size")
        for name, value in (("min_match", min_match), ("min_drafts", min_drafts),
                            ("min_steps", min_steps), ("probe_every", probe_every)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"argument '{name}' must be an int >= 1, got {value!r}")
        if isinstance(graft, bool) or not isinstance(graft, int) or graft < 0:
            raise ValueError(f"argument 'graft' must be an int >= 0, got {graft!r}")
        if not 0.0 <= model_min_accepted < model.num_draft_tokens:
            raise ValueError(f"argument 'model_min_accepted' must be in [0, N), got "
                             f"{model_min_accepted!r}")
        self.model, self.lookup = model, lookup
        self.min_match, self.min_drafts = min_match, min_drafts
        self.model_min_accepted, self.probe_every = model_min_accepted, probe_every
        self.min_steps, self.graft = min_steps, graft
        self.num_draft_tokens = model.num_draft_tokens
        self.num_spec_steps = max(model.num_spec_steps, lookup.num_spec_steps)
        self.needs_target_hidden = model.needs_target_hidden
        self.engine = model.engine
        self._sources: Dict[int, _Source] = {}
        self.costs: Optional[StepCosts] = None  # the loop's (use_step_costs)
        self.draft_s: Optional[float] = None  # running mean of a model draft's seconds
        self._chosen = None  # (request ids, trees, sources) draft_program chose for propose
        self._mixer: Optional["MixedDrafter"] = None  # over the model's program drafter
        self._variant = 0  # use_program_variant's
        # When a step drafted in its program began: (clock, graphs_compiled(), bucket).
        self._program_t0: Optional[tuple] = None
        # Request-steps each source drafted and the drafts accepted from them (for reports).
        self.drafts = {LOOKUP: 0, MODEL: 0, BOTH: 0}
        self.accepted = {LOOKUP: 0, MODEL: 0, BOTH: 0}
        # Steps that drafted inside the step program (MixedDrafter) with a graft, and with
        # rows that drafted with the lookup alone or rested (tests assert the path).
        self.grafts_in_program = 0
        self.mixed_in_program_steps = 0

    def start(self, request_ids: List[int], contexts: List[List[int]],
              hidden: Optional[List[Tensor]] = None) -> None:
        self.model.start(request_ids, contexts, hidden)
        try:
            self.lookup.start(request_ids, contexts)
        except BaseException:
            self.model.finish(request_ids)
            raise
        for rid in request_ids:
            self._sources[rid] = _Source()

    def draft_program(self, request_ids: List[int], seq_lens: Tensor,
                      roots: Tensor) -> Optional[DraftProgram]:
        """The model's program when it drafts for some request this step (as the model alone
        would draft: inside the step program); where requests draft otherwise (with both, the
        lookup alone, or not at all), the model's program with each row's source applied
        after its trees (MixedDrafter). None when no request drafts with the model (the
        lookup's trees, or none, are the step's: propose)."""
        bs = len(request_ids)
        found, sources = self._choose(request_ids, seq_lens[:bs])
        program = None
        both = any(s.last == BOTH for s in sources)
        mixed = any(s.last in (LOOKUP, NONE) for s in sources)
        if (any(s.last in (MODEL, BOTH) for s in sources)
                and (self.mixed_in_program or not (both or mixed))):
            program = self.model.draft_program(request_ids, seq_lens, roots)
        if program is not None and (both or mixed or self._variant == 1):
            program = self._mixed(program, found, sources, roots.shape[0])
            if mixed:  # the model's drafts there are never verified
                self.model.discard_drafts([r for r, s in zip(request_ids, sources)
                                           if s.last in (LOOKUP, NONE)])
            self.grafts_in_program += int(both)
            self.mixed_in_program_steps += int(mixed)
        if program is None:
            self._chosen = (list(request_ids), found, sources)
        else:  # priced at commit: the step's seconds beyond a verify
            self._program_t0 = (self.clock(), graphs_compiled(), roots.shape[0])
        return program

    def use_program_variant(self, k: int) -> None:
        if k not in range(self.program_variants):
            raise ValueError(f"argument 'k' must be in [0, {self.program_variants}), got {k!r}")
        self._variant = k

    def _mixed(self, program: DraftProgram, found: DraftTree, sources: List[_Source],
               rows: int) -> DraftProgram:
        """`program` (the model's, over `rows` bucket rows) with MixedDrafter's inputs: each
        request's lookup path to graft (where it drafts with both), the lookup's trees
        (`found`, padded to the bucket) and each row's source."""
        g = self._mixer
        if g is None or g.inner is not program.drafter or g.cap != self.graft:
            g = self._mixer = MixedDrafter(program.drafter, self.graft)
        bs, n = found.tokens.shape
        path, path_len = self._paths(sources, rows)
        tokens = torch.zeros(rows, n, dtype=torch.int64)
        tokens[:bs] = found.tokens
        mask = torch.eye(n, dtype=torch.bool).repeat(rows, 1, 1)  # padding rows: never read
        mask[:bs] = found.tree_mask.view(bs, n, n)
        code = torch.full((rows,), MixedDrafter.MODEL_ROW, dtype=torch.int64)
        for b, s in enumerate(sources):
            if s.last == LOOKUP:
                code[b] = MixedDrafter.LOOKUP_ROW
            elif s.last == NONE:
                code[b] = MixedDrafter.RESTING_ROW
        return DraftProgram(g, [*program.inputs, path, path_len, tokens, mask.view(-1), code],
                            functools.partial(self._model_trees, sources))

    def propose(self, request_ids: List[int], seq_lens: Tensor) -> DraftTree:
        chosen, self._chosen = self._chosen, None
        if chosen is not None and chosen[0] == list(request_ids):
            found, sources = chosen[1], chosen[2]
        else:
            found, sources = self._choose(request_ids, seq_lens)
        model_rows = [b for b, s in enumerate(sources) if s.last in (MODEL, BOTH)]
        if not model_rows:
            return found
        # The model drafts the whole batch when it drafts for any request: for a subset its
        # catch-up and draft graphs would run at a smaller bucket, a graph compiled mid-run.
        # The rows that lookup drafted or that rest keep their own, and the model is told that
        # its drafts there go unverified.
        t0 = (self.clock(), graphs_compiled())
        drafted = self.model.propose(request_ids, seq_lens)
        both = [b for b, s in enumerate(sources) if s.last == BOTH]
        if not both:  # a graft before the program costs more than a model step: not priced
            self._price(t0, sources)
        if len(model_rows) == len(request_ids) and not both:
            return drafted
        # A graft row's model nodes were drafted and verified as in a model step: the model
        # keeps what of them the step accepts (it compares its proposal with the emitted).
        unverified = [r for r, s in zip(request_ids, sources) if s.last not in (MODEL, BOTH)]
        if unverified:
            self.model.discard_drafts(unverified)
        if both:
            drafted = self._graft(drafted, sources)
        return self._merge(found, drafted, model_rows, seq_lens)

    def _choose(self, request_ids: List[int], seq_lens: Tensor):
        """(the lookup's trees [B], each request's _Source with this step's source in `last`):
        the lookup where it matched and is trusted (or the model rests), both where a short
        match leaves neither source ahead, else the model unless it rests. A request that
        rests offers no drafts."""
        found, match_len = self.lookup.propose_with_match(request_ids, seq_lens)
        use_lookup = ((match_len >= self.min_match)
                      & (found.num_drafts >= self.min_drafts)).tolist()  # [B]
        sources = [self._sources[r] for r in request_ids]
        short = (match_len < GRAFT_BELOW).tolist() if self.graft else [False] * len(sources)
        for b, (s, match) in enumerate(zip(sources, use_lookup)):
            margin = GRAFT_MARGIN if short[b] else 0.0
            better = match and (s.lookup_mean >= s.model_mean + margin or s.rest > 0)
            s.last = LOOKUP if better else self._model_turn(s)
            if match and s.last == MODEL:  # scored against the emitted tokens at commit
                s.shadow = _path_table(found, b)
                if s.lookup_mean > s.model_mean - margin:  # neither leads: draft with both
                    s.last = BOTH
            if s.last != NONE:
                self.drafts[s.last] += 1
        num_drafts = found.num_drafts.clone()
        resting = [b for b, s in enumerate(sources) if s.last == NONE]
        num_drafts[resting] = 0  # a decode step for them, unless others verify drafts
        found.num_drafts = num_drafts
        return found, sources

    def _price(self, t0: tuple, sources: List[_Source], in_step: bool = False) -> None:
        """The seconds of a model draft begun at t0 (clock, graphs_compiled()) into the running
        mean the gate prices drafts by, as the loop's gate does: not a draft that also caught
        the model up over a rest or a prompt, nor one during which a graph compiled (the time
        was the compiler's). in_step: the draft ran inside the step program, and its seconds
        are what the step took beyond a verify."""
        if graphs_compiled() != t0[1]:
            return
        seconds = self.clock() - t0[0]
        if in_step:
            seconds = (self.costs.draft_in_step(seconds, t0[2]) if self.costs is not None
                       else None)
        if seconds is not None and all(s.model_before for s in sources
                                       if s.last in (MODEL, BOTH)):
            self.draft_s = running_draft_s(self.draft_s, seconds)

    def commit(self, request_ids: List[int], emitted: List[List[int]],
               hidden: Optional[List[Tensor]] = None) -> None:
        t0, self._program_t0 = self._program_t0, None
        if t0 is not None:  # the step ran the model's draft and the verify as one program
            self._price(t0, [self._sources[r] for r in request_ids], in_step=True)
        self.model.commit(request_ids, emitted, hidden)
        self.lookup.commit(request_ids, emitted)
        for rid, toks in zip(request_ids, emitted):
            s = self._sources[rid]
            if toks and s.last != NONE:
                self.accepted[s.last] += len(toks) - 1
            if toks and s.last == LOOKUP:
                s.lookup_mean = 0.5 * (s.lookup_mean + len(toks) - 1)
            if toks and s.last in (MODEL, BOTH):
                # After a graft each source is scored on what its own tree predicted.
                accepted = len(toks) - 1
                own = accepted if s.last == MODEL else min(accepted,
                                                           _matched(*s.model_table, toks))
                s.model_mean = 0.5 * (s.model_mean + own)
                self._gate(s, own)
                if s.shadow is not None:  # a match not drafted alone (every graft has one)
                    scored = _matched(*s.shadow, toks)
                    if s.last == BOTH:
                        scored = min(accepted, scored)
                    s.lookup_mean = 0.5 * (s.lookup_mean + scored)
            s.model_before = bool(toks) and s.last in (MODEL, BOTH)
            s.last, s.shadow, s.model_table = NONE, None, None

    def use_step_costs(self, costs: StepCosts) -> None:
        self.costs = costs

    def threshold(self) -> float:
        """Accepted model drafts per step below which a request's model drafts rest."""
        if self.costs is None:
            return self.model_min_accepted
        return break_even(self.model_min_accepted, self.costs, self.draft_s)

    def finish(self, request_ids: List[int]) -> None:
        for rid in request_ids:
            self._sources.pop(rid, None)
        try:
            self.model.finish(request_ids)
        finally:
            self.lookup.finish(request_ids)

    def _gate(self, s: _Source, accepted: int) -> None:
        """Count a model draft's accepted drafts; rest the model while its mean does not pay."""
        s.model_steps += 1
        s.model_accepted += accepted
        if fails_to_pay(s.model_accepted, s.model_steps, self.min_steps, self.threshold()):
            s.rest = rest_after(self.probe_every, s.failures)
            s.failures += 1
        else:
            s.failures = 0

    def _model_turn(self, s: _Source) -> str:
        """MODEL while the request's model drafts pay or a probe is due, else NONE."""
        if s.rest > 0:
            s.rest -= 1
            return NONE
        return MODEL

    def _paths(self, sources: List[_Source], rows: int) -> tuple:
        """(path [rows, N - 1], path_len [rows]) int64: the lookup's first path from the root
        (along first children, its `shadow`) of each request drafting with both; length 0 for
        every other row, the padding rows past the requests too."""
        n = self.num_draft_tokens
        path = torch.zeros(rows, n - 1, dtype=torch.int64)
        path_len = torch.zeros(rows, dtype=torch.int64)
        for b, s in enumerate(sources):
            if s.last != BOTH:
                continue
            tokens, first, _, offered = s.shadow
            node, along = 0, []
            while first[node] != -1 and first[node] <= offered:
                node = first[node]
                along.append(tokens[node])
            path[b, :len(along)] = torch.tensor(along, dtype=torch.int64)
            path_len[b] = len(along)
        return path, path_len

    @staticmethod
    def _model_trees(sources: List[_Source], own: tuple) -> None:
        """MixedDrafter's extra outputs (DraftProgram.read): the model's own trees' tokens and
        linkage, kept for its score at commit by each request that drafted with both."""
        tokens, nxt, sib = (t.tolist() for t in own)
        for b, s in enumerate(sources):
            if s.last == BOTH:
                s.model_table = (tokens[b], nxt[b], sib[b], len(tokens[b]) - 1)

    def _graft(self, drafted: DraftTree, sources: List[_Source]) -> DraftTree:
        """`drafted` with the lookup's first path grafted in at each request drafting with
        both (graft_paths); each such row offers N - 1 drafts. Linkage is rebuilt by _merge."""
        bs, n = drafted.tokens.shape
        for b, s in enumerate(sources):
            if s.last == BOTH:
                s.model_table = _path_table(drafted, b)
        offered = (drafted.num_drafts.long() if drafted.num_drafts is not None
                   else torch.full((bs,), n - 1, dtype=torch.int64))
        path, path_len = self._paths(sources, bs)
        tokens, mask, grafted = graft_paths(drafted.tokens, drafted.tree_mask, path, path_len,
                                            self.graft, offered)
        # The graft ends at the last node: a cut to the offered size must keep it.
        num_drafts = torch.where(grafted, n - 1, offered)
        return DraftTree(tokens, mask, drafted.positions, drafted.retrieve_index,
                         drafted.retrieve_next_token, drafted.retrieve_next_sibling, num_drafts)

    def _merge(self, found: DraftTree, drafted: DraftTree, rows: List[int],
               seq_lens: Tensor) -> DraftTree:
        """`found` with rows `rows` replaced by the same rows of `drafted` (both trees of the
        whole batch); positions and linkage rebuilt from the merged ancestor mask."""
        bs, n = found.tokens.shape
        index = torch.tensor(rows, dtype=torch.int64)
        tokens = found.tokens.clone()
        tokens[index] = drafted.tokens[index]
        mask = found.tree_mask.view(bs, n * n).clone()
        mask[index] = drafted.tree_mask.view(bs, n * n)[index]
        mask = mask.flatten()
        num_drafts = found.num_drafts.clone()
        num_drafts[index] = (drafted.num_drafts[index].to(num_drafts.dtype)
                             if drafted.num_drafts is not None else n - 1)
        positions, ridx, nxt, sib = ops.reconstruct_tree_from_mask(mask, seq_lens, n)
        return DraftTree(tokens, mask, positions, ridx, nxt, sib, num_drafts)


def graft_paths(tokens: Tensor, tree_mask: Tensor, path: Tensor, path_len: Tensor, cap: int,
                offered: Optional[Tensor] = None) -> tuple:
    """Each request's path grafted into its draft tree, as tensor ops (traced inside a step
    program by MixedDrafter; eager in propose). tokens [B, N] int64, tree_mask [B*N*N] bool
    (parents numbered before children), path [B, P] int64 with path_len [B] tokens each (0:
    leave the row), cap: at most this many new nodes (and N - 2), offered [B]: the tree's
    drafts (nodes past them are not followed; default all N - 1).

    The path follows the tree from its root while the tree holds its tokens, among the nodes
    kept; then goes on as new nodes, a chain under the last node followed, that take the
    places of the tree's last (deepest) nodes: as many as the path has left, at most cap. Taking
    places can cut a followed node, which leaves more of the path to graft: the count is the
    least fixed point of new = min(cap, path_len - followed(N - new)). Returns (tokens [B, N],
    tree_mask [B*N*N], grafted [B] bool); the linkage and positions are to be rebuilt from
    the mask."""
    bs, n = tokens.shape
    steps = path.shape[1]
    cap = max(0, min(cap, n - 2))
    if steps == 0 or cap == 0:
        return tokens, tree_mask, torch.zeros(bs, dtype=torch.bool)
    idx = torch.arange(n, dtype=torch.int64)
    mask = tree_mask.view(bs, n, n)
    # A node's parent: its last ancestor above itself (-1 at the root).
    above = mask & (idx.view(1, 1, n) < idx.view(1, n, 1))  # [B, N, N]
    parent = torch.where(above.any(2), (above.long() * idx).amax(2), -1)  # [B, N]
    # The nodes holding the path's first k + 1 tokens in a row (n: not held); their numbers
    # rise along the path, so the nodes below any limit are a prefix of them.
    held, node = [], torch.zeros(bs, dtype=torch.int64)
    going = path_len > 0  # [B]
    for k in range(steps):
        hit = ((parent == node.view(bs, 1)) & (tokens == path[:, k:k + 1]) & (idx > 0)
               & (going & (k < path_len)).view(bs, 1))  # [B, N]
        found = hit.any(1)
        child = torch.where(found, hit.long().argmax(1), n)  # the first such child
        held.append(child)
        node = torch.where(found, child, node)
        going = going & found
    held_at = torch.stack(held, 1)  # [B, P]
    limit = (n if offered is None else offered.clamp(max=n - 1) + 1)
    limit = torch.as_tensor(limit, dtype=torch.int64).expand(bs)  # [B]
    new = torch.zeros(bs, dtype=torch.int64)
    for _ in range(cap + 1):  # new only grows, at most to cap
        followed = (held_at < torch.minimum(limit, n - new).view(bs, 1)).sum(1)
        new = torch.maximum(new, (path_len - followed).clamp(min=0, max=cap))
    keep = n - new  # [B]
    followed = (held_at < torch.minimum(limit, keep).view(bs, 1)).sum(1)  # [B]
    attach = torch.where(followed > 0, held_at.gather(1, (followed - 1).clamp(min=0).view(bs, 1))
                         .view(bs), 0)  # [B] the last node followed (the root if none)
    fresh = idx.view(1, n) >= keep.view(bs, 1)  # [B, N] the nodes the path takes
    pick = (followed.view(bs, 1) + idx.view(1, n) - keep.view(bs, 1)).clamp(0, steps - 1)
    tokens = torch.where(fresh, path.gather(1, pick), tokens)
    # A new node's ancestors: the attach node's, and the new nodes up to itself.
    base = mask.gather(1, attach.view(bs, 1, 1).expand(bs, 1, n))  # [B, 1, N]
    chain = (idx.view(1, 1, n) >= keep.view(bs, 1, 1)) & (idx.view(1, 1, n) <= idx.view(1, n, 1))
    mask = torch.where(fresh.view(bs, n, 1), base | chain, mask)  # [B, N, N]
    return tokens, mask.reshape(-1), new > 0


class MixedDrafter:
    """A draft model's program drafter (DraftProgram.drafter) with each row's source applied
    to its trees inside the step program: the lookup's path grafted in (graft_paths) where a
    row drafts with both, the lookup's own tree where it drafts alone, no drafts (a decode
    row: the root's linkage cut) where it rests. Inputs: the model's, then path [B, N - 1]
    and path_len [B] (0: no graft), the lookup's trees (tokens [B, N] int64, tree_mask
    [B*N*N] bool) and each row's source [B] int64 (MODEL_ROW, LOOKUP_ROW, RESTING_ROW).
    Also returns the model's own trees' tokens and linkage (tokens, retrieve_next_token,
    retrieve_next_sibling [B, N]) for its proposer to score the model on what it drafted
    (DraftProgram.read)."""

    MODEL_ROW, LOOKUP_ROW, RESTING_ROW = 0, 1, 2

    def __init__(self, inner, cap: int):
        self.inner, self.cap = inner, cap

    def tree_program(self, roots, seq_lens, *inputs):
        *model_inputs, path, path_len, found_tokens, found_mask, source = inputs
        tokens, mask, _, _, nxt, sib = self.inner.tree_program(roots, seq_lens, *model_inputs)
        bs, n = tokens.shape
        grafted, grafted_mask, _ = graft_paths(tokens, mask, path, path_len, self.cap)
        alone = source == self.LOOKUP_ROW  # [B]
        out = torch.where(alone.view(bs, 1), found_tokens, grafted)
        out_mask = torch.where(alone.view(bs, 1, 1), found_mask.view(bs, n, n),
                               grafted_mask.view(bs, n, n)).reshape(-1)
        positions, ridx, o_nxt, o_sib = ops.reconstruct_tree_from_mask(out_mask, seq_lens, n)
        rests = (source == self.RESTING_ROW).view(bs, 1)  # greedy acceptance takes the root
        o_nxt = o_nxt.masked_fill(rests, -1)
        o_sib = o_sib.masked_fill(rests, -1)
        return out, out_mask, positions, ridx, o_nxt, o_sib, tokens, nxt, sib


def _path_table(tree: DraftTree, b: int) -> tuple:
    """(tokens, first child, next sibling) of request b's draft tree, from its linkage
    (retrieve_next_token / retrieve_next_sibling, -1: none), and how many drafts it offers."""
    offered = tree.tokens.shape[1] - 1 if tree.num_drafts is None else int(tree.num_drafts[b])
    return (tree.tokens[b].tolist(), tree.retrieve_next_token[b].tolist(),
            tree.retrieve_next_sibling[b].tolist(), offered)


def _matched(tokens: List[int], first: List[int], sibling: List[int], offered: int,
             emitted: List[int]) -> int:
    """How many of the emitted tokens the draft tree predicts in a row from its root (nodes
    past `offered` left out): the drafts a verify of that tree would have accepted, counting
    the bonus token when the tree went on past the accepted ones (at most len(emitted))."""
    node, count = 0, 0
    for tok in emitted:
        child = first[node]
        while child != -1 and (child > offered or tokens[child] != tok):
            child = sibling[child]
        if child == -1:
            break
        node, count = child, count + 1
    return count
