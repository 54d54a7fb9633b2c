"""The one place that knows the speculative methods: a `ProposerConfig` names a method and its
draft shape; from it come what the target Engine must capture (`target_capture`,
`make_target_engine`), the draft Engine's size (`draft_engine_size`) and the proposer itself
(`make_proposer`). The CLI, the benchmarks and training build their proposers here.
"""
import os
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from specdec_inductor import loading
from specdec_inductor.proposers.ngram import RECOMMENDED_WINDOW
from specdec_inductor.proposers.tree_draft import check_tree_shape

METHODS = ("none", "ngram", "standalone", "eagle", "eagle3", "mtp")
DRAFT_MODEL_METHODS = ("standalone", "eagle", "eagle3", "mtp")  # chains or top-k trees
HEAD_METHODS = ("eagle", "eagle3")  # a head checkpoint directory (shipped for the default model)
HIDDEN_METHODS = ("eagle", "eagle3", "mtp")  # draft from the target's hidden states

# The draft tree when neither topk nor depth is given (and N holds it). EAGLE-3 drafts topk 3 /
# depth 4: with the shipped head it accepts more per step than topk 2 (train/evaluate.py) and
# the longer drafting pays for it; EAGLE keeps topk 2 / depth 4, which beat its chain of N-1
# drafts (benchmarks/RESULTS.md).
DEFAULT_TREES = {"eagle": (2, 4), "eagle3": (3, 4)}

# Methods whose requests draft with prompt lookup first unless told otherwise (the CLI's
# --lookup / --no-lookup; ProposerConfig.lookup itself defaults to off, so that benchmarks name
# each variant). EAGLE-3 with the shipped head: lookup first beat the head alone on the 30
# style-held-out prompts in every run (1.39-1.53x against 1.09-1.19x our AR), on the corpus's
# 18 held-out prompts (1.73x against 1.68x) and on the quantized SmolLM2 (1.03x against
# 0.88x), and serves as the head alone does under concurrency since the acceptance gate
# judges its batches per bucket (benchmarks/RESULTS.md). STANDALONE with lookup lost on the
# Qwen2.5-Coder pair; EAGLE and MTP were not measured with it.
LOOKUP_BY_DEFAULT = ("eagle3",)


def default_lookup(method: str) -> bool:
    """Whether `method` drafts with prompt lookup first when the caller does not say."""
    return method in LOOKUP_BY_DEFAULT


# STANDALONE without a draft model drafts with the target cut to its first layers: a draft
# that is the whole target would never pay.
DEFAULT_DRAFT_LAYERS = 8

# NGRAM keeps two children at the first draft level, chains below: on SmolLM2 code prompts
# (benchmarks/bench_spec.py --ngram-breadth) it accepts more per verify than a plain chain at
# the same N.
DEFAULT_NGRAM_BREADTH = (2, 1)


class ProposerConfigError(ValueError):
    """A ProposerConfig field that cannot work; `field` names it ("a/b" when several share
    the blame, as a tree shape's)."""

    def __init__(self, field: str, message: str):
        super().__init__(f"argument '{field}': {message}")
        self.field, self.message = field, message


