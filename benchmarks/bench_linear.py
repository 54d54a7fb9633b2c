"""skinny_linear vs aten's F.linear over the linear layers of one SmolLM2-135M step (30 x
q/k/v/o/gate/up/down + the 49152-row lm_head, random weights), fp32 and bf16, for M rows
(batch x new tokens), with plain weights (the row kernel) and with registered, packed weights
(the path the specdec backend uses for parameters; csrc/linear.cpp). Prints medians, the
ratios, the packed path's weight-read rate and its share of this process's measured read
bandwidth; the crossover in M sets lowerings/skinny_linear.MAX_ROWS. The "grouped" column
runs the same packed weights as the specdec backend's linear_cat pass calls them: q/k/v and
gate/up each as one skinny_linear_cat (one packed stream per group, 4 calls per layer instead
of 7).

    python benchmarks/bench_linear.py [--rows 1,2,4,8,16,32,64] [--repeats 7]
"""
import argparse
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F

import specdec_inductor
from specdec_inductor.ops import (register_packed_weight, release_packed_weight, skinny_linear,
                                  skinny_linear_cat)

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]
SHAPES = LAYER * 30 + [(49152, 576)]  # (N, K) per weight


def read_bandwidth_gbs(nbytes=1 << 30):
    x = torch.ones(nbytes // 4)
    x.sum()
    best = min((lambda t0: (x.sum(), time.perf_counter() - t0)[1])(time.perf_counter()) for _ in range(5))
    return nbytes / best / 1e9


def median_times(runs, repeats):
    """Median seconds of each of `runs` (a list of callables) over `repeats` rounds in which
    they take turns (a drift of the machine's speed hits them alike), after one untimed call."""
    for run in runs:
        run()
    times = [[] for _ in runs]
    for _ in range(repeats):
        for run, t in zip(runs, times):
            t0 = time.perf_counter()
            run()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def step_runner(fn, weights, xs):
    def run():
        for w in weights:
            fn(xs[w.shape[1]], w)
    return run


def grouped_runner(weights, xs):
    """The step's weights (registered) called as the linear_cat pass groups them."""
    calls = []
    for layer in range(30):
        q, k, v, o, gate, up, down = weights[7 * layer:7 * layer + 7]
        calls += [([q, k, v], 576), ([o], 576), ([gate, up], 576), ([down], 1536)]
    lm_head = weights[-1]

    def run():
        for ws, width in calls:
            if len(ws) == 1:
                skinny_linear(xs[width], ws[0])
            else:
                skinny_linear_cat(xs[width], ws)
        skinny_linear(xs[576], lm_head)
    return run


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32,64")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    bw = read_bandwidth_gbs()
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} threads, ISA {specdec_inductor.active_isa()}, torch "
          f"{torch.__version__}; read bandwidth {bw:.1f} GB/s; medians of {args.repeats}")
    print("| dtype | M | aten ms | row ms | packed ms | grouped ms | row vs aten | packed vs aten | "
          "packed vs row | grouped vs packed | packed GB/s | % of read bandwidth | grouped % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(n, k, generator=gen).to(dtype) for n, k in SHAPES]
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k, generator=gen).to(dtype) for k in (576, 1536)}
            t_aten, t_row = median_times([step_runner(F.linear, weights, xs),
                                          step_runner(skinny_linear, weights, xs)], args.repeats)
            for w in weights:
                register_packed_weight(w)
            specdec_inductor.reset_kernel_path_counts()
            # packed and grouped take turns: their ratio is the grouping's effect
            t_packed, t_grouped = median_times([step_runner(skinny_linear, weights, xs),
                                                grouped_runner(weights, xs)], args.repeats)
            ran = specdec_inductor.kernel_path_counts()
            for path in ("skinny_linear_packed:", "skinny_linear_cat_packed:"):
                if not any(k.startswith(path) for k in ran):
                    raise SystemExit(f"{path[:-1]} did not run (no AVX2 / AVX-512 here?): {ran}")
            for w in weights:
                release_packed_weight(w)
            print(f"| {str(dtype).replace('torch.', '')} | {m} | {1e3 * t_aten:.1f} | "
                  f"{1e3 * t_row:.1f} | {1e3 * t_packed:.1f} | {1e3 * t_grouped:.1f} | "
                  f"{t_aten / t_row:.2f}x | {t_aten / t_packed:.2f}x | {t_row / t_packed:.2f}x | "
                  f"{t_packed / t_grouped:.2f}x | {nbytes / t_packed / 1e9:.1f} | "
                  f"{100 * nbytes / t_packed / 1e9 / bw:.0f}% | "
                  f"{100 * nbytes / t_grouped / 1e9 / bw:.0f}% |", flush=True)


if __name__ == "__main__":
    main()
