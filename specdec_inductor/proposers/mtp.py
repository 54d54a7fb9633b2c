"""MTP (NextN) drafts: the target's own multi-token-prediction layer run as an EAGLE-style head.

Checkpoint layout (DeepSeek-V3 README_WEIGHTS.md; the loaders of SGLang
`python/sglang/srt/models/deepseek_nextn.py` and vLLM `model_executor/models/deepseek_mtp.py`):
config.json carries `num_nextn_predict_layers` (k), and NextN layer j is stored in the target's
own weight files as `model.layers.{num_hidden_layers + j}.*`:
  `enorm.weight`, `hnorm.weight` [H]       RMSNorms of the token embedding and of the hidden
  `eh_proj.weight` [H, 2H], no bias       over cat([enorm(embed(x_{p+1})), hnorm(h_p)])
  `self_attn.*`, `mlp.*`, `input_layernorm.weight`, `post_attention_layernorm.weight`
                                          one decoder layer, the same kind as the target's
  `shared_head.norm.weight` [H]           the norm before the LM head
  `shared_head.head.weight` [V, H]        optional: else the target's LM head
  `embed_tokens.weight` [V, H]            optional: else the target's embedding
The concat ORDER is embedding first, hidden second in both SGLang (DeepseekModelNextN.forward:
cat((enorm(embeds), hnorm(spec_info.hidden_states)))) and vLLM
(DeepSeekMultiTokenPredictorLayer.forward: cat([inputs_embeds, previous_hidden_states])); the
DeepSeek-V3 report writes [h ; emb], but both engines load the released weights the other way.

h_p at the first draft step is the target's final normed hidden state at position p (what
SGLang's and vLLM's target forwards hand to the draft; our Engine's capture_hidden=[-1]).
What is fed back further down a chain differs between the references: SGLang returns
shared_head.norm(layer output) as the draft's hidden state and drafts the next token from it;
vLLM feeds back the layer output before that norm. We follow SGLang: g = shared_head.norm(...)
is both what the LM head reads and the aux of the next step, the counterpart of the target's
normed h_p. (vLLM also zeroes the embedding at position 0; SGLang does not, nor do we.)

Only layer `layer` of the k is used, for every draft step (SGLang's single-layer NextN); the
decoder layer is the target family's own class (Llama, Qwen2, Qwen3, Mistral: the family's base
model built with one layer), so it runs through the specdec attention in its own Engine.
Drafting is EagleProposer's (draft_model.py), unchanged.
"""
import copy
import json
import os
from typing import Dict, Optional

import torch
from torch import Tensor, nn

from specdec_inductor.proposers.eagle import EagleProposer

_NEXTN_KEYS = ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"]
_OPTIONAL_KEYS = ["shared_head.head.weight", "embed_tokens.weight"]


class MtpCheckpointError(ValueError):
    """A model directory that carries no usable MTP (NextN) layer for this target."""


class MtpDraftModel(nn.Module):
    """NextN layer as a module the Engine can run (the interface of EagleDraftModel):
    forward(input_ids, position_ids, aux_hidden=h, specdec_batch) -> .logits [B, T, V],
    .hidden_states = (g,) with g [B, T, H] the next step's aux."""

    draft_to_target = None  # logits over the target's whole vocabulary

    def __init__(self, config, target, embed: nn.Module, head: nn.Module):
        super().__init__()
        decoder = target.get_decoder()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        vocab = config.vocab_size
        config.vocab_size = 1  # embedding and head are given: allocate none
        self.model = type(decoder)(config)  # the family's base model, one decoder layer
        config.vocab_size = vocab
        self.config = config
        self.model.embed_tokens = embed
        norm = type(decoder.norm)
        self.enorm, self.hnorm = norm(hidden, eps=eps), norm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.lm_head = head  # self.model.norm is shared_head.norm

    def forward(self, input_ids: Tensor, position_ids: Tensor, aux_hidden: Tensor,
                specdec_batch=None, use_cache: bool = False, output_hidden_states: bool = False):
        emb = self.model.embed_tokens(input_ids)  # [B, T, H]
        h = aux_hidden.to(emb.dtype)  # [B, T, H]
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1))  # [B, T, H]
        kwargs = {} if specdec_batch is None else {"specdec_batch": specdec_batch}
        g = self.model(inputs_embeds=x, position_ids=position_ids, use_cache=False,
                       **kwargs).last_hidden_state  # [B, T, H], after shared_head.norm
        from transformers.modeling_outputs import CausalLMOutputWithPast
        return CausalLMOutputWithPast(logits=self.lm_head(g), hidden_states=(g,))


