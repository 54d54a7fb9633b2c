"""Benchmark of extend_attention (tree verify) and decode_attention over the paged KV pool,
against plain PyTorch SDPA with an exact-length bool mask (K/V gathered from the pool by index,
and, separately, SDPA alone on pre-gathered K/V), compiled flex_attention with the tree as its
mask_mod, and the roofline: the larger of the memory time (K/V + q + out bytes / read bandwidth
measured here by summing a large tensor) and the compute time (the attention's multiply-add flops
/ the peak multiply-add rate measured here by register-only FMAs on every thread, or torch.mm's
rate without AVX2 / AVX-512; exp and max are not counted, so the roofline is a lower bound on any
kernel's time). Every method cycles
through enough copies of the K/V data (>= 96 MiB in all) that each call reads it from DRAM, not
from the last-level cache, unless --warm. Prints medians over repeats
and ratios measured in the same run; never asserts.

    python benchmarks/bench_attention.py [--quick] [--isa portable|avx2|avx512|amx] [--no-flex]
                                         [--threads N] [--warm] [--vs-isa PATH]
                                         [--slots scattered|consecutive]

flex_attention is compiled per shape (dynamic=False: its dynamic-shape CPU kernel failed to
compile with torch 2.13), so outside --quick it runs on the prefix-2048, N in {8, 64} shapes only.
"""
import argparse
import math
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
import specdec_inductor as si  # noqa: E402
from specdec_inductor.ops import decode_attention, extend_attention  # noqa: E402


