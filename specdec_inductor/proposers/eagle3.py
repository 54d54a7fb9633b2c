"""EAGLE-3 drafts: a one-layer head over three of the target's layers, with its own norm, LM
head and reduced draft vocabulary. Drafting is EagleProposer's (draft_model.py); this file
loads the head and presents it with EagleDraftModel's interface.

Published layout (checked against SGLang's models/llama_eagle3.py, SafeAILab/EAGLE and the
SpecForge / HF `LlamaForCausalLMEagle3` configs): config.json with `draft_vocab_size`, optional
`target_hidden_size` and `eagle_config.eagle_aux_hidden_state_layer_ids`; one state dict with
`fc.weight` [H, 3*Ht] (+ optional `fc.bias`), `midlayer.{input_layernorm, hidden_norm,
post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v}_proj.weight` over 2*H inputs,
`midlayer.self_attn.o_proj.weight`, `midlayer.mlp.{gate,up,down}_proj.weight`, `norm.weight`,
`lm_head.weight` [Vd, H], `d2t` [Vd] (target id = draft id + d2t[draft id]), `t2d` [V] bool and
an optional `embed_tokens.weight` [V, H] (else the target's embedding).

Forward at position p, with x = the token at p + 1 and h = the feature for p:
  h = fc([low ; mid ; high]) of the target's three captured layers (3*Ht wide), projected by
      the head's `project` as the target's rows arrive, or the head's own previous output g
      (H wide) fed back further down a draft: the forward always reads H-wide features;
  a = h + o_proj(attn(cat(input_layernorm(embed(x)), hidden_norm(h))))   (attention over 2*H)
  g = a + mlp(post_attention_layernorm(a))        (pre-norm output, the next step's feature)
  logits = lm_head(norm(g)) over the draft vocabulary [Vd]: column j is the target id
           draft_to_target[j] = j + d2t[j]. The proposers rank these columns and map the ids
           they keep (scattering them into the target's vocabulary first cost a 49152-wide
           fill, scatter and column gather per draft step).
"""
import json
import os
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

from specdec_inductor import ops
from specdec_inductor.proposers.eagle import (EagleCheckpointError, EagleProposer,
                                              _read_state_dict, set_head_rope)

_MIDLAYER_KEYS = ["input_layernorm.weight", "hidden_norm.weight", "self_attn.q_proj.weight",
                  "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                  "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                  "mlp.down_proj.weight"]
_REQUIRED = (["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"]
             + [f"midlayer.{k}" for k in _MIDLAYER_KEYS])
_OPTIONAL = ["fc.bias", "embed_tokens.weight"]


class Eagle3CheckpointError(EagleCheckpointError):
    """A checkpoint that is not an EAGLE-3 head for this target."""


