"""MTP (NextN) drafts (proposers/mtp.py): a tiny target saved with random NextN layers in the
DeepSeek-V3 layout still loads through the stock HF loader; the NextN layer loads from every
weight format; its forward equals a plain-torch recomputation from the checkpoint tensors (which
pins key names, the [embed ; hidden] order and the norms); the proposer's chains equal a
from-scratch chain over the committed tokens and target hidden states; greedy MTP output equals
plain greedy (Llama and Qwen2, batch 1 and a ragged batch of 8, eager; compiled without
recompiles); every bad checkpoint is refused by name; the CLI runs --method mtp and refuses a
model without NextN layers; all pools end free."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor.engine.engine import Engine  # noqa: E402
from specdec_inductor.proposers.mtp import (  # noqa: E402
    MtpCheckpointError, MtpDraftModel, MtpProposer, load_mtp_head)
from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats  # noqa: E402
from specdec_inductor.testing import write_random_mtp_checkpoint  # noqa: E402

VOCAB, HIDDEN, LAYERS = 256, 64, 2
FAMILIES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}


def tiny_target(family="llama", seed=0):
    torch.manual_seed(seed)
    config = getattr(transformers, FAMILIES[family])(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def saved(path, family="llama", seed=0, **kwargs):
    """(target reloaded from `path` by the stock loader, NextN tensors written)."""
    nextn = write_random_mtp_checkpoint(str(path), tiny_target(family, seed), seed=seed + 1,
                                        **kwargs)
    target = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    target.config._attn_implementation = "sdpa"
    return target, nextn


def prompts(count, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (3 + 4 * i,), generator=gen).tolist() for i in range(count)]


def _engines(target, head, batch, compiled=False):
    engine = Engine(target, max_batch=batch, max_len=96, compile=compiled, prefill_chunk=16,
                    capture_hidden=[-1])
    draft = Engine(head, max_batch=batch, max_len=96, compile=compiled, prefill_chunk=8,
                   capture_hidden=[-1])
    return engine, draft


def _free(*engines):
    for e in engines:
        e.pool.check_consistent()
        assert e.pool.num_free_slots == e.pool.num_slots and not e.pool.live_requests


# -- plain-torch NextN layer, straight from the checkpoint tensors ------------------------------
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # [D/2]
    ang = pos.float().view(-1, 1) * inv.view(1, -1)  # [T, D/2]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()  # [T, D]
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def plain_nextn(t, cfg, ids, h, embed, head, layer=0):
    """Logits [T, V] and fed-back g [T, H] of NextN layer `layer` for tokens ids [T] (x_{p+1})
    and target hidden h [T, H] (h_p) at positions 0..T-1, from the checkpoint tensors `t`
    (full names) alone: g = norm(layer(eh_proj([enorm(e) ; hnorm(h)]))), logits = head(g)."""
    p = f"model.layers.{cfg.num_hidden_layers + layer}."
    eps, nh, nkv = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // nh
    theta = cfg.rope_parameters["rope_theta"]

    def lin(x, name):
        y = x @ t[p + name + ".weight"].T
        return y + t[p + name + ".bias"] if p + name + ".bias" in t else y

    e = t.get(p + "embed_tokens.weight", embed)[torch.tensor(ids)]  # [T, H]
    x = torch.cat([_rms(e, t[p + "enorm.weight"], eps), _rms(h, t[p + "hnorm.weight"], eps)],
                  -1) @ t[p + "eh_proj.weight"].T  # [T, H]
    n = x.shape[0]
    pos = torch.arange(n)
    a = _rms(x, t[p + "input_layernorm.weight"], eps)
    q = _rope(lin(a, "self_attn.q_proj").view(n, nh, hd).transpose(0, 1), pos, theta)  # [nh, T, hd]
    k = _rope(lin(a, "self_attn.k_proj").view(n, nkv, hd).transpose(0, 1), pos, theta)
    v = lin(a, "self_attn.v_proj").view(n, nkv, hd).transpose(0, 1)
    k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)  # [nh, T, hd]
    s = (q @ k.transpose(1, 2)) * hd ** -0.5  # [nh, T, T]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    o = (s.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)  # [T, H]
    x = x + lin(o, "self_attn.o_proj")
    m = _rms(x, t[p + "post_attention_layernorm.weight"], eps)
    x = x + lin(torch.nn.functional.silu(lin(m, "mlp.gate_proj")) * lin(m, "mlp.up_proj"),
                "mlp.down_proj")
    g = _rms(x, t[p + "shared_head.norm.weight"], eps)  # [T, H]
    return g @ t.get(p + "shared_head.head.weight", head).T, g


def _target_hidden(target, tokens):
    """Final normed hidden of every position of `tokens` (plain HF attention)."""
    impl = target.config._attn_implementation
    target.config._attn_implementation = "sdpa"
    try:
        with torch.no_grad():
            return target(torch.tensor([tokens]), output_hidden_states=True).hidden_states[-1][0]
    finally:
        target.config._attn_implementation = impl


def reference_chain(target, nextn, committed, k):
    """The NextN layer's greedy chain after `committed` tokens, recomputed from scratch in
    plain torch: pairs (x_{p+1}, h_p) for every committed position but the root's, then the
    layer's own g fed back for each draft."""
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    with torch.no_grad():
        h = _target_hidden(target, committed)
        ids, hid, chain = list(committed[1:]), h[:-1], []
        for _ in range(k):
            logits, g = plain_nextn(nextn, target.config, ids, hid, embed, head)
            d = int(logits[-1].argmax())
            chain.append(d)
            ids.append(d)
            hid = torch.cat([hid, g[-1:]])
    return chain


