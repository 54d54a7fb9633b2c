"""EAGLE (EAGLE-2 layout) drafts: a one-layer head over the target's features.

The head (published EAGLE checkpoint layout, checked against SafeAILab/EAGLE's cnets.py):
`fc` maps cat(embed(x_{p+1}), h_p) (2H) to H (`fc.weight` [H, 2H], `fc.bias` when the
checkpoint has one), then one Llama decoder layer `layers.0.*` whose input RMSNorm is absent,
no final norm, and the target's embedding and LM head. h_p is the target's final (normed)
hidden state at position p; the head's output g_p stands in for h_{p+1} further down a draft.

Drafting is DraftModelProposer's (draft_model.py), with hidden states: each step the head
first extends its KV over the newly committed pairs (x_{p+1}, h_p) -- the positions the target
just verified, root and accepted drafts -- then decodes K - 1 more tokens feeding back its own
g, or expands an EAGLE-2 top-k tree (tree_draft.py), each beam with its parent's g as aux
input. EAGLE-3 checkpoints are refused here.

Draft vocabulary (FR-Spec-style, optional): a checkpoint directory may hold, beside the
published layout, `draft_vocab.safetensors` with `draft_to_target` [Vd] (target ids, e.g. the
most frequent ones in the training data; `specdec train-draft` writes it). The head then runs
its LM head over those rows of the target's only -- a copy of Vd x H instead of reading all V x H
every draft step -- and its logits are Vd wide (column j is target id draft_to_target[j], as an
EAGLE-3 head's). Drafts only change which tokens are proposed; verification stays exact.
"""
import json
import os
from typing import Dict, Optional

import torch
from torch import Tensor, nn

from specdec_inductor.proposers.draft_model import DraftModelProposer

# T of a draft head's EXTEND graph (the Engine's prefill_chunk). After the prompt, each step
# feeds the head the accepted drafts plus the bonus token: at most depth + 1 (5 for the shipped
# trees), so 8 rows are enough, where a 16-row chunk computes mostly padding. A longer prompt
# or a deep chain takes more than one chunk.
DRAFT_PREFILL_CHUNK = 8

DRAFT_VOCAB_FILE = "draft_vocab.safetensors"

_LAYER_KEYS = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
               "mlp.down_proj.weight", "post_attention_layernorm.weight"]


class EagleCheckpointError(ValueError):
    """A checkpoint that is not an EAGLE (EAGLE-1/2 layout) head for this target."""


class EagleDraftModel(nn.Module):
    """The EAGLE head as a module the Engine can run: forward(input_ids, position_ids,
    specdec_batch, aux_hidden=h) -> .logits, .hidden_states = (g,)."""

    def __init__(self, config, target, fc_bias: bool, draft_vocab: Optional[Tensor] = None):
        """draft_vocab: target ids [Vd] the LM head keeps (see the module docstring); None: the
        target's whole LM head, shared."""
        super().__init__()
        from transformers import LlamaModel
        hidden = config.hidden_size
        vocab = config.vocab_size
        # Registered first: the Engine takes the head's dtype from its first parameter, which
        # must be the head's own, not the shared target embedding's (load_eagle_head's dtype).
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        config.vocab_size = 1  # the head shares the target's embedding: allocate none
        self.model = LlamaModel(config)
        config.vocab_size = vocab
        self.config = config
        self.model.embed_tokens = target.get_input_embeddings()
        self.model.layers[0].input_layernorm = nn.Identity()
        self.model.norm = nn.Identity()
        self.lm_head = target.get_output_embeddings()
        if draft_vocab is not None:
            full = self.lm_head
            if hasattr(full, "select_rows"):  # a GGUF-quantized LM head: its rows, still quantized
                self.lm_head = full.select_rows(draft_vocab)
            else:
                self.lm_head = nn.Linear(hidden, draft_vocab.numel(), bias=full.bias is not None)
                with torch.no_grad():
                    self.lm_head.weight.copy_(full.weight[draft_vocab])
                    if full.bias is not None:
                        self.lm_head.bias.copy_(full.bias[draft_vocab])
        self.lm_input_dtype: Optional[torch.dtype] = None  # what lm_head reads; None: g's
        self.register_buffer("draft_to_target", None if draft_vocab is None
                             else draft_vocab.to(torch.int64).clone())

    def forward(self, input_ids: Tensor, position_ids: Tensor, aux_hidden: Tensor,
                specdec_batch=None, use_cache: bool = False, output_hidden_states: bool = False):
        dtype = self.fc.weight.dtype  # the head's (the shared embedding may differ)
        emb = self.model.embed_tokens(input_ids).to(dtype)  # [B, T, H]
        x = self.fc(torch.cat([emb, aux_hidden.to(dtype)], dim=-1))  # [B, T, H]
        kwargs = {} if specdec_batch is None else {"specdec_batch": specdec_batch}
        g = self.model(inputs_embeds=x, position_ids=position_ids, use_cache=False,
                       **kwargs).last_hidden_state  # [B, T, H]
        from transformers.modeling_outputs import CausalLMOutputWithPast
        return CausalLMOutputWithPast(logits=self.lm_head(g.to(self.lm_input_dtype or g.dtype)),
                                      hidden_states=(g,))


