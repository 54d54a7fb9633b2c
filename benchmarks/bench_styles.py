"""Speculative decoding vs our own compiled autoregressive decoding, per prompt style, on the
style-held-out evaluation set (specdec_inductor/train/styles.py: code, structured output,
rewriting, short factual answers, multi-turn chat, math word problems; no template, topic or
code task of the training corpus). SmolLM2-135M fp32 (or its GGUF blocks kept quantized:
--quantized), batch 1, greedy, stop at eos, compiled.

Per prompt and method: speedup over our AR (medians of --repeats runs, AR and every method
taking turns within each repeat), mean accepted length and whether the tokens equal AR's; then
medians per style and overall, and each method's worst prompt.

    python benchmarks/bench_styles.py                              # EAGLE-3 (shipped head), NGRAM
    python benchmarks/bench_styles.py --styles short,chat --repeats 5
    python benchmarks/bench_styles.py --eagle3-heads A,B --per-style 3 --old-heldout 4
    python benchmarks/bench_styles.py --start-policy none,0,4      # StartPolicy, 0 / 4 plain steps
    python benchmarks/bench_styles.py --admission-costs            # what admitting a request costs
    python benchmarks/bench_styles.py --quantized int8             # the Q4_1 file, INT8 activations
    python benchmarks/bench_styles.py --acceptance --eagle3-heads A,B   # accepted length only
    python benchmarks/bench_styles.py --acceptance --eagle-heads shipped,C  # EAGLE heads too
"""
import argparse
import re
import statistics
import time
from dataclasses import replace

import torch

import specdec_inductor
from specdec_inductor.engine.engine import Engine, GenerationStats
from specdec_inductor.loading import load_model
from specdec_inductor.ops.quant import QuantActivation
from specdec_inductor.proposers.registry import (ProposerConfig, make_proposer,
                                                 make_target_engine, target_capture)
from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats
from specdec_inductor.train.corpus import heldout_prompts
from specdec_inductor.train.styles import STYLES, StylePrompt, encode_prompt, eval_prompts


def start_rule(spec: str) -> dict:
    """--start-policy's "K[/M/B]" as StartPolicy keyword arguments (plain steps, probe misses,
    backoff steps)."""
    names = ("plain_steps", "probe_misses", "backoff_steps")
    return dict(zip(names, (int(x) for x in spec.split("/"))))


def head_list(args) -> list:
    """[(method, head directory or None for the shipped head, its draft_dtype)]: --eagle3-heads,
    then --eagle-heads ("HEAD@fp32": that head's weights in fp32); the shipped EAGLE-3 head when
    neither is given."""
    heads = []
    for method, names in (("eagle3", args.eagle3_heads), ("eagle", args.eagle_heads)):
        for spec in (names or "").split(","):
            if spec:
                head, _, dtype = spec.partition("@")
                heads.append((method, None if head == "shipped" else head, dtype or "auto"))
    return heads or [("eagle3", None, "auto")]


def head_config(args, method: str, head, dtype: str) -> ProposerConfig:
    return ProposerConfig(method=method, num_draft_tokens=args.num_draft_tokens, draft_model=head,
                          draft_dtype=dtype)


METHOD_NAMES = {"eagle3": "EAGLE-3", "eagle": "EAGLE"}


def head_label(method: str, head, dtype: str, i: int) -> str:
    return (METHOD_NAMES[method] + ("" if head is None else f" head {i} ({head})")
            + ("" if dtype == "auto" else f" {dtype}"))


def target_engine(engines: dict, config: ProposerConfig, model, **kwargs) -> Engine:
    """The target Engine capturing what config's head reads: one per distinct capture, shared
    by the heads that read the same layers (made only for a capture not seen yet)."""
    key = tuple(target_capture(config, model) or ())
    if key not in engines:
        engines[key] = make_target_engine(config, model, max_batch=1, **kwargs)
    return engines[key]