def eagle3_target_layers(raw_config: dict, num_layers: int, path: str = "<config>") -> List[int]:
    """The target `hidden_states` indices (Engine capture_hidden) an EAGLE-3 head reads, in
    ascending order (the order the features are concatenated in: one pass over the layers).
    Default: [2, L // 2, L - 3] for an L-layer target. `eagle_config.eagle_aux_hidden_state_layer_ids`
    are layer OUTPUT ids (SGLang's set_eagle3_layers_to_capture adds 1: the output of layer i is
    the input of layer i + 1, hidden_states index i + 1)."""
    ids = (raw_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        layers = [2, num_layers // 2, num_layers - 3]
        source = f"the default [2, L//2, L-3] for L={num_layers}"
    else:
        layers = [int(i) + 1 for i in ids]
        source = f"eagle_config.eagle_aux_hidden_state_layer_ids {list(ids)} (+1)"
    layers = sorted(layers)
    if len(layers) != 3 or len(set(layers)) != 3 or not all(1 <= i < num_layers for i in layers):
        raise Eagle3CheckpointError(
            f"{path!r}: target layers {layers} from {source} must be 3 distinct hidden_states "
            f"indices in [1, {num_layers - 1}] of the {num_layers}-layer target; a shallow target "
            "needs eagle_config.eagle_aux_hidden_state_layer_ids in config.json")
    return layers


class Eagle3Midlayer(nn.Module):
    """The head's decoder layer: attention over cat(embeds, hidden) (2*H), residual = hidden."""

    def __init__(self, config, attn_input: int):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.self_attn = LlamaAttention(config, layer_idx=0)
        heads, kv_heads, dim = (config.num_attention_heads, config.num_key_value_heads,
                                self.self_attn.head_dim)
        self.self_attn.q_proj = nn.Linear(attn_input, heads * dim, bias=False)
        self.self_attn.k_proj = nn.Linear(attn_input, kv_heads * dim, bias=False)
        self.self_attn.v_proj = nn.Linear(attn_input, kv_heads * dim, bias=False)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.mlp = LlamaMLP(config)

    def forward(self, embeds: Tensor, hidden: Tensor, position_embeddings, **kwargs) -> Tensor:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
        attn, _ = self.self_attn(hidden_states=x, position_embeddings=position_embeddings,
                                 attention_mask=None, **kwargs)  # [B, T, H]
        h = hidden + attn
        return h + self.mlp(self.post_attention_layernorm(h))  # [B, T, H]


class Eagle3DraftModel(nn.Module):
    """The EAGLE-3 head as a module the Engine can run, with EagleDraftModel's interface:
    forward(input_ids, position_ids, aux_hidden, specdec_batch) -> .logits [B, T, Vd] over the
    draft vocabulary (column j is target id draft_to_target[j]; an Engine over this model
    reports vocab_size Vd and its argmax ids are draft ids), .hidden_states = (g,) with g
    [B, T, H] the pre-norm output.
    aux_hidden [B, T, H] is either the target's features projected by `project` or g."""

    def __init__(self, config, target, target_hidden: int, draft_vocab: int, fc_bias: bool,
                 own_embedding: bool, target_hidden_layers: List[int]):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
        hidden, vocab = config.hidden_size, config.vocab_size
        self.config = config  # vocab_size = the target's (embedding, t2d); logits are Vd wide
        self.target_hidden_layers = list(target_hidden_layers)
        self.embed_tokens = (nn.Embedding(vocab, hidden) if own_embedding
                             else target.get_input_embeddings())
        self.fc = nn.Linear(3 * target_hidden, hidden, bias=fc_bias)
        self.midlayer = Eagle3Midlayer(config, 2 * hidden)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(vocab, dtype=torch.bool))
        # target id of each draft id, derived from d2t after loading (load_eagle3_head)
        self.register_buffer("draft_to_target", torch.arange(draft_vocab, dtype=torch.int64))

    def forward(self, input_ids: Tensor, position_ids: Tensor, aux_hidden: Tensor,
                specdec_batch=None, use_cache: bool = False, output_hidden_states: bool = False,
                logits_to_keep=None):
        from transformers.modeling_outputs import CausalLMOutputWithPast
        if not isinstance(logits_to_keep, Tensor) and logits_to_keep:
            raise ValueError(f"argument 'logits_to_keep' must be a tensor of row indices, None "
                             f"or 0, got {logits_to_keep!r}")
        dtype = self.lm_head.weight.dtype  # the head's (a shared embedding may differ)
        emb = self.embed_tokens(input_ids).to(dtype)  # [B, T, H]
        hidden = aux_hidden.to(dtype)  # [B, T, H]
        if hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"argument 'aux_hidden' must be {self.config.hidden_size} wide (the "
                             "target's features through project(), or the head's own output), "
                             f"got width {hidden.shape[-1]}")
        kwargs = {} if specdec_batch is None else {"specdec_batch": specdec_batch}
        cos_sin = self.rotary_emb(hidden, position_ids=position_ids)
        g = self.midlayer(emb, hidden, cos_sin, **kwargs)  # [B, T, H]
        # logits_to_keep, as the Engine passes HF's: a tensor [K] of the rows to keep (each
        # request's last extended row); None or 0 keeps all. g stays whole for the next step.
        kept = g
        if isinstance(logits_to_keep, Tensor):
            kept = g.index_select(1, logits_to_keep)  # [B, K, H]
        logits = self.lm_head(self.norm(kept))  # [B, T or K, Vd]: draft ids
        return CausalLMOutputWithPast(logits=logits, hidden_states=(g,))

    def project(self, features: Tensor) -> Tensor:
        """fc over the target's captured features [..., 3*Ht] -> [..., H] in the head's dtype:
        what the forward reads as the target's feature of a position."""
        width = self.fc.in_features
        if features.shape[-1] != width:
            raise ValueError(
                f"argument 'features': the target's captured features are {features.shape[-1]} "
                f"wide, the EAGLE-3 head needs {width}: make the target Engine with "
                f"capture_hidden={self.target_hidden_layers}")
        # A handful of rows per commit: our GEMV (aten's bf16 GEMM is slower at 3 rows).
        w, b = self.fc.weight, self.fc.bias
        rows = features.reshape(-1, width).to(w.dtype)  # [n, 3*Ht]
        with torch.no_grad():
            return ops.skinny_linear(rows, w, b).view(*features.shape[:-1], w.shape[0])


