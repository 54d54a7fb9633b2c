"""Decode throughput next to CPU co-tenants (issue 39): ours, llama.cpp and OpenVINO GenAI on
SmolLM2-135M, each load condition against the same run's idle one.

A co-tenant is a busy process: a pure-Python spin or a numpy matmul loop (one BLAS thread),
optionally pinned to a CPU (tenant i on CPU i mod cores). For each load condition (--tenants,
default "0,1": idle, then one co-tenant) the runs take turns within every round (--rounds):
- ours, compiled, batch 1, greedy, eos ignored: plain AR on the dense model (the default GGUF
  dequantized to fp32) and on the quantized file (--no-quant to skip), each with 1 thread, all
  threads fixed and the thread governor (SPECDEC_THREADS=auto, engine/threads.py); NGRAM and
  EAGLE-3 (the shipped head) on the dense model with the governor (--methods);
  with --dynamic-ab (idle only) the dense AR again on a second engine compiled with Inductor's
  cpp.dynamic_threads (every kernel a parallel region), to check it costs nothing idle;
- llama.cpp (benchmarks/build_llamacpp.sh binaries, llama-bench tg) on the same quantized file,
  1 thread and all threads;
- OpenVINO GenAI (its own venv, made once by benchmarks/install_openvino_genai.sh; skipped,
  with the reason, when that fails) on the same
  GGUF file, its default threads, in a worker process that loads the model once.
Printed: medians of decode tok/s per condition, the ratio loaded / idle, the ratio to our AR
with the governor (spec methods) and the governor's time share at each thread count.

    python benchmarks/bench_cotenant.py     # five engines compile first (~4 min quiet, 2 cores)
    python benchmarks/bench_cotenant.py --tenants 0,1,2 --tenant matmul --pin
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import specdec_inductor
from specdec_inductor.loading import encode, shipped_head
from specdec_inductor.engine import threads
from specdec_inductor.engine.engine import Engine, GenerationStats
from specdec_inductor.loading import default_gguf_path, load_model
from specdec_inductor.ops.quant import default_activation
from specdec_inductor.proposers.eagle import DRAFT_PREFILL_CHUNK
from specdec_inductor.proposers.eagle3 import Eagle3Proposer, load_eagle3_head
from specdec_inductor.proposers.ngram import NgramProposer
from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = ("def bubble_sort(items):\n    n = len(items)\n    for i in range(n):\n"
          "        for j in range(0, n - i - 1):\n            if items[j] > items[j + 1]:\n"
          "                items[j], items[j + 1] = items[j + 1], items[j]\n    return items\n\n"
          "Rewrite the function above with the variable name `values` instead of `items`.")

TENANTS = {
    "spin": "while True:\n    pass\n",
    "matmul": ("import numpy as np\na = np.random.rand(384, 384)\nwhile True:\n    a = a @ a\n"
               "    a /= np.abs(a).max()\n"),
}


# ---- co-tenants -----------------------------------------------------------------------------

def start_tenants(count, kind, pin):
    """`count` busy processes of TENANTS[kind] (one thread each), tenant i pinned to CPU
    i mod cores with `pin`."""
    cpus = sorted(os.sched_getaffinity(0))
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs = []
    for i in range(count):
        cpu = cpus[i % len(cpus)]
        procs.append(subprocess.Popen(
            [sys.executable, "-c", TENANTS[kind]], env=env,
            preexec_fn=(lambda c=cpu: os.sched_setaffinity(0, {c})) if pin else None))
    time.sleep(0.5)  # running before the first timed run
    return procs


def stop_tenants(procs):
    for p in procs:
        p.kill()
        p.wait()


# ---- ours -----------------------------------------------------------------------------------

class Ours:
    """Our runs: {label: callable() -> decode tok/s}, with the governor each label runs under."""

    def __init__(self, args, ids):
        self.args, self.ids, self.runs = args, ids, {}
        self.max_threads = torch.get_num_threads()
        self.auto = threads.make_governor("auto")  # kept across runs, as in a long-lived process
        dense, _ = load_model(None, torch.float32, dequantize=True)
        engine = self._engine(dense)
        self._add_ar("dense", engine)
        if args.dynamic_ab:
            dyn = self._engine(dense, {"cpp.dynamic_threads": True})
            self.runs["ours AR dense dynamic-threads, max threads"] = (
                self._ar(dyn), self.max_threads)
        if not args.no_quant:
            # The activations the CLI's default (--quant-activations auto) picks here.
            quant, _ = load_model(None, torch.float32, dequantize=False,
                                  quant_activation=default_activation())
            self._add_ar(f"Q4_1 {quant.quant_activation}", self._engine(quant))
        for name in filter(None, args.methods.split(",")):
            label, spec = self._method(name, dense, engine)
            self.runs[f"ours {label}, auto"] = (self._spec(spec), self.auto)

    def _engine(self, model, options=None):
        engine = Engine(model, max_batch=1, max_len=len(self.ids) + self.args.new_tokens + 64,
                        compile_options=options)
        engine.generate([self.ids], 3)  # compiles prefill and decode
        return engine

    def _add_ar(self, kind, engine):
        run = self._ar(engine)
        self.runs[f"ours AR {kind}, 1 thread"] = (run, 1)
        self.runs[f"ours AR {kind}, {self.max_threads} threads"] = (run, self.max_threads)
        self.runs[f"ours AR {kind}, auto"] = (run, self.auto)

    def _ar(self, engine):
        def run():
            stats = GenerationStats()
            engine.generate([self.ids], self.args.new_tokens, None, stats)
            return stats.decode_tokens_per_s
        return run

    def _spec(self, spec):
        # A whole generation first: the verify sizes its drafts reach each compile a graph.
        spec.generate([self.ids], self.args.new_tokens)

        def run():
            stats = SpeculativeStats()
            spec.generate([self.ids], self.args.new_tokens, None, stats)
            return stats.tokens_per_s
        return run

    def _method(self, name, model, engine):
        if name == "ngram":
            return "NGRAM N=8", SpeculativeGenerator(engine, NgramProposer(num_draft_tokens=8))
        if name == "eagle3":
            head = load_eagle3_head(shipped_head("eagle3"), model,
                                    torch.bfloat16 if specdec_inductor.active_isa() in ("avx512", "amx")
                                    else torch.float32)
            max_len = len(self.ids) + self.args.new_tokens + 64
            draft = Engine(head, max_batch=4, max_len=max_len + 64, prefill_chunk=DRAFT_PREFILL_CHUNK,
                           capture_hidden=[-1])
            proposer = Eagle3Proposer(draft, 8, topk=3, depth=4)
            target = Engine(model, max_batch=1, max_len=max_len,
                            capture_hidden=proposer.target_hidden_layers)
            return "EAGLE-3 N=8 topk 3 depth 4", SpeculativeGenerator(target, proposer)
        raise SystemExit(f"--methods: unknown method {name!r} (ngram, eagle3)")

    def run(self, label):
        """(tok/s, seconds at 1 thread / seconds) of one run under its governor."""
        fn, gov = self.runs[label]
        gov = threads.configure(gov)
        before = dict(gov.stats.seconds_at)
        rate = fn()
        spent = {k: v - before.get(k, 0.0) for k, v in gov.stats.seconds_at.items()}
        total = sum(spent.values())
        return rate, (spent.get(1, 0.0) / total if total > 0 and gov.adaptive else None)


# ---- llama.cpp and OpenVINO GenAI -----------------------------------------------------------

def llamacpp_bin(args):
    """Directory of llama-bench, or None (rows skipped, with the reason)."""
    if args.no_llamacpp:
        return None
    bindir = args.llamacpp_bin or os.path.join(ROOT, ".cache", "llamacpp", "0.3.36", "bin")
    if not os.path.exists(os.path.join(bindir, "llama-bench")):
        print(f"# llama.cpp skipped: no llama-bench in {bindir} (bash benchmarks/build_llamacpp.sh)")
        return None
    return bindir


def llamacpp_rate(bindir, gguf, new_tokens, n_threads):
    out = subprocess.run([os.path.join(bindir, "llama-bench"), "-m", gguf, "-p", "0", "-n",
                          str(new_tokens), "-t", str(n_threads), "-r", "1", "-o", "json"],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed (rc {out.returncode}): {out.stderr[-500:]}")
    return float(json.loads(out.stdout)[0]["avg_ts"])


OV_WORKER = r"""
import sys, openvino_genai as ov
pipe = ov.LLMPipeline(sys.argv[1], "CPU")
config = ov.GenerationConfig()
config.max_new_tokens = int(sys.argv[2])
config.ignore_eos = True
prompt = sys.stdin.readline().rstrip("\n").encode().decode("unicode_escape")
print("ready", flush=True)
for line in sys.stdin:
    res = pipe.generate([prompt], config)
    print(res.perf_metrics.get_throughput().mean, flush=True)
