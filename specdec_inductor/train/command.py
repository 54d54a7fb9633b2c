"""`specdec train-draft`: build the data through the Engine, train an EAGLE or EAGLE-3 head on
the CPU, write it in the published layout, and report held-out acceptance."""
import json
import os
import sys
import time

import torch

DEFAULT_OUT = "draft-heads"

# The defaults of a full run by the data pass's precision (--data-precision), each sized to the
# 45-minute budget on a 2-core machine of the kind that picks it (README: Training draft heads):
# fp32 data (no AMX) as the 2400-prompt head was made; bf16 data on an AMX Xeon, whose data pass
# takes a fraction of the fp32 one's time, spends the rest on more prompts.
RUN_DEFAULTS = {
    "fp32": {"num_prompts": 2400, "epochs": 3, "max_batch": 16},
    "bf16": {"num_prompts": 7000, "epochs": 2, "max_batch": 64},
}


def add_parser(sub, common) -> None:
    p = sub.add_parser("train-draft", help="train an EAGLE / EAGLE-3 draft head on the CPU")
    common(p)
    p.add_argument("--method", choices=["eagle", "eagle3"], required=True)
    p.add_argument("--target", dest="model", default=None,
                   help="target model directory or .gguf (default: SmolLM2-135M GGUF)")
    p.add_argument("--out", default=None, help=f"output directory (default {DEFAULT_OUT}/<method>)")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="training prompts (corpus.py holds 11580; default "
                        f"{RUN_DEFAULTS['fp32']['num_prompts']} with fp32 data, "
                        f"{RUN_DEFAULTS['bf16']['num_prompts']} with bf16 data: the 45-minute "
                        "budget on 2 cores)")
    p.add_argument("--corpus", choices=["default", "styles", "mixed"], default="default",
                   help="training prompts: corpus.py's (default), styles.py's style-covering "
                        "ones (code in many languages, structured output, rewriting, short "
                        "facts, multi-turn chat, math), or half of each (mixed)")
    p.add_argument("--init", default=None,
                   help="eagle3: start from this head checkpoint (a warm start: its weights, "
                        "draft vocabulary and target layers) instead of a fresh head")
    p.add_argument("--new-tokens", type=int, default=128, help="greedy continuation per prompt")
    p.add_argument("--epochs", type=int, default=None,
                   help=f"default {RUN_DEFAULTS['fp32']['epochs']} with fp32 data, "
                        f"{RUN_DEFAULTS['bf16']['epochs']} with bf16 data")
    p.add_argument("--data-precision", choices=["auto", "fp32", "bf16"], default="auto",
                   help="the target's dtype while building the data (continuations, features, "
                        "labels); auto: bf16 where the CPU has AMX tiles, else fp32")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ttt-steps", type=int, default=4, help="EAGLE-3 unrolled draft steps")
    p.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="draft vocabulary: EAGLE-3's d2t; EAGLE's draft_vocab.safetensors")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="the head's training matmuls: bf16 autocast (fp32 weights, optimizer and "
                        "losses) or fp32; auto: bf16 where the CPU has bf16 matmul instructions")
    p.add_argument("--save-every", type=int, default=50, help="trainer state every K steps")
    p.add_argument("--data", default=None,
                   help="data cache file (default <out>/data.pt); reused when it was built with "
                        "the same prompts / tokens / seed (EAGLE can reuse EAGLE-3's data)")
    p.add_argument("--overwrite", action="store_true",
                   help="let --data replace an existing file that is not a data cache of this "
                        "run (no FILE.json beside it, or one built with other settings)")
    p.add_argument("--resume", action="store_true",
                   help="continue from --out's trainer state and cached data")
    p.add_argument("--no-eval", dest="eval", action="store_false",
                   help="skip the held-out acceptance evaluation")
    # --max-batch (a common option): prompts continued together while building the data (default
    # 16 with fp32 data, 64 with bf16). Decode rows are computed independently; a batch's prompts
    # are prefilled together, in GEMMs whose rounding may depend on the batch.
    p.set_defaults(func=run, max_batch=None, max_len=512, subparser=p)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def corpus_prompts(corpus: str, num_prompts: int, seed: int) -> list:
    """The training prompts of --corpus: texts (corpus.py) and/or StylePrompts (styles.py)."""
    from specdec_inductor.train.corpus import training_prompts
    from specdec_inductor.train.styles import style_training_prompts
    if corpus == "default":
        return training_prompts(num_prompts, seed)
    if corpus == "styles":
        return style_training_prompts(num_prompts, seed)
    half = num_prompts // 2
    return style_training_prompts(num_prompts - half, seed) + (
        training_prompts(half, seed) if half else [])


