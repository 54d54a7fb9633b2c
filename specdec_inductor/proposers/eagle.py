"""EAGLE (EAGLE-2 layout) drafts: a one-layer head over the target's features.

The head (published EAGLE checkpoint layout, checked against SafeAILab/EAGLE's cnets.py):
`fc` maps cat(embed(x_{p+1}), h_p) (2H) to H (`fc.weight` [H, 2H], `fc.bias` when the
checkpoint has one), then one Llama decoder layer `layers.0.*` whose input RMSNorm is absent,
no final norm, and the target's embedding and LM head. h_p is the target's final (normed)
hidden state at position p; the head's output g_p stands in for h_{p+1} further down a draft.

Per step: the draft first extends its own KV over the newly committed pairs (x_{p+1}, h_p) --
the positions the target just verified, root and accepted drafts -- then decodes K - 1 more
tokens feeding back its own g. Its KV row therefore always covers exactly the target's
committed positions before drafting, and speculative positions are overwritten next step.
With topk > 1 the head drafts EAGLE-2 top-k trees instead (proposers/tree_draft.py): each
beam decodes through its own virtual row with its parent's g as aux input; the KV bookkeeping
is unchanged (tree nodes only write past the committed positions). EAGLE-3 checkpoints are
refused here.

Draft vocabulary (FR-Spec-style, optional): a checkpoint directory may hold, beside the
published layout, `draft_vocab.safetensors` with `draft_to_target` [Vd] (target ids, e.g. the
most frequent ones in the training data; `specdec train-draft` writes it). The head then runs
its LM head over those rows of the target's only -- a copy of Vd x H instead of reading all V x H
every draft step -- and its logits are Vd wide (column j is target id draft_to_target[j], as an
EAGLE-3 head's). Drafts only change which tokens are proposed; verification stays exact.
"""
import json
import os
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
from torch import Tensor, nn

from specdec_inductor.proposers.chain import (admit_draft_requests, chain_tree,
                                              finish_draft_requests)
from specdec_inductor.proposers.tree_draft import TreeDrafter, check_tree_shape
from specdec_inductor.speculative import DraftTree, Proposer

# T of a draft head's EXTEND graph (the Engine's prefill_chunk). After the prompt, each step
# feeds the head the accepted drafts plus the bonus token: at most depth + 1 (5 for the shipped
# trees), so 8 rows are enough and a 16-row chunk computed mostly padding (bench_spec,
# SmolLM2 EAGLE-3 bf16 head, AVX2: the draft extend 3.0-3.2 -> 1.9 ms, a step's drafting
# 9.2-11.2 -> 8.3-8.8 ms). A longer prompt or a deep chain takes more than one chunk.
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
        config.vocab_size = 1  # the head shares the target's embedding: allocate none
        self.model = LlamaModel(config)
        config.vocab_size = vocab
        self.config = config
        self.model.embed_tokens = target.get_input_embeddings()
        self.model.layers[0].input_layernorm = nn.Identity()
        self.model.norm = nn.Identity()
        self.fc = nn.Linear(2 * hidden, hidden, bias=fc_bias)
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
            self.register_buffer("draft_to_target", draft_vocab.to(torch.int64).clone())

    def forward(self, input_ids: Tensor, position_ids: Tensor, aux_hidden: Tensor,
                specdec_batch=None, use_cache: bool = False, output_hidden_states: bool = False):
        emb = self.model.embed_tokens(input_ids)  # [B, T, H]
        x = self.fc(torch.cat([emb, aux_hidden.to(emb.dtype)], dim=-1))  # [B, T, H]
        kwargs = {} if specdec_batch is None else {"specdec_batch": specdec_batch}
        g = self.model(inputs_embeds=x, position_ids=position_ids, use_cache=False,
                       **kwargs).last_hidden_state  # [B, T, H]
        from transformers.modeling_outputs import CausalLMOutputWithPast
        return CausalLMOutputWithPast(logits=self.lm_head(g), hidden_states=(g,))


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


def load_eagle_head(path: str, target, full_vocab: bool = False) -> EagleDraftModel:
    """An EAGLE head from a checkpoint directory (config.json + one state dict) for `target`
    (a HF causal LM, whose embedding and LM head the head shares). A draft vocabulary beside
    the checkpoint (DRAFT_VOCAB_FILE) narrows its LM head to those rows unless full_vocab."""
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
    dtype = next(target.parameters()).dtype
    return head.to(dtype).eval()


