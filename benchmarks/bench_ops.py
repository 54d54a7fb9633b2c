"""Times every speculative index op (C++ kernel) against its pure-PyTorch reference run eagerly
and under torch.compile, at bs {1, 8, 64} x N {8, 16, 64}; prints medians and ratios plus the CPU
and the ISA path. Timings are medians of repeated calls after warm-up; quote the ratios, these
machines are shared and noisy.

    python benchmarks/bench_ops.py            # full grid
    python benchmarks/bench_ops.py --quick    # bs 8, N 16 only, fewer repeats

top_k_top_p_renorm runs over SmolLM2's 49152-token vocabulary (top-k 50, top-p 0.9) with no
compiled reference (its reference loops over rows in Python).
"""
import argparse
import json
import os
import platform
import statistics
import time

import torch

import specdec_inductor
from specdec_inductor import ops
from specdec_inductor.ops import reference as ref
from specdec_inductor.testing import random_draft, random_verify_inputs

# (topk, depth) giving at least N-1 candidates, as an EAGLE-2 style draft would use.
TREE_SHAPE = {8: (4, 2), 16: (4, 3), 64: (8, 3)}
LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M's KV pool geometry


def median_us(fn, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def make_cases(bs, n):
    """(op name, kernel call, reference call) for one batch size and tree size."""
    topk, depth = TREE_SHAPE[n]
    gen = torch.Generator().manual_seed(bs * 1000 + n)
    d = random_draft(bs, topk, depth, n, gen, max_seq_len=1000)
    mask, _, ridx, nxt, sib = ops.build_tree(d.parent_list, d.selected_index, d.seq_lens, topk, depth, n)
    candidates, target = random_verify_inputs(nxt, sib, gen)
    max_len = 1100 + topk * depth + n
    rows = torch.randperm(max(bs, 2) * 2, generator=gen)[:bs]
    table = torch.randperm(2 * max(bs, 2) * max_len, generator=gen).to(torch.int32)
    table = table.view(2 * max(bs, 2), max_len)  # [R, L] req_to_token
    seq = d.seq_lens
    start, end = seq, seq + n
    loc = torch.randperm(10 * bs * n, generator=gen)[: bs * n]
    _, accept_index, accept_num = ops.verify_tree_greedy(candidates, ridx, nxt, sib, target, depth + 1)
    accept_tokens = torch.randint(0, 1000, (bs, depth + 1), generator=gen)
    slots = bs * max_len
    k_pool = [torch.randn(slots, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    v_pool = [torch.randn(slots, KV_HEADS, HEAD_DIM) for _ in range(LAYERS)]
    moved = max(1, bs * depth)
    src = torch.randperm(slots, generator=gen)[:moved]
    dst = torch.randperm(slots, generator=gen)[:moved]
    # Sampling at T > 0 with top-k 50 / top-p 0.9 over SmolLM2's vocabulary, one row per tree
    # node (at most 128 rows: 64 x 64 rows would be 800 MB of probabilities).
    v_rows = min(bs * n, 128)
    probs = torch.softmax(torch.randn(v_rows, 49152, generator=gen) * 4, dim=-1)  # [R, V]
    top_k = torch.full((v_rows,), 50, dtype=torch.int32)
    top_p = torch.full((v_rows,), 0.9)
    tree_args = (d.parent_list, d.selected_index, d.seq_lens, topk, depth, n)
    verify_args = (candidates, ridx, nxt, sib, target, depth + 1)
    return [
        ("build_tree", lambda: ops.build_tree(*tree_args), lambda: ref.build_tree_ref(*tree_args)),
        ("verify_tree_greedy", lambda: ops.verify_tree_greedy(*verify_args),
         lambda: ref.verify_tree_greedy_ref(*verify_args)),
        ("reconstruct_tree_from_mask", lambda: ops.reconstruct_tree_from_mask(mask, seq, n),
         lambda: ref.reconstruct_tree_from_mask_ref(mask, seq, n)),
        ("assign_req_to_token", lambda: ops.assign_req_to_token(table, rows, start, end, loc),
         lambda: ref.assign_req_to_token_ref(table, rows, start, end, loc)),
        ("assign_draft_cache_locs", lambda: ops.assign_draft_cache_locs(table, rows, seq, topk, depth),
         lambda: ref.assign_draft_cache_locs_ref(table, rows, seq, topk, depth)),
        ("gather_extend_cache_locs", lambda: ops.gather_extend_cache_locs(table, rows, start, end, bs * n),
         lambda: ref.gather_extend_cache_locs_ref(table, rows, start, end, bs * n)),
        ("build_draft_decode_table", lambda: ops.build_draft_decode_table(table, rows, seq, topk, depth),
         lambda: ref.build_draft_decode_table_ref(table, rows, seq, topk, depth)),
        ("fill_bonus_tokens", lambda: ops.fill_bonus_tokens(accept_tokens, accept_num + 1),
         lambda: ref.fill_bonus_tokens_ref(accept_tokens, accept_num + 1)),
        ("compact_accepted_cache_locs", lambda: ops.compact_accepted_cache_locs(loc, accept_index),
         lambda: ref.compact_accepted_cache_locs_ref(loc, accept_index)),
        ("move_kv_slots", lambda: ops.move_kv_slots(k_pool, v_pool, src, dst),
         lambda: ref.move_kv_slots_ref(k_pool, v_pool, src, dst)),
        (f"top_k_top_p_renorm ({v_rows} rows)", lambda: ops.top_k_top_p_renorm(probs, top_k, top_p),
         lambda: ref.top_k_top_p_renorm_ref(probs, top_k, top_p)),
    ]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="bs 8, N 16 only")
    parser.add_argument("--no-compiled-ref", action="store_true", help="skip the torch.compile'd references")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args()
    grid = [(8, 16)] if args.quick else [(bs, n) for bs in (1, 8, 64) for n in (8, 16, 64)]
    repeats = args.repeats or (20 if args.quick else 30)
    torch._dynamo.config.cache_size_limit = 256

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(f"CPU: {cpu}; cores: {os.cpu_count()}; torch threads: {torch.get_num_threads()}; "
          f"torch {torch.__version__}")
    print(f"ISA: detected {specdec_inductor.detected_isa()}, active {specdec_inductor.active_isa()}, "
          f"built {specdec_inductor.built_isas()}")
    header = (f"{'op':28s} {'bs':>3s} {'N':>3s} {'kernel us':>10s} {'ref us':>10s} {'compiled ref us':>15s} "
              f"{'x ref':>8s} {'x compiled':>10s}")
    print(header)
    print("-" * len(header))
    rows = []
    for bs, n in grid:
        for name, kernel, reference in make_cases(bs, n):
            k_us = median_us(kernel, repeats)
            r_us = median_us(reference, max(5, repeats // 3))
            c_us = float("nan")
            # The sampling reference loops over rows in Python (sort, .item()): no graph to compile.
            if not args.no_compiled_ref and not name.startswith("top_k_top_p_renorm"):
                torch._dynamo.reset()
                compiled = torch.compile(reference)
                c_us = median_us(compiled, max(5, repeats // 3), warmup=2)
            row = dict(op=name, bs=bs, n=n, kernel_us=k_us, ref_us=r_us, compiled_ref_us=c_us,
                       speedup_vs_ref=r_us / k_us, speedup_vs_compiled_ref=c_us / k_us)
            rows.append(row)
            print(f"{name:28s} {bs:3d} {n:3d} {k_us:10.1f} {r_us:10.1f} {c_us:15.1f} "
                  f"{r_us / k_us:7.1f}x {c_us / k_us:9.1f}x", flush=True)
    paths = specdec_inductor.kernel_path_counts()
    print("kernel paths that ran:", ", ".join(f"{k}={v}" for k, v in sorted(paths.items())))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu, isa=specdec_inductor.active_isa(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
