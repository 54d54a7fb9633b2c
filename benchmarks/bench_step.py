"""Host share of a speculative step: the part of the loop's time spent outside the target's
compiled step calls (Engine.decode / Engine.verify, and the greedy step programs that also
hold acceptance and commit, Engine.run_program), on SmolLM2-135M (or --model), compiled,
greedy, at batch 1 and 8, for NGRAM and plain decoding through the same loop. Uses only the
public API, so the same script measures an older checkout (PYTHONPATH=that checkout).

    python benchmarks/bench_step.py                       # batch 1 and 8, 64 new tokens
    python benchmarks/bench_step.py --batches 8 --rounds 5
    python benchmarks/bench_step.py --profile   # counts per step instead of times
    python benchmarks/bench_step.py --pieces    # one program against the step in pieces
    python benchmarks/bench_step.py --program-ab --batches 8   # in-graph cost of the program
    python benchmarks/bench_step.py --ar-ab     # Engine.generate against its former own loop
    python benchmarks/bench_step.py --methods eagle3 --drafted-ab   # the draft in the program
    python benchmarks/bench_step.py --methods standalone --drafted-ab   # a chain in the program
    python benchmarks/bench_step.py --methods ar,eagle3 --quantized int8   # the Q4_1 file, INT8
    python benchmarks/bench_step.py --methods eagle3+lookup --style-prompts --mixed-ab
        # lookup first over a batch of different styles: steps mixing sources in the program

--profile counts, per step of one generate run (deterministic, so comparable across checkouts on
a loaded machine where times are not): eager aten ops called from the host outside the compiled
graphs (torch.profiler, top-level operator events), Python function calls (cProfile), host
reads of tensors (.tolist / .item / int / float / bool of a tensor), and the functions with the
most calls.
"""
import argparse
import cProfile
import os
import pstats
import statistics
import time

import torch

from specdec_inductor.engine.engine import Engine
from specdec_inductor.loading import load_model
from specdec_inductor.ops.quant import QuantActivation
from specdec_inductor.proposers.autoregressive import AutoregressiveProposer
from specdec_inductor.proposers.lookup_first import LookupFirstProposer
from specdec_inductor.proposers.ngram import NgramProposer
from specdec_inductor.proposers.registry import ProposerConfig, make_proposer, make_target_engine
from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats
from specdec_inductor.train.styles import encode_prompt, eval_prompts

PROMPT = ("def bubble_sort(items):\n    n = len(items)\n    for i in range(n):\n"
          "        for j in range(0, n - i - 1):\n            if items[j] > items[j + 1]:\n"
          "                items[j], items[j + 1] = items[j + 1], items[j]\n    return items\n\n"
          "Rewrite the function above with the variable name `values` instead of `items`.")


class InGraphTimer:
    """Seconds spent inside the engines' public step calls (the compiled graphs, their guards
    and input checks), installed over each engine's decode, verify, extend and run_program
    (the loop's step programs, and a draft engine's tree program)."""

    def __init__(self, *engines):
        self.seconds = 0.0
        self.installed = set()
        for engine in engines:
            self.install(engine)

    def install(self, engine):
        if id(engine) in self.installed:
            return
        self.installed.add(id(engine))
        for name in ("decode", "verify", "extend", "run_program"):
            setattr(engine, name, self._timed(getattr(engine, name)))

    def _timed(self, fn):
        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return call


class ProposerHostTimer:
    """Host seconds of a proposer's calls outside the engines' step calls (a call's time less
    what `timer` counted inside it): `prepare` (draft_program, propose: the draft's inputs,
    or the whole host side of a host-drafted step) and `commit` (the state update after a
    step)."""

    def __init__(self, timer: InGraphTimer):
        self.timer, self.seconds, self.installed = timer, {"prepare": 0.0, "commit": 0.0}, set()

    def install(self, proposer):
        if proposer is None or id(proposer) in self.installed:
            return
        self.installed.add(id(proposer))
        for name, part in (("draft_program", "prepare"), ("propose", "prepare"),
                           ("commit", "commit")):
            setattr(proposer, name, self._timed(getattr(proposer, name), part))

    def _timed(self, fn, part):
        def call(*args, **kwargs):
            t0, graph0 = time.perf_counter(), self.timer.seconds
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += (time.perf_counter() - t0) - (self.timer.seconds - graph0)
        return call


