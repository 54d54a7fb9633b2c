"""Random draft trees made the way a real multi-step top-k draft loop makes them (kernels.md
section 1): cumulative log-prob scores, topk beams kept per step, the N-1 best ids selected and
sorted; and random greedy-verify inputs that accept, reject and hop siblings. Used by the tests
and the benchmarks."""
from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    parent_list: torch.Tensor  # [B, topk*(depth-1)+1] or [B, 0]
    selected_index: torch.Tensor  # [B, N-1] sorted ascending
    seq_lens: torch.Tensor  # [B]
    topk: int
    depth: int
    num_draft_tokens: int


def random_draft(bs, topk, depth, num_draft_tokens, gen, dtype=torch.int64, max_seq_len=50):
    """One draft per request. Scores: step-0 log-probs, then beam score + child log-prob."""
    assert num_draft_tokens - 1 <= topk + topk * topk * (depth - 1)
    parent_rows, selected_rows = [], []
    for _ in range(bs):
        logp = -torch.rand(topk, generator=gen) * 3 - 1e-3  # [topk], strictly negative
        scores = [logp]
        beam_scores, beam_ids = logp, torch.arange(topk)
        parents = [-1] + list(range(topk)) if depth > 1 else []
        for step in range(1, depth):
            child = beam_scores.view(-1, 1) - torch.rand(topk, topk, generator=gen) * 3 - 1e-3
            scores.append(child.flatten())  # [topk*topk], ids beam-major
            if step < depth - 1:
                best = child.flatten().topk(topk).indices
                beam_scores = child.flatten()[best]
                beam_ids = topk + topk * topk * (step - 1) + best
                parents.extend(beam_ids.tolist())
        all_scores = torch.cat(scores)
        chosen = all_scores.topk(num_draft_tokens - 1).indices.sort().values
        parent_rows.append(parents)
        selected_rows.append(chosen.tolist())
    width = topk * (depth - 1) + 1 if depth > 1 else 0
    parent_list = torch.tensor(parent_rows, dtype=dtype).view(bs, width)
    selected = torch.tensor(selected_rows, dtype=dtype).view(bs, num_draft_tokens - 1)
    seq_lens = torch.randint(0, max_seq_len, (bs,), generator=gen, dtype=dtype)
    if bs > 1:
        seq_lens[0] = 0  # ragged, including an empty prefix
    return DraftTree(parent_list, selected, seq_lens, topk, depth, num_draft_tokens)


def random_verify_inputs(next_token, next_sibling, gen, vocab=50):
    """candidates and target_predict for trees given by linkage [B, N]: at each node the
    target picks, with probability 0.75, the token of a random child (often not the first, so
    the walk must hop siblings), else a token no child carries (rejection)."""
    bs, n = next_token.shape
    candidates = torch.randint(0, vocab, (bs, n), generator=gen)
    target = torch.empty(bs, n, dtype=torch.int64)
    for b in range(bs):
        for i in range(n):
            children = []
            c = int(next_token[b, i])
            while c != -1:
                children.append(c)
                c = int(next_sibling[b, c])
            tokens = {int(candidates[b, c]) for c in children}
            if children and torch.rand(1, generator=gen).item() < 0.75:
                pick = children[int(torch.randint(len(children), (1,), generator=gen))]
                target[b, i] = candidates[b, pick]
            else:
                free = [t for t in range(vocab, vocab + 10) if t not in tokens]
                target[b, i] = free[0]
    return candidates, target