@dataclass
class _EagleRequest:
    request: object  # the draft pool's Request
    cached: int  # draft KV covers positions [0, cached)
    tokens: List[int]  # pending x_{p+1}, p = cached, cached + 1, ...
    hidden: Tensor  # pending h_p [pending, H], one row per pending token
    done: bool = False
    root: int = 0
    virtual_rows: List[int] = field(default_factory=list)  # trees: one draft-pool row per beam


class EagleProposer(Proposer):
    """Greedy EAGLE chains of K = N - 1 drafts (topk = 1) or EAGLE-2 top-k trees from
    `draft_engine` (an Engine over an EagleDraftModel made with capture_hidden=[-1]); the
    target Engine needs capture_hidden=[-1] too.

    Args:
        num_draft_tokens: N, nodes per tree including the root.
        topk: branching (1: a chain, today's code path); depth: draft steps (default N - 1).
        For trees the draft Engine needs max_batch >= batch * (1 + topk) and topk*(depth-1)
        row positions past the target's.
    """

    needs_target_hidden = True

    def __init__(self, draft_engine, num_draft_tokens: int, topk: int = 1,
                 depth: Optional[int] = None):
        if num_draft_tokens < 2:
            raise ValueError(f"num_draft_tokens must be >= 2 (root + drafts), got {num_draft_tokens}")
        if draft_engine.capture_hidden != [-1]:
            raise ValueError("argument 'draft_engine' must be made with capture_hidden=[-1]")
        depth = num_draft_tokens - 1 if depth is None else depth
        check_tree_shape(num_draft_tokens, topk, depth)
        self.engine = draft_engine
        self.num_draft_tokens = num_draft_tokens
        self.topk, self.depth = topk, depth
        self.num_spec_steps = depth + 1
        self.k = num_draft_tokens - 1
        # An EAGLE-3 head's logits cover its own vocabulary: column j is target id
        # _token_map[j] (the draft Engine's argmax ids are columns too).
        self._token_map = getattr(getattr(draft_engine, "model", None), "draft_to_target", None)
        self._tree = (TreeDrafter(draft_engine, num_draft_tokens, topk, depth, self._token_map)
                      if topk > 1 else None)
        self._requests: Dict[int, _EagleRequest] = {}

    def _rows(self, states) -> Tensor:
        pad = self.engine.pool.padding_row
        rows = [pad if st.done else st.request.row for st in states]
        rows += [pad] * (self.engine.bucket_for(len(rows)) - len(rows))
        return torch.tensor(rows, dtype=torch.int64)  # [B]

    def start(self, request_ids: List[int], contexts: List[List[int]], hidden: List[Tensor]):
        reserve = max(self.num_draft_tokens, self.topk * (self.depth - 1) + 1)
        requests = admit_draft_requests(self.engine.pool, contexts, reserve)
        for rid, req, ctx, h in zip(request_ids, requests, contexts, hidden):
            # Pairs (x_{p+1}, h_p) for the prompt positions p = 0 .. P-1.
            self._requests[rid] = _EagleRequest(req, 0, list(ctx[1:]), h, root=ctx[-1])
        if self._tree is not None:
            try:
                virtual = self._tree.reserve_rows(len(request_ids))
            except BaseException:
                self.finish(request_ids)
                raise
            for rid, rows in zip(request_ids, virtual):
                self._requests[rid].virtual_rows = rows

    def propose(self, request_ids: List[int], seq_lens: Tensor) -> DraftTree:
        bs, eng = len(request_ids), self.engine
        states = [self._requests[r] for r in request_ids]
        req_rows = self._rows(states)
        chunk = eng.prefill_chunk
        last_logits = [None] * bs
        last_g = [None] * bs
        # Draft extend over the pending pairs (the prompt at the first step; later the root
        # and the accepted drafts), chunk by chunk. A tree leaves each request's last chunk
        # (at most `chunk` pairs) to TreeDrafter, which extends it in the tree's own graph.
        keep = chunk if self._tree is not None else 0
        while any(len(st.tokens) > keep and not st.done for st in states):
            take = [0 if st.done else max(0, min(chunk, len(st.tokens) - keep)) for st in states]
            args = self._extend_inputs(states, take, req_rows)
            _, logits, g = eng.extend(*args[:5], None, args[5])
            for b, st in enumerate(states):
                if take[b] and not st.tokens:
                    last_logits[b], last_g[b] = logits[b, take[b] - 1], g[b, take[b] - 1]
        if self._tree is not None:
            take = [0 if st.done else len(st.tokens) for st in states]
            if any(t == 0 for t, st in zip(take, states) if not st.done):
                raise RuntimeError("EagleProposer: a live request has no committed pair to "
                                   "extend (commit after every step)")
            extend = self._extend_inputs(states, take, req_rows)
            # beams at depth 1 take the root's g, deeper ones their parent's
            roots = torch.tensor([st.root for st in states])  # [bs]
            return self._tree.draft(roots, seq_lens, None,
                                    [None if st.done else st.request.row for st in states],
                                    [st.cached for st in states],
                                    [st.virtual_rows for st in states], None, extend=extend)
        bucket = req_rows.shape[0]
        hdim, hdtype = states[0].hidden.shape[-1], states[0].hidden.dtype
        vocab = eng.vocab_size
        for b in range(bs):  # finished requests: placeholders (their drafts are never used)
            if last_logits[b] is None:
                last_logits[b] = torch.zeros(vocab, dtype=eng.dtype)
                last_g[b] = torch.zeros(hdim, dtype=hdtype)
        tok = self._target_ids(torch.stack(last_logits).argmax(-1))  # [bs] d1
        g = torch.stack(last_g)  # [bs, H]
        drafts = [tok]
        seq = torch.tensor([st.cached for st in states] + [1] * (bucket - bs))  # [B]
        pad = bucket - bs
        tok = torch.cat([tok, torch.zeros(pad, dtype=torch.int64)])
        g = torch.cat([g, g.new_zeros(pad, g.shape[-1])])
        for _ in range(self.k - 1):
            tok, _, g = eng.decode(tok, req_rows, seq, g)
            tok = self._target_ids(tok)
            seq = seq + 1
            drafts.append(tok[:bs])
        chain = torch.stack(drafts, dim=1)  # [bs, K]
        roots = torch.tensor([st.root for st in states])  # [bs]
        return chain_tree(roots, chain, seq_lens)

    def _target_ids(self, columns: Tensor) -> Tensor:
        """Target ids of the draft logits' argmax columns."""
        return columns if self._token_map is None else self._token_map[columns]

    def _extend_inputs(self, states, take: List[int], req_rows: Tensor):
        """Engine.extend's inputs for the next take[b] pending pairs of each request, which
        they leave (the request's `cached` advances): (input_ids [B, T], positions [B, T],
        req_rows, prefix_lens [B], extend_lens [B], aux [B, T, H]), B the bucket."""
        bucket, chunk = req_rows.shape[0], self.engine.prefill_chunk
        hdim, hdtype = states[0].hidden.shape[-1], states[0].hidden.dtype
        ids = torch.zeros(bucket, chunk, dtype=torch.int64)  # [B, T]
        aux = torch.zeros(bucket, chunk, hdim, dtype=hdtype)  # [B, T, H]
        prefix = torch.zeros(bucket, dtype=torch.int64)  # [B]
        ext = torch.zeros(bucket, dtype=torch.int64)  # [B]
        for b, st in enumerate(states):
            m = take[b]
            if m == 0:
                continue
            ids[b, :m] = torch.tensor(st.tokens[:m], dtype=torch.int64)
            aux[b, :m] = st.hidden[:m]
            prefix[b], ext[b] = st.cached, m
            st.cached += m
            st.tokens, st.hidden = st.tokens[m:], st.hidden[m:]
        positions = prefix.view(-1, 1) + torch.arange(chunk).view(1, -1)  # [B, T]
        return ids, positions, req_rows, prefix, ext, aux

    def commit(self, request_ids: List[int], emitted: List[List[int]], hidden: List[Tensor]):
        for rid, toks, h in zip(request_ids, emitted, hidden):
            st = self._requests[rid]
            if not toks:
                st.done = True
                continue
            # emitted[i] = x_{p+1} for the path position p whose target hidden is h[i].
            st.tokens = st.tokens + list(toks)
            rows = h[:len(toks)]
            st.hidden = torch.cat([st.hidden, rows])
            st.root = toks[-1]

    def finish(self, request_ids: List[int]) -> None:
        finish_draft_requests(self._requests, request_ids, self.engine.pool, self._tree)