def measure(variants, timer, prompts, new_tokens, rounds, parts=None):
    """{label: median over rounds of (ms per step, in-graph ms per step, host share, the
    proposer's host ms per step preparing drafts, committing)} and the per-round ratios of ms
    per step to the first variant's; variants: {label: (generator, one_program,
    draft_in_program, mixed_in_program)} (the last for lookup first), taking turns within
    every round so that a drift of the machine's speed hits them alike; parts: a
    ProposerHostTimer installed over their proposers."""
    rows = {label: [] for label in variants}
    for _ in range(rounds):
        for label, (spec, one_program, in_program, mixed) in variants.items():
            spec.one_program, spec.draft_in_program = one_program, in_program
            if isinstance(spec.proposer, LookupFirstProposer):
                spec.proposer.mixed_in_program = mixed
            stats = SpeculativeStats()
            timer.seconds = 0.0
            if parts is not None:
                parts.seconds = dict.fromkeys(parts.seconds, 0.0)
            spec.generate(prompts, new_tokens, stats=stats)
            steps = stats.verify_steps
            split = parts.seconds if parts is not None else {"prepare": 0.0, "commit": 0.0}
            rows[label].append((1e3 * stats.decode_s / steps, 1e3 * timer.seconds / steps,
                                1.0 - timer.seconds / stats.decode_s,
                                1e3 * split["prepare"] / steps, 1e3 * split["commit"] / steps))
    first = next(iter(rows.values()))
    # ms/step against the first variant's in the same round: the machine's drift between
    # rounds cancels out
    return {label: [statistics.median(r[i] for r in rs) for i in range(5)] +
            [sorted(r[0] / f[0] for r, f in zip(rs, first))]
            for label, rs in rows.items()}


def _top_level_aten_ops(prof) -> int:
    """Operator events the host called directly (no operator parent): the eager ops of the
    loop; the compiled graphs' own kernels are children of their compiled-region event."""
    count = 0
    for e in prof.events():
        if e.name.startswith("aten::") and e.cpu_parent is None:
            count += 1
    return count


HOST_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__")


def profile_counts(spec, prompts, new_tokens, top=8):
    """(steps, eager aten ops / step, Python calls / step, host reads / step, top functions)
    over one generate run."""
    stats = SpeculativeStats()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        spec.generate(prompts, new_tokens, stats=stats)
    ops = _top_level_aten_ops(prof)
    profiler = cProfile.Profile()
    stats = SpeculativeStats()
    profiler.enable()
    spec.generate(prompts, new_tokens, stats=stats)
    profiler.disable()
    table = pstats.Stats(profiler).stats  # (file, line, name) -> (prim calls, calls, tt, ct, ..)
    calls = sum(v[1] for v in table.values())
    reads = sum(v[1] for k, v in table.items()
                if k[2].split(" ")[-1].strip("'>") in HOST_READS or
                any(f"'{r}' of 'torch._C.TensorBase'" in k[2] for r in HOST_READS))
    steps = stats.verify_steps
    busiest = sorted(table.items(), key=lambda kv: -kv[1][1])[:top]
    names = ", ".join(f"{k[2] if k[0] == '~' else os.path.basename(k[0]) + ':' + k[2]} "
                      f"{v[1] / steps:.1f}" for k, v in busiest)
    return steps, ops / steps, calls / steps, reads / steps, names


