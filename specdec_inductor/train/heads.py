"""Draft heads as trainable modules whose `state_dict()` IS the published checkpoint layout, so
`write_checkpoint` output loads through the methods' own loaders (proposers/eagle.py,
proposers/eagle3.py):

- EagleHead (EAGLE-1/2, SafeAILab/EAGLE cnets.py): fc over cat(embed(x_{p+1}), h_p) ([H, 2H]),
  one Llama decoder layer `layers.0` without an input norm; the target's embedding and LM head
  (frozen, not saved). Trained with teacher forcing, its loss scored over the rows of the LM
  head for the draft vocabulary the proposer drafts from (draft_vocab.safetensors).
- Eagle3Head (EAGLE-3): fc over the three captured target layers ([H, 3H]), `midlayer` whose
  attention reads cat(input_layernorm(embed), hidden_norm(hidden)) (2H) with the hidden as the
  residual, its own final `norm` and an `lm_head` over a draft vocabulary (`d2t`, `t2d`).
  Trained with the training-time test: `steps` unrolled draft steps, step s feeding back step
  s-1's output; a query at step s, index i (sequence position i + s) attends to step 0's keys
  at indices <= i (the committed context, real target features) and to steps 1..s's keys at
  index i only (its own earlier drafts) -- exactly what it sees when drafting.
"""
import json
import math
import os
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def _rope_theta(tcfg) -> float:
    params = getattr(tcfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(tcfg, "rope_theta", 10000.0)))


def _llama_config(tcfg, intermediate_size: Optional[int] = None):
    from transformers import LlamaConfig
    hidden = tcfg.hidden_size
    cfg = LlamaConfig(
        vocab_size=tcfg.vocab_size, hidden_size=hidden,
        intermediate_size=intermediate_size or tcfg.intermediate_size, num_hidden_layers=1,
        num_attention_heads=tcfg.num_attention_heads,
        num_key_value_heads=getattr(tcfg, "num_key_value_heads", None) or tcfg.num_attention_heads,
        rms_norm_eps=getattr(tcfg, "rms_norm_eps", 1e-6),
        max_position_embeddings=tcfg.max_position_embeddings, hidden_act="silu")
    cfg.rope_parameters = {"rope_type": "default", "rope_theta": _rope_theta(tcfg)}
    cfg._attn_implementation = "sdpa"
    return cfg


def _config_json(cfg, **extra) -> dict:
    out = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
           "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.num_key_value_heads, "num_hidden_layers": 1,
           "rms_norm_eps": cfg.rms_norm_eps, "vocab_size": cfg.vocab_size,
           "max_position_embeddings": cfg.max_position_embeddings,
           "rope_theta": cfg.rope_parameters["rope_theta"], "hidden_act": "silu",
           "model_type": "llama", "torch_dtype": "bfloat16"}
    out.update(extra)
    return out


class _Frozen:
    """The target's embedding and LM head, held outside the module so they are neither trained
    nor saved."""

    def __init__(self, target):
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()


def _target_to_draft(draft_vocab: Tensor, vocab: int) -> Tensor:
    """[vocab] int64: each target id's index in draft_vocab [Vd], -1 for ids outside it."""
    index = torch.full((vocab,), -1, dtype=torch.int64)
    index[draft_vocab] = torch.arange(draft_vocab.numel())
    return index


class EagleHead(nn.Module):
    def __init__(self, target, draft_vocab: Optional[Tensor] = None,
                 intermediate_size: Optional[int] = None, fc_bias: bool = True):
        """draft_vocab: the target ids [Vd] (sorted ascending) whose rows of the target's LM head
        the loss scores, as the proposer's narrowed LM head drafts them (proposers/eagle.py);
        None: the full LM head."""
        super().__init__()
        from transformers.models.llama.modeling_llama import (LlamaDecoderLayer,
                                                              LlamaRotaryEmbedding)
        self.cfg = _llama_config(target.config, intermediate_size)
        hidden = self.cfg.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
        self.layers = nn.ModuleList([LlamaDecoderLayer(self.cfg, layer_idx=0)])
        self.layers[0].input_layernorm = nn.Identity()
        self.rotary = LlamaRotaryEmbedding(self.cfg)
        self.frozen = _Frozen(target)
        self.draft_vocab = None if draft_vocab is None else draft_vocab.long().clone()
        if self.draft_vocab is not None:
            self.register_buffer("target_to_draft",
                                 _target_to_draft(self.draft_vocab, self.cfg.vocab_size),
                                 persistent=False)
            # The LM head rows the draft model keeps: frozen, and not part of the checkpoint.
            lm = self.frozen.lm_head
            self.frozen.draft_weight = lm.weight.detach()[self.draft_vocab]
            self.frozen.draft_bias = None if lm.bias is None else lm.bias.detach()[self.draft_vocab]

    def logits(self, g: Tensor) -> Tensor:
        """g [..., H] -> [..., Vd] over the draft vocabulary (or [..., V] without one)."""
        if self.draft_vocab is None:
            return self.frozen.lm_head(g)
        return F.linear(g, self.frozen.draft_weight, self.frozen.draft_bias)

    def forward(self, next_tokens: Tensor, feats: Tensor) -> Tensor:
        """next_tokens [B, T] (x_{p+1}), feats [B, T, H] (h_p) -> g [B, T, H] (~ h_{p+1})."""
        bs, t = next_tokens.shape
        with torch.no_grad():
            emb = self.frozen.embed(next_tokens).float()  # [B, T, H]
        x = self.fc(torch.cat([emb, feats], dim=-1))  # [B, T, H]
        pos = torch.arange(t).view(1, t).expand(bs, t)  # [B, T]
        return self.layers[0](x, position_embeddings=self.rotary(x, pos))

    def published_state_dict(self) -> Dict[str, Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary")}

    def config_json(self) -> dict:
        return _config_json(self.cfg, architectures=["LlamaForCausalLM"],
                            bias=self.fc.bias is not None)


class _Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        hidden, self.heads = cfg.hidden_size, cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = hidden // self.heads
        self.q_proj = nn.Linear(2 * hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)


class _Midlayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=eps)
        self.self_attn = _Attention(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=eps)
        self.mlp = LlamaMLP(cfg)


