"""The ops trace under torch.compile(fullgraph=True) with Inductor and give the eager results,
including the mutating ops (functionalized through auto_functionalize)."""
import torch

from specdec_inductor import ops

from specdec_inductor.testing import random_draft, random_verify_inputs


def _draft_step(parent_list, selected_index, seq_lens, candidates, target, cache_loc):
    """build_tree -> verify -> accepted slots and bonus tokens, as one verify step does."""
    mask, positions, ridx, nxt, sib = ops.build_tree(parent_list, selected_index, seq_lens, 2, 3, 6)
    predicts, accept_index, accept_num = ops.verify_tree_greedy(candidates, ridx, nxt, sib, target, 4)
    slots, count = ops.compact_accepted_cache_locs(cache_loc, accept_index)
    accept_tokens = torch.where(accept_index >= 0, predicts[accept_index.clamp(min=0).long()], -1)
    bonus = ops.fill_bonus_tokens(accept_tokens, accept_num + 1)
    return mask, positions, predicts, accept_index, accept_num, slots, count, bonus


def test_build_tree_to_verify_eager_equals_compiled():
    gen = torch.Generator().manual_seed(11)
    d = random_draft(5, 2, 3, 6, gen)
    _, _, _, nxt, sib = ops.build_tree(d.parent_list, d.selected_index, d.seq_lens, 2, 3, 6)
    candidates, target = random_verify_inputs(nxt, sib, gen)
    cache_loc = torch.randperm(200, generator=gen)[:30]
    args = (d.parent_list, d.selected_index, d.seq_lens, candidates, target, cache_loc)
    eager = _draft_step(*args)
    compiled = torch.compile(_draft_step, fullgraph=True)(*args)
    assert int(eager[4].sum()) > 0  # the sample accepts something
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def _commit(req_to_token, k0, k1, v0, v1, rows, start, end, cache_loc, src, dst):
    ops.assign_req_to_token(req_to_token, rows, start, end, cache_loc)
    ops.move_kv_slots([k0, k1], [v0, v1], src, dst)
    table = ops.build_draft_decode_table(req_to_token, rows, start, 2, 2)
    locs = ops.gather_extend_cache_locs(req_to_token, rows, start, end, cache_loc.shape[0])
    return table, locs + 0


def test_mutating_ops_eager_equals_compiled():
    def fresh():
        gen = torch.Generator().manual_seed(2)
        pools = [torch.randn(32, 2, 4, generator=gen) for _ in range(4)]
        return [torch.zeros(4, 16, dtype=torch.int32), *pools]

    tail = (torch.tensor([1, 3]), torch.tensor([2, 5]), torch.tensor([6, 9]),
            torch.arange(20, 28), torch.tensor([3, 4, 5]), torch.tensor([2, 3, 4]))
    eager_state, compiled_state = fresh(), fresh()
    eager = _commit(*eager_state, *tail)
    compiled = torch.compile(_commit, fullgraph=True)(*compiled_state, *tail)
    for e, c in zip(list(eager) + eager_state, list(compiled) + compiled_state):
        assert torch.equal(e, c)
    assert eager_state[0][3, 5:9].tolist() == [24, 25, 26, 27]  # the table really was written
