"""Quantized GGUF targets end to end: our compiled engine on the file's own quantized blocks
against llama.cpp on the same file, in one run, batch 1, greedy, code and chat prompts.

Rows per prompt (decode-phase tokens/s: prompt processing excluded on both sides, as
llama.cpp's "eval" / "decoded" lines exclude it):
- ours: plain AR, then each --methods entry (ngram; standalone with --draft-model, once per
  --draft-vocab size and --draft-stop-below value; standalone+lookup, the same with prompt
  lookup first; eagle3 with --eagle3-head), with the ratio to our AR and whether the tokens equal our AR's;
- llama.cpp (binaries of benchmarks/build_llamacpp.sh, same source as llama-cpp-python, native
  flags): plain decode (llama-completion), draft-model speculation with the same --draft-model
  (llama-speculative-simple) and prompt lookup (llama-lookup).
Ratios "vs llama.cpp" divide by llama.cpp's plain decode on the same prompt. Medians over
--repeats (runs take turns within a repeat) and over prompts at the end. Also printed: load
time, time to the first token (load + compile + prefill, this process: cold with a fresh
TORCHINDUCTOR_CACHE_DIR), resident memory against the file size plus the KV pool.
--compare-rows: per prompt and method, how many verify rows reproduce our AR's decode logits
bit for bit (greedy speculation can equal AR only where they do).
--min-accepted A: every method's acceptance-gate threshold set by hand (0 drafts every step),
to see a method's own acceptance where the calibrated gate would switch it off.
--profile N: only a torch.profiler table of our AR decoding N tokens of the first prompt (after a
warm-up): where a decode step's time goes, op by op, with the quantized linears' share.
--step-costs: only the seconds of one step program (target step, acceptance, commit) of each
verify size at batch 1 (or each of --batches) over a 200-token context, as a ratio to a decode
step of the same batch (what a verify's extra rows cost under concurrency), and, with
--draft-model, the draft model's decode step (per --draft-vocab size) as a share of the
target's: what a STANDALONE step costs before any draft is accepted.
--int8-agreement: only the accuracy of INT8 activations against FLOAT on the target (eager, one
forward over each prompt's chat text followed by FLOAT's greedy continuation): top-1 agreement
by position and the median over positions of max |logit difference| / max |logit|.

    bash benchmarks/build_llamacpp.sh        # once (~10 min on 2 cores)
    specdec fetch-model qwen2.5-coder-1.5b   # and qwen2.5-coder-0.5b for the draft
    python benchmarks/bench_quant_e2e.py --model qwen2.5-coder-1.5b \
        --draft-model qwen2.5-coder-0.5b --methods ngram,standalone
    python benchmarks/bench_quant_e2e.py --model qwen2.5-coder-1.5b \
        --draft-model qwen2.5-coder-0.5b --methods standalone,standalone+lookup \
        --draft-vocab 32768,full --quant-activations int8 --no-llamacpp
    python benchmarks/bench_quant_e2e.py --methods ngram,eagle3    # SmolLM2 Q4_1 (default)
"""
import argparse
import os
import re
import resource
import shlex
import statistics
import subprocess
import sys
import time

import torch