def previous_generate(engine, prompts, max_new_tokens, stats):
    """Engine.generate as it was before plain decoding became the speculative loop without a
    proposer: its own loop of Engine.decode steps (the engine's decode graph), seq_lens
    advanced in eager, one host read per step; no eos. Kept for the same-process A/B of the
    AR rate (--ar-ab)."""
    bs = len(prompts)
    bucket = engine.bucket_for(bs)
    requests = engine.pool.admit([len(p) for p in prompts], max_new_tokens)
    try:
        with torch.inference_mode():
            rows = torch.tensor([r.row for r in requests] +
                                [engine.pool.padding_row] * (bucket - bs))  # [B]
            seq_lens = torch.tensor([len(p) for p in prompts] + [1] * (bucket - bs))  # [B]
        t0 = time.perf_counter()
        tokens = engine.prefill(prompts, rows).argmax  # [B]
        stats.prefill_s += time.perf_counter() - t0
        out = [tokens[:bs].tolist()]
        t0 = time.perf_counter()
        for _ in range(max_new_tokens - 1):
            tokens = engine.decode(tokens, rows, seq_lens).argmax
            with torch.inference_mode():
                seq_lens += 1
            out.append(tokens[:bs].tolist())
            stats.decode_steps += 1
            stats.decode_tokens += bs
        stats.decode_s += time.perf_counter() - t0
    finally:
        for r in requests:
            engine.pool.release(r)
    return [list(column) for column in zip(*out)]


def current_generate(engine, prompts, max_new_tokens, stats):
    return engine.generate(prompts, max_new_tokens, None, stats)


def ar_ab(engine, prompts, new_tokens, rounds):
    """{name: (median decode tok/s over rounds, eager aten ops / decode step, tokens)} of the
    previous and the current Engine.generate, taking turns within every round, and the
    per-round ratios current / previous (sorted)."""
    from specdec_inductor.engine.engine import GenerationStats
    runs = {"previous": previous_generate, "current": current_generate}
    rates = {name: [] for name in runs}
    tokens = {}
    for name, run in runs.items():
        run(engine, prompts, 8, GenerationStats())  # warm-up: compiles what it has not
    for _ in range(rounds):
        for name, run in runs.items():
            stats = GenerationStats()
            tokens[name] = run(engine, prompts, new_tokens, stats)
            rates[name].append(stats.decode_tokens_per_s)
    result = {}
    for name, run in runs.items():
        stats = GenerationStats()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run(engine, prompts, new_tokens, stats)
        ops = _top_level_aten_ops(prof) / stats.decode_steps
        result[name] = (statistics.median(rates[name]), ops, tokens[name])
    ratios = sorted(c / p for c, p in zip(rates["current"], rates["previous"]))
    return result, ratios


