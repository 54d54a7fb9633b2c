"""A GGUF file as a stock Hugging Face causal LM whose quantized tensors stay quantized.

`load_gguf(path)` builds the transformers model from the GGUF's config with no weights, then
fills it from the memory-mapped file: each quantized 2-D tensor becomes a `QuantLinear` (or the
`QuantEmbedding`) holding the tensor's bytes exactly as in the file, uint8 [N, row_bytes], a
zero-copy view of the mmap, run by `specdec_inductor.ops.quant`; F32/F16/BF16 tensors load dense.
`dequantize=True` gives the same model with every weight dense (via `gguf.quants.dequantize`).
Not here: the weights' kernels (ops/quant.py) or fetching files (models.py).
"""
import collections
import os
import re
import shutil
import struct
import tempfile
import warnings
from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from specdec_inductor.engine import hugepages as huge_pages
from specdec_inductor.ops.quant import (QuantActivation, QuantFormat, file_format, group_rows,
                                        int8_path, is_repacked, quant_block, quant_dequantize,
                                        quant_embedding, quant_linear, quant_repack,
                                        repacked_format)

if TYPE_CHECKING:  # gguf is imported where a file is read (an optional dependency)
    import gguf

# GGUF architectures we map, and whether llama.cpp's converter row-permuted their q/k weights
# (it does for llama-style rotary: HF's rotate-half layout -> GGML's interleaved pairs).
ARCHITECTURES = {"llama": True, "qwen2": False}
DENSE_TYPES = ("F32", "F16", "BF16")

# GGUF tensor name -> HF parameter name (the part after "model.layers.N." for per-layer ones).
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# Recomputed by transformers from the config's rope parameters (llama 3 style scaling).
_IGNORED = ("rope_freqs.weight",)


def hf_name(gguf_name: str) -> str:
    """The HF parameter name of a GGUF tensor (llama / qwen2 layout); KeyError if unknown."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise KeyError(gguf_name)
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation: output row r = GGUF row perm[r].
    GGUF rows are independent (each a whole number of quant blocks), so gathering the raw
    block rows with it is exact. Same as transformers' LlamaTensorProcessor, applied to row
    indices instead of dequantized values."""
    dim = num_rows // num_heads // 2
    return np.arange(num_rows).reshape(num_heads, dim, 2).swapaxes(2, 1).reshape(num_rows)


# File formats repacked at load for INT8 on VNNI (docs/decisions.md: Q6_K_R16 reads about as fast
# as the file layout at one row of x, 0.75-1.25x by shape, and 1.2-2.4x faster at 2-8 rows).
REPACKED_AT_LOAD = (QuantFormat.Q4_0, QuantFormat.Q4_1, QuantFormat.Q5_0, QuantFormat.Q5_1,
                    QuantFormat.Q8_0, QuantFormat.Q4_K, QuantFormat.Q6_K)


def kernel_layout(weight: Tensor, fmt, activation) -> Tuple[Tensor, QuantFormat]:
    """(weight, fmt) in the layout quant_linear reads fastest with `activation`: rows of
    REPACKED_AT_LOAD formats interleaved in 16-row groups (their *_R16 format, a new tensor) where
    INT8 runs the AVX-512 VNNI kernel, N is a multiple of 16 and K of the layout's block (64 for
    the 32-weight formats); the given file rows everywhere else (FLOAT, AVX2, portable, Q5_K /
    Q6_K, a tensor whose N or K does not fit), unchanged."""
    fmt = QuantFormat(int(fmt))
    packed = repacked_format(fmt) if fmt in REPACKED_AT_LOAD else None
    if (packed is None or QuantActivation(int(activation or 0)) != QuantActivation.INT8
            or weight.shape[0] % group_rows(packed) or int8_path(packed) != "avx512"):
        return weight, fmt
    size, nbytes = quant_block(fmt)
    if weight.shape[1] // nbytes * size % quant_block(packed)[0]:
        return weight, fmt
    return quant_repack(weight, fmt), packed