def make_methods(args, model):
    """label -> SpeculativeGenerator."""
    methods, engines = {}, {}
    first_config = None
    for i, (method, head, dtype) in enumerate(head_list(args)):
        config = head_config(args, method, head, dtype)
        first_config = first_config or config
        engine = target_engine(engines, config, model, max_len=args.max_len, prefill_chunk=64)
        name = head_label(method, head, dtype, i)
        starts = args.start_policy.split(",")
        if i > 0 and len(starts) > 1:  # later heads: against the first head's policies only
            starts = [x for x in starts if x != "none"]
        variants = [(name, config)]
        if args.lookup:
            variants += [(f"{name} + lookup {m}", replace(config, lookup=True))
                         for m in args.lookup.split(",")]
        for start in starts:
            for label, cfg in variants:
                proposer = make_proposer(cfg, engine)
                fixed = outside = False
                if cfg.lookup:  # "M[/G[/P[/S]]][+gate][+graftK][+hostgraft][-propose]":
                    # min_match M, the model's per-request gate's least threshold G ("=G": that
                    # threshold, not priced from costs), its first rest P and the model drafts S
                    # it judges from, the loop's batch acceptance gate on top, at most K lookup
                    # nodes grafted into the model's tree, graft steps drafted before the step
                    # program, the model's drafts never inside the step program
                    spec, *flags = re.split(r"(?=[+-][a-z])", label.rsplit(" ", 1)[1])
                    unknown = set(flags) - {"+gate", "-propose", "+hostgraft"} - {
                        f for f in flags if re.fullmatch(r"\+graft\d+", f)}
                    if unknown:
                        raise SystemExit(f"--lookup {label}: unknown {sorted(unknown)}")
                    outside = "-propose" in flags
                    proposer.mixed_in_program = "+hostgraft" not in flags
                    proposer.gates_own_drafts = "+gate" not in flags
                    for f in flags:
                        if f.startswith("+graft"):
                            proposer.graft = int(f[len("+graft"):])
                    match, *gate = spec.split("/")
                    proposer.min_match = int(match)
                    if gate:
                        fixed = gate[0].startswith("=")
                        proposer.model_min_accepted = float(gate[0].lstrip("="))
                    if len(gate) > 1:
                        proposer.probe_every = int(gate[1])
                    if len(gate) > 2:
                        proposer.min_steps = int(gate[2])
                if start == "none":
                    methods[label] = SpeculativeGenerator(engine, proposer)
                    methods[label].draft_in_program = not outside
                    if fixed:
                        proposer.costs = None  # the threshold as given
                    continue
                methods[f"{label} + start {start}"] = SpeculativeGenerator(
                    engine, proposer, start_policy=start_rule(start))
    if args.floor:
        # What the loop costs without drafts: plain decoding through it, and EAGLE-3 that never
        # drafts (its target captures the head's layers; its proposer is started and committed).
        plain = engines.get(None) or Engine(model, max_batch=1, max_len=args.max_len,
                                            prefill_chunk=64)
        methods["loop, no proposer"] = SpeculativeGenerator(plain, None)
        first = next(s for s in methods.values() if s.proposer is not None)
        methods[f"{METHOD_NAMES[first_config.method]} never drafting"] = SpeculativeGenerator(
            first.engine, make_proposer(first_config, first.engine),
            start_policy=dict(plain_steps=10 ** 9))
    if not args.no_ngram:
        config = ProposerConfig(method="ngram", num_draft_tokens=args.num_draft_tokens)
        engine = engines.get(None) or Engine(model, max_batch=1, max_len=args.max_len,
                                             prefill_chunk=64)
        methods["NGRAM"] = SpeculativeGenerator(engine, make_proposer(config, engine))
    return methods


def admission_costs(args, model, tokenizer, prompts, rounds=8):
    """Seconds of admitting a request to EAGLE-3 (prefill, the proposer's start, its first
    propose: the catch-up over the prompt plus one draft) against a plain decode step and a
    later propose (median of `rounds`), per prompt length."""
    config = ProposerConfig(method="eagle3", num_draft_tokens=args.num_draft_tokens)
    engine = make_target_engine(config, model, max_batch=1, max_len=args.max_len, prefill_chunk=64)
    spec = SpeculativeGenerator(engine, make_proposer(config, engine), min_accepted=0.0)
    print("| prompt | prompt tokens | prefill / decode | start / decode | first propose / decode "
          "| later propose / decode |")
    print("|---|---|---|---|---|---|")
    for p in prompts:
        ids = encode_prompt(tokenizer, p)
        spec.generate([ids], 8)  # compile
        parts = {k: [] for k in ("prefill", "start", "first", "later", "decode")}
        for _ in range(rounds):
            _time_admission(spec, ids, parts)
        med = {k: statistics.median(v) for k, v in parts.items()}
        print(f"| {p.name} | {len(ids)} | {med['prefill'] / med['decode']:.2f} | "
              f"{med['start'] / med['decode']:.2f} | {med['first'] / med['decode']:.2f} | "
              f"{med['later'] / med['decode']:.2f} |", flush=True)