def _select(path: str, prefix: str) -> Dict[str, Tensor]:
    """Tensors named `prefix*` from the model directory's weights (single or sharded safetensors,
    pytorch_model.bin with or without an index), with the prefix stripped. Only the shards
    that hold such tensors are opened."""
    def from_safetensors(files):
        from safetensors import safe_open
        out = {}
        for f in files:
            with safe_open(os.path.join(path, f), framework="pt") as st:
                for k in st.keys():
                    if k.startswith(prefix):
                        out[k[len(prefix):]] = st.get_tensor(k)
        return out

    def from_bin(files):
        out = {}
        for f in files:
            sd = torch.load(os.path.join(path, f), map_location="cpu", weights_only=True, mmap=True)
            out.update({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)})
        return out

    for index, reader in (("model.safetensors.index.json", from_safetensors),
                          ("pytorch_model.bin.index.json", from_bin)):
        if os.path.exists(os.path.join(path, index)):
            with open(os.path.join(path, index)) as f:
                weight_map = json.load(f)["weight_map"]
            return reader(sorted({f for k, f in weight_map.items() if k.startswith(prefix)}))
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return from_safetensors(["model.safetensors"])
    if os.path.exists(os.path.join(path, "pytorch_model.bin")):
        return from_bin(["pytorch_model.bin"])
    raise MtpCheckpointError(f"argument 'path': {path!r} has no model.safetensors(.index.json) "
                             "nor pytorch_model.bin(.index.json)")


def _shared_or_own(weight: Optional[Tensor], target_module: nn.Module, make, name: str, path,
                   shape) -> nn.Module:
    """The target's module when the checkpoint has no copy of `name` or an identical one
    (DeepSeek-V3 stores the shared embedding and head again in the NextN layer); else its own."""
    if weight is None:
        return target_module
    if tuple(weight.shape) != shape:
        raise MtpCheckpointError(f"{path!r}: {name} has shape {tuple(weight.shape)}, the target "
                                 f"needs {shape}")
    if torch.equal(weight.to(target_module.weight.dtype), target_module.weight.detach()):
        return target_module
    module = make()
    module.weight.data.copy_(weight)
    return module


