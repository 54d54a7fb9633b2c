"""The interface every speculative method implements (proposers/, one file per method).
Subclass `Proposer`: its class attributes declare what the loop must do for the method, and
its methods default to doing nothing, so a method overrides only what it keeps state for."""
from typing import TYPE_CHECKING, List, Optional

from torch import Tensor

from specdec_inductor.speculative.tree import DraftProgram, DraftTree

if TYPE_CHECKING:
    from specdec_inductor.speculative.policies import StepCosts


class Proposer:
    """What a speculative method provides. Request ids are the target engine's request rows;
    requests join (start) and leave (finish) the batch between steps."""

    num_draft_tokens: int  # N, nodes per tree including the root
    num_spec_steps: int  # S, longest root-to-leaf path + 1

    # Drafts that cost next to nothing next to a target step (NGRAM: a host-side trie lookup):
    # the loop then cuts poorly accepted drafts to a small verify (AdaptiveVerifySize) instead
    # of gating drafting off (AcceptanceGate).
    cheap_drafts: bool = False

    # A request's drafts may stop short of N - 1 in a step (a chain that ends at an unsure
    # draft): the generator's default verify sizes are then every size 1..N, so a short chain
    # is verified at its own size rather than padded to N.
    variable_drafts: bool = False

    # The proposer decides per request and per step whether the request drafts at all (one that
    # offers no drafts decodes plainly in a verify step's batch): the loop then verifies every
    # draft offered at bucket 1 instead of switching drafting off for the batch (AcceptanceGate),
    # which would also silence the requests whose drafts pay; from bucket 2 on, where every
    # row pays for a verify's rows, the gate judges the batch's drafts by that bucket's price.
    gates_own_drafts: bool = False

    # Drafts made from the target's hidden states (EAGLE-style): the loop then passes, as a
    # third argument, start(..., hidden) with each prompt's captured target hidden [P, k*H],
    # and commit(..., hidden) with the hidden rows of each request's accepted path (root
    # first, [accepted + 1, k*H]): row i belongs to the position of emitted[i]'s predecessor.
    needs_target_hidden: bool = False

    # The draft Engine of a draft-model method (None: no KV of its own): the loop scopes its
    # pool to each batch, so a request it still holds after the batch is reported as leaked.
    engine = None

    # Step programs per bucket that steps drafting inside the step program may take (lookup
    # first: the draft model's, and MixedDrafter's for a batch whose requests draft from
    # different sources): a warm-up compiles program k > 0 by stepping after
    # use_program_variant(k).
    program_variants: int = 1

    def start(self, request_ids: List[int], contexts: List[List[int]],
              hidden: Optional[List[Tensor]] = None) -> None:
        """New requests: their prompt followed by their first emitted token."""

    def propose(self, request_ids: List[int], seq_lens: Tensor) -> DraftTree:
        """Draft trees rooted at each request's last emitted token; seq_lens [B] = cached tokens."""
        raise NotImplementedError(f"{type(self).__name__} must implement propose")

    def draft_program(self, request_ids: List[int], seq_lens: Tensor,
                      roots: Tensor) -> Optional[DraftProgram]:
        """This step's drafts as a function the loop traces into the step program (draft,
        verify, accept and commit as one graph: commit.DraftedStep), over the batch's whole
        bucket (seq_lens, roots [bucket]); it advances the proposer's state as propose would.
        None (the default): draft with propose this step. Asked only when the step verifies
        full trees of N nodes whatever the drafts (the policy plans before drafting), so the
        drafts must be full trees for every request."""
        return None

    def discard_drafts(self, request_ids: List[int]) -> None:
        """The drafts this step's propose made for these requests will not be verified (a
        proposer in front of this one drafts them otherwise): their commit must take nothing
        of the emitted tokens as its own drafts."""

    def use_program_variant(self, k: int) -> None:
        """Warm-ups only: every later step that drafts inside the step program takes its k-th
        program (0, the default: the one each step's drafts choose)."""

    def use_step_costs(self, costs: "StepCosts") -> None:
        """The loop's step costs (a decode step's seconds, verify(N) against it), measured by
        its compile_verify into this same object later: a proposer that gates its own drafts
        prices them with these."""

    def commit(self, request_ids: List[int], emitted: List[List[int]],
               hidden: Optional[List[Tensor]] = None) -> None:
        """Tokens each request emitted in the last step (accepted drafts + bonus; none for a
        request that had already finished). A step may run without a propose call (the
        acceptance gate's plain decode steps): then emitted holds just the next token."""

    def finish(self, request_ids: List[int]) -> None:
        """Requests that left the batch."""