def program_ab(engine, bs, sizes=(1, 2, 8), rounds=5, context=100):
    """Per tree size, the median seconds of a greedy step program (GreedyStep: target step,
    acceptance and commit in one graph) and of the engine's bare step graph, on a scratch
    request in bs's bucket, the two taking turns (step_times)."""
    from specdec_inductor.speculative.commit import GreedyStep
    from specdec_inductor.speculative.stats import step_times
    greedy = GreedyStep.of(engine, max(sizes))
    runs = {"bare": [], "program": []}
    for _ in range(rounds):
        for name, program in (("bare", None), ("program", greedy)):
            runs[name].append(step_times(engine, sizes, context=context, rounds=5,
                                         batch_size=bs, program=program))
    return {z: [statistics.median(r[z] for r in runs[name]) for name in ("bare", "program")]
            for z in sizes}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--methods", default="ngram,ar",
                        help="comma list of ngram, ar, and the draft-model methods eagle3, "
                             "eagle (the shipped heads, their default trees) and standalone (the "
                             "target's first layers, a chain), N = 8, drafting every step; "
                             "METHOD+lookup: prompt lookup in front (ProposerConfig.lookup)")
    parser.add_argument("--style-prompts", action="store_true",
                        help="batch b's prompts: the first b style evaluation prompts taken "
                             "one style at a time (train/styles.py), not one prompt cut to b "
                             "ragged lengths")
    parser.add_argument("--mixed-ab", action="store_true",
                        help="also time each +lookup method with the steps that mix sources "
                             "drafting before the step program (mixed_in_program = False), in "
                             "turns with the program that drafts them inside it")
    parser.add_argument("--drafted-ab", action="store_true",
                        help="also time each draft-model method drafting before the step program "
                             "(draft_in_program = False: a tree in its own graph, a chain by its "
                             "host loop of draft decodes), in turns with the step program that "
                             "drafts inside it")
    parser.add_argument("--pieces", action="store_true",
                        help="also time each method with one_program = False (the engine's step "
                             "graph, then acceptance and commit in eager), in turns with it")
    parser.add_argument("--program-ab", action="store_true",
                        help="time the greedy step programs against the engine's bare step "
                             "graphs per tree size (1, 2, 8), in turns, instead")
    parser.add_argument("--ar-ab", action="store_true",
                        help="time Engine.generate (plain decoding through the speculative "
                             "loop) against its former own loop (previous_generate), in turns, "
                             "and count eager aten ops per decode step of each, instead")
    parser.add_argument("--profile", action="store_true",
                        help="count ops, Python calls and host reads per step instead of timing")
    parser.add_argument("--quantized", choices=["float", "int8"], default=None,
                        help="the default model's GGUF blocks kept quantized, with float or INT8 "
                             "activations (default: load_model's default, dequantized fp32)")
    parser.add_argument("--max-batch", type=int, default=8,
                        help="the engine's max_batch (its KV pool's shape: keep it across runs "
                             "that should share compiled graphs)")
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.quantized is None:
        model, tokenizer = load_model(args.model)
    else:
        model, tokenizer = load_model(args.model, dequantize=False,
                                      quant_activation=QuantActivation[args.quantized.upper()])
    batches = [int(b) for b in args.batches.split(",")]
    engine = Engine(model, max_batch=max(args.max_batch, *batches), max_len=512, compile=True,
                    prefill_chunk=64)
    timer = InGraphTimer(engine)
    parts = ProposerHostTimer(timer)
    ids = tokenizer(PROMPT)["input_ids"]
    methods = {}
    for name in args.methods.split(","):
        if name == "ngram":
            methods[name] = SpeculativeGenerator(engine, NgramProposer(num_draft_tokens=8))
        elif name == "ar":
            methods[name] = SpeculativeGenerator(engine, AutoregressiveProposer())
        elif name.removesuffix("+lookup") in ("eagle3", "eagle", "standalone"):
            config = ProposerConfig(method=name.removesuffix("+lookup"), num_draft_tokens=8,
                                    lookup=name.endswith("+lookup"))
            target = make_target_engine(config, model, max_batch=engine.max_batch, max_len=512,
                                        compile=True, prefill_chunk=64)
            proposer = make_proposer(config, target)
            timer.install(target)
            timer.install(proposer.engine)
            methods[name] = SpeculativeGenerator(target, proposer, min_accepted=0.0)
        else:
            raise SystemExit(f"--methods: unknown method {name!r}")
    if args.program_ab:
        for bs in batches:
            for z, (bare, program) in program_ab(engine, bs).items():
                print(f"batch {bs} size {z}: bare {1e3 * bare:.2f} ms, program "
                      f"{1e3 * program:.2f} ms, program / bare {program / bare:.3f}", flush=True)
        return
    if args.ar_ab:
        print(f"# AR decode, {args.max_new_tokens} new tokens, median of {args.rounds} rounds "
              "in turns; ratio = current / previous decode tok/s of the same round")
        print("| batch | previous tok/s | current tok/s | median ratio (min-max) | aten ops/step "
              "previous | current | tokens equal |")
        print("|---|---|---|---|---|---|---|")
        for bs in batches:
            prompts = [ids[:len(ids) - b] for b in range(bs)]  # ragged lengths
            r, ratios = ar_ab(engine, prompts, args.max_new_tokens, args.rounds)
            (prev, prev_ops, prev_tok), (cur, cur_ops, cur_tok) = r["previous"], r["current"]
            print(f"| {bs} | {prev:.1f} | {cur:.1f} | {statistics.median(ratios):.3f} "
                  f"({ratios[0]:.2f}-{ratios[-1]:.2f}) | {prev_ops:.1f} | {cur_ops:.1f} | "
                  f"{prev_tok == cur_tok} |", flush=True)
        return
    if args.profile:
        print(f"# counts per step of one generate run, {args.max_new_tokens} new tokens")
        print("| method | batch | steps | eager aten ops/step | Python calls/step | host reads/step |")
        print("|---|---|---|---|---|---|")
    else:
        print(f"# {os.cpu_count()} CPUs, torch {torch.__version__}, {args.max_new_tokens} new tokens, "
              f"median of {args.rounds} rounds; host share = 1 - in-graph time / loop time")
        print("| method | batch | ms/step | in-graph ms/step | host ms/step | host share | "
              "of which the proposer's: prepare / commit ms/step | "
              "ms/step / the method's first row, per round: median (min-max) |")
        print("|---|---|---|---|---|---|---|---|")
    if args.style_prompts:
        by_style = {}
        for p in eval_prompts():
            by_style.setdefault(p.style, []).append(p)
        mix = [p for group in zip(*by_style.values()) for p in group]  # one style at a time
        style_ids = [encode_prompt(tokenizer, p) for p in mix]
    for bs in batches:
        prompts = [ids[:len(ids) - b] for b in range(bs)]  # ragged lengths
        if args.style_prompts:
            prompts = style_ids[:bs]
        for name, spec in methods.items():
            spec.compile_verify(batch_size=bs)
            spec.generate(prompts, 16)  # the bucket's prefill and decode graphs
            if args.profile:
                draft_graph = args.drafted_ab and spec.proposer is not None and spec.proposer.engine
                for in_program in ((True, False) if draft_graph else (True,)):
                    spec.draft_in_program = in_program
                    spec.generate(prompts, 16)  # what this variant compiles
                    steps, ops, calls, reads, names = profile_counts(spec, prompts,
                                                                     args.max_new_tokens)
                    label = name if in_program else f"{name} propose first"
                    print(f"| {label} | {bs} | {steps} | {ops:.1f} | {calls:.0f} | {reads:.1f} |",
                          flush=True)
                    print(f"#   most called per step: {names}", flush=True)
                spec.draft_in_program = True
                continue
            variants = {name: (spec, True, True, True)}
            if args.pieces:
                variants[f"{name} pieces"] = (spec, False, True, True)
                spec.one_program = False
                spec.generate(prompts, 16)  # the engine's own decode graph
                spec.one_program = True
            if args.drafted_ab and spec.proposer is not None and spec.proposer.engine:
                variants[f"{name} propose first"] = (spec, True, False, True)
                spec.draft_in_program = False
                spec.generate(prompts, 16)  # the draft's own graphs
                spec.draft_in_program = True
            if args.mixed_ab and isinstance(spec.proposer, LookupFirstProposer):
                variants[f"{name} mixed steps first"] = (spec, True, True, False)
                for mixed in (True, False):  # what either compiles, at full length
                    spec.proposer.mixed_in_program = mixed
                    spec.generate(prompts, args.max_new_tokens)
            parts.install(spec.proposer)
            for label, (step, graph, share, prepare, commit, ratios) in measure(
                    variants, timer, prompts, args.max_new_tokens, args.rounds, parts).items():
                print(f"| {label} | {bs} | {step:.2f} | {graph:.2f} | {step - graph:.2f} | "
                      f"{100 * share:.1f}% | {prepare:.2f} / {commit:.2f} | "
                      f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f}) |",
                      flush=True)
            if isinstance(spec.proposer, LookupFirstProposer):
                lf = spec.proposer
                print(f"#   {name} batch {bs}, every run so far: request-steps by source "
                      f"{lf.drafts}; steps mixing sources inside the program "
                      f"{lf.mixed_in_program_steps}, grafting there {lf.grafts_in_program}",
                      flush=True)


if __name__ == "__main__":
    main()
