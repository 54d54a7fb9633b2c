"""Held-out evaluation of a draft head: mean accepted length and per-position acceptance on
corpus.heldout_prompts() (never in the training data), for chain and tree settings, with greedy
exactness against plain decoding checked on every prompt. Acceptance does not depend on
compilation, so it runs eager by default (each tree shape would compile its own draft graphs);
benchmarks/bench_spec.py measures the compiled speed."""
from typing import Callable, List, Optional, Sequence, Tuple

# (N nodes incl. the root, topk, depth): a chain and EAGLE-2-style trees ((8, 3, 4) is the
# EAGLE-3 default, proposers/registry.DEFAULT_TREES).
DEFAULT_SETTINGS: List[Tuple[int, int, int]] = [(6, 1, 5), (8, 2, 4), (8, 3, 4), (12, 4, 4)]


def evaluate_head(method: str, head_dir: str, *, model_path: Optional[str] = None,
                  dtype: str = "fp32", chat: bool = True, compile: bool = False,
                  new_tokens: int = 96, prompts: Optional[Sequence[str]] = None,
                  settings: Sequence[Tuple[int, int, int]] = DEFAULT_SETTINGS,
                  progress: Callable[[str], None] = lambda s: None) -> dict:
    from specdec_inductor.loading import load_model
    from specdec_inductor.loading import DTYPES, encode
    from specdec_inductor.proposers.registry import (ProposerConfig, make_proposer,
                                                     make_target_engine)
    from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats
    from specdec_inductor.train.corpus import heldout_prompts
    target, tokenizer = load_model(model_path, DTYPES[dtype])
    texts = list(prompts or heldout_prompts())
    ids = [encode(tokenizer, t, chat) for t in texts]
    rows = []
    engine = None
    for n, topk, depth in settings:
        try:
            config = ProposerConfig(method=method, draft_model=head_dir, num_draft_tokens=n,
                                    topk=topk, depth=depth, target_model=model_path, dtype=dtype)
            if engine is None:
                engine = make_target_engine(config, target, max_batch=1, max_len=512,
                                            compile=None if compile else False)
                plain = [engine.generate([p], new_tokens, tokenizer.eos_token_id)[0] for p in ids]
            proposer = make_proposer(config, engine)
        except ValueError as exc:
            progress(f"[eval] N={n} topk={topk} depth={depth}: not available ({exc})")
            continue
        spec = SpeculativeGenerator(engine, proposer, min_accepted=0.0)
        stats = SpeculativeStats()
        exact = True
        for p, want in zip(ids, plain):
            got = spec.generate([p], new_tokens, tokenizer.eos_token_id, stats)[0]
            exact &= got == want
        rows.append({"num_draft_tokens": n, "topk": topk, "depth": depth,
                     "mean_accepted_length": stats.mean_accepted_length,
                     "acceptance_by_position": stats.acceptance_by_position,
                     "verify_steps": stats.verify_steps, "exact": exact})
        progress(f"[eval] N={n} topk={topk} depth={depth}: {stats.summary()}")
        proposer.finish(list(range(engine.max_batch)))
    return {"method": method, "head": head_dir, "prompts": len(texts), "new_tokens": new_tokens,
            "rows": rows}


def format_eval(result: dict) -> str:
    lines = [f"# held-out evaluation of {result['head']} ({result['method']}): "
             f"{result['prompts']} prompts, {result['new_tokens']} new tokens, greedy",
             "| N | topk | depth | mean accepted length | acceptance by position | == greedy |",
             "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        acc = " ".join(f"{a:.2f}" for a in r["acceptance_by_position"])
        lines.append(f"| {r['num_draft_tokens']} | {r['topk']} | {r['depth']} | "
                     f"{r['mean_accepted_length']:.2f} | {acc} | {'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines)
