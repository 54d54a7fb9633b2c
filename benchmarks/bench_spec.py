"""Speculative decoding vs our own compiled autoregressive decoding on SmolLM2-135M (or --model
DIR), batch 1, greedy and sampled (--temperatures, default 0 and 0.7): per prompt kind
(code-like, chat), temperature and method prints tokens/s, speedup over our AR at the same
temperature, mean accepted length, per-position acceptance and (greedy) whether the tokens are
identical.
Sampled AR runs through the same loop with no drafts (proposers/autoregressive.py).

    python benchmarks/bench_spec.py                    # NGRAM N=8, STANDALONE, 128 new tokens
    python benchmarks/bench_spec.py --eager --max-new-tokens 32 --temperatures 0.7
    python benchmarks/bench_spec.py --methods ngram --dtype bf16
    python benchmarks/bench_spec.py --model DIR --methods ngram,mtp   # DIR with NextN layers
    python benchmarks/bench_spec.py --methods eagle3 --eagle3-head DIR   # random head if absent
    python benchmarks/bench_spec.py --methods standalone --topk 2 --depth 4 --num-draft-tokens 8
    python benchmarks/bench_spec.py --methods eagle3 --eagle3-head DIR --trees 8/3/4,6/3/3
"""
import argparse
import statistics
import tempfile
import time

import torch

import specdec_inductor
from specdec_inductor.engine.engine import Engine, GenerationStats
from specdec_inductor.loading import load_model
from specdec_inductor.loading import DTYPES, encode
from specdec_inductor.proposers.autoregressive import AutoregressiveProposer
from specdec_inductor.proposers.ngram import RECOMMENDED_WINDOW, parse_window
from specdec_inductor.proposers.registry import (ProposerConfig, ProposerConfigError,
                                                 load_standalone_draft, make_proposer,
                                                 target_capture)
from specdec_inductor.proposers.tree_draft import check_tree_shape
from specdec_inductor.sampler import SamplingParams
from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats, step_times
from specdec_inductor.testing import write_random_eagle3_checkpoint, write_random_eagle_checkpoint

PROMPTS = {
    "code": ("def bubble_sort(items):\n    n = len(items)\n    for i in range(n):\n"
             "        for j in range(0, n - i - 1):\n            if items[j] > items[j + 1]:\n"
             "                items[j], items[j + 1] = items[j + 1], items[j]\n    return items\n\n"
             "Rewrite the function above with the variable name `values` instead of `items`."),
    "chat": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
}


def print_verify_costs(engine, sizes, context=256, rounds=30):
    """Median time of a verify of each tree size (a star tree over a `context`-token prefix)
    against a plain decode step, the sizes taking turns within every round."""
    times = step_times(engine, sizes, context=context, rounds=rounds)
    print(f"# verify cost by tree size, {context}-token context, medians of {rounds} interleaved rounds")
    print("| tree size | ms | vs plain decode |")
    print("|---|---|---|")
    for z in sizes:
        print(f"| {z} | {1e3 * times[z]:.2f} | {times[z] / times[1]:.2f}x |")


def parse_trees(text):
    """[(N, topk, depth)] of --trees' comma list of N/TOPK/DEPTH."""
    shapes = []
    for item in text.split(","):
        parts = item.split("/")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise SystemExit(f"--trees: {item!r} is not N/TOPK/DEPTH (e.g. 8/3/4)")
        n, topk, depth = (int(p) for p in parts)
        try:
            check_tree_shape(n, topk, depth)
        except ValueError as exc:
            raise SystemExit(f"--trees: {item}: {exc}")
        if (n, topk, depth) in shapes:  # its label would replace the first one's results
            raise SystemExit(f"--trees: {item} is given twice")
        shapes.append((n, topk, depth))
    return shapes


def random_head(shared, key, write, config):
    """The directory of one random (seeded) head checkpoint that every shape of a method
    shares: written by `write` on the first call, kept in `shared[key]`."""
    if key not in shared:
        shared[key] = tempfile.mkdtemp(prefix=f"specdec_{key}_")
        write(shared[key], config, scale=0.02)
    return shared[key]


