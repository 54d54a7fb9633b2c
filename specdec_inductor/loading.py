"""Models and prompts in, before any Engine exists: the dtypes a run may ask for, which model
names and paths are accepted, loading a target (or draft) with clear errors for damaged
weights, the trained heads shipped for the default model, and prompt encoding (chat template
or raw text). The CLI, the benchmarks and training share these; the Engine never imports them.
"""
import os
from typing import List, Optional

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

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


def load_checked(path: Optional[str], dtype: torch.dtype, dequantize: bool = False,
                 quant_activation: str = "auto"):
    """hf.load_model, with a damaged safetensors file (a truncated conversion cache, an
    interrupted download) reported by name with what to do, not as a raw traceback; a named
    model that was never fetched ends with the command that fetches it. `dequantize`: GGUF
    tensors become dense weights of `dtype` (default: kept quantized, except the default model,
    see hf.DEFAULT_QUANTIZED); `quant_activation`: auto | float | int8 (ops.quant.QuantActivation;
    auto: ops.quant.default_activation())."""
    from specdec_inductor.engine.hf import load_model
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
    from specdec_inductor.engine import hf
    path = path or hf.default_gguf_path()
    if path.endswith(".gguf"):
        stat = os.stat(path)
        return os.path.join(hf._cache_root(),
                            f"{os.path.basename(path)}-{stat.st_size}-{int(stat.st_mtime)}")
    return path


def _is_cache(directory: str) -> bool:
    from specdec_inductor.engine import hf
    return os.path.abspath(directory).startswith(os.path.abspath(hf._cache_root()))


def model_directory(model: Optional[str]) -> str:
    """The HF model directory of a model argument (None: the default GGUF): a .gguf file is
    converted once into the conversion cache (hf.convert_gguf)."""
    from specdec_inductor.engine.hf import convert_gguf, default_gguf_path
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