@dataclass(frozen=True)
class ProposerConfig:
    """Everything that decides a speculative method's proposer; checked when made (raises
    ProposerConfigError naming the field).

    method: one of METHODS ("none": plain decoding through the speculative loop).
    num_draft_tokens: N, tree nodes including the root (>= 2 with a method).
    topk / depth: draft-model methods' tree shape; None: the method's DEFAULT_TREES entry
        when N holds it, else a chain (topk 1, depth N - 1).
    draft_model: standalone: the draft's model name or path (default: the target, cut to
        draft_layers); eagle / eagle3: the head's checkpoint directory (default: the head
        shipped for the default model).
    draft_layers: standalone: keep the draft's first K layers (default DEFAULT_DRAFT_LAYERS
        when the draft is the target itself).
    draft_vocab: standalone: the draft's LM head keeps only its tokenizer's Vd most frequent
        ids (a multiple of 16; proposers/draft_vocab.py); None: the whole head.
    draft_stop_below: standalone chains: a chain ends at a draft whose probability under the
        draft is below this (DraftModelProposer stop_below; 0: never), and the generator then
        verifies at every size 1..N (Proposer.variable_drafts).
    draft_dtype: eagle, eagle3: the head's own weights, "auto" (bf16 where our bf16 kernels
        run, else the target's dtype) or a loading.DTYPES name.
    mtp_layer: mtp: which of the model's NextN layers drafts.
    ngram_window / ngram_breadth: ngram: (MIN, MAX) suffix lengths; children per level.
    lookup: draft-model methods: a request whose context suffix repeats earlier context
        drafts the repeat's continuation (NGRAM, with ngram_window / ngram_breadth) that step
        instead of the draft model (proposers/lookup_first.py).
    target_model: the target's model argument (None: the default model): which heads ship,
        the MTP checkpoint, standalone's default draft.
    dtype / dequantize / quant_activations: how a standalone draft model is loaded (as the
        target is: loading.load_checked).
    """
    method: str = "none"
    num_draft_tokens: int = 8
    topk: Optional[int] = None
    depth: Optional[int] = None
    draft_model: Optional[str] = None
    draft_layers: Optional[int] = None
    draft_vocab: Optional[int] = None
    draft_stop_below: float = 0.0
    draft_dtype: str = "auto"
    mtp_layer: int = 0
    ngram_window: Tuple[int, int] = RECOMMENDED_WINDOW
    ngram_breadth: Tuple[int, ...] = DEFAULT_NGRAM_BREADTH
    lookup: bool = False
    target_model: Optional[str] = None
    dtype: str = "fp32"
    dequantize: bool = False
    quant_activations: str = "auto"

    def __post_init__(self):
        _check_config(self)

    @property
    def drafts_with_model(self) -> bool:
        return self.method in DRAFT_MODEL_METHODS

    def tree_shape(self) -> Tuple[int, int]:
        """(topk, depth) of the draft: as given, else the method's DEFAULT_TREES entry when N
        holds it, else a chain (1, N - 1)."""
        n = self.num_draft_tokens
        if self.topk is None and self.depth is None and self.method in DEFAULT_TREES:
            topk, depth = DEFAULT_TREES[self.method]
            try:
                check_tree_shape(n, topk, depth)
                return topk, depth
            except ValueError:
                pass
        return (1 if self.topk is None else self.topk), (n - 1 if self.depth is None else self.depth)

    def head_dir(self) -> str:
        """eagle / eagle3: draft_model, else the head shipped for the default model."""
        return self.draft_model or loading.shipped_head(self.method)