class QuantLinear(nn.Module):
    """y = x @ W^T + b with W kept in a GGUF quant format: `weight` is uint8 [N, row_bytes],
    the file's bytes (never written; often a read-only mmap view), or for fmt *_R16 our
    row-interleaved copy [N / 16, 16 * row_bytes] (kernel_layout; INT8 only)."""

    def __init__(self, weight: Tensor, fmt, in_features: int, bias: Optional[Tensor] = None,
                 activation=None):
        super().__init__()
        self.fmt = QuantFormat(int(fmt))
        # FLOAT (default): exact fp32 math on the exact weights; INT8: llama.cpp-style 8-bit
        # activations, faster. Both kernels give a row the same bits whatever M, but where a
        # compiled verify graph hands a layer activations that differ from the decode graph's
        # in the last bits, INT8's rounding can turn that into different tokens
        # (docs/decisions.md, INT8 activations and speculation).
        self.activation = QuantActivation(int(activation or 0))
        if is_repacked(self.fmt) and self.activation != QuantActivation.INT8:
            raise ValueError(f"argument 'activation' must be INT8 for the repacked fmt "
                             f"{self.fmt.name}, got {self.activation.name}")
        self.in_features, self.out_features = in_features, weight.shape[0] * group_rows(self.fmt)
        self.register_buffer("weight", weight, persistent=False)  # [N, row_bytes] uint8
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return quant_linear(x, self.weight, self.fmt, self.bias, activation=self.activation)

    def select_rows(self, index: Tensor) -> "QuantLinear":
        """The layer restricted to output rows `index` (a draft vocabulary's LM head): rows are
        whole quant blocks, so this is exact and stays quantized (a copy of those rows, in the
        layout kernel_layout picks for their count)."""
        rows, fmt = self.weight, self.fmt
        if is_repacked(fmt):
            rows, fmt = quant_repack(rows, fmt), file_format(fmt)  # the file's rows back
        weight, fmt = kernel_layout(rows[index], fmt, self.activation)
        return QuantLinear(weight, fmt, self.in_features,
                           None if self.bias is None else self.bias[index], self.activation)

    def dequantized_weight(self) -> Tensor:
        """The exact fp32 weight [N, K] (a new tensor; for code that needs dense rows)."""
        return quant_dequantize(self.weight, self.fmt)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"fmt={self.fmt.name}, activation={self.activation.name}, "
                f"bias={self.bias is not None}")


class QuantEmbedding(nn.Module):
    """Rows of a GGUF-quantized embedding table [V, row_bytes] uint8, dequantized to `dtype`."""

    def __init__(self, weight: Tensor, fmt, embedding_dim: int, dtype: torch.dtype):
        super().__init__()
        self.fmt = QuantFormat(int(fmt))
        self.num_embeddings = weight.shape[0] * group_rows(self.fmt)
        self.embedding_dim, self.dtype = embedding_dim, dtype
        # [V, row_bytes] uint8 (a repacked fmt: [V / 16, 16 * row_bytes], the tied LM head's)
        self.register_buffer("weight", weight, persistent=False)

    def forward(self, ids: Tensor) -> Tensor:
        return quant_embedding(ids, self.weight, self.fmt, self.dtype)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, fmt={self.fmt.name}, "
                f"dtype={self.dtype}")


def _cache_root() -> str:
    from specdec_inductor.loading import cache_root as root
    return root()


def gguf_metadata_dir(path: str) -> str:
    """Directory with the GGUF's config.json and tokenizer files (no weights), made once per
    file (keyed by name, size and mtime; written to a temp dir and renamed, so concurrent
    loaders never see half a directory). Converting a GGUF vocabulary takes seconds;
    reloading the directory a fraction of that."""
    from transformers import AutoConfig, AutoTokenizer
    stat = os.stat(path)
    key = f"{os.path.basename(path)}-{stat.st_size}-{int(stat.st_mtime)}"
    target = os.path.join(_cache_root(), "gguf-metadata", key)
    if os.path.exists(os.path.join(target, "config.json")):
        return target
    directory, file = os.path.split(os.path.abspath(path))
    config = AutoConfig.from_pretrained(directory, gguf_file=file)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file)
    if hasattr(config, "quantization_config"):  # we place the weights ourselves
        del config.quantization_config
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".tmp-")
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, target)  # atomic; a concurrent loader may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