# -- loader -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "bin"])
def test_checkpoint_loads_in_every_format(tmp_path, fmt):
    original = tiny_target()
    nextn = write_random_mtp_checkpoint(str(tmp_path), original, num_nextn_predict_layers=2,
                                        seed=1, fmt=fmt, own_head=fmt == "bin",
                                        tokenizer=char_tokenizer())
    # The stock loaders ignore the NextN keys and give back the same target.
    from specdec_inductor.loading import load_model
    target, tokenizer = load_model(str(tmp_path))
    ids = torch.tensor([tokenizer("Hi there")["input_ids"]])
    with torch.no_grad():
        assert torch.equal(target(ids).logits, original(ids).logits)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 2
    for layer in (0, 1):
        head = load_mtp_head(str(tmp_path), target, layer)
        assert isinstance(head, MtpDraftModel)
        assert type(head.model.layers[0]) is type(target.model.layers[0])
        p = f"model.layers.{LAYERS + layer}."
        assert torch.equal(head.eh_proj.weight, nextn[p + "eh_proj.weight"])
        assert torch.equal(head.enorm.weight, nextn[p + "enorm.weight"])
        assert torch.equal(head.hnorm.weight, nextn[p + "hnorm.weight"])
        assert torch.equal(head.model.norm.weight, nextn[p + "shared_head.norm.weight"])
        assert torch.equal(head.model.layers[0].mlp.up_proj.weight, nextn[p + "mlp.up_proj.weight"])
        assert head.model.embed_tokens is target.get_input_embeddings()
        if fmt == "bin":  # its own head
            assert head.lm_head is not target.get_output_embeddings()
            assert torch.equal(head.lm_head.weight, nextn[p + "shared_head.head.weight"])
        else:
            assert head.lm_head is target.get_output_embeddings()


