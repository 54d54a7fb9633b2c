"""quant_linear (csrc/quant.cpp) on the weight shapes of the models we serve from GGUF files:
Qwen2.5-1.5B (1536 / 8960 wide, 151936-row LM head) in Q4_K and Q6_K, SmolLM2-135M (576 wide,
49152-row head) in Q4_1 and Q8_0; random blocks. For M rows of x (1 = decode, 8/16 = verify),
prints the median time, the effective weight-read rate (the quantized bytes per call / time), its
share of this process's measured memory read bandwidth, and the ratio to aten's F.linear on the
dequantized fp32 weight (what the model would run without these kernels; 4-7x the bytes).
Both activation modes run in the same rounds: FLOAT (exact fp32 products) and INT8 (x quantized
to 8 bits per 32 values, integer dot products: the AVX-512 VNNI kernel where the CPU has VNNI);
the INT8 columns give its rate and its speedup over FLOAT and over F.linear.

    python benchmarks/bench_quant.py [--rows 1,8,16] [--repeats 7] [--path avx512] [--no-head]
                                     [--threads 1] [--formats Q4_K,Q6_K] [--shapes 8960x1536]
                                     [--baseline /work/main] [--repacked]

--baseline ROOT: also times INT8 with the kernels of another checkout (ROOT's specdec_inductor
and its built extension, e.g. main's before a kernel change) in a second process that takes
turns with this one call by call on the same random weights; the "vs base" column is the
baseline's time over ours (> 1: ours is faster) and "base/M=1" the baseline's M-row time over
its own 1-row time. With --repacked the A/B is on the repacked layout (where it has one: both
processes repack the same weights), else on the file layout; with --streamed the baseline process
makes its own copies and both sides take them in turn.

--repacked: also times INT8 on the same weights repacked into their 16-row interleaved layout
(QuantFormat.*_R16, what load_gguf builds for INT8 on VNNI: Q4_K, Q6_K and the 32-weight
formats, K a multiple of 64) in the same rounds:
"R16 ms", its rate in file bytes, "file/R16" (the file layout's INT8 time over the repacked one's:
> 1 the repacked layout is faster), and each layout's M-row time over its own 1-row time;
"of peak": the repacked kernel's multiply-adds (N * K * M) per second over the INT8 peak the
AVX-512 VNNI probe measures on the same threads (vpdpbusd back to back, no memory traffic): how
close a compute-bound call (M >= 8) comes to the machine's integer multiply-add rate.

--streamed: each call reads its weights from memory, not from a cache, as a model's decode step
does (every weight once a token): the case's weights are copied until the copies hold at least
STREAMED_BYTES and the calls take them in turn. Without it a weight smaller than the last-level
cache is read from there after the first call, which favours a kernel that is fast from cache
(the file-layout Q6_K kernel: fast from L3, slower than Q6_K_R16 from memory). The copies sit
in huge pages where the system gives them, as the model loader places weights.

On a machine shared with other jobs, --threads 1 gives steadier numbers (an OpenMP barrier can
wait a whole scheduler slice for a descheduled worker); the bandwidth probe then uses one thread
too.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import specdec_inductor
from specdec_inductor.engine import hugepages
from specdec_inductor.ops import QuantFormat, quant_block, quant_dequantize, quant_linear
from specdec_inductor.ops.quant import QuantActivation, file_format, quant_repack, repacked_format

from bench_linear import median_times, read_bandwidth_gbs  # benchmarks/ is on sys.path

QWEN = [(1536, 1536), (8960, 1536), (1536, 8960), (151936, 1536)]  # (N, K)
SMOL = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]
QWEN05 = [(896, 896), (4864, 896), (896, 4864), (151936, 896)]  # the 0.5B's Q8_0 / Q5_0 / Q4_0 shapes
CASES = ([(f, n, k) for f in (QuantFormat.Q4_K, QuantFormat.Q6_K) for n, k in QWEN]
         + [(f, n, k) for f in (QuantFormat.Q4_1, QuantFormat.Q8_0, QuantFormat.Q5_0, QuantFormat.Q4_0)
            for n, k in SMOL + QWEN05])
STREAMED_BYTES = 512 << 20  # --streamed: above the last-level cache of any machine we run on
F16_FIELDS = {QuantFormat.Q4_1: [0, 2], QuantFormat.Q8_0: [0], QuantFormat.Q4_K: [0, 2],
              QuantFormat.Q6_K: [208], QuantFormat.Q4_0: [0], QuantFormat.Q5_0: [0], QuantFormat.Q5_1: [0, 2],
              QuantFormat.Q5_K: [0, 2]}


class Turns:
    """Tensors handed out in turn (--streamed: copies of one weight)."""

    def __init__(self, tensors):
        self.tensors, self.i = tensors, -1

    def next(self):
        self.i = (self.i + 1) % len(self.tensors)
        return self.tensors[self.i]


def random_weight(fmt, n, k):
    """uint8 [N, row_bytes] of random `fmt` blocks with small finite fp16 scales (seeded by the
    shape: the baseline process builds the same bytes)."""
    gen = torch.Generator().manual_seed(int(fmt) * 1_000_003 + n * 7 + k)
    size, nbytes = quant_block(fmt)
    blocks = torch.randint(0, 256, (n * k // size, nbytes), dtype=torch.uint8, generator=gen)
    for off in F16_FIELDS[fmt]:
        vals = (torch.rand(blocks.shape[0], generator=gen) * 0.01).to(torch.float16)
        blocks[:, off:off + 2] = vals.view(torch.uint8).reshape(-1, 2)
    return blocks.reshape(n, -1)


def case_input(fmt, n, k, m):
    """The weight and x of a case (x seeded too)."""
    return random_weight(fmt, n, k), torch.randn(m, k, generator=torch.Generator().manual_seed(m * 31 + k))


def weight_turns(w, streamed):
    """Turns over w alone, or (streamed) over copies of it that hold STREAMED_BYTES, in huge pages
    where the system has them (as a loaded model's weights are: engine/hugepages.py)."""
    if not streamed:
        return Turns([w])
    copies = -(-STREAMED_BYTES // (w.numel() * w.element_size()))
    arena = hugepages.Arena() if hugepages.available() else None
    return Turns([arena.copy(w) if arena else w.clone() for _ in range(copies)])


def int8_peak_macs() -> float:
    """u8 x s8 multiply-adds per second of the AVX-512 VNNI probe on torch's threads (the INT8
    kernels' compute bound: one vpdpbusd does 64), median of 3 timed calls; 0 without VNNI."""
    probe = specdec_inductor._C.peak_int8_multiply_adds
    if probe(1000) == 0:
        return 0.0
    rates = []
    for _ in range(3):
        t0 = time.perf_counter()
        macs = probe(5_000_000)
        rates.append(macs / (time.perf_counter() - t0))
    return statistics.median(rates)


def worker():
    """The --baseline process: reads a JSON case per line ([fmt, n, k, m, streamed]; fmt a file
    format or its repacked layout), prints the seconds of one INT8 quant_linear call on it (its
    inputs built, copied when streamed, and warmed up on first sight)."""
    cache = {}
    for line in sys.stdin:
        fmt, n, k, m, streamed = json.loads(line)
        fmt = QuantFormat(fmt)
        key = (fmt, n, k, m, streamed)
        if key not in cache:
            cache.clear()
            base = file_format(fmt)
            w, x = case_input(base, n, k, m)
            ws = weight_turns(quant_repack(w, base) if fmt != base else w, streamed)
            cache[key] = (ws, x)
            quant_linear(x, ws.next(), fmt, activation=QuantActivation.INT8)
        ws, x = cache[key]
        w = ws.next()
        t0 = time.perf_counter()
        quant_linear(x, w, fmt, activation=QuantActivation.INT8)
        print(time.perf_counter() - t0, flush=True)


class Baseline:
    """A worker process on another checkout's kernels; `runner(case)` gives a callable that has
    the worker time one call and returns after it (so median_times can interleave it)."""

    def __init__(self, root, threads):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.path.dirname(os.path.abspath(__file__))]))
        cmd = [sys.executable, os.path.abspath(__file__), "--worker"]
        if threads:
            cmd += ["--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=root)
        self.last = None

    def runner(self, case):
        def run():
            self.proc.stdin.write(json.dumps(case) + "\n")
            self.proc.stdin.flush()
            self.last = float(self.proc.stdout.readline())
        return run

    def timed(self, case, repeats, own):
        """Median seconds of the worker's call and of `own` (this process), taking turns."""
        times, mine = [], []
        self.runner(case)()
        own()
        for _ in range(repeats):
            self.runner(case)()
            times.append(self.last)
            t0 = time.perf_counter()
            own()
            mine.append(time.perf_counter() - t0)
        return statistics.median(times), statistics.median(mine)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--path", default=None, help="force an ISA path (default: the active one)")
    ap.add_argument("--no-head", action="store_true", help="skip the LM-head shapes (N > 40000)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--formats", default=None, help="only these formats, e.g. Q4_K,Q6_K")
    ap.add_argument("--shapes", default=None, help="only these NxK shapes, e.g. 8960x1536,1536x8960")
    ap.add_argument("--baseline", default=None, help="a checkout (with its built extension) whose "
                    "INT8 kernels to time against ours in the same run")
    ap.add_argument("--repacked", action="store_true", help="also time the 16-row interleaved "
                    "layout (Q4_K_R16 / Q6_K_R16) with INT8 on the same weights")
    ap.add_argument("--streamed", action="store_true", help="each call reads weights not in "
                    "any cache (copies taken in turn), as a model's decode step does")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        return worker()
    base = Baseline(args.baseline, args.threads) if args.baseline else None
    rows = [int(r) for r in args.rows.split(",")]
    formats = None if args.formats is None else [QuantFormat[f] for f in args.formats.split(",")]
    shapes = None if args.shapes is None else [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    if args.path:
        specdec_inductor.set_active_isa(args.path)
    bw = read_bandwidth_gbs()
    peak = int8_peak_macs()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"torch threads {torch.get_num_threads()}, path {specdec_inductor.active_isa()} "
          f"(detected {specdec_inductor.detected_isa()}), torch {torch.__version__}")
    print(f"read bandwidth (torch.sum over 1 GiB): {bw:.1f} GB/s; load average "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print("INT8 peak (AVX-512 VNNI probe, vpdpbusd on every thread): "
          + (f"{peak / 1e9:.0f} G multiply-adds/s" if peak else "none on this path"))
    if base:
        print(f"baseline INT8 kernels: {args.baseline} (the {'repacked' if args.repacked else 'file'} "
              f"layout where it has one)")
    if args.streamed:
        print(f"streamed: each call reads a copy of the weights not read in the last "
              f"{STREAMED_BYTES >> 20} MB of quantized weights (F.linear's fp32 copies likewise), "
              f"{'in huge pages' if hugepages.available() else 'no huge pages on this system'}")
    print()
    print(f"{'':20} | {'FLOAT':^22} | {'INT8':^22} | {'':16} | {'speedup':^15}")
    print(f"{'fmt':5} {'N':>6} {'K':>5} {'M':>3} | {'ms':>8} {'GB/s':>6} {'of bw':>6} | "
          f"{'ms':>8} {'GB/s':>6} {'of bw':>6} | {'F.linear fp32 ms':>16} | "
          f"{'FLOAT':>7} {'INT8':>7}" + (f" | {'base ms':>8} {'vs base':>7} {'base/M=1':>8} {'ours/M=1':>8}"
                                          if base else "")
          + (f" | {'R16 ms':>8} {'GB/s':>6} {'file/R16':>8} {'file/M=1':>8} {'R16/M=1':>8}"
             f" {'of peak':>7}" if args.repacked else ""))
    for fmt, n, k in CASES:
        if args.no_head and n > 40000:
            continue
        if (formats is not None and fmt not in formats) or (shapes is not None and (n, k) not in shapes):
            continue
        w = random_weight(fmt, n, k)  # [N, row_bytes]
        w_dq = quant_dequantize(w, fmt)  # [N, K] fp32
        packed = repacked_format(fmt) if args.repacked and n % 16 == 0 else None
        if packed is not None and k % quant_block(packed)[0]:
            packed = None  # K does not fill the layout's chunks (64 weights for the 32-weight formats)
        w_r = quant_repack(w, fmt) if packed else None  # [N / 16, 16 * row_bytes']
        ws, w_dqs = weight_turns(w, args.streamed), weight_turns(w_dq, args.streamed)
        w_rs = weight_turns(w_r, args.streamed) if packed else None
        one_row = {}  # baseline and ours at M = 1
        for m in rows:
            x = case_input(fmt, n, k, m)[1]  # [M, K]
            calls = [lambda: quant_linear(x, ws.next(), fmt),
                     lambda: quant_linear(x, ws.next(), fmt, activation=QuantActivation.INT8),
                     lambda: F.linear(x, w_dqs.next())]
            if packed:
                calls.append(lambda: quant_linear(x, w_rs.next(), packed,
                                                  activation=QuantActivation.INT8))
            t_q, t_8, t_ref, *t_r = median_times(calls, args.repeats)
            gbs, gbs8 = w.numel() / t_q / 1e9, w.numel() / t_8 / 1e9
            line = (f"{fmt.name:5} {n:6d} {k:5d} {m:3d} | {t_q * 1e3:8.3f} {gbs:6.1f} {gbs / bw:6.2f} | "
                    f"{t_8 * 1e3:8.3f} {gbs8:6.1f} {gbs8 / bw:6.2f} | {t_ref * 1e3:16.3f} | "
                    f"{t_ref / t_q:7.2f} {t_ref / t_8:7.2f}")
            if base:
                ab_fmt, ab_ws = (packed, w_rs) if packed else (fmt, ws)
                t_base, t_ours = base.timed([int(ab_fmt), n, k, m, args.streamed], args.repeats,
                                            lambda: quant_linear(x, ab_ws.next(), ab_fmt,
                                                                 activation=QuantActivation.INT8))
                one_row.setdefault("base", t_base)
                one_row.setdefault("ours", t_ours)
                line += (f" | {t_base * 1e3:8.3f} {t_base / t_ours:7.2f} {t_base / one_row['base']:8.2f} "
                         f"{t_ours / one_row['ours']:8.2f}")
            if t_r:
                one_row.setdefault("file", t_8)
                one_row.setdefault("r16", t_r[0])
                line += (f" | {t_r[0] * 1e3:8.3f} {w.numel() / t_r[0] / 1e9:6.1f} {t_8 / t_r[0]:8.2f} "
                         f"{t_8 / one_row['file']:8.2f} {t_r[0] / one_row['r16']:8.2f}"
                         f" {n * k * m / t_r[0] / peak if peak else float('nan'):7.2f}")
            elif args.repacked:
                line += " | (no repacked layout)"
            print(line, flush=True)
        w = w_dq = w_r = ws = w_dqs = w_rs = None  # freed before the next shape's weights


if __name__ == "__main__":
    main()
