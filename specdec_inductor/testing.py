"""Random draft trees made the way a real multi-step top-k draft loop makes them (kernels.md
section 1): cumulative log-prob scores, topk beams kept per step, the N-1 best ids selected and
sorted; random greedy-verify inputs that accept, reject and hop siblings; random EAGLE and
EAGLE-3 heads written in the published checkpoint layouts; tiny target checkpoints carrying
random MTP (NextN) layers in the DeepSeek-V3 layout; RowRecorder, which checks verify rows
against decode rows bit for bit. Used by the tests and the benchmarks."""
import json
import os
from dataclasses import dataclass

import torch

from specdec_inductor.ops import reference


@dataclass
class DraftTree:
    parent_list: torch.Tensor  # [B, topk*(depth-1)+1] or [B, 0]
    selected_index: torch.Tensor  # [B, N-1] sorted ascending
    seq_lens: torch.Tensor  # [B]
    topk: int
    depth: int
    num_draft_tokens: int


def random_draft(bs, topk, depth, num_draft_tokens, gen, dtype=torch.int64, max_seq_len=50):
    """One draft per request. Scores: step-0 log-probs, then beam score + child log-prob."""
    assert num_draft_tokens - 1 <= topk + topk * topk * (depth - 1)
    parent_rows, selected_rows = [], []
    for _ in range(bs):
        logp = -torch.rand(topk, generator=gen) * 3 - 1e-3  # [topk], strictly negative
        scores = [logp]
        beam_scores, beam_ids = logp, torch.arange(topk)
        parents = [-1] + list(range(topk)) if depth > 1 else []
        for step in range(1, depth):
            child = beam_scores.view(-1, 1) - torch.rand(topk, topk, generator=gen) * 3 - 1e-3
            scores.append(child.flatten())  # [topk*topk], ids beam-major
            if step < depth - 1:
                best = child.flatten().topk(topk).indices
                beam_scores = child.flatten()[best]
                beam_ids = topk + topk * topk * (step - 1) + best
                parents.extend(beam_ids.tolist())
        all_scores = torch.cat(scores)
        chosen = all_scores.topk(num_draft_tokens - 1).indices.sort().values
        parent_rows.append(parents)
        selected_rows.append(chosen.tolist())
    width = topk * (depth - 1) + 1 if depth > 1 else 0
    parent_list = torch.tensor(parent_rows, dtype=dtype).view(bs, width)
    selected = torch.tensor(selected_rows, dtype=dtype).view(bs, num_draft_tokens - 1)
    seq_lens = torch.randint(0, max_seq_len, (bs,), generator=gen, dtype=dtype)
    if bs > 1:
        seq_lens[0] = 0  # ragged, including an empty prefix
    return DraftTree(parent_list, selected, seq_lens, topk, depth, num_draft_tokens)


def random_verify_inputs(next_token, next_sibling, gen, vocab=50):
    """candidates and target_predict for trees given by linkage [B, N]: at each node the
    target picks, with probability 0.75, the token of a random child (often not the first, so
    the walk must hop siblings), else a token no child carries (rejection)."""
    bs, n = next_token.shape
    candidates = torch.randint(0, vocab, (bs, n), generator=gen)
    target = torch.empty(bs, n, dtype=torch.int64)
    for b in range(bs):
        for i in range(n):
            children = []
            c = int(next_token[b, i])
            while c != -1:
                children.append(c)
                c = int(next_sibling[b, c])
            tokens = {int(candidates[b, c]) for c in children}
            if children and torch.rand(1, generator=gen).item() < 0.75:
                pick = children[int(torch.randint(len(children), (1,), generator=gen))]
                target[b, i] = candidates[b, pick]
            else:
                free = [t for t in range(vocab, vocab + 10) if t not in tokens]
                target[b, i] = free[0]
    return candidates, target