def method_config(name, args, n, topk, depth, shared, model):
    """The ProposerConfig of method `name` with tree shape (n, topk, depth) and the bench's
    flags; an EAGLE / EAGLE-3 head not given is a random (seeded) one, shared by every shape."""
    draft_model = None
    if name == "eagle":
        draft_model = args.eagle_head or random_head(shared, "eagle_path",
                                                     write_random_eagle_checkpoint, model.config)
    elif name == "eagle3":
        draft_model = args.eagle3_head or random_head(shared, "eagle3_path",
                                                      write_random_eagle3_checkpoint, model.config)
    breadth = tuple(int(b) for b in args.ngram_breadth.split(","))
    return ProposerConfig(
        method=name, num_draft_tokens=n, topk=topk if name != "ngram" else None,
        depth=depth if name != "ngram" else None, draft_model=draft_model,
        draft_layers=args.draft_layers if name == "standalone" else None,
        draft_dtype=args.draft_dtype, ngram_window=parse_window(args.ngram_window),
        ngram_breadth=breadth, target_model=args.model, dtype=args.dtype)


def method_label(name, config, proposer, args):
    topk, depth = config.tree_shape()
    shape = f" topk={topk} depth={depth}" if topk > 1 else ""
    n = config.num_draft_tokens
    if name == "ngram":
        lo, hi = config.ngram_window
        return f"NGRAM N={n} breadth {config.ngram_breadth} window {lo}-{hi}"
    if name == "standalone":
        return f"STANDALONE {args.draft_layers}L N={n}{shape}"
    if name == "eagle":
        return f"EAGLE{'' if args.eagle_head else ' (random head)'} N={n}{shape}"
    if name == "eagle3":
        dtype = str(proposer.engine.model.lm_head.weight.dtype)[6:]
        return (f"EAGLE-3{'' if args.eagle3_head else ' (random head)'} {dtype} head "
                f"N={n}{shape}")
    return f"MTP (NextN layer 0) N={n}{shape}"