def load_mtp_head(path: str, target, layer: int = 0) -> MtpDraftModel:
    """NextN layer `layer` of the model directory `path` (the target's own checkpoint:
    config.json with num_nextn_predict_layers + its weight files) as a draft for `target` (the HF
    causal LM loaded from it, whose embedding and LM head the head shares unless it has its
    own)."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise MtpCheckpointError(f"argument 'path': no config.json in {path!r}")
    with open(cfg_path) as f:
        raw = json.load(f)
    k = raw.get("num_nextn_predict_layers") or 0
    if k < 1:
        raise MtpCheckpointError(
            f"{path!r} has no MTP (NextN) layer: its config.json sets num_nextn_predict_layers="
            f"{raw.get('num_nextn_predict_layers')} (a model trained with multi-token prediction, "
            "DeepSeek-V3 layout, is needed)")
    if not 0 <= layer < k:
        raise MtpCheckpointError(f"argument 'layer' must lie in [0, {k}) for {path!r} "
                                 f"(num_nextn_predict_layers={k}), got {layer}")
    tcfg = target.config
    num_layers = raw.get("num_hidden_layers", tcfg.num_hidden_layers)
    prefix = f"model.layers.{num_layers + layer}."
    from specdec_inductor.proposers.eagle import check_finite
    sd = check_finite(_select(path, prefix), f"{path} ({prefix}*)", MtpCheckpointError)
    hidden, vocab = tcfg.hidden_size, tcfg.vocab_size

    config = copy.deepcopy(tcfg)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[-1:]  # the NextN layer follows the last one
    config.pad_token_id = None  # the one-layer model allocates no vocabulary
    embed = _shared_or_own(sd.get("embed_tokens.weight"), target.get_input_embeddings(),
                           lambda: nn.Embedding(vocab, hidden), prefix + "embed_tokens.weight",
                           path, (vocab, hidden))
    head = _shared_or_own(sd.get("shared_head.head.weight"), target.get_output_embeddings(),
                          lambda: nn.Linear(hidden, vocab, bias=False),
                          prefix + "shared_head.head.weight", path, (vocab, hidden))
    model = MtpDraftModel(config, target, embed, head)

    layer_keys = list(model.model.layers[0].state_dict())
    missing = [prefix + x for x in _NEXTN_KEYS + layer_keys if x not in sd]
    if missing:
        raise MtpCheckpointError(f"{path!r}: NextN layer {layer} is missing {missing}")
    unknown = [prefix + x for x in sd if x not in _NEXTN_KEYS + _OPTIONAL_KEYS + layer_keys
               and "rotary_emb" not in x]
    if unknown:
        raise MtpCheckpointError(f"{path!r}: unexpected keys for a NextN layer: {unknown[:5]}")
    if tuple(sd["eh_proj.weight"].shape) != (hidden, 2 * hidden):
        raise MtpCheckpointError(
            f"{path!r}: {prefix}eh_proj.weight has shape {tuple(sd['eh_proj.weight'].shape)}, "
            f"the target needs ({hidden}, {2 * hidden}) (hidden_size {hidden})")
    own = {"enorm.weight": sd["enorm.weight"], "hnorm.weight": sd["hnorm.weight"],
           "eh_proj.weight": sd["eh_proj.weight"],
           "model.norm.weight": sd["shared_head.norm.weight"]}
    own.update({f"model.layers.0.{x}": sd[x] for x in layer_keys})
    try:
        result = model.load_state_dict(own, strict=False)
    except RuntimeError as exc:  # size mismatches: the layer is not the target's kind
        raise MtpCheckpointError(f"{path!r}: NextN layer {layer} does not fit the target's "
                                 f"decoder layer: {exc}") from None
    bad = [x for x in result.missing_keys if not x.startswith(("model.embed_tokens", "lm_head"))
           and "rotary" not in x]
    if bad:
        raise MtpCheckpointError(f"{path!r}: weights not loaded: {bad}")
    dtype = next(target.parameters()).dtype
    return model.to(dtype).eval()


class MtpProposer(EagleProposer):
    """MTP chains or trees: EagleProposer's drafting (draft extend over the committed
    (x_{p+1}, h_p) pairs, then decodes feeding back g) over an Engine running an
    MtpDraftModel."""

    @classmethod
    def from_model_dir(cls, path: str, target_engine, num_draft_tokens: int, layer: int = 0,
                       prefill_chunk: int = 16, topk: int = 1, depth=None, max_batch=None,
                       max_len=None) -> "MtpProposer":
        """NextN layer `layer` of `path` in a draft Engine shaped like `target_engine` (same
        batch, length, compile mode and attention backend; a top-k tree needs max_batch
        >= batch * (1 + topk) and topk * depth more positions: registry.draft_engine_size)."""
        from specdec_inductor.engine.engine import Engine
        head = load_mtp_head(path, target_engine.model, layer)
        draft = Engine(head, max_batch=max_batch or target_engine.max_batch,
                       max_len=max_len or target_engine.max_len,
                       compile=target_engine.compiled,
                       attention=target_engine.attention_backend.value,
                       prefill_chunk=prefill_chunk, capture_hidden=[-1])
        return cls(draft, num_draft_tokens, topk=topk, depth=depth)