"""


class OpenVinoWorker:
    """OpenVINO GenAI in its own venv: one process loads the GGUF once, then each line sent
    runs one generation and answers its decode tok/s (perf_metrics throughput: first token
    excluded)."""

    def __init__(self, python, gguf, new_tokens, prompt):
        self.proc = subprocess.Popen([python, "-c", OV_WORKER, gguf, str(new_tokens)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.proc.stdin.write(prompt.encode("unicode_escape").decode() + "\n")
        self.proc.stdin.flush()
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("OpenVINO GenAI worker failed to load the model")
        self.rate()  # warm-up

    def rate(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self):
        self.proc.kill()
        self.proc.wait()


def openvino_worker(args, gguf, prompt):
    if args.no_openvino:
        return None
    out = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "install_openvino_genai.sh")],
                         capture_output=True, text=True)
    if out.returncode != 0:
        print(f"# OpenVINO GenAI skipped: install_openvino_genai.sh failed: "
              f"{out.stderr.strip()[-300:]}")
        return None
    python = out.stdout.strip().splitlines()[-1]
    try:
        return OpenVinoWorker(python, gguf, args.new_tokens, prompt)
    except (RuntimeError, ValueError) as exc:
        print(f"# OpenVINO GenAI skipped: {exc}")
        return None


# ---- the run --------------------------------------------------------------------------------

def measure(args, ours, bindir, gguf, ov):
    """{tenant count: {label: [(tok/s, share of time at 1 thread or None)]}}, runs taking turns."""
    results = {}
    for count in args.tenant_counts:
        procs = start_tenants(count, args.tenant, args.pin)
        try:
            rows = results.setdefault(count, {})

            def record(label, rate, share=None):  # printed as it comes: a cut run keeps its data
                rows.setdefault(label, []).append((rate, share))
                print(f"# {count} co-tenant(s), round {r + 1}: {label}: {rate:.1f} tok/s"
                      + ("" if share is None else f", {share:.0%} of the time at 1 thread"),
                      flush=True)

            for r in range(args.rounds):
                labels = [lab for lab in ours.runs if count == 0 or "dynamic" not in lab]
                labels = labels[r % 2:] + labels[:r % 2]  # order shifts by round
                for label in labels:
                    record(label, *ours.run(label))
                if bindir:
                    for t in sorted({1, ours.max_threads}):
                        record(f"llama.cpp Q4_1, {t} thread{'s' * (t > 1)}",
                               llamacpp_rate(bindir, gguf, args.new_tokens, t))
                if ov:
                    record("OpenVINO GenAI Q4_1, default threads", ov.rate())
        finally:
            stop_tenants(procs)
    return results


def print_table(args, results):
    counts = args.tenant_counts
    head = " | ".join(f"{c} co-tenant{'s' * (c != 1)}" for c in counts)
    ratios = " | ".join(f"{c}: x idle" for c in counts if c)
    print(f"| run | {head} | {ratios} | vs our AR dense auto | time at 1 thread |")
    print("|---" * (2 + len(counts) + len([c for c in counts if c]) + 1) + "|")
    for label in results[counts[0]]:
        med = {c: statistics.median(v[0] for v in results[c][label])
               for c in counts if label in results[c]}
        cells = " | ".join(f"{med[c]:.1f}" if c in med else "-" for c in counts)
        vs_idle = " | ".join(f"{med[c] / med[0]:.2f}x" if c in med and 0 in med else "-"
                             for c in counts if c)
        ar = {c: statistics.median(v[0] for v in results[c]["ours AR dense, auto"])
              for c in counts if "ours AR dense, auto" in results[c]}
        vs_ar = (" / ".join(f"{med[c] / ar[c]:.2f}x" for c in counts if c in med and c in ar)
                 if "EAGLE" in label or "NGRAM" in label or "dynamic" in label else "-")
        shares = [s for c in counts if c in results and label in results[c]
                  for _, s in results[c][label] if s is not None]
        share = (" / ".join(f"{statistics.median(s for _, s in results[c][label]):.0%}"
                            for c in counts if label in results[c]) if shares else "-")
        print(f"| {label} | {cells} | {vs_idle} | {vs_ar} | {share} |")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tenants", default="0,1", help="comma list of co-tenant counts (0 = idle)")
    p.add_argument("--tenant", choices=sorted(TENANTS), default="spin")
    p.add_argument("--pin", action="store_true", help="pin co-tenant i to CPU i mod cores")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--methods", default="ngram,eagle3", help="comma list of ngram, eagle3")
    p.add_argument("--no-quant", action="store_true", help="skip our AR on the quantized file")
    p.add_argument("--dynamic-ab", action=argparse.BooleanOptionalAction, default=True,
                   help="idle A/B of Inductor's cpp.dynamic_threads (one more compile)")
    p.add_argument("--llamacpp-bin", default=None)
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--no-openvino", action="store_true",
                   help="skip OpenVINO GenAI (else installed once into its own venv, "
                        "benchmarks/install_openvino_genai.sh)")
    args = p.parse_args()
    args.tenant_counts = [int(c) for c in args.tenants.split(",")]
    if 0 not in args.tenant_counts:
        args.tenant_counts.insert(0, 0)
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")
    t0 = time.perf_counter()
    _, tokenizer = load_model(None, torch.float32, dequantize=True)
    ids = encode(tokenizer, PROMPT, chat=True)
    gguf = default_gguf_path()
    ours = Ours(args, ids)
    bindir = llamacpp_bin(args)
    ov = openvino_worker(args, gguf, PROMPT)  # it applies the chat template itself
    print(f"# {os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} allowed), ISA "
          f"{specdec_inductor.active_isa()}, torch {torch.__version__}, {ours.max_threads} threads "
          f"max; SmolLM2-135M-Instruct ({os.path.basename(gguf)}), {args.new_tokens} new tokens, "
          f"greedy, batch 1; co-tenant: {args.tenant}{' pinned' if args.pin else ''}; medians of "
          f"{args.rounds} interleaved rounds; setup {time.perf_counter() - t0:.0f} s")
    try:
        results = measure(args, ours, bindir, gguf, ov)
    finally:
        if ov:
            ov.close()
    print_table(args, results)
    print(f"# total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