class Eagle3Head(nn.Module):
    def __init__(self, target, draft_vocab: Tensor, layers: List[int],
                 intermediate_size: Optional[int] = None):
        """draft_vocab: the target ids the head can emit [Dv] (sorted ascending); layers: the
        target's captured HF hidden_states indices (input of decoder layer i)."""
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding
        self.cfg = _llama_config(target.config, intermediate_size)
        hidden, vocab = self.cfg.hidden_size, self.cfg.vocab_size
        self.layers_captured = list(layers)
        self.fc = nn.Linear(len(layers) * hidden, hidden, bias=False)
        self.midlayer = _Midlayer(self.cfg)
        self.norm = LlamaRMSNorm(hidden, eps=self.cfg.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab.numel(), bias=False)
        draft_vocab = draft_vocab.long()
        self.register_buffer("d2t", draft_vocab - torch.arange(draft_vocab.numel()))
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[draft_vocab] = True
        self.register_buffer("t2d", t2d)
        self.register_buffer("target_to_draft", _target_to_draft(draft_vocab, vocab),
                             persistent=False)
        self.rotary = LlamaRotaryEmbedding(self.cfg)
        self.frozen = _Frozen(target)
        # Start from the target's own final norm and LM-head rows for the draft vocabulary.
        with torch.no_grad():
            tnorm = target.get_decoder().norm.weight
            self.norm.weight.copy_(tnorm.float())
            self.lm_head.weight.copy_(self.frozen.lm_head.weight[draft_vocab].float())

    def _attend(self, q: Tensor, keys: List[Tensor], values: List[Tensor]) -> Tensor:
        """q [B, h, T, D] at step s = len(keys) - 1; keys/values [B, h, T, D] per step."""
        t = q.shape[2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        s0 = (q @ keys[0].transpose(-1, -2)) * scale  # [B, h, T, T]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        s0 = s0.masked_fill(~causal, float("-inf"))
        diag = [((q * k).sum(-1, keepdim=True)) * scale for k in keys[1:]]  # [B, h, T, 1] each
        p = torch.softmax(torch.cat([s0] + diag, dim=-1), dim=-1)  # [B, h, T, T + s]
        out = p[..., :t] @ values[0]  # [B, h, T, D]
        for j, v in enumerate(values[1:]):
            out = out + p[..., t + j:t + j + 1] * v
        return out

    def forward(self, tokens: Tensor, feats: Tensor, steps: int) -> List[Tensor]:
        """tokens [B, T] (the sequence x_0..), feats [B, T, 3H] (target features at each
        position) -> draft-vocab logits [B, T, Dv] per step; step s, index i predicts token
        i + s + 2 from input token i + s + 1."""
        bs, t = tokens.shape
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
        m = self.midlayer
        a = m.self_attn
        hidden = self.fc(feats)  # [B, T, H]
        keys, values, logits = [], [], []
        for s in range(steps):
            ids = torch.zeros_like(tokens)
            if s + 1 < t:
                ids[:, :t - s - 1] = tokens[:, s + 1:]
            with torch.no_grad():
                emb = self.frozen.embed(ids).float()  # [B, T, H]
            x = torch.cat([m.input_layernorm(emb), m.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
            q = a.q_proj(x).view(bs, t, a.heads, a.head_dim).transpose(1, 2)  # [B, h, T, D]
            k = a.k_proj(x).view(bs, t, a.kv_heads, a.head_dim).transpose(1, 2)
            v = a.v_proj(x).view(bs, t, a.kv_heads, a.head_dim).transpose(1, 2)
            pos = (torch.arange(t) + s).view(1, t).expand(bs, t)  # [B, T]
            cos, sin = self.rotary(x, pos)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            rep = a.heads // a.kv_heads
            keys.append(k.repeat_interleave(rep, dim=1))
            values.append(v.repeat_interleave(rep, dim=1))
            att = self._attend(q, keys, values).transpose(1, 2).reshape(bs, t, -1)  # [B, T, h*D]
            h = hidden + a.o_proj(att)
            h = h + m.mlp(m.post_attention_layernorm(h))  # [B, T, H], fed back pre-norm
            logits.append(self.lm_head(self.norm(h)))  # [B, T, Dv]
            hidden = h
        return logits

    def published_state_dict(self) -> Dict[str, Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("rotary")}

    def config_json(self) -> dict:
        return _config_json(
            self.cfg, architectures=["LlamaForCausalLMEagle3"],
            draft_vocab_size=int(self.lm_head.weight.shape[0]),
            target_hidden_size=self.cfg.hidden_size,
            eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in self.layers_captured]})


def write_checkpoint(head: nn.Module, path: str, dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json + model.safetensors (floats in `dtype`, index buffers as they are)."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    sd = {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous()
          for k, v in head.published_state_dict().items()}
    save_file(sd, os.path.join(path, "model.safetensors.tmp"))
    os.replace(os.path.join(path, "model.safetensors.tmp"), os.path.join(path, "model.safetensors"))
    cfg = head.config_json()
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