def run(args) -> int:
    from specdec_inductor.engine.engine import eager_requested
    from specdec_inductor.loading import load_model
    from specdec_inductor.loading import DTYPES, encode
    from specdec_inductor.proposers.eagle3 import eagle3_target_layers
    from specdec_inductor.train.styles import StylePrompt, encode_prompt
    from specdec_inductor.train.data import DraftData, build_draft_data, data_precision
    from specdec_inductor.train.trainer import TrainConfig, train_head, train_precision
    torch.manual_seed(args.seed)
    precision = data_precision(args.data_precision)
    for name, value in RUN_DEFAULTS[precision].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    cfg = TrainConfig(method=args.method, epochs=args.epochs, batch_size=args.batch_size,
                      lr=args.lr, seed=args.seed, ttt_steps=args.ttt_steps,
                      save_every=args.save_every, precision=train_precision(args.precision),
                      compile_loss=not (args.eager or eager_requested()), init=args.init)
    try:
        cfg.validate()
        texts = corpus_prompts(args.corpus, args.num_prompts, args.seed)
        if args.new_tokens < 1:
            raise ValueError(f"argument 'new_tokens' must be >= 1, got {args.new_tokens}")
        if args.max_batch < 1:
            raise ValueError(f"argument 'max_batch' must be >= 1, got {args.max_batch}")
    except ValueError as exc:
        raise SystemExit(f"specdec train-draft: {exc}")
    if (args.data and os.path.exists(args.data) and not os.path.exists(args.data + ".json")
            and not args.overwrite):
        # Never overwrite a file the user named unless told to: it is no data cache of ours.
        raise SystemExit(f"specdec train-draft: --data {args.data} exists and is not a data "
                         f"cache (no {args.data}.json beside it); pass --overwrite to replace it, "
                         "or name a new file")
    out = args.out or os.path.join(DEFAULT_OUT, args.method)
    os.makedirs(out, exist_ok=True)
    t_start = time.perf_counter()
    target, tokenizer = load_model(args.model, DTYPES[args.dtype])
    # EAGLE-3's default low / mid / high features, as the loaded head will read them
    layers = (eagle3_target_layers({}, target.config.num_hidden_layers)
              if args.method == "eagle3" else [])
    meta = {"prompts": args.num_prompts, "new_tokens": args.new_tokens, "seed": args.seed,
            "layers": layers, "model": args.model, "dtype": args.dtype, "chat": args.chat,
            "data_precision": precision}
    if args.corpus != "default":  # data caches of the default corpus stay valid
        meta["corpus"] = args.corpus
    data_path = args.data or os.path.join(out, "data.pt")
    meta_path = data_path + ".json"
    data = None
    if os.path.exists(data_path) and os.path.exists(meta_path):
        with open(meta_path) as f:
            cached = json.load(f)
        # EAGLE reads only the final hidden state, which every data file carries.
        same = ({k: v for k, v in cached.items() if k != "layers"} ==
                {k: v for k, v in meta.items() if k != "layers"}
                and (cached["layers"] == layers or not layers))
        if same:
            data = DraftData.load(data_path)
            _log(f"[train-draft] reusing {data_path}: {len(data)} sequences")
        elif args.data and not args.overwrite:
            raise SystemExit(f"specdec train-draft: --data {data_path} was built with {cached}, "
                             f"this run needs {meta} (--overwrite rebuilds it)")
    if data is None:
        prompts = [encode_prompt(tokenizer, t) if isinstance(t, StylePrompt)
                   else encode(tokenizer, t, args.chat) for t in texts]
        data = build_draft_data(target, prompts, layers, new_tokens=args.new_tokens,
                                eos_token_id=tokenizer.eos_token_id, max_batch=args.max_batch,
                                compile=False if args.eager else None, precision=precision,
                                progress=_log)
        data.save(data_path)
        with open(meta_path, "w") as f:
            json.dump(meta, f)
    t_data = time.perf_counter() - t_start
    _log(f"[train-draft] data ({data.precision} target): {len(data)} sequences, "
         f"{data.num_tokens()} tokens ({data.num_generated_tokens} generated) in {t_data:.0f} s")
    _log(f"[train-draft] training in {cfg.precision}"
         f"{'' if cfg.compile_loss else ' (eager loss)'}")
    t0 = time.perf_counter()
    train_head(target, data, out, cfg, draft_vocab_size=args.draft_vocab_size,
               resume=args.resume, progress=_log)
    t_train = time.perf_counter() - t0
    _log(f"[train-draft] wrote {out} (published {args.method} layout, bf16); data {t_data:.0f} s, "
         f"training {t_train:.0f} s, total {time.perf_counter() - t_start:.0f} s")
    if args.eval:
        from specdec_inductor.train.evaluate import evaluate_head, format_eval
        result = evaluate_head(args.method, out, model_path=args.model, dtype=args.dtype,
                               chat=args.chat, compile=False, progress=_log)
        print(format_eval(result))
    return 0