@torch.inference_mode()
def _time_admission(spec, ids, parts):
    """One admission's parts timed separately (the loop's admit, unrolled)."""
    engine, proposer = spec.engine, spec.proposer
    with spec.batch(1) as batch:
        (req,) = engine.pool.admit([len(ids)], 64 + spec.num_draft_tokens)
        try:
            rows = torch.tensor([req.row] + [engine.pool.padding_row] * (batch.bucket - 1))
            t0 = time.perf_counter()
            first = engine.prefill([ids], rows)
            t1 = time.perf_counter()
            proposer.start([req.row], [ids + [int(first.argmax[0])]], [first.hidden[0, :len(ids)]])
            t2 = time.perf_counter()
            seq = torch.tensor([len(ids)])
            proposer.propose([req.row], seq)
            t3 = time.perf_counter()
            proposer.commit([req.row], [[int(first.argmax[0])]],
                            [first.hidden[0, len(ids) - 1:len(ids)]])
            t4 = time.perf_counter()
            proposer.propose([req.row], seq + 1)
            t5 = time.perf_counter()
            roots = torch.tensor([int(first.argmax[0])] + [0] * (batch.bucket - 1))
            lens = torch.tensor([len(ids)] + [1] * (batch.bucket - 1))
            engine.decode(roots, rows, lens)
            t6 = time.perf_counter()
        finally:
            proposer.finish([req.row])
            engine.pool.release(req)
    for k, v in (("prefill", t1 - t0), ("start", t2 - t1), ("first", t3 - t2),
                 ("later", t5 - t4), ("decode", t6 - t5)):
        parts[k].append(v)


def _mean_accepted(steps: int, accepted: int) -> float:
    """SpeculativeStats.mean_accepted_length of summed request steps and accepted drafts."""
    return 1.0 + accepted / steps if steps else float("nan")


@torch.inference_mode()
def acceptance(args, model, tokenizer, prompts):
    """Mean accepted length per prompt, style and head with every step drafting (no acceptance
    gate, min_accepted 0), eager: what the head drafts, whatever a step costs. Tokens are
    checked against plain greedy decoding on every prompt."""
    heads = head_list(args)
    eos = tokenizer.eos_token_id
    engines, plain = {}, {}
    per = {}  # (style, head index) -> [request steps, accepted drafts]
    print("| style | prompt | head | mean accepted length | acceptance by position "
          "| tokens == AR |")
    print("|---|---|---|---|---|---|")
    for i, (method, head, dtype) in enumerate(heads):
        config = head_config(args, method, head, dtype)
        engine = target_engine(engines, config, model, max_len=args.max_len, prefill_chunk=64,
                               compile=False)
        spec = SpeculativeGenerator(engine, make_proposer(config, engine), min_accepted=0.0)
        for p in prompts:
            ids = encode_prompt(tokenizer, p)
            if p.name not in plain:
                plain[p.name] = engine.generate([ids], args.max_new_tokens, eos)
            stats = SpeculativeStats()
            out = spec.generate([ids], args.max_new_tokens, eos, stats)
            total = per.setdefault((p.style, i), [0, 0])
            total[0] += stats.request_steps
            total[1] += stats.accepted_drafts
            acc = " ".join(f"{a:.2f}" for a in stats.acceptance_by_position)
            print(f"| {p.style} | {p.name} | {i} | {stats.mean_accepted_length:.2f} | {acc} | "
                  f"{'yes' if out == plain[p.name] else 'NO'} |", flush=True)
    print("\n| style | " + " | ".join(head_label(m, h, d, i) for i, (m, h, d) in enumerate(heads))
          + " |")
    print("|---|" + "---|" * len(heads))
    styles = list(dict.fromkeys(p.style for p in prompts))
    for style in styles:
        print(f"| {style} | " + " | ".join(f"{_mean_accepted(*per[(style, i)]):.2f}"
                                            for i in range(len(heads))) + " |")
    held = [s for s in styles if s in STYLES]  # the style-held-out set, without corpus-heldout
    print("| all styles | " + " | ".join(
        f"{_mean_accepted(*[sum(per[(s, i)][k] for s in held) for k in (0, 1)]):.2f}"
        for i in range(len(heads))) + " |")


