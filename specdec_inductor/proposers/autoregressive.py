"""No speculation: every tree is the root alone, so each step of the shared loop is one plain
decode step. It runs plain autoregressive decoding through the same loop as the speculative
methods (sampling included), so they are compared against the same code path."""
from typing import List

import torch
from torch import Tensor

from specdec_inductor.speculative import DraftTree, Proposer, root_only_draft


class AutoregressiveProposer(Proposer):
    num_draft_tokens = 1
    num_spec_steps = 1

    def start(self, request_ids: List[int], contexts: List[List[int]]) -> None:
        self.last = {r: c[-1] for r, c in zip(request_ids, contexts)}

    def propose(self, request_ids: List[int], seq_lens: Tensor) -> DraftTree:
        return root_only_draft(torch.tensor([self.last[r] for r in request_ids]), seq_lens)

    def commit(self, request_ids: List[int], emitted: List[List[int]]) -> None:
        for r, e in zip(request_ids, emitted):
            if e:
                self.last[r] = e[-1]

    def finish(self, request_ids: List[int]) -> None:
        for r in request_ids:
            self.last.pop(r, None)
