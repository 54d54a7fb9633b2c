"""No speculation: every tree is the root alone, so each step of the shared loop is one plain
decode step. It runs plain autoregressive decoding through the same loop as the speculative
methods (sampling included), so they are compared against the same code path."""
from typing import List

import torch
from torch import Tensor

from specdec_inductor.speculative import DraftTree


class AutoregressiveProposer:
    num_draft_tokens = 1
    num_spec_steps = 1

    def start(self, request_ids: List[int], contexts: List[List[int]]) -> None:
        self.last = {r: c[-1] for r, c in zip(request_ids, contexts)}

    def propose(self, request_ids: List[int], seq_lens: Tensor) -> DraftTree:
        bs = len(request_ids)
        tokens = torch.tensor([[self.last[r]] for r in request_ids], dtype=torch.int64)  # [B, 1]
        row = torch.arange(bs, dtype=torch.int64).view(bs, 1)  # [B, 1] flat node rows
        none = torch.full((bs, 1), -1, dtype=torch.int64)  # [B, 1]
        return DraftTree(tokens, torch.ones(bs, dtype=torch.bool), seq_lens.clone(), row, none,
                         none.clone(), torch.zeros(bs, dtype=torch.int64))

    def commit(self, request_ids: List[int], emitted: List[List[int]]) -> None:
        for r, e in zip(request_ids, emitted):
            if e:
                self.last[r] = e[-1]

    def finish(self, request_ids: List[int]) -> None:
        for r in request_ids:
            self.last.pop(r, None)