class GGUFTensor(NamedTuple):
    name: str
    tensor_type: "gguf.GGMLQuantizationType"
    shape: Tuple[int, ...]  # GGUF order: shape[0] is the row length K
    data: np.ndarray  # [rows, row_bytes] uint8 for quant types, [rows, K] / [K] float otherwise


# GGUF metadata value types -> fixed byte size (8 = string, 9 = array are variable).
_VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_DENSE_NP = {"F32": np.float32, "F16": np.float16}


def read_gguf(path: str) -> Tuple[str, List[GGUFTensor]]:
    """(architecture, tensors) of a GGUF v2/v3 file, every tensor a view of one read-only
    np.memmap. Reads only what loading needs: gguf.GGUFReader parses every metadata value
    into numpy views (the vocabulary: ~6 s for SmolLM2's 49k tokens), this skips them."""
    import gguf
    data = np.memmap(path, mode="r")  # uint8 [file bytes]
    buf = memoryview(data)
    if len(buf) < 24 or bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"argument 'path': {path!r} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"argument 'path': GGUF version {version} is not supported")
    at = 24

    def string() -> str:
        nonlocal at
        (n,) = struct.unpack_from("<Q", buf, at)
        at += 8 + n
        return bytes(buf[at - n:at]).decode("utf-8", "replace")

    def skip(kind: int) -> None:
        nonlocal at
        if kind == 8:
            (n,) = struct.unpack_from("<Q", buf, at)
            at += 8 + n
        elif kind == 9:
            item, count = struct.unpack_from("<IQ", buf, at)
            at += 12
            if item in _VALUE_SIZES:
                at += count * _VALUE_SIZES[item]
            else:
                for _ in range(count):
                    skip(item)
        else:
            at += _VALUE_SIZES[kind]

    arch, alignment = None, 32
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", buf, at)
        at += 4
        if key == "general.architecture" and kind == 8:
            arch = string()
        elif key == "general.alignment" and kind == 4:
            (alignment,) = struct.unpack_from("<I", buf, at)
            at += 4
        else:
            skip(kind)
    infos = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, at)
        shape = struct.unpack_from(f"<{n_dims}Q", buf, at + 4)
        kind, offset = struct.unpack_from("<IQ", buf, at + 4 + 8 * n_dims)
        at += 4 + 8 * n_dims + 12
        infos.append((name, shape, kind, offset))
    start = (at + alignment - 1) // alignment * alignment
    tensors = []
    for name, shape, kind, offset in infos:
        try:
            qtype = gguf.GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"argument 'path': tensor {name!r} has unknown GGML type "
                             f"{kind}") from None
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        k, rows = shape[0], int(np.prod(shape[1:], dtype=np.int64))
        if k % block:
            raise ValueError(f"argument 'path': tensor {name!r} row length {k} is not a "
                             f"multiple of {qtype.name}'s block of {block}")
        row_bytes = k // block * type_size
        begin = start + offset
        raw = data[begin:begin + rows * row_bytes]
        if len(raw) != rows * row_bytes:
            raise ValueError(f"argument 'path': tensor {name!r} runs past the end of the file")
        if qtype.name in _DENSE_NP:
            view = raw.view(_DENSE_NP[qtype.name]).reshape(*reversed(shape))
        else:
            view = raw.reshape(*reversed(shape[1:]), row_bytes)
        tensors.append(GGUFTensor(name, qtype, tuple(shape), view))
    if arch is None:
        raise ValueError("argument 'path': the GGUF has no general.architecture field")
    return arch, tensors


def _empty_model(config, dtype: torch.dtype):
    """The HF model for `config` with its parameters on the meta device (no memory, no init)
    and its computed buffers (rotary inv_freq) real."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            if not name.endswith("rotary_emb"):
                raise ValueError(f"argument 'path': cannot rebuild buffers of module {name!r}")
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child,
                    type(module)(config=module.config))
    return model


def _tensor(data: np.ndarray) -> Tensor:
    """Zero-copy tensor over (possibly read-only) mmap bytes; nothing writes to it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "The given NumPy array is not writable"
        return torch.from_numpy(data)