def check_finite(sd: Dict[str, Tensor], where: str, error=ValueError) -> Dict[str, Tensor]:
    """sd unchanged, or `error` naming the file and the first tensor holding NaN or inf (a
    head trained past divergence drafts garbage, silently)."""
    for name, t in sd.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise error(f"{where}: tensor {name!r} holds NaN or inf values")
    return sd


def _read_state_dict(path: str) -> Dict[str, Tensor]:
    st = os.path.join(path, "model.safetensors")
    if os.path.exists(st):
        from safetensors.torch import load_file
        return check_finite(load_file(st), st, EagleCheckpointError)
    pt = os.path.join(path, "pytorch_model.bin")
    if os.path.exists(pt):
        return check_finite(torch.load(pt, map_location="cpu", weights_only=True), pt,
                            EagleCheckpointError)
    raise EagleCheckpointError(f"argument 'path': {path!r} has neither model.safetensors nor "
                               "pytorch_model.bin")


def set_head_rope(config, raw: dict, target_config) -> None:
    """A draft head's RoPE: as its checkpoint's config.json (`raw`) says, else as the target has
    it (transformers 5 keeps it in rope_parameters; older configs in rope_theta)."""
    if "rope_theta" in raw:
        config.rope_parameters = {"rope_type": "default", "rope_theta": float(raw["rope_theta"])}
    elif getattr(target_config, "rope_parameters", None):
        config.rope_parameters = dict(target_config.rope_parameters)


def read_draft_vocab(path: str, vocab_size: int) -> Optional[Tensor]:
    """The draft vocabulary [Vd] int64 of the checkpoint directory `path` (DRAFT_VOCAB_FILE), or
    None when it has none; refused unless 1-D, distinct, sorted ids in [0, vocab_size)."""
    file = os.path.join(path, DRAFT_VOCAB_FILE)
    if not os.path.exists(file):
        return None
    from safetensors.torch import load_file
    sd = load_file(file)
    ids = sd.get("draft_to_target")
    if (ids is None or ids.dim() != 1 or ids.is_floating_point() or ids.numel() < 1
            or int(ids.min()) < 0 or int(ids.max()) >= vocab_size
            or (ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()))):
        raise EagleCheckpointError(
            f"{file!r}: draft_to_target must be a 1-D tensor of distinct ascending target ids "
            f"in [0, {vocab_size}), got "
            f"{None if ids is None else (ids.dtype, tuple(ids.shape))}")
    return ids.to(torch.int64)


def write_draft_vocab(path: str, draft_to_target: Tensor) -> None:
    """Write `draft_to_target` [Vd] (ascending target ids) as the draft vocabulary of `path`."""
    from safetensors.torch import save_file
    save_file({"draft_to_target": draft_to_target.to(torch.int64).contiguous()},
              os.path.join(path, DRAFT_VOCAB_FILE))