def run_prompt(args, engine, methods, tokenizer, prompt: StylePrompt):
    """{label: (speedup, mean accepted length, tokens == AR, new tokens)} of one prompt."""
    ids = encode_prompt(tokenizer, prompt)
    eos = tokenizer.eos_token_id
    engine.generate([ids], 2)
    for spec in methods.values():
        spec.generate([ids], spec.num_draft_tokens + 2, eos)
    ar_r, sp_r, runs = [], {label: [] for label in methods}, {}
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        ar = engine.generate([ids], args.max_new_tokens, eos, GenerationStats())
        ar_r.append(time.perf_counter() - t0)
        for label, spec in methods.items():
            stats = SpeculativeStats()
            t0 = time.perf_counter()
            out = spec.generate([ids], args.max_new_tokens, eos, stats)
            sp_r[label].append(time.perf_counter() - t0)
            runs[label] = (out, stats)
    for label, spec in methods.items():
        counts = getattr(spec.proposer, "drafts", None)
        if counts:
            done = spec.proposer.accepted
            print(f"#   {prompt.name} {label}: " + ", ".join(
                f"{k} drafted {n} request-steps ({done[k] / max(1, n):.2f} accepted each)"
                for k, n in counts.items()) + f"; model gate threshold "
                f"{spec.proposer.threshold():.2f}")
            for k in counts:
                counts[k] = done[k] = 0
    ar_s = statistics.median(ar_r)  # the same tokens: time ratios are rate ratios
    return {label: (ar_s / statistics.median(sp_r[label]), runs[label][1].mean_accepted_length,
                    runs[label][0] == ar, len(ar[0])) for label in methods}


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--styles", default=",".join(STYLES))
    parser.add_argument("--per-style", type=int, default=None,
                        help="only the first K prompts of each style")
    parser.add_argument("--old-heldout", type=int, default=0,
                        help="also bench the first K held-out prompts of train/corpus.py "
                             "(style 'corpus-heldout')")
    parser.add_argument("--num-draft-tokens", type=int, default=8,
                        help="N (EAGLE-3 uses the CLI's tree topk 3 depth 4 at N=8)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eagle3-heads", default=None,
                        help="comma list of EAGLE-3 head directories ('shipped': the shipped "
                             "head; default: the shipped head unless --eagle-heads is given); "
                             "heads after the first run only --start-policy's numbers")
    parser.add_argument("--eagle-heads", default=None,
                        help="comma list of EAGLE head directories ('shipped': the shipped "
                             "head; HEAD@fp32: its weights in fp32, not the default auto), after "
                             "the --eagle3-heads")
    parser.add_argument("--start-policy", default="none,0",
                        help="comma list of none (the loop's own policy) or K[/M/B]: the "
                             "loop's policy behind a StartPolicy with K plain steps, probes of "
                             "verify size 2, backoff after M missed probes starting at B steps "
                             "(default M=2, B=4) (default: none,0)")
    parser.add_argument("--prompts", default=None, help="comma list of prompt names only")
    parser.add_argument("--no-ngram", action="store_true")
    parser.add_argument("--lookup", default=None,
                        help="comma list of M[/G[/P[/S]]][+gate][+graftK][+hostgraft][-propose]: "
                             "also EAGLE-3 with prompt lookup first (ProposerConfig.lookup) at "
                             "minimum match length M (and G: the least accepted drafts a step "
                             "below which a request's model drafts rest, default "
                             "lookup_first.MODEL_MIN_ACCEPTED, raised to the break-even of the "
                             "measured costs; =G: G alone; P: their first rest in steps, default "
                             "lookup_first.PROBE_EVERY; S: the model drafts it judges from, "
                             "default lookup_first.MIN_STEPS; +gate: the loop's batch acceptance "
                             "gate on top of the per-request one; +graftK: at most K of the "
                             "lookup's nodes grafted into the model's tree where a short match "
                             "leaves neither source ahead (default lookup_first.GRAFT, +graft0: "
                             "never); +hostgraft: graft steps (and at batch > 1 steps mixing "
                             "sources) draft before the step program, not inside it; -propose: "
                             "the model's drafts never inside the step program)")
    parser.add_argument("--floor", action="store_true",
                        help="also time the loop without drafts: plain decoding through it and "
                             "EAGLE-3 that never drafts (what a policy cannot save)")
    parser.add_argument("--quantized", choices=["float", "int8"], default=None,
                        help="the target as its GGUF file's quantized blocks, with float or "
                             "INT8 activations (default: dequantized to fp32)")
    parser.add_argument("--acceptance", action="store_true",
                        help="only the mean accepted length of each head (--eagle3-heads, "
                             "--eagle-heads) per prompt and style, every step drafting (no gate), "
                             "eager")
    parser.add_argument("--admission-costs", action="store_true",
                        help="only time what admitting a request to EAGLE-3 costs, per prompt")
    args = parser.parse_args()
    prompts = eval_prompts(args.styles.split(","))
    if args.prompts is not None:
        prompts = [p for p in prompts if p.name in args.prompts.split(",")]
    if args.per_style is not None:
        prompts = [p for p in prompts
                   if [q.name for q in prompts if q.style == p.style].index(p.name) < args.per_style]
    prompts += [StylePrompt("corpus-heldout", f"heldout-{i}", t)
                for i, t in enumerate(heldout_prompts()[:args.old_heldout])]
    if args.quantized is None:
        model, tokenizer = load_model(None, torch.float32, dequantize=True)
        weights = "fp32"
    else:
        act = QuantActivation[args.quantized.upper()]
        model, tokenizer = load_model(None, torch.float32, dequantize=False, quant_activation=act)
        weights = f"GGUF blocks kept quantized, {args.quantized} activations"
    how = ("eager, every step drafting" if args.acceptance
           else f"compiled; medians of {args.repeats}")
    print(f"# SmolLM2-135M {weights}, batch 1, greedy, <= {args.max_new_tokens} new tokens "
          f"stopping at eos, {how}; {torch.get_num_threads()} threads, ISA "
          f"{specdec_inductor.active_isa()}, torch {torch.__version__}")
    if args.admission_costs:
        admission_costs(args, model, tokenizer, prompts)
        return
    if args.acceptance:
        acceptance(args, model, tokenizer, prompts)
        return
    engine = Engine(model, max_batch=1, max_len=args.max_len, prefill_chunk=64)
    methods = make_methods(args, model)
    for spec in methods.values():
        spec.compile_verify()  # also measures the costs the policies weigh drafts against
    # Untimed, the first prompt of each style at full length: every path a method's steps take
    # (a model drafting inside the step program or before it, a lookup's drafts) compiles
    # here, not inside the timed runs of whichever prompt first takes it (run_prompt's own
    # warm-up is a few tokens).
    for p in {q.style: q for q in reversed(prompts)}.values():
        ids = encode_prompt(tokenizer, p)
        engine.generate([ids], args.max_new_tokens)
        for spec in methods.values():
            spec.generate([ids], args.max_new_tokens, tokenizer.eos_token_id)
    print("| style | prompt | new tokens | method | speedup vs our AR | mean accepted length "
          "| tokens == AR |")
    print("|---|---|---|---|---|---|---|")
    results = {}  # (style, label) -> [speedup]
    lengths = {}  # (style, label) -> [mean accepted length]
    worst = {}  # label -> (speedup, prompt)
    for p in prompts:
        for label, (speedup, accepted, same, new) in run_prompt(
                args, engine, methods, tokenizer, p).items():
            print(f"| {p.style} | {p.name} | {new} | {label} | {speedup:.2f}x | {accepted:.2f} | "
                  f"{'yes' if same else 'NO'} |", flush=True)
            results.setdefault((p.style, label), []).append(speedup)
            lengths.setdefault((p.style, label), []).append(accepted)
            worst[label] = min(worst.get(label, (float("inf"), "")), (speedup, p.name))
    print("\n| style | " + " | ".join(methods) + " |")
    print("|---|" + "---|" * len(methods))
    styles = list(dict.fromkeys(p.style for p in prompts))
    for style in styles:
        cells = [f"{statistics.median(results[(style, m)]):.2f}x" for m in methods]
        print(f"| {style} | " + " | ".join(cells) + " |")
    held = [s for s in styles if s in STYLES]  # the style-held-out set, without corpus-heldout
    if held:  # none with --per-style 0 (the corpus's held-out prompts alone)
        overall = [f"{statistics.median([v for s in held for v in results[(s, m)]]):.2f}x"
                   for m in methods]
        print("| all styles | " + " | ".join(overall) + " |")
        per_prompt = {m: [v for s in held for v in lengths[(s, m)]] for m in methods}
        print("| accepted length, mean (median) | " + " | ".join(
            f"{statistics.mean(per_prompt[m]):.2f} ({statistics.median(per_prompt[m]):.2f})"
            for m in methods) + " |")
    print("| worst prompt | " + " | ".join(f"{worst[m][0]:.2f}x ({worst[m][1]})" for m in methods)
          + " |")


if __name__ == "__main__":
    main()