def _release_file_pages(data: np.ndarray) -> None:
    """Drops this process's mapping of the whole pages under `data` (a view of the GGUF's
    read-only np.memmap; the pages stay in the page cache): once a tensor is repacked its file
    copy is never read again, and resident memory should hold one copy. A neighbour sharing an
    edge page keeps it; anything that reads a dropped page faults it back in."""
    import mmap
    base = data
    while base is not None and not isinstance(getattr(base, "_mmap", None), mmap.mmap):
        base = getattr(base, "base", None)
    if base is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    mapping = base._mmap
    start = (data.__array_interface__["data"][0]
             - np.frombuffer(mapping, np.uint8).__array_interface__["data"][0])  # offset in the mapping
    page = mmap.PAGESIZE
    begin, end = -(-start // page) * page, (start + data.nbytes) // page * page
    if end > begin:
        mapping.madvise(mmap.MADV_DONTNEED, begin, end - begin)


def _placed(arena: Optional[huge_pages.Arena], weight: Tensor) -> Tensor:
    """weight copied into the huge-page arena; weight itself without one (huge pages off or
    unavailable) or under huge_pages.MIN_BYTES."""
    if arena is None or weight.numel() < huge_pages.MIN_BYTES:
        return weight
    return arena.copy(weight)


def _set(model, name: str, module_or_tensor) -> None:
    parent, _, child = name.rpartition(".")
    owner = model.get_submodule(parent)
    if isinstance(module_or_tensor, nn.Module):
        setattr(owner, child, module_or_tensor)
    else:
        owner._parameters[child] = nn.Parameter(module_or_tensor, requires_grad=False)


def load_gguf(path: str, dtype: torch.dtype = torch.float32, dequantize: bool = False,
              activation=None, hugepages: bool = True):
    """(model, tokenizer) in eval mode from a llama or qwen2 GGUF file.

    Quantized tensors stay in their GGUF format (QuantLinear / QuantEmbedding over the mapped
    file, which must stay in place while the model lives) unless `dequantize`, which makes every
    weight a dense `dtype` tensor. Dense GGUF tensors (norms, biases, F16 weights) load in
    `dtype`. A GGUF without output.weight (tied embeddings) gets an LM head over the
    embedding's own bytes. `model.quantized_formats` counts the tensors kept per format.
    `activation`: the QuantLinear layers' QuantActivation (None: FLOAT, exact weights and fp32
    products; INT8: 8-bit activations as llama.cpp); `model.quant_activation` records it. With
    INT8 where the VNNI kernel runs, Q4_K layers and the 32-weight formats' (Q8_0, Q4_1, Q5_0,
    ...) are repacked at load into their 16-row interleaved layout (kernel_layout;
    `model.quantized_formats` counts them under their *_R16 name; a tied embedding then reads the
    LM head's repacked copy) and the file's pages are dropped from this process's mapping.
    `hugepages` (default; quantized models, where THP is available): each quantized weight that
    a step streams (not an untied embedding: a lookup reads a few rows, and a copy would make all
    of them resident) is copied into huge-page memory as it loads (engine/hugepages.py;
    `model.hugepage_bytes`), and its file pages are dropped. Dense models stay in
    torch's memory: the engine reads their weights from packed copies of its own, and placing
    them measured 0.95x (benchmarks/bench_hugepages.py)."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        raise FileNotFoundError(f"argument 'path': no GGUF file at {path!r}")
    path = os.fspath(path)
    arch, tensor_list = read_gguf(path)
    if arch not in ARCHITECTURES:
        raise ValueError(f"argument 'path': GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    supported = set() if dequantize else {f.name for f in QuantFormat}
    # One tensor at a time: a repacked weight is freed as soon as it is copied, so the next one
    # reuses its memory (a whole model's worth of them would stay in the malloc heap).
    arena = huge_pages.Arena() if hugepages and not dequantize and huge_pages.available() else None
    meta = gguf_metadata_dir(path)
    config = AutoConfig.from_pretrained(meta)
    tokenizer = AutoTokenizer.from_pretrained(meta)
    model = _empty_model(config, dtype)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    permuted = ARCHITECTURES[arch]

    tensors = {t.name: t for t in tensor_list if t.name not in _IGNORED}
    formats: Dict[str, int] = collections.Counter()
    biases = {name: t for name, t in tensors.items() if name.endswith(".bias")}
    for name, t in tensors.items():
        if name.endswith(".bias") and name[:-5] + ".weight" in tensors:
            continue  # loaded with its weight
        try:
            target = hf_name(name)
        except KeyError:
            raise ValueError(f"argument 'path': tensor {name!r} has no place in a {arch} "
                             "model") from None
        kind = t.tensor_type.name
        rows = None
        if permuted and (".attn_q." in name or ".attn_k." in name):
            rows = unpermute_rows(int(t.shape[-1]), heads if ".attn_q." in name else kv_heads)
        bias = biases.get(name[:-7] + ".bias") if name.endswith(".weight") else None
        bias_t = None
        if bias is not None:
            b = np.asarray(bias.data, dtype=np.float32)
            bias_t = torch.from_numpy(np.ascontiguousarray(b if rows is None else b[rows]))
            bias_t = bias_t.to(dtype)
        if kind in DENSE_TYPES or dequantize:
            if kind not in DENSE_TYPES and t.tensor_type not in gguf.quants._type_traits:
                raise ValueError(f"argument 'path': tensor {name!r} has type {kind}, which "
                                 "gguf.quants cannot dequantize")
            values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)  # [N, K] / [K] float32
            if rows is not None:
                values = values[rows]
            # A copy, never a view of the read-only mapping: dense parameters may be written in
            # place by other code (a write to the mapping would be a segfault, not an error).
            dense = torch.tensor(np.ascontiguousarray(values, dtype=np.float32), dtype=dtype)
            _set(model, target, dense)
            if bias_t is not None:
                _set(model, target[:-7] + ".bias", bias_t)
            continue
        if kind not in supported:
            raise ValueError(f"argument 'path': tensor {name!r} has type {kind}; quantized "
                             f"types supported: {', '.join(sorted(supported))} "
                             "(or pass dequantize=True)")
        if t.data.ndim != 2:
            raise ValueError(f"argument 'path': quantized tensor {name!r} is not 2-D")
        raw = t.data if rows is None else np.ascontiguousarray(t.data[rows])  # [N, row_bytes]
        weight, k = _tensor(raw), int(t.shape[0])
        fmt = QuantFormat(int(t.tensor_type))
        module_name = target[:-len(".weight")]
        if name == "token_embd.weight":
            _set(model, module_name, QuantEmbedding(weight, fmt, k, dtype))
        else:
            weight, fmt = kernel_layout(weight, fmt, activation)
            temporary = weight.data_ptr() != raw.ctypes.data  # repacked: freed once placed
            weight = _placed(arena, weight)
            if weight.data_ptr() != raw.ctypes.data:  # repacked, placed or a row-permuted copy
                _release_file_pages(t.data)
            if temporary and arena is not None:
                huge_pages.trim_heap()
            _set(model, module_name, QuantLinear(weight, fmt, k, bias_t, activation))
        formats[fmt.name] += 1
    if "output.weight" not in tensors:
        # Tied embeddings: the LM head reads the embedding table (the same bytes, no copy).
        embed = model.model.embed_tokens
        if isinstance(embed, QuantEmbedding):
            weight, fmt = kernel_layout(embed.weight, embed.fmt, activation)
            weight = _placed(arena, weight)
            model.lm_head = QuantLinear(weight, fmt, embed.embedding_dim, activation=activation)
            # The embedding reads the head's copy (one in memory), repacked or placed.
            model.model.embed_tokens = QuantEmbedding(weight, fmt, embed.embedding_dim, embed.dtype)
            if weight.data_ptr() != embed.weight.data_ptr():
                _release_file_pages(tensors["token_embd.weight"].data)
            if fmt != embed.fmt:
                formats[embed.fmt.name] -= 1
                formats[fmt.name] += 1
        else:
            model.lm_head.weight = embed.weight
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    missing += [n for n, b in model.named_buffers() if b.is_meta]
    if missing:
        raise ValueError(f"argument 'path': the GGUF lacks tensors for {', '.join(missing[:4])}")
    model.hugepage_bytes = 0 if arena is None else arena.placed_bytes
    model.quantized_formats = dict(+formats)  # (a format whose only tensor was repacked: gone)
    acts = {m.activation.name for m in model.modules() if isinstance(m, QuantLinear)}
    model.quant_activation = acts.pop() if len(acts) == 1 else None  # None: dense model
    model.gguf_path = path
    model.eval()
    return model, tokenizer
