"""STANDALONE drafts: a separate (smaller) causal LM with the target's vocabulary proposes a
chain of K = N - 1 tokens by greedy multi-step decoding (or, with topk > 1, an EAGLE-2 top-k
tree) through its own `Engine` (own KV pool, own compiled extend and decode graphs). Drafting
is DraftModelProposer's (draft_model.py) without hidden states: the draft caches the committed
tokens themselves, and a chain's accepted drafts keep the KV the chain wrote for them, so a
step's catch-up extend is the bonus token plus at most one draft (a tree's catch-up is every
accepted draft and the bonus, depth + 1 tokens at most).
"""
from specdec_inductor.proposers.draft_model import DraftModelProposer


def check_draft_vocabulary(draft_model, target_model, draft_name: str) -> None:
    """A STANDALONE draft and its target exchange token ids both ways (the draft reads the
    target's tokens, the target verifies the draft's), so their vocabularies must be the same
    size; raises ValueError naming the draft otherwise (else an embedding lookup fails later
    with a bare IndexError)."""
    draft_v = draft_model.get_input_embeddings().weight.shape[0]
    target_v = target_model.get_input_embeddings().weight.shape[0]
    if draft_v != target_v:
        raise ValueError(f"the draft model {draft_name} has a vocabulary of {draft_v} tokens, the "
                         f"target {target_v}: a STANDALONE draft needs the target's tokenizer "
                         "and vocabulary")


class StandaloneProposer(DraftModelProposer):
    """Greedy chain (topk = 1) or top-k tree drafts from `draft_engine`, an Engine over a
    causal LM with the target's vocabulary (check_draft_vocabulary); DraftModelProposer's
    drafting without hidden states. See DraftModelProposer for the arguments."""

    def draft_token_map(self):
        """The draft model's draft_to_target [Vd] when its LM head keeps a draft vocabulary
        (draft_vocab.restrict_lm_head), else None (the whole head)."""
        return getattr(self.engine.model, "draft_to_target", None)