def load_eagle_head(path: str, target, full_vocab: bool = False,
                    dtype: Optional[torch.dtype] = None) -> EagleDraftModel:
    """An EAGLE head from a checkpoint directory (config.json + one state dict) for `target`
    (a HF causal LM, whose embedding and LM head the head shares). A draft vocabulary beside
    the checkpoint (DRAFT_VOCAB_FILE) narrows its LM head to those rows unless full_vocab.
    dtype: the head's own weights (fc, the layer, a narrowed dense LM head; default the
    target's); the shared embedding and LM head, and a quantized one's rows, keep theirs."""
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"argument 'dtype' must be torch.float32 or torch.bfloat16, got {dtype}")
    from transformers import LlamaConfig
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise EagleCheckpointError(f"argument 'path': no config.json in {path!r}")
    with open(cfg_path) as f:
        raw = json.load(f)
    sd = _read_state_dict(path)
    archs = " ".join(raw.get("architectures") or [])
    if "Eagle3" in archs or "midlayer.self_attn.q_proj.weight" in sd or "d2t" in sd:
        raise EagleCheckpointError(
            f"{path!r} is an EAGLE-3 checkpoint (midlayer / d2t / {archs or 'no architectures'}); "
            "the EAGLE path needs an EAGLE-1/2 head (fc over 2*hidden + layers.0); load it "
            "with the EAGLE-3 proposer instead")
    tcfg = target.config
    hidden = tcfg.hidden_size
    missing = [k for k in ["fc.weight"] + [f"layers.0.{k}" for k in _LAYER_KEYS] if k not in sd]
    if missing:
        raise EagleCheckpointError(f"{path!r} is not an EAGLE head: missing {missing}")
    if tuple(sd["fc.weight"].shape) != (hidden, 2 * hidden):
        raise EagleCheckpointError(
            f"{path!r}: fc.weight has shape {tuple(sd['fc.weight'].shape)}, the target needs "
            f"({hidden}, {2 * hidden}) (hidden_size {hidden})")
    config = LlamaConfig(
        vocab_size=tcfg.vocab_size, hidden_size=hidden,
        intermediate_size=raw.get("intermediate_size", sd["layers.0.mlp.gate_proj.weight"].shape[0]),
        num_hidden_layers=1,
        num_attention_heads=raw.get("num_attention_heads", tcfg.num_attention_heads),
        num_key_value_heads=raw.get("num_key_value_heads", getattr(tcfg, "num_key_value_heads", None)),
        rms_norm_eps=raw.get("rms_norm_eps", getattr(tcfg, "rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", tcfg.max_position_embeddings),
        hidden_act=raw.get("hidden_act", "silu"))
    set_head_rope(config, raw, tcfg)
    draft_vocab = None if full_vocab else read_draft_vocab(path, tcfg.vocab_size)
    head = EagleDraftModel(config, target, fc_bias="fc.bias" in sd, draft_vocab=draft_vocab)
    own = {"fc.weight": sd["fc.weight"]}
    if "fc.bias" in sd:
        own["fc.bias"] = sd["fc.bias"]
    for k in _LAYER_KEYS:
        own[f"model.layers.0.{k}"] = sd[f"layers.0.{k}"]
    unknown = [k for k in sd if k not in own and not k.startswith("embed_tokens.")
               and k not in (f"layers.0.{x}" for x in _LAYER_KEYS) and k != "fc.bias"]
    if unknown:
        raise EagleCheckpointError(f"{path!r}: unexpected keys for an EAGLE head: {unknown[:5]}")
    result = head.load_state_dict(own, strict=False)
    bad = [k for k in result.missing_keys if not k.startswith(("model.embed_tokens", "lm_head"))
           and "rotary" not in k and k != "draft_to_target"]
    if bad:
        raise EagleCheckpointError(f"{path!r}: weights not loaded: {bad}")
    dtype = dtype or next(target.parameters()).dtype
    # The target's own modules (its embedding; its LM head, or a quantized one's rows) are left
    # out of the cast and put back afterwards.
    embed = head.model._modules.pop("embed_tokens")
    own_lm = isinstance(head.lm_head, nn.Linear) and draft_vocab is not None
    lm = None if own_lm else head._modules.pop("lm_head")
    head.to(dtype)
    head.model.embed_tokens = embed
    if lm is not None:
        head.lm_head = lm
    head.lm_input_dtype = dtype if own_lm else next(target.parameters()).dtype
    return head.eval()


class EagleProposer(DraftModelProposer):
    """DraftModelProposer over an Engine running an EagleDraftModel (made with
    capture_hidden=[-1]); the target Engine needs capture_hidden=[-1] too. With a draft
    vocabulary the head's logits columns are mapped to target ids."""

    needs_target_hidden = True

    def draft_token_map(self) -> Optional[Tensor]:
        return self.engine.model.draft_to_target

    def catch_up_tokens(self) -> int:
        # The head's Engine is made with a prefill chunk sized for the catch-up
        # (DRAFT_PREFILL_CHUNK), so the prompt and every step share one extend graph.
        return self.engine.prefill_chunk