def median_time(fn, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_ours(fn, repeats, vs_isa):
    """Median of fn under the active path, or with vs_isa: (ours, ours under vs_isa), the two
    paths taking turns call by call so machine noise hits both alike."""
    if vs_isa is None:
        return median_time(fn, repeats), None
    mine = si.active_isa()
    times = {mine: [], vs_isa: []}
    for r in range(repeats + 3):
        for isa in (mine, vs_isa):
            si.set_active_isa(isa)
            t0 = time.perf_counter()
            fn()
            if r >= 3:  # warmup rounds
                times[isa].append(time.perf_counter() - t0)
    si.set_active_isa(mine)
    return statistics.median(times[mine]), statistics.median(times[vs_isa])


def measure_read_bandwidth(repeats):
    """Bytes/s of x.sum() over a 512 MiB fp32 tensor (all threads): the read roofline."""
    x = torch.ones(128 * 1024 * 1024)  # [128M] fp32 = 512 MiB
    t = median_time(lambda: x.sum(), repeats, warmup=2)
    return x.numel() * 4 / t


def measure_gemm_flops(dtype, repeats):
    """Flop/s of torch.mm on 512 x 512 matrices of `dtype` (cache-resident, all threads)."""
    a = torch.randn(512, 512).to(dtype)
    b = torch.randn(512, 512).to(dtype)
    t = min(median_time(lambda: torch.mm(a, b), repeats, warmup=3) for _ in range(3))
    return 2 * 512 ** 3 / t


def measure_probe_flops(dtype, repeats):
    """Peak flop/s from the widest probe of our extension for the active path -- independent
    register-only FMAs (fp32; AVX2 bf16 too), vdpbf16ps (AVX-512 bf16) or tdpbf16ps (bf16 on
    the AMX path) on every thread, no memory traffic -- or None without AVX2 / AVX-512."""
    bf16 = dtype == torch.bfloat16
    if si._C.peak_multiply_adds(bf16, 1000) == 0:
        return None
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        madds = si._C.peak_multiply_adds(bf16, 2_000_000)
        times.append(time.perf_counter() - t0)
    return 2 * madds / min(times)  # a peak: the best repeat (a shared core only slows it)


def attention_flops(bs, h, d, n, prefix, tree_pairs):
    """Multiply-add flops of QK^T and PV over the visible (query, key) pairs: every query sees
    the whole prefix plus its tree ancestors (tree_pairs = visible pairs inside the trees)."""
    pairs = bs * n * prefix + tree_pairs
    return 2 * 2 * h * d * pairs


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


COLD_BYTES = 96 << 20  # K/V footprint cycled through per method: 3x this machine's 32 MiB L3


class Rotation:
    """Cycles through `n` copies of some tensors, so repeated calls do not hit a warm cache."""

    def __init__(self, tensors, kv_bytes, warm):
        n = 1 if warm else max(1, min(32, -(-COLD_BYTES // kv_bytes)))
        self.copies = [tensors] + [[t.clone() for t in tensors] for _ in range(n - 1)]
        self.i = 0

    def next(self):
        self.i = (self.i + 1) % len(self.copies)
        return self.copies[self.i]


CONSECUTIVE_SLOTS = False  # --slots consecutive


def make_problem(bs, h, h_kv, d, n, prefix, dtype, seed=0):
    """Pool with each request's slots scattered at random (as after many allocations), or
    consecutive with --slots consecutive."""
    g = torch.Generator().manual_seed(seed)
    total = bs * (prefix + n)
    k_pool = torch.randn(total + 16, h_kv, d, generator=g).to(dtype)  # [S, Hkv, D]
    v_pool = torch.randn(total + 16, h_kv, d, generator=g).to(dtype)  # [S, Hkv, D]
    table = torch.randperm(total + 16, generator=g)[:total].view(bs, prefix + n).int()  # [B, L]
    if CONSECUTIVE_SLOTS:
        table = torch.arange(total, dtype=torch.int32).view(bs, prefix + n)
    q = torch.randn(bs, n, h, d, generator=g).to(dtype)  # [B, N, H, D]
    tree = torch.zeros(bs, n, n, dtype=torch.bool)  # [B, N, N] random tree (ancestor rows)
    for b in range(bs):
        for i in range(n):
            tree[b, i, i] = True
            if i:
                tree[b, i] |= tree[b, int(torch.randint(0, i, (1,), generator=g))]
    return q, k_pool, v_pool, table, tree


def bench_verify(bs, h, h_kv, d, n, prefix, dtype, repeats, use_flex, flex_fn, warm, vs_isa=None):
    q, k_pool, v_pool, table, tree = make_problem(bs, h, h_kv, d, n, prefix, dtype)
    rows = torch.arange(bs)
    pre = torch.full((bs,), prefix, dtype=torch.int32)
    ext = torch.full((bs,), n, dtype=torch.int32)
    scale = 1.0 / math.sqrt(d)
    flat_tree = tree.reshape(-1)
    kv_bytes = bs * (prefix + n) * h_kv * d * 2 * k_pool.element_size()
    res = {}
    pools = Rotation([k_pool, v_pool], kv_bytes, warm)
    res["ours"], res["vs"] = time_ours(lambda: extend_attention(
        q, *pools.next(), table, rows, pre, ext, flat_tree, scale), repeats, vs_isa)
    mask = torch.cat([torch.ones(bs, n, prefix, dtype=torch.bool), tree], dim=2)  # [B, N, L]
    mask = mask.unsqueeze(1)  # [B, 1, N, L]
    qt = q.transpose(1, 2)  # [B, H, N, D]
    slots = table.long()

    def sdpa_gather():
        kp, vp = pools.next()
        k = kp[slots].transpose(1, 2)  # [B, Hkv, L, D]
        v = vp[slots].transpose(1, 2)
        return F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    res["sdpa+gather"] = median_time(sdpa_gather, repeats)
    pools = None  # the rotation's pool copies are freed before the next shape
    k_dense = k_pool[slots].transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    v_dense = v_pool[slots].transpose(1, 2).contiguous()
    dense = Rotation([k_dense, v_dense], kv_bytes, warm)
    res["sdpa"] = median_time(lambda: F.scaled_dot_product_attention(
        qt, *dense.next(), attn_mask=mask, scale=scale, enable_gqa=True), repeats)
    if use_flex:
        from torch.nn.attention.flex_attention import create_block_mask

        def mask_mod(b, hh, qi, ki):
            e = ki - prefix
            return (ki < prefix) | ((e >= 0) & tree[b, qi, e.clamp(0, n - 1)])

        block_mask = create_block_mask(mask_mod, bs, None, n, prefix + n, device="cpu")
        qc = qt.contiguous()
        res["flex"] = median_time(lambda: flex_fn(qc, *dense.next(), block_mask=block_mask,
                                                  scale=scale, enable_gqa=True), repeats)
        out = flex_fn(qc, k_dense, v_dense, block_mask=block_mask, scale=scale, enable_gqa=True)
        ours = extend_attention(q, k_pool, v_pool, table, rows, pre, ext, flat_tree, scale)
        res["flex_err"] = (out.transpose(1, 2).float() - ours.float()).abs().max().item()
    qo_bytes = 2 * q.numel() * q.element_size()
    res["bytes"] = kv_bytes + qo_bytes
    res["flops"] = attention_flops(bs, h, d, n, prefix, int(tree.sum()))
    return res


def bench_decode(bs, h, h_kv, d, kv_len, dtype, repeats, warm, vs_isa=None):
    q4, k_pool, v_pool, table, _ = make_problem(bs, h, h_kv, d, 1, kv_len - 1, dtype)
    q = q4[:, 0]  # [B, H, D]
    rows = torch.arange(bs)
    lens = torch.full((bs,), kv_len, dtype=torch.int32)
    scale = 1.0 / math.sqrt(d)
    kv_bytes = bs * kv_len * h_kv * d * 2 * k_pool.element_size()
    pools = Rotation([k_pool, v_pool], kv_bytes, warm)
    res = {}
    res["ours"], res["vs"] = time_ours(lambda: decode_attention(q, *pools.next(), table, rows, lens,
                                                                scale), repeats, vs_isa)
    mask = torch.ones(bs, 1, 1, kv_len, dtype=torch.bool)  # exact lengths (all equal here)
    qt = q.unsqueeze(2)  # [B, H, 1, D]
    slots = table.long()

    def sdpa_gather():
        kp, vp = pools.next()
        k = kp[slots].transpose(1, 2)  # [B, Hkv, L, D]
        v = vp[slots].transpose(1, 2)
        return F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    res["sdpa+gather"] = median_time(sdpa_gather, repeats)
    pools = None  # the rotation's pool copies are freed before the next shape
    dense = Rotation([k_pool[slots].transpose(1, 2).contiguous(),
                      v_pool[slots].transpose(1, 2).contiguous()], kv_bytes, warm)
    res["sdpa"] = median_time(lambda: F.scaled_dot_product_attention(
        qt, *dense.next(), attn_mask=mask, scale=scale, enable_gqa=True), repeats)
    res["bytes"] = kv_bytes + 2 * q.numel() * q.element_size()
    res["flops"] = attention_flops(bs, h, d, 1, kv_len, 0)
    return res


def fmt_us(t):
    return f"{t * 1e6:9.0f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes, fewer repeats")
    ap.add_argument("--isa", choices=["portable", "avx2", "avx512", "amx"], default=None,
                    help="force the kernel path (default: the best this machine supports)")
    ap.add_argument("--no-flex", action="store_true", help="skip compiled flex_attention")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None,
                    help="torch / kernel threads (default: torch's default); on a shared machine "
                         "one thread gives far steadier medians")
    ap.add_argument("--warm", action="store_true",
                    help="reuse one copy of K/V (cache-resident when it fits the LLC)")
    ap.add_argument("--vs-isa", choices=["portable", "avx2", "avx512", "amx"], default=None,
                    help="also time our kernels under this path, taking turns with the active "
                         "one call by call, and print the ratio (e.g. --isa amx --vs-isa avx512)")
    ap.add_argument("--slots", choices=["scattered", "consecutive"], default="scattered",
                    help="each request's KV slots: a random permutation of the pool (as after "
                         "many allocations; default) or consecutive (as a fresh pool hands "
                         "them out)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.isa:
        si.set_active_isa(args.isa)
    if args.vs_isa:
        si.set_active_isa(args.vs_isa)  # raises here, not mid-run, when this machine cannot
        si.set_active_isa(args.isa or si.detected_isa())
    global CONSECUTIVE_SLOTS
    CONSECUTIVE_SLOTS = args.slots == "consecutive"
    repeats = args.repeats or (10 if args.quick else 20)

    flex_fn, flex_note = None, ""
    if not args.no_flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention
            from torch._dynamo import config as dynamo_config
            dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 64)
            flex_fn = torch.compile(flex_attention, dynamic=False)
        except Exception as exc:  # noqa: BLE001 (reported, not swallowed)
            flex_note = f"flex_attention unavailable: {type(exc).__name__}: {exc}"
    else:
        flex_note = "flex skipped (--no-flex)"

    bw = measure_read_bandwidth(5 if args.quick else 10)
    peak, peak_how, gemm = {}, {}, {}
    for dt in (torch.float32, torch.bfloat16):
        # Without the probe, torch.mm's rate stands in (a GEMM library can only understate it).
        gemm[dt] = measure_gemm_flops(dt, 5 if args.quick else 10)
        probe = measure_probe_flops(dt, 5 if args.quick else 10)
        how = f"{si._C.peak_probe_isa(dt == torch.bfloat16)} probe"
        peak[dt], peak_how[dt] = (probe, how) if probe else (gemm[dt], "torch.mm 512^3")

    def roofline(r, dt):
        """(roofline time, 'mem' or 'cmp': which bound sets it)."""
        mem, cmp = r["bytes"] / bw, r["flops"] / peak[dt]
        return (mem, "mem") if mem >= cmp else (cmp, "cmp")

    si.reset_kernel_path_counts()
    print(f"# CPU: {cpu_name()}; threads: {torch.get_num_threads()}; os.cpu_count: {os.cpu_count()}")
    print(f"# torch {torch.__version__}; specdec detected ISA: {si.detected_isa()}, "
          f"active path: {si.active_isa()} (AMX attention kernel: bf16 only, fp32 on amx runs "
          f"avx512)")
    print(f"# measured read bandwidth (x.sum over 512 MiB): {bw / 1e9:.1f} GB/s; roofline = "
          f"max((K/V + q + out bytes) / bandwidth, flops / peak); peak: "
          f"fp32 {peak[torch.float32] / 1e9:.1f} ({peak_how[torch.float32]}), bf16 "
          f"{peak[torch.bfloat16] / 1e9:.1f} GFLOP/s ({peak_how[torch.bfloat16]}) "
          f"(torch.mm 512^3 reaches {gemm[torch.float32] / 1e9:.1f} / "
          f"{gemm[torch.bfloat16] / 1e9:.1f}); K/V " +
          ("reused (warm caches)" if args.warm else "cycled over >= 96 MiB of copies (cold caches)"))
    print(f"# times in microseconds (median of {repeats}); ratios = baseline time / ours; "
          f"roof% = roofline time / ours, bound = which side of the roofline sets it")
    if flex_note:
        print("# " + flex_note)

    if args.quick:
        verify_shapes = [(bs, h, hk, 64, n, p, dt) for dt in (torch.float32, torch.bfloat16)
                         for (bs, h, hk, n, p) in ((1, 32, 8, 8, 4096), (1, 9, 3, 16, 2048),
                                                   (4, 32, 8, 64, 2048))]
        decode_shapes = [(bs, h, hk, 64, L, dt) for dt in (torch.float32, torch.bfloat16)
                         for (bs, h, hk, L) in ((1, 32, 8, 4096), (4, 9, 3, 2048))]
    else:
        verify_shapes = [(bs, h, hk, 64, n, p, dt) for dt in (torch.float32, torch.bfloat16)
                         for bs in (1, 4) for (h, hk) in ((9, 3), (32, 8))
                         for n in (8, 16, 64) for p in (512, 2048, 4096)]
        decode_shapes = [(bs, h, hk, 64, L, dt) for dt in (torch.float32, torch.bfloat16)
                         for bs in (1, 4) for (h, hk) in ((9, 3), (32, 8))
                         for L in (512, 2048, 4096)]

    vs = args.vs_isa
    vs_hdr = f" {'x ' + vs:>8}" if vs else ""
    if vs:
        print(f"# x {vs} = ours under {vs} / ours under {si.active_isa()}, the two taking turns "
              f"call by call (recorded paths below count both)")
    print(f"# KV slots: {args.slots}")

    def vs_col(r):
        return f" {r['vs'] / r['ours']:8.2f}" if vs else ""

    print("\n## verify: extend_attention with a random tree mask")
    hdr = (f"{'dtype':5} {'bs':>2} {'H/Hkv':>5} {'N':>3} {'prefix':>6} | {'ours':>9} {'sdpa+gat':>9} "
           f"{'sdpa':>9} {'flex':>9} {'roof':>9} | {'x sdpa+g':>8} {'x sdpa':>7} {'x flex':>7} "
           f"{'roof%':>6} bound{vs_hdr}")
    print(hdr)
    ratios = {"sdpa+gather": [], "sdpa": [], "flex": [], "roof": []}
    if vs:
        ratios[vs] = []
    for (bs, h, hk, d, n, p, dt) in verify_shapes:
        use_flex = flex_fn is not None and (args.quick or (p == 2048 and n in (8, 64)))
        try:
            r = bench_verify(bs, h, hk, d, n, p, dt, repeats, use_flex, flex_fn, args.warm,
                             args.vs_isa)
        except Exception as exc:  # noqa: BLE001  flex can fail to compile on some CPUs/builds
            if not use_flex:
                raise
            msg = " ".join(str(exc).split())
            print(f"# flex_attention failed on this shape ({type(exc).__name__}: {msg[:300]} ... "
                  f"{msg[-400:]}); continuing without flex")
            flex_fn = None
            r = bench_verify(bs, h, hk, d, n, p, dt, repeats, False, None, args.warm,
                             args.vs_isa)
        roof, bound = roofline(r, dt)
        flex_t = r.get("flex")
        row = (f"{str(dt)[6:]:5} {bs:2d} {h:2d}/{hk:<2d} {n:3d} {p:6d} | {fmt_us(r['ours'])} "
               f"{fmt_us(r['sdpa+gather'])} {fmt_us(r['sdpa'])} "
               f"{fmt_us(flex_t) if flex_t else '        -'} {fmt_us(roof)} | "
               f"{r['sdpa+gather'] / r['ours']:8.2f} {r['sdpa'] / r['ours']:7.2f} "
               f"{(flex_t / r['ours']) if flex_t else float('nan'):7.2f} {100 * roof / r['ours']:5.0f}% "
               f"{bound:5}{vs_col(r)}")
        if vs:
            ratios[vs].append(r["vs"] / r["ours"])
        print(row, flush=True)
        ratios["sdpa+gather"].append(r["sdpa+gather"] / r["ours"])
        ratios["sdpa"].append(r["sdpa"] / r["ours"])
        if flex_t:
            ratios["flex"].append(flex_t / r["ours"])
            if r["flex_err"] > (1e-3 if dt == torch.float32 else 5e-2):
                print(f"#   warning: flex and ours differ by {r['flex_err']:.3g}")
        ratios["roof"].append(roof / r["ours"])
    print("# kernel paths that ran: " + ", ".join(
        f"{k}={v}" for k, v in sorted(si.kernel_path_counts().items()) if "attention" in k))
    si.reset_kernel_path_counts()
    print("# verify medians over shapes: " + ", ".join(
        f"x {k} {statistics.median(v):.2f}" for k, v in ratios.items() if v))

    print("\n## decode: decode_attention (one query per request)")
    print(f"{'dtype':5} {'bs':>2} {'H/Hkv':>5} {'kv_len':>6} | {'ours':>9} {'sdpa+gat':>9} {'sdpa':>9} "
          f"{'roof':>9} | {'x sdpa+g':>8} {'x sdpa':>7} {'roof%':>6} bound{vs_hdr}")
    dratios = {"sdpa+gather": [], "sdpa": [], "roof": []}
    if vs:
        dratios[vs] = []
    for (bs, h, hk, d, L, dt) in decode_shapes:
        r = bench_decode(bs, h, hk, d, L, dt, repeats, args.warm, args.vs_isa)
        roof, bound = roofline(r, dt)
        print(f"{str(dt)[6:]:5} {bs:2d} {h:2d}/{hk:<2d} {L:6d} | {fmt_us(r['ours'])} "
              f"{fmt_us(r['sdpa+gather'])} {fmt_us(r['sdpa'])} {fmt_us(roof)} | "
              f"{r['sdpa+gather'] / r['ours']:8.2f} {r['sdpa'] / r['ours']:7.2f} "
              f"{100 * roof / r['ours']:5.0f}% {bound:5}{vs_col(r)}", flush=True)
        if vs:
            dratios[vs].append(r["vs"] / r["ours"])
        dratios["sdpa+gather"].append(r["sdpa+gather"] / r["ours"])
        dratios["sdpa"].append(r["sdpa"] / r["ours"])
        dratios["roof"].append(roof / r["ours"])
    print("# kernel paths that ran: " + ", ".join(
        f"{k}={v}" for k, v in sorted(si.kernel_path_counts().items()) if "attention" in k))
    print("# decode medians over shapes: " + ", ".join(
        f"x {k} {statistics.median(v):.2f}" for k, v in dratios.items() if v))


if __name__ == "__main__":
    main()
