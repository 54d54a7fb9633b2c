"""The quant_cat pass (lowerings/quant_cat.py) and its op, specdec::quant_linear_cat, on a
quantized GGUF target (default: SmolLM2-135M Q4_1 with INT8 activations), same run:

- end to end: compiled batch-1 greedy decode tok/s with the pass on and off -- two engines on the
  same model, taking turns within each repeat (medians; the tokens must be equal);
- the op: layer 0's q/k/v and gate/up groups, one quant_linear_cat call against the separate
  quant_linear calls, M = --rows (microseconds per group, medians of interleaved batches).

The load average is printed: on a shared machine only the same-run ratios mean anything.

    python benchmarks/bench_quant_cat.py                      # SmolLM2 Q4_1, INT8
    python benchmarks/bench_quant_cat.py --model qwen2.5-coder-0.5b --no-e2e
"""
import argparse
import os
import statistics
import sys
import time

import torch

import specdec_inductor
from specdec_inductor.engine.engine import Engine, GenerationStats
from specdec_inductor.loading import encode, load_model
from specdec_inductor.ops.quant import QuantActivation, quant_linear, quant_linear_cat

PROMPT = ("def bubble_sort(items):\n    n = len(items)\n    for i in range(n):\n"
          "        for j in range(0, n - i - 1):\n            if items[j] > items[j + 1]:\n"
          "                items[j], items[j + 1] = items[j + 1], items[j]\n"
          "    return items\n\nRewrite the function above with the variable name `values` instead "
          "of `items`, and add a docstring.")


def load_note() -> str:
    return "load average {:.1f} / {:.1f} / {:.1f}".format(*os.getloadavg())


def calls_per_step(engine, ids, args) -> float:
    """quant_linear and quant_linear_cat calls (kernel path counters) per decode step of one
    generation, its prefill's calls left out (those of a 1-token generation)."""
    def calls(new_tokens):
        specdec_inductor.reset_kernel_path_counts()
        st = GenerationStats()
        engine.generate([ids], new_tokens, None, st)
        n = sum(c for p, c in specdec_inductor.kernel_path_counts().items()
                if p.startswith("quant_linear"))
        return n, st.decode_steps
    prefill_calls, _ = calls(1)
    n, steps = calls(args.max_new_tokens)
    return (n - prefill_calls) / steps


def e2e(model, tokenizer, args):
    """Decode tok/s with the pass on and off, the engines taking turns."""
    ids = encode(tokenizer, PROMPT, chat=True)
    engines = {on: Engine(model, max_batch=1, max_len=args.max_new_tokens + len(ids) + 8,
                          compile=True, prefill_chunk=64,
                          compile_options={"specdec.quant_cat": on}) for on in (True, False)}
    tokens = {}
    for on, engine in engines.items():
        t0 = time.perf_counter()
        torch._dynamo.utils.counters.clear()
        tokens[on] = engine.generate([ids], args.max_new_tokens)
        print(f"# quant_cat {'on ' if on else 'off'}: compile + first run {time.perf_counter() - t0:.0f} s, "
              f"groups merged {torch._dynamo.utils.counters['specdec']['quant_cat']}, "
              f"quantized calls per decode step {calls_per_step(engine, ids, args):.1f}", flush=True)
    rates = {True: [], False: []}
    for r in range(args.repeats):
        for on in ((True, False) if r % 2 == 0 else (False, True)):
            st = GenerationStats()
            out = engines[on].generate([ids], args.max_new_tokens, None, st)
            assert out == tokens[on]
            rates[on].append(st.decode_tokens_per_s)
    print(f"# {load_note()}")
    print("| quant_cat | decode tok/s (median) | runs | ratio on / off |")
    print("|---|---|---|---|")
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    pairs = [a / b for a, b in zip(rates[True], rates[False])]
    print(f"| on | {on:.1f} | {', '.join(f'{v:.1f}' for v in rates[True])} | "
          f"{on / off:.3f}x (median of per-turn ratios {statistics.median(pairs):.3f}x) |")
    print(f"| off | {off:.1f} | {', '.join(f'{v:.1f}' for v in rates[False])} | - |")
    print(f"# tokens equal with and without the pass: {'yes' if tokens[True] == tokens[False] else 'NO'}")


def _call_us(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e6


def ops(model, args):
    """Layer 0's q/k/v and gate/up: one quant_linear_cat against the separate calls, timed call
    by call in turns. The median is the kernels' speed; the mean adds the stalls (a parallel
    region waits for a descheduled worker thread on a loaded machine), what a decode step pays."""
    layer = model.model.layers[0]
    groups = {"q/k/v": [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
              "gate/up": [layer.mlp.gate_proj, layer.mlp.up_proj]}
    print(f"# {load_note()}; {torch.get_num_threads()} threads; {args.op_calls} calls of each, "
          "in turns")
    print("| group | shapes (N x K, fmt) | M | separate us (median / mean) | "
          "cat us (median / mean) | separate / cat (median / mean) |")
    print("|---|---|---|---|---|---|")
    for name, mods in groups.items():
        ws, fmts = [m.weight for m in mods], [m.fmt for m in mods]
        bs, act = [m.bias for m in mods], mods[0].activation
        shapes = ", ".join(f"{m.out_features}x{m.in_features} {m.fmt.name}" for m in mods)
        for rows in args.rows:
            x = torch.randn(rows, mods[0].in_features)

            def apart():
                return torch.cat([quant_linear(x, w, f, b, act) for w, f, b in zip(ws, fmts, bs)], -1)

            def cat():
                return quant_linear_cat(x, ws, fmts, bs, act)

            assert torch.equal(cat(), apart())
            times = {apart: [], cat: []}
            for _ in range(args.op_calls):
                for fn in (apart, cat):
                    times[fn].append(_call_us(fn))
            (am, aa), (cm, ca) = [(statistics.median(times[f]), statistics.mean(times[f]))
                                  for f in (apart, cat)]
            print(f"| {name} | {shapes} | {rows} | {am:.1f} / {aa:.1f} | {cm:.1f} / {ca:.1f} | "
                  f"{am / cm:.2f}x / {aa / ca:.2f}x |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model name or .gguf (default: SmolLM2-135M Q4_1)")
    p.add_argument("--quant-activations", choices=["float", "int8"], default="int8")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=6, help="turns of each engine")
    p.add_argument("--rows", default="1,4,8", help="M of the op timings")
    p.add_argument("--op-calls", type=int, default=3000)
    p.add_argument("--no-e2e", action="store_true")
    p.add_argument("--no-ops", action="store_true")
    args = p.parse_args()
    args.rows = [int(r) for r in args.rows.split(",")]
    act = QuantActivation[args.quant_activations.upper()]
    model, tokenizer = load_model(args.model, torch.float32, dequantize=False, quant_activation=act)
    print(f"# {args.model or 'smollm2-135m'}, activations {model.quant_activation}, "
          f"{torch.get_num_threads()} threads, ISA {specdec_inductor.active_isa()}, "
          f"torch {torch.__version__}")
    with torch.no_grad():
        if not args.no_ops:
            ops(model, args)
        if not args.no_e2e:
            e2e(model, tokenizer, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
