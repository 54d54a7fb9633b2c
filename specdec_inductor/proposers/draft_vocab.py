"""A draft vocabulary for STANDALONE drafts: the draft model's LM head restricted to Vd target
ids, so that each draft step streams Vd head rows instead of V (the 0.5B Qwen2.5-Coder's head
is 151936 x 896 Q8_0, about 37% of the bytes its decode step reads). The input embedding stays
whole: the draft reads every token the target commits.

The ids: the Vd most frequent in a text sample tokenized with the draft's tokenizer, the
Python standard library's own sources (code with English docstrings and comments, on every
machine that runs us, nothing fetched), ties and unseen ids in id order (a BPE vocabulary's ids
follow its merge order, itself a frequency order). The ranking is cached per tokenizer.

Greedy output stays the target's (the target verifies every draft). Sampling stays lossless:
the drafts are the draft's argmax over its Vd columns, deterministic candidates that
tree_speculative_sampling accepts against the target's own distribution (the draft's q is
never read), as EAGLE-3's reduced-vocabulary drafts are.
"""
import glob
import hashlib
import json
import os
import sysconfig
from typing import Iterable, Optional

import torch
from torch import Tensor, nn

# Rows the head keeps come in whole 16-row groups: the INT8 kernel's interleaved layout of a
# quantized head (gguf_model.kernel_layout) needs N % 16 == 0, and a head that missed it would
# run the slower file layout.
GROUP_ROWS = 16


def stdlib_sources() -> Iterable[str]:
    """The texts of the Python standard library's .py files in sorted order (not its tests,
    idlelib or site-packages: test data and GUI strings are no one's output)."""
    root = sysconfig.get_paths()["stdlib"]
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, root)
        if rel.split(os.sep)[0] in ("test", "idlelib", "site-packages") or "/tests/" in path:
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()


def count_tokens(tokenizer, vocab_size: int, texts: Iterable[str]) -> Tensor:
    """How often each id [vocab_size] occurs in `texts` tokenized with `tokenizer`."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for text in texts:
        ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.int64)
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"argument 'tokenizer' makes id {int(ids.max())}, outside the "
                             f"model's vocabulary of {vocab_size}")
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def rank_by_count(counts: Tensor) -> Tensor:
    """All ids [V] by descending count, ties in id order."""
    ids = torch.arange(counts.numel())
    # A stable sort on -count keeps equal counts in id order.
    return ids[torch.sort(-counts, stable=True).indices]


def _ranking_file(tokenizer, vocab_size: int) -> str:
    from specdec_inductor.loading import cache_root
    key = json.dumps([sorted(tokenizer.get_vocab().items()), vocab_size,
                      sysconfig.get_python_version()])
    digest = hashlib.sha1(key.encode()).hexdigest()[:16]
    return os.path.join(cache_root(), "draft_vocab", f"stdlib-{vocab_size}-{digest}.pt")


def frequency_ranking(tokenizer, vocab_size: int) -> Tensor:
    """All ids [vocab_size] by descending frequency in the standard library's sources
    (stdlib_sources) tokenized with `tokenizer`, ties in id order; cached per tokenizer."""
    path = _ranking_file(tokenizer, vocab_size)
    if os.path.exists(path):
        return torch.load(path, weights_only=True).to(torch.int64)
    ranking = rank_by_count(count_tokens(tokenizer, vocab_size, stdlib_sources()))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    torch.save(ranking.to(torch.int32), tmp)
    os.replace(tmp, path)  # readers never see half a file
    return ranking


class DraftVocabError(ValueError):
    """A draft vocabulary that cannot work; `problem` says why (the message names the
    argument)."""

    def __init__(self, problem: str, name: str = "draft_vocab"):
        super().__init__(f"argument '{name}': {problem}")
        self.problem = problem


def draft_vocab_problem(size, vocab_size: Optional[int]) -> Optional[str]:
    """Why `size` cannot be a draft vocabulary's size (None: it can): it must be an int
    multiple of GROUP_ROWS below vocab_size (None: unknown yet)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < GROUP_ROWS or size % GROUP_ROWS:
        return (f"must be an int multiple of {GROUP_ROWS} (whole 16-row groups of a quantized "
                f"head), got {size!r}")
    if vocab_size is not None and size >= vocab_size:
        return (f"must be below the draft's vocabulary of {vocab_size} tokens (leave it unset "
                f"for the whole head), got {size}")
    return None


def check_draft_vocab_size(size, vocab_size: Optional[int], name: str = "draft_vocab") -> None:
    """Raises DraftVocabError naming `name` where draft_vocab_problem finds one."""
    problem = draft_vocab_problem(size, vocab_size)
    if problem is not None:
        raise DraftVocabError(problem, name)


def top_ids(ranking: Tensor, size: int) -> Tensor:
    """The first `size` ids of `ranking`, ascending [size] (a draft vocabulary)."""
    check_draft_vocab_size(size, ranking.numel())
    return ranking[:size].sort().values