import specdec_inductor
from specdec_inductor.loading import encode, shipped_head
from specdec_inductor.engine.engine import Engine, GenerationStats
from specdec_inductor.loading import load_model
from specdec_inductor.ops.quant import QuantActivation
from specdec_inductor.proposers.eagle import DRAFT_PREFILL_CHUNK
from specdec_inductor.proposers.eagle3 import Eagle3Proposer, load_eagle3_head
from specdec_inductor.proposers.ngram import NgramProposer
from specdec_inductor.proposers.draft_vocab import apply_draft_vocab
from specdec_inductor.proposers.standalone import StandaloneProposer
from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats
from specdec_inductor.testing import RowRecorder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROMPTS = {
    "code-rewrite": ("def bubble_sort(items):\n    n = len(items)\n    for i in range(n):\n"
                     "        for j in range(0, n - i - 1):\n            if items[j] > items[j + 1]:\n"
                     "                items[j], items[j + 1] = items[j + 1], items[j]\n"
                     "    return items\n\nRewrite the function above with the variable name "
                     "`values` instead of `items`, and add a docstring."),
    "code-write": "Write a Python function that parses a CSV line with quoted fields, with tests.",
    "code-fix": ("This JavaScript function should return the sum of the even numbers but it "
                 "does not. Fix it and explain the bug.\n\nfunction sumEven(xs) {\n  let s = 0;\n"
                 "  for (let i = 0; i <= xs.length; i++) {\n    if (xs[i] % 2 == 1) s += xs[i];\n"
                 "  }\n  return s;\n}"),
    "chat-explain": "Explain in a few paragraphs how a hash map works and when to use one.",
    "chat-story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def rss_bytes() -> int:
    """Current resident set size (Linux /proc), in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_parts(path: str) -> dict:
    """The resident set split as /proc/self/status and smaps see it, in bytes: anonymous memory
    (the weights we placed, the KV pool, the heap), file-backed pages (libraries and compiled
    kernels as they fault in, and the GGUF's own mapped pages), and of those the pages mapped
    from `path`."""
    parts = {"anon": 0, "file": 0, "gguf": 0}
    with open("/proc/self/status") as f:
        for line in f:
            key = {"RssAnon:": "anon", "RssFile:": "file"}.get(line.split(":")[0] + ":")
            if key:
                parts[key] = int(line.split()[1]) * 1024
    mapping = None
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header line
                mapping = fields[5] if len(fields) > 5 else None
            elif fields[0] == "Rss:" and mapping == path:
                parts["gguf"] += int(fields[1]) * 1024
    return parts


def model_file(model) -> str:
    """The GGUF file behind a model name or path (for llama.cpp and the memory check)."""
    from specdec_inductor.models import resolve_model
    path = resolve_model(model) if model else None
    if path is None:
        from specdec_inductor.loading import default_gguf_path
        path = default_gguf_path()
    return path


# ---- llama.cpp ----

def llamacpp_bin(explicit):
    """Directory of the llama.cpp binaries, or None (column skipped, with the reason)."""
    if explicit:
        return explicit
    out = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "build_llamacpp.sh")],
                         capture_output=True, text=True)
    if out.returncode != 0:
        print(f"# llama.cpp skipped: build_llamacpp.sh failed: {out.stderr.strip()[-300:]}")
        return None
    return out.stdout.strip().splitlines()[-1]


# --llamacpp-args' example, here and in bench_serve.py.
LLAMACPP_ARGS_EXAMPLE = ("e.g. '-nr' (no weight repacking: 0.3.36's AMX repack crashes at its "
                         "first multi-row matmul on some AMX machines, llama.cpp issue 20824)")


def run_llamacpp(cmd, pattern):
    """Runs one llama.cpp command; returns (tokens/s from `pattern`, stdout+stderr)."""
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    text = out.stdout + out.stderr
    m = re.search(pattern, text)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"{os.path.basename(cmd[0])} failed (rc {out.returncode}): {text[-800:]}")
    return float(m.group(1)), text


def llamacpp_runs(bindir, target, draft, prompt_text, new_tokens, threads, n_draft, extra=()):
    """{label: (tok/s, accepted fraction or None)} of llama.cpp's plain, draft-model and lookup
    decoding on one prompt (greedy, eos ignored so every run makes new_tokens tokens); extra:
    more arguments for every run (--llamacpp-args)."""
    common = ["-p", prompt_text, "-n", str(new_tokens), "-t", str(threads), "--temp", "0",
              "--ignore-eos", "-c", "2048", *extra]
    res = {}
    rate, _ = run_llamacpp([os.path.join(bindir, "llama-completion"), "-m", target, "-no-cnv",
                            *common], r"(?<!prompt )eval time =\s+[\d.]+ ms /\s+\d+ runs.*?([\d.]+) tokens per second")
    res["llama.cpp plain"] = (rate, None)
    spec = ["--spec-draft-n-max", str(n_draft), "--spec-draft-n-min", "0"]
    if draft:
        rate, text = run_llamacpp([os.path.join(bindir, "llama-speculative-simple"), "-m", target,
                                   "-md", draft, "--spec-type", "draft-simple", *spec, *common], r"decoded\s+\d+ tokens in .*speed:\s+([\d.]+) t/s")
        acc = re.search(r"accept\s+=\s+([\d.]+)%", text)
        res["llama.cpp draft model"] = (rate, float(acc.group(1)) / 100 if acc else None)
    rate, text = run_llamacpp([os.path.join(bindir, "llama-lookup"), "-m", target,
                               "--spec-draft-n-max", str(n_draft), *common],
                              r"decoded\s+\d+ tokens in .*speed:\s+([\d.]+) t/s")
    acc = re.search(r"accept\s+=\s+([\d.]+)%", text)
    res["llama.cpp lookup"] = (rate, float(acc.group(1)) / 100 if acc else None)
    return res


# ---- ours ----

STANDALONE_METHODS = ("standalone", "standalone+lookup")
# Draft tokens of STANDALONE: 4 drafts a step (N = 5) measured best for the 0.5B drafting the
# 1.5B (the draft's steps cost 0.47 of the target's each).
STANDALONE_N = 5


def draft_vocabs(text: str):
    """--draft-vocab's sizes: ints, or "full" (None: the whole head)."""
    try:
        return [None if v == "full" else int(v) for v in text.split(",")]
    except ValueError:
        raise SystemExit(f"--draft-vocab: a comma list of ints or full, got {text!r}") from None


def standalone_proposer(args, engine, vd):
    """A StandaloneProposer with --draft-model over `engine` (registry), its LM head keeping
    the vd most frequent ids (None: all)."""
    from specdec_inductor.proposers.registry import (ProposerConfig, ProposerConfigError,
                                                     make_proposer)
    try:
        config = ProposerConfig(method="standalone", num_draft_tokens=min(args.num_draft_tokens,
                                                                          STANDALONE_N),
                                draft_model=args.draft_model, draft_vocab=vd,
                                dequantize=args.dequantize,
                                quant_activations=args.quant_activations)
        return make_proposer(config, engine, log=lambda msg: print(f"# {msg}"))
    except ProposerConfigError as exc:
        raise SystemExit(f"--draft-vocab: {exc}") from None


def standalone_methods(args, engine, vd, proposer, name):
    """{label: SpeculativeGenerator} of `name` (standalone, or standalone+lookup: prompt lookup
    first, proposers/lookup_first.py) for each --draft-stop-below value, over proposers that
    share the STANDALONE `proposer`'s draft Engine (compiled once per draft vocabulary)."""
    from specdec_inductor.proposers.lookup_first import LookupFirstProposer
    from specdec_inductor.proposers.registry import ProposerConfig, make_proposer
    k = proposer.num_draft_tokens
    methods = {}
    for stop in args.draft_stops:
        drafts = proposer if not stop else StandaloneProposer(proposer.engine, k, stop_below=stop)
        label = (f"STANDALONE {args.draft_model} N={k} Vd={vd or 'full'}"
                 + (f" stop<{stop}" if stop else ""))
        if name == "standalone+lookup":
            lookup = make_proposer(ProposerConfig(method="ngram", num_draft_tokens=k))
            drafts, label = LookupFirstProposer(drafts, lookup), f"{label} +lookup"
        methods[label] = SpeculativeGenerator(engine, drafts)  # sizes 1..N when stop > 0
    return methods


def build_methods(args, model, engine):
    """{label: SpeculativeGenerator} for --methods."""
    methods = {}
    wanted = set(args.methods.split(","))
    standalone = {vd: standalone_proposer(args, engine, vd) for vd in args.draft_vocabs
                  if wanted & set(STANDALONE_METHODS)}
    for name in filter(None, args.methods.split(",")):
        if name == "ngram":
            methods[f"NGRAM N={args.num_draft_tokens}"] = SpeculativeGenerator(
                engine, NgramProposer(num_draft_tokens=args.num_draft_tokens))
        elif name in STANDALONE_METHODS:
            if not args.draft_model:
                raise SystemExit(f"--methods {name} needs --draft-model")
            for vd in args.draft_vocabs:
                methods.update(standalone_methods(args, engine, vd, standalone[vd], name))
        elif name == "eagle3":
            head = load_eagle3_head(args.eagle3_head or shipped_head("eagle3"), model,
                                    torch.bfloat16 if specdec_inductor.active_isa() in ("avx512", "amx")
                                    else torch.float32)
            draft_engine = Engine(head, max_batch=4, max_len=args.max_len + 64,
                                  compile=not args.eager, prefill_chunk=DRAFT_PREFILL_CHUNK,
                                  capture_hidden=[-1])
            proposer = Eagle3Proposer(draft_engine, 8, topk=3, depth=4)
            engine3 = Engine(model, max_batch=1, max_len=args.max_len, compile=not args.eager,
                             prefill_chunk=64, capture_hidden=proposer.target_hidden_layers)
            methods["EAGLE-3 N=8 topk 3 depth 4"] = SpeculativeGenerator(engine3, proposer)
        else:
            raise SystemExit(f"--methods: unknown method {name!r} (ngram, standalone, "
                             "standalone+lookup, eagle3)")
    return methods


def compare_rows(recorders, engine, methods, kind, ids, max_new_tokens):
    """Prints, per method, how many verify rows of the method's own target Engine (EAGLE-3
    steps a capture_hidden one) reproduce our AR's decode logits bitwise. recorders: one
    RowRecorder per Engine, made on first use."""
    def recorder(e):
        if e not in recorders:
            recorders[e] = RowRecorder(e)
        return recorders[e]

    # Steps through engine.decode / engine.verify, where the recorders see them (the plain
    # generate inside Engine.generate is a SpeculativeGenerator too).
    SpeculativeGenerator.one_program = False
    try:
        rec = recorder(engine)
        rec.rows, rec.on = [], True
        ar = engine.generate([ids], max_new_tokens)[0]
        ar_rows, rec.on = rec.rows, False
        for label, spec in methods.items():
            rec = recorder(spec.engine)
            rec.rows, rec.on = [], True
            out = spec.generate([ids], max_new_tokens)[0]
            rec.on = False
            same, different, worst = rec.compare(ar_rows, rec.rows, ids + ar)
            print(f"# {kind} {label}: verify rows == decode rows bitwise: {same}, different: "
                  f"{different} (largest |logit difference| {worst:.3g}); tokens == AR: "
                  f"{out == ar}")
    finally:
        SpeculativeGenerator.one_program = True


def int8_agreement(args):
    """INT8 activations against FLOAT on the target, teacher-forced on FLOAT's own greedy text
    (the engine's FLOAT greedy; the forwards on plain-attention models of the same file)."""
    from specdec_inductor.engine.gguf_model import load_gguf
    generator, tokenizer = load_model(args.model, torch.float32, quant_activation=QuantActivation.FLOAT)
    engine = Engine(generator, max_batch=1, max_len=args.max_len, compile=False)
    models = {act: load_gguf(model_file(args.model), activation=act)[0]
              for act in (QuantActivation.FLOAT, QuantActivation.INT8)}
    for kind in args.prompts.split(","):
        ids = encode(tokenizer, PROMPTS[kind], chat=True)
        text = torch.tensor([ids + engine.generate([ids], args.max_new_tokens)[0]])
        with torch.no_grad():
            f, i = (models[act](text).logits[0, len(ids) - 1:-1] for act in models)  # [T, V] each
        agree = (f.argmax(-1) == i.argmax(-1)).float().mean().item()
        rel = ((f - i).abs().amax(-1) / f.abs().amax(-1)).median().item()
        print(f"{kind}: {f.shape[0]} generated positions, INT8 top-1 == FLOAT's at {agree:.3f}; "
              f"median max|logit difference| / max|logit| {rel:.4f}", flush=True)
    return 0


def profile_decode(engine, ids, new_tokens: int, rows: int = 25) -> int:
    """Profile our AR decoding new_tokens (prefill included: one chunk against many steps):
    self time by op, and the share of the specdec quantized-linear ops in it."""
    from torch.profiler import ProfilerActivity, profile
    engine.generate([ids], new_tokens)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        engine.generate([ids], new_tokens)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=rows))
    total = sum(e.self_cpu_time_total for e in events)
    quant = sum(e.self_cpu_time_total for e in events if e.key.startswith("specdec::quant_linear"))
    print(f"# {new_tokens} tokens in {wall * 1e3:.0f} ms under the profiler; quantized linears "
          f"{100 * quant / total:.0f}% of the self time ({quant / 1e3 / new_tokens:.2f} ms a "
          f"token), the rest {(total - quant) / 1e3 / new_tokens:.2f} ms a token")
    return 0


