"""Stock Hugging Face causal LMs through our attention, without editing model classes.

`register()` adds the "specdec" attention implementation to transformers
(`AttentionInterface` + an `AttentionMaskInterface` entry that builds no mask); a model switched
to it (`use_specdec_attention(model)`) writes each layer's new K/V into our pool and attends over
the pool. Per-step pool metadata travels as one `StepBatch` in the forward kwargs
(`model(..., specdec_batch=batch)`), which transformers hands to every attention call; the
model runs with `use_cache=False` and positions come in through `position_ids`.

Also here: the decoder layers as one nested compile region (compile_layers_once) and the shape
the engine reads off a model (model_shape). Loading models is specdec_inductor/loading.py's.
"""
import enum
import types
from dataclasses import dataclass
from typing import Dict, NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from specdec_inductor.engine import attention_backend as ab
from specdec_inductor.engine.kv_pool import KVPool

ATTN_IMPLEMENTATION = "specdec"


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