def _check_vocab_maps(path: str, d2t: Tensor, t2d: Tensor, vocab: int, draft_vocab: int) -> Tensor:
    """Target id of every draft id [Vd], after checking d2t / t2d; raises naming the problem."""
    if d2t.dim() != 1 or d2t.shape[0] != draft_vocab or d2t.is_floating_point():
        raise Eagle3CheckpointError(f"{path!r}: d2t must be an integer vector of draft_vocab_size "
                                    f"{draft_vocab}, got {d2t.dtype} {tuple(d2t.shape)}")
    if tuple(t2d.shape) != (vocab,):
        raise Eagle3CheckpointError(f"{path!r}: t2d must have the target's vocabulary size "
                                    f"{vocab}, got shape {tuple(t2d.shape)}")
    target_ids = torch.arange(draft_vocab, dtype=torch.int64) + d2t.to(torch.int64)  # [Vd]
    bad = ((target_ids < 0) | (target_ids >= vocab)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise Eagle3CheckpointError(
            f"{path!r}: d2t maps draft id {i} to target id {int(target_ids[i])}, outside the "
            f"target vocabulary [0, {vocab}) ({bad.numel()} draft ids out of range)")
    if torch.unique(target_ids).numel() != draft_vocab:
        raise Eagle3CheckpointError(f"{path!r}: d2t maps two draft ids to the same target id")
    hot = t2d.to(torch.bool)
    if int(hot.sum()) != draft_vocab or not bool(hot[target_ids].all()):
        raise Eagle3CheckpointError(f"{path!r}: t2d does not mark exactly the target ids d2t "
                                    f"maps to ({int(hot.sum())} marked, {draft_vocab} draft ids)")
    return target_ids


def _shape_error(path: str, key: str, got, want) -> Eagle3CheckpointError:
    return Eagle3CheckpointError(f"{path!r}: {key} has shape {tuple(got)}, expected {tuple(want)}")


def _read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise Eagle3CheckpointError(f"argument 'path': no config.json in {path!r}")
    with open(cfg_path) as f:
        return json.load(f)


def _text_config(target):
    return target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config


def default_head_dtype(target_dtype: torch.dtype) -> torch.dtype:
    """The head dtype the CLI and bench use unless told: bf16 where this CPU runs our bf16
    kernels (active ISA avx512, which includes avx512_bf16, or amx), else the target's."""
    from specdec_inductor import active_isa
    return torch.bfloat16 if active_isa() in ("avx512", "amx") else target_dtype


def load_eagle3_head(path: str, target, dtype: Optional[torch.dtype] = None) -> Eagle3DraftModel:
    """An EAGLE-3 head from a checkpoint directory (config.json + one state dict) for `target`
    (a HF causal LM). Its `target_hidden_layers` are the capture_hidden indices the target
    Engine must use. Raises Eagle3CheckpointError (an EagleCheckpointError) naming the path and
    the problem: an EAGLE-1/2 head, missing or unexpected keys, shapes that do not fit the
    target, d2t / t2d that do not map into the target's vocabulary.

    dtype: the head's own weights' dtype (default: the target's). A draft only proposes, so
    its precision changes which drafts are offered, never the tokens emitted; a bf16 head
    reads half the bytes per draft step. A target embedding the head shares stays as it is
    (the head casts the looked-up rows)."""
    from transformers import LlamaConfig
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"argument 'dtype' must be torch.float32 or torch.bfloat16, got {dtype}")
    raw = _read_config(path)
    try:
        sd = _read_state_dict(path)
    except EagleCheckpointError as exc:
        raise Eagle3CheckpointError(str(exc)) from None
    tcfg = _text_config(target)
    t_hidden, vocab = tcfg.hidden_size, tcfg.vocab_size
    if any(k.startswith("layers.") for k in sd) and not any(k.startswith("midlayer.") for k in sd):
        fc = tuple(sd["fc.weight"].shape) if "fc.weight" in sd else "absent"
        raise Eagle3CheckpointError(
            f"{path!r} is an EAGLE-1/2 checkpoint (layers.0.*, fc.weight {fc}), not EAGLE-3 "
            "(midlayer.*, fc over 3 target layers, d2t); load it with load_eagle_head "
            "(--method eagle) instead")
    missing = [k for k in _REQUIRED if k not in sd]
    if missing:
        raise Eagle3CheckpointError(f"{path!r} is not an EAGLE-3 head: missing {missing}")
    unknown = [k for k in sd if k not in _REQUIRED and k not in _OPTIONAL]
    if unknown:
        raise Eagle3CheckpointError(f"{path!r}: unexpected keys for an EAGLE-3 head "
                                    f"(one midlayer only): {unknown[:5]}")
    if raw.get("num_hidden_layers", 1) != 1:
        raise Eagle3CheckpointError(f"{path!r}: num_hidden_layers is {raw['num_hidden_layers']}; "
                                    "only single-layer EAGLE-3 heads are supported")
    hidden = sd["norm.weight"].shape[0]
    if raw.get("hidden_size", hidden) != hidden:
        raise Eagle3CheckpointError(f"{path!r}: hidden_size {raw['hidden_size']} in config.json "
                                    f"but norm.weight has {hidden}")
    if raw.get("target_hidden_size", t_hidden) != t_hidden:
        raise Eagle3CheckpointError(f"{path!r}: target_hidden_size {raw['target_hidden_size']} "
                                    f"does not match the target's hidden_size {t_hidden}")
    if raw.get("vocab_size", vocab) != vocab:
        raise Eagle3CheckpointError(f"{path!r}: vocab_size {raw['vocab_size']} does not match "
                                    f"the target's {vocab}")
    fc_w = sd["fc.weight"]
    if tuple(fc_w.shape) != (hidden, 3 * t_hidden):
        raise Eagle3CheckpointError(
            f"{path!r}: fc.weight has shape {tuple(fc_w.shape)}, the target needs "
            f"({hidden}, {3 * t_hidden}) (3 layers of hidden_size {t_hidden})")
    draft_vocab = sd["lm_head.weight"].shape[0]
    if raw.get("draft_vocab_size", draft_vocab) != draft_vocab:
        raise Eagle3CheckpointError(f"{path!r}: draft_vocab_size {raw['draft_vocab_size']} but "
                                    f"lm_head.weight has {draft_vocab} rows")
    target_ids = _check_vocab_maps(path, sd["d2t"], sd["t2d"], vocab, draft_vocab)
    heads = raw.get("num_attention_heads", tcfg.num_attention_heads)
    kv_heads = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or hidden // heads
    inter = raw.get("intermediate_size", sd["midlayer.mlp.gate_proj.weight"].shape[0])
    want = {"fc.bias": (hidden,), "embed_tokens.weight": (vocab, hidden),
            "lm_head.weight": (draft_vocab, hidden),
            "midlayer.self_attn.q_proj.weight": (heads * head_dim, 2 * hidden),
            "midlayer.self_attn.k_proj.weight": (kv_heads * head_dim, 2 * hidden),
            "midlayer.self_attn.v_proj.weight": (kv_heads * head_dim, 2 * hidden),
            "midlayer.self_attn.o_proj.weight": (hidden, heads * head_dim),
            "midlayer.mlp.gate_proj.weight": (inter, hidden),
            "midlayer.mlp.up_proj.weight": (inter, hidden),
            "midlayer.mlp.down_proj.weight": (hidden, inter)}
    for k in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        want[f"midlayer.{k}.weight"] = (hidden,)
    for k, shape in want.items():
        if k in sd and tuple(sd[k].shape) != shape:
            raise _shape_error(path, k, sd[k].shape, shape)
    own_embedding = "embed_tokens.weight" in sd
    if not own_embedding and hidden != t_hidden:
        raise Eagle3CheckpointError(f"{path!r}: the head's hidden size {hidden} differs from the "
                                    f"target's {t_hidden}, so it needs its own embed_tokens.weight")
    layers = eagle3_target_layers(raw, tcfg.num_hidden_layers, path)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        rms_norm_eps=raw.get("rms_norm_eps", getattr(tcfg, "rms_norm_eps", 1e-6)),
        max_position_embeddings=raw.get("max_position_embeddings", tcfg.max_position_embeddings),
        hidden_act=raw.get("hidden_act", "silu"))
    set_head_rope(config, raw, tcfg)
    head = Eagle3DraftModel(config, target, t_hidden, draft_vocab, "fc.bias" in sd,
                            own_embedding, layers)
    own: Dict[str, Tensor] = {k: v for k, v in sd.items() if k not in ("d2t", "t2d")}
    own["d2t"] = sd["d2t"].to(torch.int64)
    own["t2d"] = sd["t2d"].to(torch.bool)
    own["draft_to_target"] = target_ids
    result = head.load_state_dict(own, strict=False)
    bad = [k for k in result.missing_keys if not k.startswith(("embed_tokens", "rotary_emb"))]
    if bad or result.unexpected_keys:
        raise Eagle3CheckpointError(f"{path!r}: weights not loaded: {bad or result.unexpected_keys}")
    dtype = dtype or next(target.parameters()).dtype
    shared = None if own_embedding else head._modules.pop("embed_tokens")
    head.to(dtype)  # the head's own weights only: a shared target embedding is left alone
    if shared is not None:
        head.embed_tokens = shared  # registered last: the head's first parameter is its own
    return head.eval()


def read_target_layers(path: str, target) -> List[int]:
    """The capture_hidden indices the EAGLE-3 head in `path` reads from `target`, from its
    config.json alone (what the target Engine must capture, known before the head loads)."""
    return eagle3_target_layers(_read_config(path), _text_config(target).num_hidden_layers, path)


class Eagle3Proposer(EagleProposer):
    """EagleProposer over an Engine running an Eagle3DraftModel (made with capture_hidden=[-1]).
    `target_hidden_layers` are the capture_hidden indices the target Engine must be made with.
    The target's features are projected by the head's fc (Eagle3DraftModel.project) as they
    arrive (start / commit), so every feature the draft reads is H wide, like its own g."""

    def __init__(self, draft_engine, *args, **kwargs):
        head = getattr(draft_engine, "model", None)
        if not isinstance(head, Eagle3DraftModel):
            raise ValueError("argument 'draft_engine' must run an EAGLE-3 head "
                             f"(load_eagle3_head), got {type(head).__name__}")
        super().__init__(draft_engine, *args, **kwargs)
        self.target_hidden_layers: List[int] = list(head.target_hidden_layers)

    def target_features(self, hidden: Tensor) -> Tensor:
        return self.engine.model.project(hidden)