def write_random_eagle_checkpoint(path, config, seed=0, scale=0.3, bias=True, fmt="bin",
                                  intermediate_size=None):
    """A random EAGLE-1/2 head for a target with HF `config`, written to directory `path` in
    the published layout (config.json + pytorch_model.bin or model.safetensors; key names as in
    SafeAILab/EAGLE's cnets.py: fc over [embed ; hidden], layers.0 without an input norm).
    Random heads prove correctness only: their drafts are almost never accepted.
    Returns the state dict."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv = (getattr(config, "num_key_value_heads", None) or heads) * (hidden // heads)
    inter = intermediate_size or config.intermediate_size
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen) * scale

    sd = {"fc.weight": r(hidden, 2 * hidden),
          "layers.0.self_attn.q_proj.weight": r(hidden, hidden),
          "layers.0.self_attn.k_proj.weight": r(kv, hidden),
          "layers.0.self_attn.v_proj.weight": r(kv, hidden),
          "layers.0.self_attn.o_proj.weight": r(hidden, hidden),
          "layers.0.mlp.gate_proj.weight": r(inter, hidden),
          "layers.0.mlp.up_proj.weight": r(inter, hidden),
          "layers.0.mlp.down_proj.weight": r(hidden, inter),
          "layers.0.post_attention_layernorm.weight": torch.ones(hidden)}
    if bias:
        sd["fc.bias"] = r(hidden)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
                   "intermediate_size": inter, "num_attention_heads": heads,
                   "num_key_value_heads": kv // (hidden // heads), "num_hidden_layers": 1,
                   "rms_norm_eps": getattr(config, "rms_norm_eps", 1e-6),
                   "vocab_size": config.vocab_size, "bias": bias,
                   "max_position_embeddings": config.max_position_embeddings}, f)
    if fmt == "bin":
        torch.save(sd, os.path.join(path, "pytorch_model.bin"))
    else:
        from safetensors.torch import save_file
        save_file(sd, os.path.join(path, "model.safetensors"))
    return sd


def write_random_mtp_checkpoint(path, target, num_nextn_predict_layers=1, seed=0, scale=0.3,
                                fmt="safetensors", own_head=False, own_embed=False,
                                tokenizer=None):
    """`target` (a tiny HF causal LM) saved to directory `path` with save_pretrained, plus
    `num_nextn_predict_layers` random NextN layers in the DeepSeek-V3 layout
    (`model.layers.{num_hidden_layers + j}.`: enorm, hnorm, eh_proj [H, 2H], one decoder layer
    of the target's own kind, shared_head.norm, and shared_head.head / embed_tokens when
    own_head / own_embed) and the count in config.json. fmt: "safetensors" (one file),
    "sharded" (target and NextN tensors in two shards with an index) or "bin"
    (pytorch_model.bin). The norms' weights are random too, so a swapped enorm / hnorm or a
    reversed concat changes the output. Random layers prove correctness only: their drafts are
    almost never accepted. Returns the NextN tensors written, by full name."""
    from safetensors.torch import load_file, save_file
    cfg = target.config
    hidden, vocab, num_layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    gen = torch.Generator().manual_seed(seed)
    # The decoder layer's names and shapes, whatever the family (Qwen2 biases, Qwen3 q/k norms).
    layer_shapes = {k: v.shape for k, v in target.get_decoder().layers[0].state_dict().items()}
    nextn = {}
    for j in range(num_nextn_predict_layers):
        prefix = f"model.layers.{num_layers + j}."
        shapes = dict(layer_shapes, **{"enorm.weight": (hidden,), "hnorm.weight": (hidden,),
                                       "eh_proj.weight": (hidden, 2 * hidden),
                                       "shared_head.norm.weight": (hidden,)})
        if own_head:
            shapes["shared_head.head.weight"] = (vocab, hidden)
        if own_embed:
            shapes["embed_tokens.weight"] = (vocab, hidden)
        for name, shape in shapes.items():
            if name.endswith("norm.weight"):  # RMSNorm scales near 1
                t = 1 + 0.2 * torch.randn(*shape, generator=gen)
            else:
                t = torch.randn(*shape, generator=gen) * scale
            nextn[prefix + name] = t.to(next(target.parameters()).dtype).contiguous()
    os.makedirs(path, exist_ok=True)
    target.save_pretrained(path, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    raw["num_nextn_predict_layers"] = num_nextn_predict_layers
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(raw, f, indent=2)
    single = os.path.join(path, "model.safetensors")
    main = load_file(single)
    if fmt == "safetensors":
        save_file(dict(main, **nextn), single, metadata={"format": "pt"})
    elif fmt == "sharded":
        os.remove(single)
        files = {"model-00001-of-00002.safetensors": main,
                 "model-00002-of-00002.safetensors": nextn}
        weight_map = {}
        for name, tensors in files.items():
            save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
            weight_map.update({k: name for k in tensors})
        with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
    elif fmt == "bin":
        os.remove(single)
        torch.save(dict(main, **nextn), os.path.join(path, "pytorch_model.bin"))
    else:
        raise ValueError(f"argument 'fmt' must be safetensors, sharded or bin, got {fmt!r}")
    return nextn


def write_random_eagle3_checkpoint(path, target_config, seed=0, scale=0.3, draft_vocab_size=None,
                                   layer_ids=None, fmt="safetensors", intermediate_size=None,
                                   own_embedding=False, bias=False):
    """A random EAGLE-3 head for a target with HF `target_config`, written to directory `path`
    in the published layout (config.json with architectures ["LlamaForCausalLMEagle3"] and
    draft_vocab_size, + model.safetensors or pytorch_model.bin with fc [H, 3H], midlayer.*,
    norm, lm_head [Vd, H], d2t, t2d; see proposers/eagle3.py). The draft vocabulary
    (default a quarter of the target's) is a random subset of the target ids, so d2t is far
    from zero. layer_ids: eagle_config.eagle_aux_hidden_state_layer_ids (layer OUTPUT ids), or
    None for the default layers. Norm weights are random too, so a test that swaps two norms
    fails. Random heads prove correctness only. Returns the state dict."""
    hidden, heads = target_config.hidden_size, target_config.num_attention_heads
    kv_heads = getattr(target_config, "num_key_value_heads", None) or heads
    head_dim = hidden // heads
    vocab = target_config.vocab_size
    draft_vocab = draft_vocab_size or max(1, vocab // 4)
    inter = intermediate_size or target_config.intermediate_size
    gen = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=gen) * scale

    def norm_weight():
        return 1.0 + r(hidden)

    hot = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values  # [Vd] target ids
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    sd = {"fc.weight": r(hidden, 3 * hidden),
          "midlayer.input_layernorm.weight": norm_weight(),
          "midlayer.hidden_norm.weight": norm_weight(),
          "midlayer.self_attn.q_proj.weight": r(heads * head_dim, 2 * hidden),
          "midlayer.self_attn.k_proj.weight": r(kv_heads * head_dim, 2 * hidden),
          "midlayer.self_attn.v_proj.weight": r(kv_heads * head_dim, 2 * hidden),
          "midlayer.self_attn.o_proj.weight": r(hidden, heads * head_dim),
          "midlayer.post_attention_layernorm.weight": norm_weight(),
          "midlayer.mlp.gate_proj.weight": r(inter, hidden),
          "midlayer.mlp.up_proj.weight": r(inter, hidden),
          "midlayer.mlp.down_proj.weight": r(hidden, inter),
          "norm.weight": norm_weight(),
          "lm_head.weight": r(draft_vocab, hidden),
          "d2t": hot - torch.arange(draft_vocab),
          "t2d": t2d}
    if bias:
        sd["fc.bias"] = r(hidden)
    if own_embedding:
        sd["embed_tokens.weight"] = r(vocab, hidden)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "num_hidden_layers": 1,
              "rms_norm_eps": getattr(target_config, "rms_norm_eps", 1e-6),
              "vocab_size": vocab, "draft_vocab_size": draft_vocab, "tie_word_embeddings": False,
              "max_position_embeddings": target_config.max_position_embeddings,
              "hidden_act": "silu"}
    rope = getattr(target_config, "rope_parameters", None) or {}
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if fmt == "bin":
        torch.save(sd, os.path.join(path, "pytorch_model.bin"))
    else:
        from safetensors.torch import save_file
        save_file(sd, os.path.join(path, "model.safetensors"))
    return sd


def tiny_gemma2(num_layers: int = 2, seed: int = 11):
    """A tiny random Gemma-2-style model (eval mode): sliding-window layers (window 3)
    alternating with full ones, attention soft cap 5, no final soft cap."""
    import transformers
    torch.manual_seed(seed)
    config = transformers.Gemma2Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        sliding_window=3, attn_logit_softcapping=5.0, final_logit_softcapping=None)
    config._attn_implementation = "eager"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


class RowRecorder:
    """Records the logits of every decode step and verify row of an Engine by position, to
    check that a verify row reproduces the decode row bit for bit: greedy speculation equals
    AR by construction only where they agree. Sees the steps a SpeculativeGenerator runs
    through engine.decode / engine.verify, i.e. with its class attribute one_program = False
    (the step programs call the step functions inside one graph)."""

    def __init__(self, engine):
        self.rows, self.on = [], False
        decode, verify = engine.decode, engine.verify

        def recorded_decode(tokens, req_rows, seq_lens, aux=None):
            out = decode(tokens, req_rows, seq_lens, aux)
            if self.on:
                self.rows.append(("decode", int(seq_lens[0]), [int(tokens[0])],
                                  out[1][:1].clone()))
            return out

        def recorded_verify(tokens, positions, req_rows, seq_lens, tree_mask, aux=None):
            out = verify(tokens, positions, req_rows, seq_lens, tree_mask, aux)
            if self.on:
                n = tokens.shape[1]
                tree = reference.unpack_tree_mask_ref(tree_mask, tokens.shape[0], n).view(-1, n, n)[0]
                paths = [torch.nonzero(tree[j]).flatten().tolist() for j in range(n)]
                self.rows.append(("verify", int(seq_lens[0]), tokens[0].tolist(),
                                  (positions[0].tolist(), paths), out[1][0].clone()))
            return out

        engine.decode, engine.verify = recorded_decode, recorded_verify

    def compare(self, ar_rows, verify_rows, sequence):
        """(same, different, largest |difference|) over the verify rows -- chain or tree rows --
        whose path (the tokens of the row's ancestors in the tree mask, itself last) is the AR
        sequence's from the verify's seq_len up to the row's position."""
        decoded = {row[1]: row[-1][0] for row in ar_rows if row[0] == "decode"}
        same = different = 0
        worst = 0.0
        for kind, start, tokens, *rest in verify_rows:
            if kind != "verify":
                continue
            (positions, paths), logits = rest
            for j, pos in enumerate(positions):
                if pos not in decoded or [tokens[e] for e in paths[j]] != sequence[start:pos + 1]:
                    continue
                if torch.equal(decoded[pos], logits[j]):
                    same += 1
                else:
                    different += 1
                    worst = max(worst, (decoded[pos] - logits[j]).abs().max().item())
        return same, different, worst
