"""A small tour of the speculative index ops (the main job until the engine lands): one
EAGLE-style draft tree per request is built, verified greedily against a toy target, and the
accepted KV slots are compacted, eagerly and under torch.compile(fullgraph=True)."""
import time

import torch

import specdec_inductor
from specdec_inductor import ops
from specdec_inductor.testing import random_draft, random_verify_inputs


def verify_step(parent_list, selected_index, seq_lens, candidates, target, cache_loc, topk, depth, n):
    _, positions, ridx, nxt, sib = ops.build_tree(parent_list, selected_index, seq_lens, topk, depth, n)
    predicts, accept_index, accept_num = ops.verify_tree_greedy(candidates, ridx, nxt, sib, target, depth + 1)
    slots, count = ops.compact_accepted_cache_locs(cache_loc, accept_index)
    return positions, predicts, accept_index, accept_num, slots, count


def main():
    topk, depth, n, bs = 4, 3, 16, 4
    gen = torch.Generator().manual_seed(0)
    d = random_draft(bs, topk, depth, n, gen)
    _, _, _, nxt, sib = ops.build_tree(d.parent_list, d.selected_index, d.seq_lens, topk, depth, n)
    candidates, target = random_verify_inputs(nxt, sib, gen)
    cache_loc = torch.randperm(1000, generator=gen)[: bs * n]
    args = (d.parent_list, d.selected_index, d.seq_lens, candidates, target, cache_loc, topk, depth, n)
    print(f"specdec_inductor {specdec_inductor.__version__}: ISA path {specdec_inductor.active_isa()} "
          f"(detected {specdec_inductor.detected_isa()}); bs={bs} topk={topk} depth={depth} N={n}")
    eager = verify_step(*args)
    t0 = time.perf_counter()
    compiled = torch.compile(verify_step, fullgraph=True)(*args)
    print(f"compiled the verify step in {time.perf_counter() - t0:.1f} s; eager == compiled: "
          f"{all(torch.equal(a, b) for a, b in zip(eager, compiled))}")
    _, predicts, accept_index, accept_num, slots, count = compiled
    for b in range(bs):
        path = [int(i) for i in accept_index[b] if i >= 0]
        tokens = [int(predicts[i]) for i in path]
        print(f"  request {b}: seq_len {int(d.seq_lens[b]):3d}, accepted {int(accept_num[b])} drafts, "
              f"emitted tokens {tokens} (last is the bonus)")
    print(f"  {int(count)} accepted KV slots compacted: {slots[: int(count)].tolist()}")


if __name__ == "__main__":
    main()