def test_a_stored_copy_of_the_targets_embedding_is_shared(tmp_path):
    target, _ = saved(tmp_path)
    from safetensors.torch import load_file, save_file
    sd = load_file(str(tmp_path / "model.safetensors"))
    p = f"model.layers.{LAYERS}."
    sd[p + "embed_tokens.weight"] = sd["model.embed_tokens.weight"].clone()  # as DeepSeek-V3
    sd[p + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
    save_file(sd, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    head = load_mtp_head(str(tmp_path), target)
    assert head.model.embed_tokens is target.get_input_embeddings()
    assert head.lm_head is target.get_output_embeddings()


@pytest.mark.parametrize("family,own", [("llama", False), ("qwen2", False), ("llama", True)])
def test_forward_equals_plain_torch_from_the_checkpoint(tmp_path, family, own):
    target, nextn = saved(tmp_path, family, own_head=own, own_embed=own)
    head = load_mtp_head(str(tmp_path), target)
    head.config._attn_implementation = "sdpa"
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (11,), generator=gen)
    h = torch.randn(11, HIDDEN, generator=gen)
    with torch.no_grad():
        out = head(input_ids=ids[None], position_ids=torch.arange(11)[None], aux_hidden=h[None])
        logits, g = plain_nextn(nextn, target.config, ids.tolist(), h,
                                target.get_input_embeddings().weight,
                                target.get_output_embeddings().weight)
    torch.testing.assert_close(out.hidden_states[0][0], g, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[0], logits, atol=1e-4, rtol=1e-5)
    # The reference is sensitive to the layout it pins: the reversed concat differs.
    p = f"model.layers.{LAYERS}."
    swapped = dict(nextn)
    w = nextn[p + "eh_proj.weight"]
    swapped[p + "eh_proj.weight"] = torch.cat([w[:, HIDDEN:], w[:, :HIDDEN]], 1)
    with torch.no_grad():
        wrong, _ = plain_nextn(swapped, target.config, ids.tolist(), h,
                               target.get_input_embeddings().weight,
                               target.get_output_embeddings().weight)
    assert (wrong - logits).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_chains_equal_a_from_scratch_recomputation(tmp_path, family):
    """Drive the proposer through steps accepting 2, 4, 0 and 1 drafts (a random layer is
    rarely right, so the loop alone seldom commits multi-token paths): every chain must equal
    the plain-torch chain over the committed tokens."""
    target, nextn = saved(tmp_path, family)
    head = load_mtp_head(str(tmp_path), target)
    _, draft = _engines(target, head, 1)
    k = 4
    proposer = MtpProposer(draft, k + 1)
    prompt = prompts(3)[2]
    committed = list(prompt) + [17]
    h = _target_hidden(target, committed)
    proposer.start([0], [committed], [h[:len(prompt)]])
    for a in (2, 4, 0, 1):
        tree = proposer.propose([0], torch.tensor([len(committed) - 1]))
        chain = tree.tokens[0, 1:].tolist()
        assert tree.tokens[0, 0] == committed[-1]
        assert chain == reference_chain(target, nextn, committed, k), (a, len(committed))
        emitted = chain[:a] + [40 + a]  # a accepted drafts, then a bonus
        root = len(committed) - 1
        h = _target_hidden(target, committed + chain[:a])
        proposer.commit([0], [emitted], [h[root:root + a + 1]])
        committed += emitted
    tree = proposer.propose([0], torch.tensor([len(committed) - 1]))
    assert tree.tokens[0, 1:].tolist() == reference_chain(target, nextn, committed, k)
    proposer.finish([0])
    _free(draft)


# -- exactness ------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_mtp_equals_plain_greedy(tmp_path, family, batch):
    target, _ = saved(tmp_path, family, seed=batch)
    head = load_mtp_head(str(tmp_path), target)
    engine, draft = _engines(target, head, batch)
    spec = SpeculativeGenerator(engine, MtpProposer(draft, 4), min_accepted=0.0)
    ps = prompts(batch)  # ragged: 3, 7, 11, ... tokens
    stats = SpeculativeStats()
    assert spec.generate(ps, 20, stats=stats) == engine.generate(ps, 20)
    assert stats.verify_steps > 0
    for max_new in (1, 2):
        assert spec.generate(ps, max_new, eos_token_id=9) == engine.generate(ps, max_new,
                                                                              eos_token_id=9)
    _free(engine, draft)


def test_compiled_mtp_is_exact_without_recompiles(tmp_path):
    target, _ = saved(tmp_path, seed=2)
    engine = Engine(target, max_batch=2, max_len=96, compile=True, prefill_chunk=16,
                    capture_hidden=[-1])
    proposer = MtpProposer.from_model_dir(str(tmp_path), engine, 4)
    assert proposer.engine.compiled and proposer.engine.capture_hidden == [-1]
    spec = SpeculativeGenerator(engine, proposer, min_accepted=0.0)
    ps = prompts(2)
    assert spec.generate(ps, 12) == engine.generate(ps, 12)
    with torch.compiler.set_stance("fail_on_recompile"):
        ps2 = prompts(2, seed=8)
        assert spec.generate(ps2, 14) == engine.generate(ps2, 14)
    _free(engine, proposer.engine)


# -- refusals ------------------------------------------------------------------------------------
def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_weights(path, edit):
    from safetensors.torch import load_file, save_file
    sd = load_file(str(path / "model.safetensors"))
    edit(sd)
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_bad_checkpoints_are_refused_by_name(tmp_path):
    target = tiny_target()
    with pytest.raises(MtpCheckpointError, match="no config.json"):
        load_mtp_head(str(tmp_path), target)
    target, _ = saved(tmp_path)
    p = f"model.layers.{LAYERS}."
    _edit_config(tmp_path, num_nextn_predict_layers=None)
    with pytest.raises(MtpCheckpointError, match="num_nextn_predict_layers=None"):
        load_mtp_head(str(tmp_path), target)
    _edit_config(tmp_path, num_nextn_predict_layers=0)
    with pytest.raises(MtpCheckpointError, match="no MTP .NextN. layer.*=0"):
        load_mtp_head(str(tmp_path), target)
    _edit_config(tmp_path, num_nextn_predict_layers=1)
    for layer in (1, -1):
        with pytest.raises(MtpCheckpointError, match=r"argument 'layer' must lie in \[0, 1\)"):
            load_mtp_head(str(tmp_path), target, layer)
    _edit_config(tmp_path, num_nextn_predict_layers=2)  # says 2, stores 1
    with pytest.raises(MtpCheckpointError, match=f"missing.*model.layers.{LAYERS + 1}.enorm"):
        load_mtp_head(str(tmp_path), target, 1)
    _edit_config(tmp_path, num_nextn_predict_layers=1)
    load_mtp_head(str(tmp_path), target)  # intact again

    def drop(name):
        return lambda sd: sd.pop(p + name)
    for name in ("hnorm.weight", "mlp.up_proj.weight", "shared_head.norm.weight"):
        saved(tmp_path)
        _edit_weights(tmp_path, drop(name))
        with pytest.raises(MtpCheckpointError, match=f"missing.*{p + name}"):
            load_mtp_head(str(tmp_path), target)
    bad = [("eh_proj.weight", torch.zeros(HIDDEN, 3 * HIDDEN),
            r"eh_proj.weight has shape \(64, 192\)"),
           ("mlp.up_proj.weight", torch.zeros(7, HIDDEN), "does not fit the target's decoder"),
           ("mlp.experts.0.up_proj.weight", torch.zeros(1), "unexpected keys.*experts"),
           ("shared_head.head.weight", torch.zeros(5, HIDDEN),
            r"shared_head.head.weight has shape \(5, 64\)")]
    for name, value, message in bad:
        saved(tmp_path)
        _edit_weights(tmp_path, lambda sd: sd.update({p + name: value}))
        with pytest.raises(MtpCheckpointError, match=message):
            load_mtp_head(str(tmp_path), target)
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(MtpCheckpointError, match="argument 'path'.*no model.safetensors"):
        load_mtp_head(str(tmp_path), target)


# -- CLI ----------------------------------------------------------------------------------------
def char_tokenizer():
    """A character-level tokenizer over printable ASCII (ids 0..95), so the CLI can load a
    tiny model directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {chr(i): i - 32 for i in range(32, 127)}
    vocab["<eos>"] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tk.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tk.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<eos>",
                                                eos_token="<eos>")


def test_cli_generate_mtp_equals_plain(tmp_path, capsys):
    from specdec_inductor import cli
    write_random_mtp_checkpoint(str(tmp_path), tiny_target(seed=4), seed=5,
                                tokenizer=char_tokenizer())
    argv = ["generate", "--model", str(tmp_path), "--prompt", "Hello there", "--raw",
            "--max-new-tokens", "12", "--eager"]
    assert cli.main(argv) == 0
    plain = capsys.readouterr().out
    assert cli.main(argv + ["--method", "mtp", "--num-draft-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == plain.strip() and out.strip()
    assert "MTP (NextN) layer 0" in err and "mtp:" in err


def test_cli_bench_mtp_is_exact(tmp_path, capsys):
    from specdec_inductor import cli
    write_random_mtp_checkpoint(str(tmp_path), tiny_target(seed=6), seed=7,
                                tokenizer=char_tokenizer())
    assert cli.main(["bench", "--model", str(tmp_path), "--raw", "--eager", "--method", "mtp",
                     "--num-prompts", "2", "--repeats", "1", "--max-new-tokens", "8",
                     "--num-draft-tokens", "3", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["method"] == "mtp" and len(result["rows"]) == 2
    assert all(r["tokens_equal_ar"] for r in result["rows"])


def test_cli_refuses_a_model_without_nextn_layers():
    from specdec_inductor import cli
    with pytest.raises(SystemExit, match="num_nextn_predict_layers"):
        cli.main(["generate", "--eager", "--method", "mtp", "--max-new-tokens", "2"])