def step_costs(args, engine, sizes=(1, 2, 3, 4, 6, 8), context: int = 200) -> int:
    """Median step-program seconds by verify size (sizes take turns), as ratios to a decode
    step; with --draft-model the draft's decode step against the target's."""
    from specdec_inductor.speculative.commit import GreedyStep
    from specdec_inductor.speculative.stats import step_times

    def times(e, batch=1):
        return step_times(e, list(sizes), context=context, rounds=15, batch_size=batch,
                          program=GreedyStep.of(e, 1))

    print(f"# step programs over a {context}-token context, medians of 15 rounds")
    print("| model | batch | " + " | ".join(f"N={z}" for z in sizes) + " |")
    print("|---|---|" + "---|" * len(sizes))
    target = {}  # batch -> seconds by size
    for batch in args.batches:
        t = target[batch] = times(engine, batch)
        print(f"| target (ms) | {batch} | " + " | ".join(f"{t[z] * 1e3:.2f}" for z in sizes) + " |")
        print(f"| target / decode | {batch} | "
              + " | ".join(f"{t[z] / t[1]:.2f}x" for z in sizes) + " |")
    if args.draft_model and 1 not in target:  # the draft runs at batch 1: against the same
        target[1] = times(engine, 1)
    for vd in args.draft_vocabs if args.draft_model else []:
        draft, _ = load_model(args.draft_model, torch.float32, dequantize=args.dequantize,
                              quant_activation=args.act, hugepages=not args.no_hugepages)
        if vd is not None:
            apply_draft_vocab(draft, vd)
        d = times(Engine(draft, max_batch=1, max_len=args.max_len, compile=not args.eager))
        print(f"| draft Vd={vd or 'full'} (ms) | 1 | "
              + " | ".join(f"{d[z] * 1e3:.2f}" for z in sizes) + " |")
        print(f"# draft (Vd={vd or 'full'}) decode step / target decode step: "
              f"{d[1] / target[1][1]:.3f}")
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model name or .gguf (default: SmolLM2-135M Q4_1)")
    p.add_argument("--draft-model", default=None, help="standalone draft: model name or .gguf")
    p.add_argument("--methods", default="ngram",
                   help="comma list of ngram, standalone, standalone+lookup, eagle3")
    p.add_argument("--draft-vocab", default="full", metavar="VD[,VD...]",
                   help="standalone methods and --step-costs: the draft's LM head keeps its VD "
                        "most frequent ids (proposers/draft_vocab.py); full: the whole head; "
                        "several: one draft each, measured in turns")
    p.add_argument("--draft-stop-below", default="0", metavar="P[,P...]",
                   help="standalone methods: chains end at a draft of probability below P and "
                        "are verified at their own size (0: full chains); several: each in "
                        "turns, over the same draft")
    p.add_argument("--eagle3-head", default=None, help="EAGLE-3 head (default: the shipped one)")
    p.add_argument("--prompts", default=",".join(PROMPTS), help="comma list of prompt kinds")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--num-draft-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--eager", action="store_true")
    p.add_argument("--dequantize", action="store_true",
                   help="ours on the fp32-dequantized weights instead of the quantized blocks")
    p.add_argument("--no-hugepages", action="store_true",
                   help="the target's weights in ordinary pages (engine/hugepages.py)")
    p.add_argument("--quant-activations", choices=["float", "int8"], default="float",
                   help="our quantized layers' activations (ops.quant.QuantActivation)")
    p.add_argument("--llamacpp-bin", default=None, help="llama.cpp bin dir (default: build it)")
    p.add_argument("--no-llamacpp", action="store_true")
    p.add_argument("--llamacpp-args", default="",
                   help=f"more arguments for every llama.cpp run, {LLAMACPP_ARGS_EXAMPLE}")
    p.add_argument("--min-accepted", type=float, default=None, metavar="A",
                   help="the acceptance gate's threshold for every method (0: always draft; "
                        "default: calibrated from the measured step costs)")
    p.add_argument("--compare-rows", action="store_true",
                   help="check that each verify row's logits equal the decode step's bit for bit "
                        "(one extra AR and speculative run per prompt, untimed)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="only profile our AR decoding N tokens of the first prompt (no timing)")
    p.add_argument("--step-costs", action="store_true",
                   help="only time the step programs by verify size (and the draft's decode)")
    p.add_argument("--batches", default="1", metavar="B[,B...]",
                   help="--step-costs: the batch sizes whose step programs are timed")
    p.add_argument("--int8-agreement", action="store_true",
                   help="only compare INT8 activations' logits with FLOAT's (no timing)")
    args = p.parse_args()
    if args.int8_agreement:
        return int8_agreement(args)
    for name in args.prompts.split(","):
        if name not in PROMPTS:
            raise SystemExit(f"--prompts: unknown prompt {name!r} ({', '.join(PROMPTS)})")
    if args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    threads = torch.get_num_threads()
    target_file = model_file(args.model)
    args.act = QuantActivation[args.quant_activations.upper()]
    args.draft_vocabs = draft_vocabs(args.draft_vocab)
    try:
        args.draft_stops = [float(v) for v in args.draft_stop_below.split(",")]
    except ValueError:
        raise SystemExit(f"--draft-stop-below: a comma list of probabilities, got "
                         f"{args.draft_stop_below!r}") from None
    draft_file = model_file(args.draft_model) if args.draft_model else None
    try:
        args.batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise SystemExit(f"--batches: a comma list of batch sizes, got {args.batches!r}") from None
    if min(args.batches) < 1:
        raise SystemExit(f"--batches must be >= 1, got {args.batches}")

    rss0, parts0 = rss_bytes(), rss_parts(os.path.realpath(target_file))
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.model, torch.float32, dequantize=args.dequantize,
                                  quant_activation=args.act, hugepages=not args.no_hugepages)
    load_s = time.perf_counter() - t0
    engine = Engine(model, max_batch=max(args.batches), max_len=args.max_len,
                    compile=not args.eager, prefill_chunk=64)
    first = encode(tokenizer, PROMPTS[args.prompts.split(",")[0]], chat=True)
    t1 = time.perf_counter()
    engine.generate([first], 1)
    first_token_s = time.perf_counter() - t0
    rss = rss_bytes() - rss0  # the target and its engine only (before any draft is loaded)
    parts = {k: v - parts0[k] for k, v in rss_parts(os.path.realpath(target_file)).items()}
    print(f"# target {args.model or 'smollm2-135m'} ({os.path.getsize(target_file) / 1e6:.0f} MB "
          f"GGUF{', dequantized to fp32' if args.dequantize else ''}, activations "
          f"{getattr(model, 'quant_activation', None)}); {threads} threads, ISA "
          f"{specdec_inductor.active_isa()}, torch {torch.__version__}; {args.max_new_tokens} new "
          f"tokens, greedy, eos ignored; medians of {args.repeats}")
    print(f"# weights in huge pages: {getattr(model, 'hugepage_bytes', 0) / 1e6:.0f} MB")
    print(f"# load {load_s:.1f} s; first token {first_token_s:.1f} s after the load started "
          f"(compile + prefill {time.perf_counter() - t1:.1f} s)")
    kv = engine.pool.nbytes()
    print(f"# resident memory added by the target, its engine and a first token: {rss / 1e6:.0f} MB"
          f" = {rss / (os.path.getsize(target_file) + kv):.2f}x (file + KV pool {kv / 1e6:.0f} MB);"
          f" peak RSS of the process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3:.0f} MB")
    # The file-backed part is library code (torch's, the compiled kernels') as it faults in and
    # the GGUF's own mapped pages; the anonymous part holds the weights the loader placed.
    print(f"#   of which anonymous {parts['anon'] / 1e6:.0f} MB (placed weights, KV pool, heap) = "
          f"{parts['anon'] / (os.path.getsize(target_file) + kv):.2f}x file + KV pool; "
          f"file-backed {parts['file'] / 1e6:.0f} MB, of it the GGUF's mapped pages "
          f"{parts['gguf'] / 1e6:.0f} MB")
    if args.profile:
        return profile_decode(engine, first, args.profile)
    if args.step_costs:
        return step_costs(args, engine)
    methods = build_methods(args, model, engine)
    for spec in methods.values():
        # Every verify size's program compiled (and the acceptance gate's costs measured) before
        # any timed run: a size a warm-up generate never reached would otherwise compile inside
        # the first timed one.
        spec.compile_verify(sampled=False)
        if args.min_accepted is not None:  # by hand: the gate's cost-based threshold unused
            spec.min_accepted = args.min_accepted
    recorders = {} if args.compare_rows else None

    bindir = None if args.no_llamacpp else llamacpp_bin(args.llamacpp_bin)
    print("| prompt | engine | tok/s | vs our AR | vs llama.cpp plain | accepted | tokens == our AR |")
    print("|---|---|---|---|---|---|---|")
    ratios = {}  # label -> [(vs our AR, vs llama.cpp plain)]
    for kind in args.prompts.split(","):
        ids = encode(tokenizer, PROMPTS[kind], chat=True)
        text = tokenizer.decode(ids)
        engine.generate([ids], 2)
        for spec in methods.values():
            spec.generate([ids], spec.proposer.num_draft_tokens + 2)
        if recorders is not None:
            compare_rows(recorders, engine, methods, kind, ids, args.max_new_tokens)
        rates = {}  # label -> [tok/s]
        accepted, same = {}, {}
        for _ in range(args.repeats):
            st = GenerationStats()
            ar = engine.generate([ids], args.max_new_tokens, None, st)
            rates.setdefault("ours AR", []).append(st.decode_tokens_per_s)
            for label, spec in methods.items():
                ss = SpeculativeStats()
                out = spec.generate([ids], args.max_new_tokens, None, ss)
                rates.setdefault(f"ours {label}", []).append(ss.tokens_per_s)
                accepted[f"ours {label}"] = f"{ss.mean_accepted_length:.2f} tok/step"
                same[f"ours {label}"] = "yes" if out == ar else "NO"
            if bindir:
                for label, (rate, acc) in llamacpp_runs(bindir, target_file, draft_file, text,
                                                        args.max_new_tokens, threads,
                                                        args.num_draft_tokens,
                                                        shlex.split(args.llamacpp_args)).items():
                    rates.setdefault(label, []).append(rate)
                    if acc is not None:
                        accepted[label] = f"{100 * acc:.0f}% of drafts"
        med = {label: statistics.median(v) for label, v in rates.items()}
        ar_rate, ll = med["ours AR"], med.get("llama.cpp plain")
        for label, rate in med.items():
            vs_ll = f"{rate / ll:.2f}x" if ll else "-"
            vs_ar = f"{rate / ar_rate:.2f}x" if label.startswith("ours") else "-"
            print(f"| {kind} | {label} | {rate:.1f} | {vs_ar} | {vs_ll} | "
                  f"{accepted.get(label, '-')} | {same.get(label, '-')} |", flush=True)
            ratios.setdefault(label, []).append((rate / ar_rate, rate / ll if ll else None))
    for label, values in ratios.items():
        vs_ar = statistics.median(v[0] for v in values)
        vs_ll = [v[1] for v in values if v[1] is not None]
        print(f"# median over {len(values)} prompts, {label}: {vs_ar:.2f}x our AR"
              + (f", {statistics.median(vs_ll):.2f}x llama.cpp plain" if vs_ll else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
