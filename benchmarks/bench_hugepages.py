"""Weights in huge pages (engine/hugepages.py) against the same model in ordinary pages: two
copies of the model loaded in one process, one with `hugepages=False`, compiled engines decoding
the same prompt in turns (greedy, batch 1). Prints each one's median decode tokens/s, the
median of the per-turn ratios, whether the tokens are equal, and how much of the placed weights
the kernel actually backs with huge pages.

    python benchmarks/bench_hugepages.py                                   # SmolLM2 (default)
    python benchmarks/bench_hugepages.py --model qwen2.5-coder-1.5b --quant-activations int8
"""
import argparse
import statistics
import sys

import torch

from specdec_inductor.engine import hugepages
from specdec_inductor.engine.engine import Engine, GenerationStats
from specdec_inductor.loading import encode, load_model
from specdec_inductor.ops.quant import QuantActivation

PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model name or .gguf (default: SmolLM2-135M)")
    p.add_argument("--dequantize", action="store_true", help="GGUF weights dense (fp32)")
    p.add_argument("--quant-activations", choices=["float", "int8"], default="int8")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args()
    if not hugepages.available():
        raise SystemExit("this system gives no transparent huge pages (Linux THP 'never' or absent)")
    act = QuantActivation[args.quant_activations.upper()]
    engines = {}
    for on in (True, False):
        model, tokenizer = load_model(args.model, torch.float32,
                                      dequantize=True if args.dequantize else None,
                                      quant_activation=act, hugepages=on)
        engine = Engine(model, max_batch=1, max_len=512, compile=True, prefill_chunk=64)
        ids = encode(tokenizer, PROMPT, chat=True)
        engine.generate([ids], 8)
        engines["huge pages" if on else "4 KB pages"] = (model, engine)
    model = engines["huge pages"][0]
    placed = [t for t in list(model.parameters()) + list(model.buffers())
              if t.numel() * t.element_size() >= hugepages.MIN_BYTES]
    backed = hugepages.backed_bytes(placed) or 0
    print(f"# {args.model or 'smollm2-135m'}, activations {args.quant_activations}, "
          f"{torch.get_num_threads()} threads; placed {model.hugepage_bytes / 1e6:.0f} MB, "
          f"backed by huge pages {backed / 1e6:.0f} MB; {args.max_new_tokens} tokens, "
          f"medians of {args.repeats} turns")
    rates = {label: [] for label in engines}
    outs = {}
    for _ in range(args.repeats):
        for label, (_, engine) in engines.items():
            st = GenerationStats()
            outs[label] = engine.generate([ids], args.max_new_tokens, None, st)
            rates[label].append(st.decode_tokens_per_s)
    for label, values in rates.items():
        print(f"| {label} | {statistics.median(values):.1f} tok/s |")
    ratio = statistics.median(a / b for a, b in zip(rates["huge pages"], rates["4 KB pages"]))
    print(f"# huge pages / 4 KB pages: {ratio:.3f}x (median of per-turn ratios); tokens equal: "
          f"{outs['huge pages'] == outs['4 KB pages']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