def add_method(methods, name, args, model, engine, shared, n, topk, depth):
    """Put method `name` with tree shape (n, topk, depth) into `methods` (label -> its
    SpeculativeGenerator), its proposer from the registry. `shared` keeps what every shape of
    a method reuses: the STANDALONE draft model, the target Engines that capture what a
    method drafts from (the AR baseline's `engine` where it captures the same) and a random
    head's checkpoint, made by the method's first shape."""
    if name == "mtp" and args.model is None:
        print("# MTP skipped: the default SmolLM2 has no NextN layer; pass --model DIR "
              "with num_nextn_predict_layers in its config.json")
        return
    if name == "standalone" and topk == 1:
        n = min(n, 5)  # a chain of the cut target pays only while short
    try:
        config = method_config(name, args, n, topk, depth, shared, model)
    except ProposerConfigError as exc:
        raise SystemExit(f"--methods {name}: {exc}")
    draft = None
    if name == "standalone":
        if "draft" not in shared:
            shared["draft"] = load_standalone_draft(config)
        draft = shared["draft"]
    capture = target_capture(config, model)
    if capture != engine.capture_hidden and capture is not None:
        key = ("engine", tuple(capture))
        if key not in shared:  # the same weights, capturing what this method drafts from
            shared[key] = Engine(model, max_batch=1, max_len=engine.max_len,
                                 compile=not args.eager, prefill_chunk=engine.prefill_chunk,
                                 capture_hidden=capture)
        engine = shared[key]
    try:
        proposer = make_proposer(config, engine, draft=draft)
    except ProposerConfigError as exc:
        if name != "mtp":
            raise
        print(f"# MTP skipped: {exc}")
        return
    methods[method_label(name, config, proposer, args)] = SpeculativeGenerator(engine, proposer)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-draft-tokens", type=int, default=8)
    parser.add_argument("--topk", type=int, default=1,
                        help="standalone/eagle: branching of the draft tree (1: a chain)")
    parser.add_argument("--depth", type=int, default=None,
                        help="standalone/eagle: draft steps (default N-1, as a chain needs)")
    parser.add_argument("--trees", default=None,
                        help="comma list of N/TOPK/DEPTH tree shapes: each tree method runs once "
                             "per shape, all taking turns in the same repeats (overrides "
                             "--num-draft-tokens, --topk and --depth; NGRAM runs once, with the "
                             "first shape's N)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--stop-at-eos", action="store_true",
                        help="stop each generation at the tokenizer's eos, as `specdec generate` "
                             "does (default: always max-new-tokens, so a chat answer runs on past "
                             "its end); tok/s then counts the tokens each run produced")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--eager", action="store_true")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="target (and draft) weights; greedy equality is against our AR "
                             "in the same dtype")
    parser.add_argument("--temperatures", default="0,0.7", help="comma list; 0 = greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ngram-breadth", default="2,1",
                        help="NGRAM children kept per level, comma list (1: a chain)")
    parser.add_argument("--ngram-window", default=",".join(map(str, RECOMMENDED_WINDOW)),
                        help="NGRAM MIN,MAX suffix lengths matched (default %(default)s)")
    parser.add_argument("--methods", default="ngram,standalone",
                        help="comma list of ngram, standalone, eagle, eagle3, mtp (mtp: only with a "
                             "--model directory whose checkpoint carries NextN layers)")
    parser.add_argument("--model", default=None,
                        help="target model directory (default: SmolLM2-135M from the GGUF)")
    parser.add_argument("--eagle-head", default=None,
                        help="EAGLE checkpoint directory (default: a random head, which proves "
                             "correctness only: its drafts are almost never accepted)")
    parser.add_argument("--eagle3-head", default=None,
                        help="EAGLE-3 checkpoint directory (default: a random head, which proves "
                             "correctness only)")
    parser.add_argument("--draft-dtype", choices=["auto"] + sorted(DTYPES), default="auto",
                        help="EAGLE-3 head weights (auto: bf16 where the CPU has bf16 kernels, "
                             "else the target's dtype)")
    parser.add_argument("--draft-layers", type=int, default=8,
                        help="standalone draft: SmolLM2 cut to its first K layers (no smaller "
                             "model with its vocabulary is available offline)")
    parser.add_argument("--min-accepted", type=float, default=None,
                        help="acceptance gate threshold (default: the loop's own, 0.03*(N-1); "
                             "NGRAM sizes its verifies adaptively instead); 0 drafts every step, "
                             "showing a head's raw acceptance and speed")
    parser.add_argument("--heldout", type=int, default=0,
                        help="bench K prompts of the draft-head training's held-out set "
                             "(train/corpus.py: half prose, half code) instead of the code/chat "
                             "pair; the chat prompt shares a topic with the training corpus")
    parser.add_argument("--verify-costs", action="store_true",
                        help="first print what a verify of each tree size the methods use costs "
                             "against a plain decode step (interleaved, medians; the adaptive "
                             "verify size of speculative.py rests on these ratios)")
    args = parser.parse_args()
    prompts = PROMPTS
    if args.heldout:
        from specdec_inductor.train.corpus import HELDOUT_TOPICS, heldout_prompts
        held = heldout_prompts()
        prose, code = held[:len(HELDOUT_TOPICS)], held[len(HELDOUT_TOPICS):]
        half = (args.heldout + 1) // 2
        prompts = {f"heldout-prose-{i}": t for i, t in enumerate(prose[:half])}
        prompts.update({f"heldout-code-{i}": t for i, t in enumerate(code[:args.heldout - half])})
    temperatures = [float(t) for t in args.temperatures.split(",")]
    dtype = DTYPES[args.dtype]
    model, tokenizer = load_model(args.model, dtype)
    # The AR baseline's Engine; it captures the final hidden state when EAGLE or MTP (which
    # draft from it) run, so they share it, and EAGLE-3 gets its own (add_method).
    eagle = {"eagle", "mtp"} & set(args.methods.split(","))
    engine = Engine(model, max_batch=1, max_len=1024, compile=not args.eager, prefill_chunk=64,
                    capture_hidden=[-1] if eagle else None)
    methods = {}
    shapes = parse_trees(args.trees) if args.trees else [(args.num_draft_tokens, args.topk,
                                                          args.depth)]
    shared = {}
    for name in args.methods.split(","):
        for n, topk, depth in (shapes[:1] if name == "ngram" else shapes):
            add_method(methods, name, args, model, engine, shared, n, topk, depth)
    if args.min_accepted is not None:
        for spec in methods.values():
            spec.min_accepted = args.min_accepted
    ar_loop = SpeculativeGenerator(engine, AutoregressiveProposer())
    if args.verify_costs:
        sizes = sorted({1} | {z for spec in methods.values() for z in spec.tree_sizes})
        print_verify_costs(engine, sizes)
    eos = tokenizer.eos_token_id if args.stop_at_eos else None
    print(f"# {args.model or 'SmolLM2-135M'} {args.dtype}, batch 1, {args.max_new_tokens} new tokens "
          f"({'stopping at eos' if args.stop_at_eos else 'no eos stop'}), "
          f"{'eager' if args.eager else 'compiled'}; {torch.get_num_threads()} threads, ISA "
          f"{specdec_inductor.active_isa()}, torch {torch.__version__}; medians of {args.repeats}")
    print("| prompt | T | method | tok/s | speedup vs our AR | mean accepted length | acceptance by position | tokens == AR |")
    print("|---|---|---|---|---|---|---|---|")
    speedups = {}  # (method, T) -> [speedup per prompt]
    for kind, text in prompts.items():
        ids = encode(tokenizer, text, chat=True)
        engine.generate([ids], 2)  # warm-up / compile
        for label, spec in methods.items():
            spec.compile_verify(sampled=any(t > 0 for t in temperatures))
            spec.generate([ids], spec.proposer.num_draft_tokens + 2)
            if spec.adaptive:
                print(f"# {kind}: {label}: adaptive verify size, probe verify({spec._probe_size()}) "
                      f"measured at {spec.probe_cost:.2f} decode steps")

        for temp in temperatures:
            # AR and every method take turns within each repeat, so a drift of this shared
            # machine's speed hits them alike instead of whichever ran last.
            # Rates per run (tokens produced / seconds; every run's tokens are max_new_tokens
            # without --stop-at-eos), medians over the repeats.
            ar_r, sp_r = [], {label: [] for label in methods}
            runs = {}
            for r in range(args.repeats):
                sampling = SamplingParams(temp, seed=args.seed + r)
                t0 = time.perf_counter()
                if temp == 0:
                    ar = engine.generate([ids], args.max_new_tokens, eos, GenerationStats())
                else:
                    ar = ar_loop.generate([ids], args.max_new_tokens, eos, SpeculativeStats(), sampling)
                ar_r.append(len(ar[0]) / (time.perf_counter() - t0))
                for label, spec in methods.items():
                    stats = SpeculativeStats()
                    t0 = time.perf_counter()
                    sp = spec.generate([ids], args.max_new_tokens, eos, stats, sampling)
                    sp_r[label].append(len(sp[0]) / (time.perf_counter() - t0))
                    runs[label] = (sp, stats)
            ar_rate = statistics.median(ar_r)
            print(f"| {kind} | {temp:g} | AR (ours) | {ar_rate:.1f} | 1.00x | 1.00 | - | - |")
            for label in methods:
                sp, stats = runs[label]
                sp_rate = statistics.median(sp_r[label])
                accept = " ".join(f"{a:.2f}" for a in stats.acceptance_by_position)
                same = ("yes" if sp == ar else "NO") if temp == 0 else "- (sampled)"
                print(f"| {kind} | {temp:g} | {label} | {sp_rate:.1f} | "
                      f"{sp_rate / ar_rate:.2f}x | {stats.mean_accepted_length:.2f} | {accept} | {same} |",
                      flush=True)
                print(f"#   {kind} T={temp:g} {label}: {stats.summary()}")
                spec = methods[label]
                if spec.verify_cost is not None and spec._draft_s is not None:
                    print(f"#   acceptance gate at {spec.gate_threshold():.2f} accepted drafts per "
                          f"step: verify({spec.proposer.num_draft_tokens}) measured at "
                          f"{spec.verify_cost:.2f} decode steps, a draft at "
                          f"{spec._draft_s / spec._decode_s:.2f}")
                speedups.setdefault((label, temp), []).append(sp_rate / ar_rate)
    for (label, temp), values in speedups.items():
        print(f"# median over {len(values)} prompts, T={temp:g}, {label}: "
              f"{statistics.median(values):.2f}x our AR")

if __name__ == "__main__":
    main()