def _positive(name: str, value, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ProposerConfigError(name, f"must be an int >= 1, got {value!r}")


def _check_config(c: ProposerConfig) -> None:
    if c.method not in METHODS:
        raise ProposerConfigError("method", f"must be one of {', '.join(METHODS)}, got {c.method!r}")
    _positive("num_draft_tokens", c.num_draft_tokens, allow_none=False)
    if c.method != "none" and c.num_draft_tokens < 2:
        raise ProposerConfigError("num_draft_tokens", f"must be >= 2 with method {c.method} "
                                  f"(the root and at least one draft), got {c.num_draft_tokens}")
    _check_tree(c)
    _check_draft_model(c)
    if c.draft_dtype != "auto" and c.draft_dtype not in loading.DTYPES:
        raise ProposerConfigError("draft_dtype", f"must be auto or one of "
                                  f"{', '.join(loading.DTYPES)}, got {c.draft_dtype!r}")
    if c.dtype not in loading.DTYPES:
        raise ProposerConfigError("dtype", f"must be one of {', '.join(loading.DTYPES)}, got "
                                  f"{c.dtype!r}")
    if isinstance(c.mtp_layer, bool) or not isinstance(c.mtp_layer, int) or c.mtp_layer < 0:
        raise ProposerConfigError("mtp_layer", f"must be an int >= 0, got {c.mtp_layer!r}")
    if not isinstance(c.lookup, bool):
        raise ProposerConfigError("lookup", f"must be a bool, got {c.lookup!r}")
    if c.lookup and not c.drafts_with_model:
        raise ProposerConfigError("lookup", f"applies to method "
                                  f"{'/'.join(DRAFT_MODEL_METHODS)}, not {c.method}")
    lo, hi = c.ngram_window
    if not 1 <= lo <= hi:
        raise ProposerConfigError("ngram_window", f"needs 1 <= MIN <= MAX, got {lo},{hi}")
    if not c.ngram_breadth or any(isinstance(b, bool) or not isinstance(b, int) or b < 1
                                  for b in c.ngram_breadth):
        raise ProposerConfigError("ngram_breadth", f"must be ints >= 1, got {c.ngram_breadth!r}")


def _check_tree(c: ProposerConfig) -> None:
    _positive("topk", c.topk)
    _positive("depth", c.depth)
    if not c.drafts_with_model:
        if c.topk not in (None, 1) or c.depth is not None:
            raise ProposerConfigError("topk/depth", f"apply to method "
                                      f"{'/'.join(DRAFT_MODEL_METHODS)}, not {c.method}")
        return
    try:
        check_tree_shape(c.num_draft_tokens, *c.tree_shape())
    except ValueError as exc:
        raise ProposerConfigError("num_draft_tokens/topk/depth", str(exc)) from None


def _check_draft_model(c: ProposerConfig) -> None:
    if c.method != "standalone" and c.draft_layers is not None:
        raise ProposerConfigError("draft_layers", f"applies to method standalone, not {c.method}")
    _positive("draft_layers", c.draft_layers)
    if c.method != "standalone" and c.draft_vocab is not None:
        raise ProposerConfigError("draft_vocab", f"applies to method standalone, not {c.method}")
    _check_stop_below(c)
    if c.draft_vocab is not None:
        from specdec_inductor.proposers.draft_vocab import draft_vocab_problem
        # the upper bound (the draft's vocabulary) is checked once the draft is loaded
        problem = draft_vocab_problem(c.draft_vocab, None)
        if problem is not None:
            raise ProposerConfigError("draft_vocab", problem)
    if c.method == "standalone":
        try:
            loading.check_model_arg(c.draft_model)
        except ValueError as exc:
            raise ProposerConfigError("draft_model", str(exc)) from None
    elif c.method in HEAD_METHODS:
        if c.draft_model is not None and not os.path.isdir(c.draft_model):
            raise ProposerConfigError("draft_model", f"{c.draft_model!r} is not a directory")
        if c.draft_model is None and not loading.is_default_model(c.target_model):
            raise ProposerConfigError("draft_model", f"method {c.method} needs a head "
                                      "checkpoint directory for a target other than the "
                                      "default model (heads ship for it only)")
        if c.draft_model is None and not os.path.exists(os.path.join(c.head_dir(), "config.json")):
            raise ProposerConfigError("draft_model", f"method {c.method} needs a head "
                                      f"checkpoint directory: no head is shipped at "
                                      f"{c.head_dir()} (`specdec train-draft --method "
                                      f"{c.method}` makes one)")
    elif c.draft_model is not None:
        raise ProposerConfigError("draft_model", f"applies to method standalone/eagle/eagle3, "
                                  f"not {c.method}")


def _check_stop_below(c: ProposerConfig) -> None:
    p = c.draft_stop_below
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ProposerConfigError("draft_stop_below", f"must be a probability in [0, 1), got {p!r}")
    if p and c.method != "standalone":
        raise ProposerConfigError("draft_stop_below", f"applies to method standalone, not "
                                  f"{c.method}")
    if p and c.drafts_with_model and c.tree_shape()[0] != 1:
        raise ProposerConfigError("draft_stop_below", "applies to chains (topk 1), not trees")


# -- the target Engine ---------------------------------------------------------------------------
def target_capture(config: ProposerConfig, target_model) -> Optional[List[int]]:
    """The target hidden_states the method drafts from (Engine capture_hidden), None for none:
    EAGLE and MTP read the final normed hidden, EAGLE-3 the three layers its head names."""
    if config.method == "eagle3":
        from specdec_inductor.proposers.eagle import EagleCheckpointError
        from specdec_inductor.proposers.eagle3 import read_target_layers
        try:
            return read_target_layers(config.head_dir(), target_model)
        except EagleCheckpointError as exc:
            raise ProposerConfigError("draft_model", str(exc)) from exc
    return [-1] if config.method in HIDDEN_METHODS else None


def make_target_engine(config: ProposerConfig, target_model, **engine_kwargs):
    """The target Engine over `target_model` that the method's proposer drafts for (it
    captures target_capture); engine_kwargs go to Engine (max_batch, max_len, compile, ...)."""
    from specdec_inductor.engine.engine import Engine
    return Engine(target_model, capture_hidden=target_capture(config, target_model),
                  **engine_kwargs)


def draft_engine_size(config: ProposerConfig, target_engine) -> Tuple[int, int]:
    """(max_batch, max_len) of the method's draft Engine: the target's for a chain; a top-k
    tree decodes batch*topk beams through one virtual row each (next to the requests' rows)
    and writes topk*(depth-1) slots past the target's positions (tree_draft.py)."""
    topk, depth = config.tree_shape()
    if topk <= 1:
        return target_engine.max_batch, target_engine.max_len
    return target_engine.max_batch * (1 + topk), target_engine.max_len + topk * depth


def head_dtype(config: ProposerConfig, target_model) -> torch.dtype:
    """An EAGLE or EAGLE-3 head's own weights: draft_dtype, or for "auto" bf16 where our bf16
    kernels run, else the target's dtype (eagle3.default_head_dtype)."""
    if config.draft_dtype != "auto":
        return loading.DTYPES[config.draft_dtype]
    from specdec_inductor.proposers.eagle3 import default_head_dtype
    return default_head_dtype(next(target_model.parameters()).dtype)


# -- the proposer --------------------------------------------------------------------------------
def make_proposer(config: ProposerConfig, target_engine=None, *, draft=None,
                  log: Callable[[str], None] = lambda msg: None):
    """The proposer of config.method for `target_engine` (the Engine it drafts for, made by
    make_target_engine; not needed by none and ngram). A draft-model method gets its own draft
    Engine (draft_engine_size, the target's compile mode and attention backend).

    draft: standalone only, the draft model already loaded (e.g. shared by the proposers of
    several tree shapes); default: loaded as the config says. `log` receives one line on
    what drafts (the draft model or head)."""
    if config.method == "none":
        from specdec_inductor.proposers.autoregressive import AutoregressiveProposer
        return AutoregressiveProposer()
    if config.method == "ngram":
        return _ngram(config)
    if target_engine is None:
        raise ValueError(f"argument 'target_engine': method {config.method} drafts for a target "
                         "Engine (make_target_engine)")
    if draft is not None and config.method != "standalone":
        raise ValueError(f"argument 'draft' applies to method standalone, not {config.method}")
    from specdec_inductor.proposers.eagle import EagleCheckpointError
    from specdec_inductor.proposers.mtp import MtpCheckpointError
    try:
        proposer = _DRAFT_MODEL_PROPOSERS[config.method](config, target_engine, draft, log)
    except EagleCheckpointError as exc:  # EAGLE-3's too
        raise ProposerConfigError("draft_model", str(exc)) from exc
    except MtpCheckpointError as exc:
        raise ProposerConfigError("target_model", f"method mtp drafts with the model's own "
                                  f"NextN layer: {exc}") from exc
    if not config.lookup:
        return proposer
    from specdec_inductor.proposers.lookup_first import LookupFirstProposer
    log("prompt lookup first: repeats of the context draft their continuation")
    return LookupFirstProposer(proposer, _ngram(config))


def _ngram(config: ProposerConfig):
    from specdec_inductor.proposers.ngram import NgramProposer
    lo, hi = config.ngram_window
    return NgramProposer(num_draft_tokens=config.num_draft_tokens, min_window=lo, max_window=hi,
                         breadth=config.ngram_breadth)


def _draft_model_proposer(cls, config: ProposerConfig, target_engine, model,
                          stop_below: float = 0.0, **engine_kwargs):
    """cls (a DraftModelProposer; its chains end below `stop_below`) over a draft Engine
    running `model`, sized by draft_engine_size, in the target's compile mode and attention
    backend."""
    from specdec_inductor.engine.engine import Engine
    max_batch, max_len = draft_engine_size(config, target_engine)
    engine = Engine(model, max_batch=max_batch, max_len=max_len, compile=target_engine.compiled,
                    attention=target_engine.attention_backend.value, **engine_kwargs)
    topk, depth = config.tree_shape()
    return cls(engine, config.num_draft_tokens, topk=topk, depth=depth, stop_below=stop_below)


def _head_proposer(cls, config: ProposerConfig, target_engine, head):
    """cls over a one-layer head's draft Engine: it returns its own output g (the next draft
    step's feature) and extends in DRAFT_PREFILL_CHUNK rows."""
    from specdec_inductor.proposers.eagle import DRAFT_PREFILL_CHUNK
    return _draft_model_proposer(cls, config, target_engine, head,
                                 prefill_chunk=DRAFT_PREFILL_CHUNK, capture_hidden=[-1])


def standalone_draft_layers(config: ProposerConfig) -> Optional[int]:
    """The first layers a STANDALONE draft keeps: draft_layers, DEFAULT_DRAFT_LAYERS for the
    target itself, None (all) for another model."""
    if config.draft_layers is None and config.draft_model is None:
        return DEFAULT_DRAFT_LAYERS
    return config.draft_layers


def load_standalone_draft(config: ProposerConfig):
    """The STANDALONE draft model: draft_model (default: the target) loaded as the target is,
    cut to standalone_draft_layers."""
    from specdec_inductor.loading import keep_first_layers
    draft, _ = loading.load_checked(config.draft_model or config.target_model,
                                    loading.DTYPES[config.dtype], config.dequantize,
                                    config.quant_activations)
    layers = standalone_draft_layers(config)
    if layers is not None:
        try:
            keep_first_layers(draft, layers)
        except ValueError as exc:
            raise ProposerConfigError("draft_layers", str(exc)) from None
    return draft


def _standalone(config, target_engine, draft, log):
    from specdec_inductor.proposers.standalone import StandaloneProposer, check_draft_vocabulary
    draft = load_standalone_draft(config) if draft is None else draft
    try:
        check_draft_vocabulary(draft, target_engine.model, config.draft_model or "(the target)")
    except ValueError as exc:
        raise ProposerConfigError("draft_model", str(exc)) from None
    if config.draft_vocab is not None:
        from specdec_inductor.proposers.draft_vocab import DraftVocabError, apply_draft_vocab
        try:
            apply_draft_vocab(draft, config.draft_vocab)
        except DraftVocabError as exc:
            raise ProposerConfigError("draft_vocab", exc.problem) from None
    layers = standalone_draft_layers(config)
    vocab = getattr(draft, "draft_to_target", None)
    log(f"draft: {config.draft_model or 'the target'}"
        f"{'' if layers is None else f', first {layers} layers'}"
        f"{'' if vocab is None else f', draft vocabulary {vocab.numel()}'}"
        f"{f', chains end below p {config.draft_stop_below}' if config.draft_stop_below else ''}")
    return _draft_model_proposer(StandaloneProposer, config, target_engine, draft,
                                 config.draft_stop_below)


def _eagle(config, target_engine, draft, log):
    from specdec_inductor.proposers.eagle import EagleProposer, load_eagle_head
    head = load_eagle_head(config.head_dir(), target_engine.model,
                           dtype=head_dtype(config, target_engine.model))
    vocab = head.draft_to_target
    log(f"EAGLE head: {config.head_dir()} ("
        f"{'' if vocab is None else f'draft vocabulary {vocab.numel()}, '}"
        f"{str(head.fc.weight.dtype)[6:]})")
    return _head_proposer(EagleProposer, config, target_engine, head)


def _eagle3(config, target_engine, draft, log):
    from specdec_inductor.proposers.eagle3 import Eagle3Proposer, load_eagle3_head
    head = load_eagle3_head(config.head_dir(), target_engine.model,
                            head_dtype(config, target_engine.model))
    if target_engine.capture_hidden != head.target_hidden_layers:
        raise ValueError(f"argument 'target_engine' captures {target_engine.capture_hidden}, the "
                         f"EAGLE-3 head needs {head.target_hidden_layers} (make_target_engine)")
    log(f"EAGLE-3 head: {config.head_dir()} (target layers {head.target_hidden_layers}, draft "
        f"vocabulary {head.lm_head.out_features}, {str(head.lm_head.weight.dtype)[6:]})")
    return _head_proposer(Eagle3Proposer, config, target_engine, head)


def _mtp(config, target_engine, draft, log):
    from specdec_inductor.proposers.mtp import MtpProposer, load_mtp_head
    head = load_mtp_head(loading.model_directory(config.target_model), target_engine.model,
                         config.mtp_layer)
    log(f"MTP (NextN) layer {config.mtp_layer} of {config.target_model or 'the default model'}")
    return _head_proposer(MtpProposer, config, target_engine, head)


_DRAFT_MODEL_PROPOSERS = {"standalone": _standalone, "eagle": _eagle, "eagle3": _eagle3,
                          "mtp": _mtp}