def _check_ids(ids: Tensor, vocab_size: int) -> None:
    if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.is_floating_point() or ids.dtype == torch.bool:
        raise DraftVocabError(f"must be a 1-D integer tensor of target ids, got "
                              f"{getattr(ids, 'dtype', type(ids))}", "ids")
    check_draft_vocab_size(ids.numel(), vocab_size, "ids")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or not bool((ids[1:] > ids[:-1]).all()):
        raise DraftVocabError(f"must be distinct ascending ids in [0, {vocab_size})", "ids")


def _contiguous_range(ids: Tensor) -> Optional[slice]:
    """ids as a slice when they are one run lo, lo + 1, ..., hi - 1, else None."""
    lo = int(ids[0])
    if int(ids[-1]) - lo + 1 == ids.numel():
        return slice(lo, lo + ids.numel())
    return None


def _quant_rows(head, ids: Tensor):
    """A QuantLinear head's rows `ids`: a view of the weight's bytes when they are one run of
    whole row groups, else the rows' quantized blocks gathered (QuantLinear.select_rows)."""
    from specdec_inductor.engine.gguf_model import QuantLinear
    from specdec_inductor.ops.quant import group_rows
    run, group = _contiguous_range(ids), group_rows(head.fmt)
    if run is None or run.start % group:
        return head.select_rows(ids)
    weight = head.weight[run.start // group:run.stop // group]
    bias = None if head.bias is None else head.bias[run]
    return QuantLinear(weight, head.fmt, head.in_features, bias, head.activation)


def _dense_rows(head: nn.Linear, ids: Tensor) -> nn.Linear:
    """An nn.Linear head's rows `ids` in its own dtype: a view when they are one run, else a
    gather."""
    run = _contiguous_range(ids)
    pick = (lambda t: t[run]) if run is not None else (lambda t: t[ids])
    out = nn.Linear(head.in_features, ids.numel(), bias=head.bias is not None,
                    device="meta", dtype=head.weight.dtype)
    out.weight = nn.Parameter(pick(head.weight.detach()), requires_grad=False)
    if head.bias is not None:
        out.bias = nn.Parameter(pick(head.bias.detach()), requires_grad=False)
    return out


def restrict_lm_head(model, ids: Tensor) -> None:
    """Restrict `model`'s LM head to the output rows `ids` (distinct ascending target ids, a
    multiple of GROUP_ROWS of them), in place, before an Engine is made over it: its logits
    become Vd wide, column j the target id ids[j], recorded as `model.draft_to_target` (the
    Engine's vocab_size is then Vd: engine/hf.model_shape; the proposer maps the columns back:
    DraftModelProposer.draft_token_map). The rows stay in the head's format (never an fp32
    copy of quantized blocks); the input embedding stays whole, even where the head shared it."""
    if getattr(model, "draft_to_target", None) is not None:
        raise ValueError("argument 'model' already has a draft vocabulary")
    head = model.get_output_embeddings()
    vocab_size = head.out_features
    _check_ids(ids, vocab_size)
    ids = ids.to(torch.int64)
    from specdec_inductor.engine.gguf_model import QuantLinear
    rows = _quant_rows(head, ids) if isinstance(head, QuantLinear) else _dense_rows(head, ids)
    model.set_output_embeddings(rows)
    model.register_buffer("draft_to_target", ids.clone(), persistent=False)


def model_tokenizer(model):
    """The tokenizer of a model loaded from a GGUF file (its metadata directory) or an HF
    directory; None when it has neither (a model built from a config)."""
    from transformers import AutoTokenizer
    gguf_path = getattr(model, "gguf_path", None)
    if gguf_path:
        from specdec_inductor.engine.gguf_model import gguf_metadata_dir
        return AutoTokenizer.from_pretrained(gguf_metadata_dir(gguf_path))
    name = getattr(getattr(model, "config", None), "_name_or_path", "")
    return AutoTokenizer.from_pretrained(name) if name and os.path.isdir(name) else None


def apply_draft_vocab(model, size: int) -> Tensor:
    """Restrict `model`'s LM head to its tokenizer's `size` most frequent ids
    (frequency_ranking; restrict_lm_head); returns them. A model that already keeps a draft
    vocabulary (a draft shared by several proposers) must keep one of this size. Raises
    DraftVocabError for a bad size or a model without a tokenizer."""
    kept = getattr(model, "draft_to_target", None)
    if kept is not None:
        if kept.numel() != size:
            raise DraftVocabError(f"the draft model already keeps a draft vocabulary of "
                                  f"{kept.numel()} ids, not {size}")
        return kept
    vocab_size = model.get_output_embeddings().out_features
    check_draft_vocab_size(size, vocab_size)
    tokenizer = model_tokenizer(model)
    if tokenizer is None:
        raise DraftVocabError("the draft model has no tokenizer to rank its ids by frequency "
                              "(load it from a GGUF file or a model directory)")
    ids = top_ids(frequency_ranking(tokenizer, vocab_size), size)
    restrict_lm_head(model, ids)
    return ids
