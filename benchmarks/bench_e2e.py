"""End-to-end greedy decoding on SmolLM2-135M-Instruct (default GGUF, dequantized), batch 1:
our compiled engine (fp32, bf16) vs HF `generate` (eager dynamic cache; static cache; static
cache + torch.compile with --hf-compile) vs llama.cpp (llama-cpp-python, optional) on F32/F16
GGUFs written from the same dequantized weights.

Prints medians, ratios, ms per decode step vs the weight-read roofline (model bytes / measured
read bandwidth) and cold compile times. Timings are printed, never asserted.

    python benchmarks/bench_e2e.py [--new-tokens 128] [--repeats 3] [--json out.json]

--ab OPTION (a bool backend option, e.g. specdec.linear_cat) times ours with it on and off in
one process, the two engines taking turns within every repeat: on this shared machine runs of
one engine after the other move by more than a 5-10% effect.
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

import specdec_inductor
from specdec_inductor.engine.engine import Engine, GenerationStats
from specdec_inductor.loading import default_gguf_path, load_model

PROMPT = "Explain in two sentences why the sky is blue."


def read_bandwidth_gbs(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Read bandwidth of this process (sum over a buffer larger than any cache), GB/s."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    x.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        times.append(time.perf_counter() - t0)
    return nbytes / min(times) / 1e9


def param_bytes(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():  # tied embeddings counted once
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def bench_ours(dtype, ids, new_tokens, repeats, options=None, layers_once=True):
    model, _ = load_model(None, dtype)
    engine = Engine(model, max_batch=1, max_len=len(ids) + new_tokens + 8,
                    compile_options=options, compile_layers_once=layers_once)
    t0 = time.perf_counter()
    engine.generate([ids], max_new_tokens=3)  # compiles the prefill and decode graphs
    compile_s = time.perf_counter() - t0
    runs, steps, prefills, tokens = [], [], [], None
    for _ in range(repeats):
        stats = GenerationStats()
        tokens = engine.generate([ids], new_tokens, None, stats)[0]
        runs.append((new_tokens - 1) / stats.decode_s)
        steps.append(statistics.median(stats.step_times))
        prefills.append(stats.prefill_s)
    return {"decode_tok_s": statistics.median(runs), "ms_per_step": 1e3 * statistics.median(steps),
            "prefill_ms": 1e3 * statistics.median(prefills),
            "compile_s": compile_s, "bytes": param_bytes(model), "tokens": tokens,
            "attention": engine.attention_backend.value, "compiled": engine.compiled}


def bench_ab(dtype, ids, new_tokens, repeats, key):
    """Decode tok/s of ours with the bool option `key` on and off, interleaved (the order
    alternates per repeat): {"on": rate, "off": rate, "won": repeats where on was faster,
    "same_tokens": bool}."""
    model, _ = load_model(None, dtype)
    engines = {}
    for name, value in (("on", True), ("off", False)):
        engines[name] = Engine(model, max_batch=1, max_len=len(ids) + new_tokens + 8,
                               compile_options={key: value})
        engines[name].generate([ids], max_new_tokens=3)  # compiles
    rates = {"on": [], "off": []}
    tokens = {}
    for r in range(repeats):
        for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
            stats = GenerationStats()
            tokens[name] = engines[name].generate([ids], new_tokens, None, stats)[0]
            rates[name].append((new_tokens - 1) / stats.decode_s)
    won = sum(a > b for a, b in zip(rates["on"], rates["off"]))
    return {"on": statistics.median(rates["on"]), "off": statistics.median(rates["off"]),
            "won": won, "same_tokens": tokens["on"] == tokens["off"]}


def _hf_decode_rate(model, ids, new_tokens, **kwargs):
    """Decode tokens/s of HF generate: (full run - 1-token run) over new_tokens - 1 tokens."""
    inp = torch.tensor([ids])
    common = dict(do_sample=False, pad_token_id=0, **kwargs)

    def run(n):
        t0 = time.perf_counter()
        out = model.generate(inp, max_new_tokens=n, min_new_tokens=n, **common)
        return time.perf_counter() - t0, out[0, len(ids):].tolist()

    t_one, _ = run(1)
    t_all, tokens = run(new_tokens)
    return (new_tokens - 1) / max(t_all - t_one, 1e-9), tokens


def bench_hf(dtype, ids, new_tokens, repeats, variant):
    model, _ = load_model(None, dtype)
    model.config._attn_implementation = "sdpa"
    kwargs = {}
    if variant in ("static", "static+compile"):
        kwargs["cache_implementation"] = "static"
    if variant == "static":
        kwargs["disable_compile"] = True
    if variant == "static+compile":
        from transformers import CompileConfig
        kwargs["compile_config"] = CompileConfig(fullgraph=True, _compile_all_devices=True)
    with torch.inference_mode():
        t0 = time.perf_counter()
        _hf_decode_rate(model, ids, 4, **kwargs)  # warm-up (compiles for static+compile)
        warm_s = time.perf_counter() - t0
        results = [_hf_decode_rate(model, ids, new_tokens, **kwargs) for _ in range(repeats)]
    rate = statistics.median(r[0] for r in results)
    return {"decode_tok_s": rate, "ms_per_step": 1e3 / rate, "compile_s": warm_s,
            "bytes": param_bytes(model), "tokens": results[0][1]}


def write_dense_gguf(src: str, dst: str, f16: bool) -> None:
    """Copy of the GGUF `src` with every tensor dequantized: F32, or F16 for matrices (1-D
    tensors stay F32, as llama.cpp's converter writes them)."""
    import gguf
    reader = gguf.GGUFReader(src)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(dst, arch=arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        if field.name == gguf.Keys.General.FILE_TYPE:
            continue
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16 if f16 else gguf.LlamaFileType.ALL_F32)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)  # float32, numpy shape (rows, cols)
        if f16 and data.ndim > 1:
            data = data.astype(np.float16)
        writer.add_tensor(t.name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def bench_llamacpp(gguf_path, ids, new_tokens, repeats, threads):
    from llama_cpp import Llama
    llm = Llama(model_path=gguf_path, n_ctx=len(ids) + new_tokens + 8, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    rates, tokens = [], None
    for _ in range(repeats + 1):  # first run is warm-up
        llm.reset()
        out, t_first = [], None
        for tok in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            out.append(tok)
            if t_first is None:
                t_first = time.perf_counter()
            if len(out) == new_tokens:
                break
        t_end = time.perf_counter()
        rates.append((new_tokens - 1) / (t_end - t_first))
        tokens = out
    rate = statistics.median(rates[1:])
    return {"decode_tok_s": rate, "ms_per_step": 1e3 / rate, "compile_s": 0.0,
            "bytes": os.path.getsize(gguf_path), "tokens": tokens}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-compile", action="store_true",
                        help="also time HF generate with a static cache + torch.compile")
    parser.add_argument("--inductor-option", action="append", default=[],
                        help="also time ours with an Inductor bool option, e.g. freezing=1")
    parser.add_argument("--ab", action="append", default=[],
                        help="only time ours with this bool option on vs off, interleaved in one "
                             "process (e.g. specdec.linear_cat); repeatable")
    parser.add_argument("--per-layer-graphs", action="store_true",
                        help="also time ours with Engine(compile_layers_once=False): every "
                             "decoder layer lowered and compiled on its own")
    parser.add_argument("--skip", default="", help="comma list of columns to skip")
    parser.add_argument("--json", default=None, help="write results to this file")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads for torch and llama.cpp alike (default: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    skip = set(filter(None, args.skip.split(",")))
    threads = torch.get_num_threads()

    _, tokenizer = load_model(None)
    ids = list(tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                             add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"])
    eos = tokenizer.eos_token_id
    bw = read_bandwidth_gbs()
    print(f"# machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{threads} threads, ISA {specdec_inductor.detected_isa()}, torch {torch.__version__}; "
          f"read bandwidth {bw:.1f} GB/s", flush=True)
    print(f"# SmolLM2-135M-Instruct (Q4_1 GGUF dequantized), batch 1, greedy, chat prompt "
          f"{len(ids)} tokens, {args.new_tokens} new tokens, medians of {args.repeats}",
          flush=True)

    if args.ab:
        print("| option | dtype | decode tok/s on | off | on / off | repeats on won | tokens equal |")
        print("|---|---|---|---|---|---|---|")
        for key in args.ab:
            for dt, dname in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
                if f"ours {dname}" in skip:
                    continue
                r = bench_ab(dt, ids, args.new_tokens, args.repeats, key)
                print(f"| {key} | {dname} | {r['on']:.1f} | {r['off']:.1f} | "
                      f"{r['on'] / r['off']:.2f}x | {r['won']} of {args.repeats} | "
                      f"{'yes' if r['same_tokens'] else 'no'} |", flush=True)
        return

    results = {}
    plan = [("ours fp32", lambda: bench_ours(torch.float32, ids, args.new_tokens, args.repeats)),
            ("ours bf16", lambda: bench_ours(torch.bfloat16, ids, args.new_tokens, args.repeats)),
            ("hf eager fp32", lambda: bench_hf(torch.float32, ids, args.new_tokens, args.repeats,
                                               "dynamic")),
            ("hf static fp32", lambda: bench_hf(torch.float32, ids, args.new_tokens,
                                                args.repeats, "static"))]
    for opt in filter(None, args.inductor_option):
        key, value = opt.split("=")
        options = {key: value.lower() in ("1", "true")}
        for dt, dname in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            plan.append((f"ours {dname} +{key}={value}", lambda d=dt, o=options: bench_ours(
                d, ids, args.new_tokens, args.repeats, o)))
    if args.per_layer_graphs:
        for dt, dname in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            plan.append((f"ours {dname} per-layer graphs", lambda d=dt: bench_ours(
                d, ids, args.new_tokens, args.repeats, layers_once=False)))
    if args.hf_compile:
        plan.append(("hf static+compile fp32", lambda: bench_hf(
            torch.float32, ids, args.new_tokens, args.repeats, "static+compile")))
    try:
        import llama_cpp  # noqa: F401
        tmp = tempfile.mkdtemp(prefix="specdec_gguf_")
        for name, f16 in (("F32", False), ("F16", True)):
            path = os.path.join(tmp, f"smollm2-135m-{name}.gguf")
            plan.append((f"llama.cpp {name}", lambda p=path, h=f16: (
                write_dense_gguf(default_gguf_path(), p, h),
                bench_llamacpp(p, ids, args.new_tokens, args.repeats, threads))[1]))
    except ImportError as exc:
        print(f"# llama.cpp column skipped: llama-cpp-python not importable ({exc}); "
              "pip install llama-cpp-python  (builds llama.cpp from source)", flush=True)
    for name, fn in plan:
        if name in skip:
            continue
        print(f"# running {name} ...", file=sys.stderr, flush=True)
        results[name] = fn()

    print("| engine | decode tok/s | ms/step | roofline ms/step | % of roofline | vs llama.cpp "
          "same dtype | vs HF eager | cold compile s | tokens == ours fp32 |")
    print("|---|---|---|---|---|---|---|---|---|")
    ref_tokens = results.get("ours fp32", {}).get("tokens")
    for name, r in results.items():
        roof = 1e3 * r["bytes"] / (bw * 1e9)
        same = "llama.cpp F16" if ("bf16" in name or "F16" in name) else "llama.cpp F32"
        vs_cpp = (f"{r['decode_tok_s'] / results[same]['decode_tok_s']:.2f}x"
                  if same in results else "-")
        vs_hf = (f"{r['decode_tok_s'] / results['hf eager fp32']['decode_tok_s']:.2f}x"
                 if "hf eager fp32" in results else "-")
        # Every engine runs all new_tokens (HF with min_new_tokens, which masks eos), so
        # tokens are compared up to ours' first eos, where the answers end.
        n = min(len(r["tokens"]), len(ref_tokens or []))
        if ref_tokens and eos in ref_tokens[:n]:
            n = ref_tokens.index(eos) + 1
        same_tokens = ("-" if ref_tokens is None else
                       str(next((f"no (from {j})" for j in range(n)
                                 if r["tokens"][j] != ref_tokens[j]), f"yes ({n})")))
        print(f"| {name} | {r['decode_tok_s']:.1f} | {r['ms_per_step']:.2f} | {roof:.2f} | "
              f"{100 * roof / r['ms_per_step']:.0f}% | {vs_cpp} | {vs_hf} | "
              f"{r['compile_s']:.1f} | {same_tokens} |")
    for name in ("ours fp32", "ours bf16"):
        if name in results:
            print(f"# {name}: attention backend {results[name]['attention']}, "
                  f"{'compiled' if results[name]['compiled'] else 'eager'}; prefill of the "
                  f"{len(ids)}-token prompt {results[name]['prefill_ms']:.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth_gbs": bw, "threads": threads, "results": {
                k: {kk: vv for kk, vv in v.items() if kk != "tokens"} for k, v in results.items()}},
                f, indent=2)


if __name__ == "__main__":
    main()
