"""EAGLE-3 (proposers/eagle3.py) and the Engine's capture of any hidden_states indices:
captured rows equal HF output_hidden_states (eager and compiled); heads in the published
EAGLE-3 layout load through the real loader and every malformed checkpoint is refused by name
(EAGLE-1/2 heads included, and EAGLE-3 heads on the EAGLE path); the head's forward equals a
plain-torch recomputation from the checkpoint tensors; drafts equal from-scratch chains through
commits of accepted paths; greedy speculative output equals plain greedy output (Llama / Qwen2
targets, batch 1 and a ragged batch 8, compiled without recompiles); every draft lands on a
target id that d2t maps to."""
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor.engine.engine import Engine  # noqa: E402
from specdec_inductor.proposers.eagle import (  # noqa: E402
    EagleCheckpointError, EagleProposer, load_eagle_head)
from specdec_inductor.proposers.eagle3 import (  # noqa: E402
    Eagle3CheckpointError, Eagle3Proposer, eagle3_target_layers, load_eagle3_head)
from specdec_inductor.proposers.ngram import NgramProposer  # noqa: E402
from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats  # noqa: E402
from specdec_inductor.testing import (  # noqa: E402
    write_random_eagle3_checkpoint, write_random_eagle_checkpoint)

VOCAB, HIDDEN = 160, 32
LAYER_IDS = [0, 1, 2]  # layer output ids of a 4-layer target: hidden_states [1, 2, 3]


def tiny_target(seed=0, layers=4, family="llama"):
    torch.manual_seed(seed)
    config = getattr(transformers, {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}[family])(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def prompts(count, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4 + 5 * i,), generator=gen).tolist() for i in range(count)]


def save(path, sd):
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"))


def write_head(path, target, seed=1, layer_ids=LAYER_IDS, **kwargs):
    return write_random_eagle3_checkpoint(str(path), target.config, seed=seed,
                                          layer_ids=layer_ids, **kwargs)


def _free(*engines):
    for e in engines:
        e.pool.check_consistent()
        assert e.pool.num_free_slots == e.pool.num_slots and not e.pool.live_requests


def _hf_hidden(model, tokens):
    """HF output_hidden_states of `tokens` (eager, stock sdpa attention): L + 1 tensors [T, H]."""
    impl = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        with torch.no_grad():
            out = model(torch.tensor([tokens]), output_hidden_states=True)
        return [h[0] for h in out.hidden_states], out.logits[0]
    finally:
        model.config._attn_implementation = impl


# -- Engine capture_hidden ---------------------------------------------------------------------

@pytest.mark.parametrize("compiled,indices", [(False, [1, 2, -1]), (False, [0, 3, -2, 4]),
                                              (True, [1, 2, -1])])
def test_captured_rows_equal_hf_hidden_states(compiled, indices):
    model = tiny_target(5)
    ps = [prompts(3)[2][:13], prompts(3)[0]]  # 13 and 4 tokens: two chunks, ragged
    engine = Engine(model, max_batch=2, max_len=32, compile=compiled, prefill_chunk=8,
                    capture_hidden=indices)
    reqs = engine.pool.admit([len(p) for p in ps], 2)
    rows = torch.tensor([r.row for r in reqs])
    _, last, hidden = engine.prefill_with_hidden(ps, rows)  # [B, V], [B, P, k*H]
    nxt = last.argmax(-1)
    tokens, logits, step_hidden = engine.decode(nxt, rows, torch.tensor([len(p) for p in ps]))
    for b, p in enumerate(ps):
        hs, stock_logits = _hf_hidden(model, p)
        want = torch.cat([hs[i] for i in indices], dim=-1)  # [P, k*H]
        assert hidden.shape[-1] == len(indices) * HIDDEN
        torch.testing.assert_close(hidden[b, :len(p)], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(last[b], stock_logits[-1], atol=1e-5, rtol=1e-5)
        hs, stock_logits = _hf_hidden(model, p + [int(nxt[b])])
        want = torch.cat([hs[i][-1] for i in indices], dim=-1)  # [k*H]
        torch.testing.assert_close(step_hidden[b], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logits[b], stock_logits[-1], atol=1e-5, rtol=1e-5)
    for r in reqs:
        engine.pool.release(r)
    # A plain engine on the same (now hooked) model is untouched: same tokens as stock HF.
    model.config._attn_implementation = "sdpa"
    with torch.no_grad():
        expected = model.generate(torch.tensor([ps[1]]), max_new_tokens=6, do_sample=False,
                                  pad_token_id=0)[0, len(ps[1]):].tolist()
    plain = Engine(model, max_batch=2, max_len=32, compile=False, prefill_chunk=8)
    assert plain.generate([ps[1]], 6) == [expected]


def test_capture_index_out_of_range_is_refused():
    model = tiny_target()
    with pytest.raises(ValueError, match="capture_hidden.*outside \\[-5, 4\\]"):
        Engine(model, max_batch=1, max_len=16, compile=False, capture_hidden=[1, 5])
    with pytest.raises(ValueError, match="capture_hidden"):
        Engine(model, max_batch=1, max_len=16, compile=False, capture_hidden=[-6])


# -- loader ------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,own_embedding,bias", [("safetensors", False, False),
                                                    ("bin", True, True)])
def test_loader_round_trip(tmp_path, fmt, own_embedding, bias):
    target = tiny_target()
    sd = write_head(tmp_path, target, fmt=fmt, own_embedding=own_embedding, bias=bias)
    head = load_eagle3_head(str(tmp_path), target)
    assert head.target_hidden_layers == [1, 2, 3]
    assert head.config.vocab_size == VOCAB and head.lm_head.out_features == VOCAB // 4
    loaded = head.state_dict()
    for k, v in sd.items():
        if k not in ("d2t", "t2d"):
            assert torch.equal(loaded[k], v), k
    assert torch.equal(head.d2t, sd["d2t"]) and torch.equal(head.t2d, sd["t2d"])
    assert torch.equal(head.draft_to_target, sd["t2d"].nonzero().flatten())
    assert head.d2t.abs().sum() > 0  # a real remapping, not the identity
    assert (head.embed_tokens is target.get_input_embeddings()) == (not own_embedding)
    assert (head.fc.bias is not None) == bias


def test_target_layers_default_and_from_config():
    assert eagle3_target_layers({}, 32) == [2, 16, 29]  # SGLang / EAGLE default [2, L//2, L-3]
    assert eagle3_target_layers({}, 7) == [2, 3, 4]
    ids = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [5, 1, 3]}}
    assert eagle3_target_layers(ids, 8) == [2, 4, 6]  # output ids + 1, in layer order
    with pytest.raises(Eagle3CheckpointError, match="distinct.*eagle_aux_hidden_state_layer_ids"):
        eagle3_target_layers({}, 4)  # [2, 2, 1]
    with pytest.raises(Eagle3CheckpointError, match="in \\[1, 3\\]"):
        eagle3_target_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}}, 4)


def _refused(tmp_path, target, mutate, match):
    sd = write_head(tmp_path, target)
    mutate(sd)
    save(tmp_path, sd)
    with pytest.raises(Eagle3CheckpointError, match=match) as info:
        load_eagle3_head(str(tmp_path), target)
    assert str(tmp_path) in str(info.value)


def test_bad_checkpoints_are_refused(tmp_path):
    target = tiny_target()
    with pytest.raises(EagleCheckpointError, match="no config.json"):
        load_eagle3_head(str(tmp_path), target)

    def drop(key):
        return lambda sd: sd.pop(key)

    def setkey(key, value):
        return lambda sd: sd.__setitem__(key, value)

    _refused(tmp_path, target, drop("midlayer.hidden_norm.weight"), "missing.*hidden_norm")
    _refused(tmp_path, target, drop("d2t"), "missing.*d2t")
    _refused(tmp_path, target, setkey("fc.weight", torch.zeros(HIDDEN, 2 * HIDDEN)),
             "fc.weight has shape \\(32, 64\\).*\\(32, 96\\)")
    _refused(tmp_path, target, setkey("midlayers.1.mlp.up_proj.weight", torch.zeros(1)),
             "unexpected keys.*midlayers.1")
    _refused(tmp_path, target, setkey("midlayer.self_attn.q_proj.weight", torch.zeros(HIDDEN, HIDDEN)),
             "q_proj.weight has shape")

    def out_of_range(sd):
        sd["d2t"][-1] = VOCAB  # the last draft id maps past the target vocabulary
    _refused(tmp_path, target, out_of_range, "d2t maps draft id 39 to target id .* outside")

    def negative(sd):
        sd["d2t"][0] = -1
    _refused(tmp_path, target, negative, "d2t maps draft id 0 to target id -1")

    def duplicate(sd):
        sd["d2t"][1] = sd["d2t"][0] - 1  # draft 1 -> the target id of draft 0
    _refused(tmp_path, target, duplicate, "two draft ids to the same target id")

    def t2d_off(sd):
        sd["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    _refused(tmp_path, target, t2d_off, "t2d does not mark")
    # A 2-layer target has no three distinct default layers.
    write_head(tmp_path, tiny_target(layers=2), layer_ids=None)
    with pytest.raises(Eagle3CheckpointError, match="distinct"):
        load_eagle3_head(str(tmp_path), tiny_target(layers=2))


def test_eagle_and_eagle3_checkpoints_refuse_each_other(tmp_path):
    target = tiny_target()
    eagle_dir, eagle3_dir = tmp_path / "eagle", tmp_path / "eagle3"
    write_random_eagle_checkpoint(str(eagle_dir), target.config)
    write_head(eagle3_dir, target)
    with pytest.raises(Eagle3CheckpointError, match="EAGLE-1/2 checkpoint.*load_eagle_head"):
        load_eagle3_head(str(eagle_dir), target)
    with pytest.raises(EagleCheckpointError, match="EAGLE-3 checkpoint"):
        load_eagle_head(str(eagle3_dir), target)


# -- the head's forward ------------------------------------------------------------------------

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, theta):
    """x [heads, T, D] rotated at positions 0..T-1 (rotate-half convention)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)  # [D/2]
    freqs = torch.arange(x.shape[1], dtype=torch.float32).view(-1, 1) * inv.view(1, -1)  # [T, D/2]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()  # [T, D]
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], dim=-1)
    return x * cos + half * sin


def reference_head(path, sd, ids, hidden):
    """The EAGLE-3 head from its checkpoint tensors in plain torch, no cache: ids [T] (target
    ids), hidden [T, H] (fc already applied to target features). (draft logits [T, Vd], g [T, H])."""
    cfg = json.loads((path / "config.json").read_text())
    eps, theta = cfg["rms_norm_eps"], cfg.get("rope_theta", 10000.0)
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = {k: v.float() for k, v in sd.items()}
    m = "midlayer."
    emb = w["embed_tokens.weight"][ids]  # [T, H]
    x = torch.cat([_rms(emb, w[m + "input_layernorm.weight"], eps),
                   _rms(hidden, w[m + "hidden_norm.weight"], eps)], dim=-1)  # [T, 2H]
    t = x.shape[0]
    q = (x @ w[m + "self_attn.q_proj.weight"].T).view(t, heads, -1).transpose(0, 1)  # [nh, T, D]
    k = (x @ w[m + "self_attn.k_proj.weight"].T).view(t, kv, -1).transpose(0, 1)  # [nkv, T, D]
    v = (x @ w[m + "self_attn.v_proj.weight"].T).view(t, kv, -1).transpose(0, 1)
    q, k = _rope(q, theta), _rope(k, theta)
    k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
    att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # [nh, T, D]
    h = hidden + att.transpose(0, 1).reshape(t, -1) @ w[m + "self_attn.o_proj.weight"].T
    y = _rms(h, w[m + "post_attention_layernorm.weight"], eps)
    mlp = (torch.nn.functional.silu(y @ w[m + "mlp.gate_proj.weight"].T)
           * (y @ w[m + "mlp.up_proj.weight"].T)) @ w[m + "mlp.down_proj.weight"].T
    g = h + mlp
    return _rms(g, w["norm.weight"], eps) @ w["lm_head.weight"].T, g


def _fc(sd, features):
    out = features @ sd["fc.weight"].T
    return out + sd["fc.bias"] if "fc.bias" in sd else out


def _draft_engine(head, batch, compiled=False):
    return Engine(head, max_batch=batch, max_len=128, compile=compiled, prefill_chunk=8,
                  capture_hidden=[-1])


@pytest.mark.parametrize("own_embedding,bias", [(False, False), (True, True)])
def test_head_forward_equals_plain_torch(tmp_path, own_embedding, bias):
    target = tiny_target(2)
    sd = write_head(tmp_path, target, own_embedding=own_embedding, bias=bias)
    if not own_embedding:
        sd["embed_tokens.weight"] = target.get_input_embeddings().weight.detach()
    head = load_eagle3_head(str(tmp_path), target)
    draft = _draft_engine(head, 1)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, 8), generator=gen)  # [1, T]
    feats = torch.randn(1, 8, 3 * HIDDEN, generator=gen)  # [1, T, 3H] target features
    req = draft.pool.admit([8], 1)[0]
    rows = torch.tensor([req.row])
    zero, eight = torch.zeros(1, dtype=torch.int64), torch.full((1,), 8)
    projected = head.project(feats)  # [1, T, H]: the head's own fc
    torch.testing.assert_close(projected[0], _fc(sd, feats[0]), atol=1e-5, rtol=1e-5)
    out = draft.extend(ids, torch.arange(8).view(1, 8), rows, zero, eight, None, projected)
    logits, g = out.logits, out.hidden
    want_logits, want_g = reference_head(tmp_path, sd, ids[0], projected[0])
    torch.testing.assert_close(g[0], want_g, atol=1e-5, rtol=1e-5)
    hot = sd["t2d"].nonzero().flatten()
    # The logits cover the draft vocabulary only (column j: target id draft_to_target[j]).
    assert torch.equal(head.draft_to_target, hot)
    assert logits.shape[-1] == hot.numel() == draft.vocab_size
    torch.testing.assert_close(logits[0], want_logits, atol=1e-5, rtol=1e-5)
    # One decode step fed the head's own output g at position 8.
    tok = torch.tensor([int(hot[3])])
    nxt, step_logits, step_g = draft.decode(tok, rows, torch.full((1,), 8), g[:, -1])
    ref_hidden = torch.cat([projected[0], g[0, -1:]])
    want_logits, want_g = reference_head(tmp_path, sd, torch.cat([ids[0], tok]), ref_hidden)
    torch.testing.assert_close(step_g[0], want_g[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step_logits[0], want_logits[-1], atol=1e-5, rtol=1e-5)
    assert int(nxt[0]) == int(want_logits[-1].argmax())  # a draft id (a column)
    draft.pool.release(req)
    with pytest.raises(ValueError, match="aux_hidden.*width 40"):
        draft.decode(tok, rows, torch.full((1,), 8), torch.zeros(1, 40))
    with pytest.raises(ValueError, match="aux_hidden.*width 96"):  # features need project()
        draft.decode(tok, rows, torch.full((1,), 8), feats[:, 0])
    with pytest.raises(ValueError, match="'features'.*capture_hidden"):
        head.project(feats[..., :40])


# -- drafting and the speculative loop ---------------------------------------------------------

def reference_chain(target, path, sd, layers, committed, k):
    """The head's greedy chain after `committed` tokens, from scratch: target features from HF
    output_hidden_states at `layers`, pairs (x_{p+1}, f_p) for every committed position but
    the root's, then k steps feeding back g; drafts mapped to target ids through d2t."""
    hs, _ = _hf_hidden(target, committed)
    feats = torch.cat([hs[i] for i in layers], dim=-1)  # [P, 3H]
    sd = dict(sd)
    sd.setdefault("embed_tokens.weight", target.get_input_embeddings().weight.detach())
    ids, hidden, chain = list(committed[1:]), _fc(sd, feats[:-1]), []
    hot = torch.arange(sd["d2t"].shape[0]) + sd["d2t"]
    with torch.no_grad():
        for _ in range(k):
            logits, g = reference_head(path, sd, torch.tensor(ids), hidden)
            d = int(hot[logits[-1].argmax()])
            chain.append(d)
            ids.append(d)
            hidden = torch.cat([hidden, g[-1:]])
    return chain


def _target_features(target, tokens, layers):
    hs, _ = _hf_hidden(target, tokens)
    return torch.cat([hs[i] for i in layers], dim=-1)  # [T, 3H]


@pytest.mark.parametrize("accepted", [[2, 4, 0, 3], [4, 1, 4]])
def test_commits_with_accepted_paths_keep_the_draft_in_step(tmp_path, accepted):
    """Drive the proposer through steps accepting `accepted[i]` drafts (a random head is
    rarely right, so the loop alone seldom commits multi-token paths): every chain equals the
    from-scratch recomputation over the target's three layers."""
    target = tiny_target(3)
    sd = write_head(tmp_path, target, seed=7)
    head = load_eagle3_head(str(tmp_path), target)
    layers = head.target_hidden_layers
    proposer = Eagle3Proposer(_draft_engine(head, 1), 5)
    k = 4
    prompt = prompts(1)[0]
    committed = list(prompt) + [17]
    proposer.start([0], [committed], [_target_features(target, committed, layers)[:len(prompt)]])
    for a in accepted:
        tree = proposer.propose([0], torch.tensor([len(committed) - 1]))
        chain = tree.tokens[0, 1:].tolist()
        assert tree.tokens[0, 0] == committed[-1]
        assert chain == reference_chain(target, tmp_path, sd, layers, committed, k)
        emitted = chain[:a] + [40 + a]
        root = len(committed) - 1
        feats = _target_features(target, committed + chain[:a], layers)
        proposer.commit([0], [emitted], [feats[root:root + a + 1]])
        committed += emitted
    tree = proposer.propose([0], torch.tensor([len(committed) - 1]))
    assert tree.tokens[0, 1:].tolist() == reference_chain(target, tmp_path, sd, layers, committed, k)
    proposer.finish([0])
    _free(proposer.engine)


def _recording(proposer, seen):
    propose = proposer.propose

    def wrapped(request_ids, seq_lens):
        tree = propose(request_ids, seq_lens)
        seen.append(tree.tokens[:, 1:].clone())
        return tree

    proposer.propose = wrapped


@pytest.mark.parametrize("family,layers,layer_ids,batch", [
    ("llama", 4, LAYER_IDS, 1), ("llama", 4, LAYER_IDS, 8),
    ("qwen2", 7, None, 1), ("qwen2", 7, None, 8)])
def test_greedy_speculative_equals_plain_greedy(tmp_path, family, layers, layer_ids, batch):
    target = tiny_target(4, layers=layers, family=family)
    sd = write_head(tmp_path, target, seed=11, layer_ids=layer_ids)
    head = load_eagle3_head(str(tmp_path), target)
    expected_layers = [1, 2, 3] if layer_ids else [2, 3, 4]
    proposer = Eagle3Proposer(_draft_engine(head, batch), 4)
    assert proposer.target_hidden_layers == expected_layers
    engine = Engine(target, max_batch=batch, max_len=128, compile=False, prefill_chunk=16,
                    capture_hidden=proposer.target_hidden_layers)
    seen = []
    _recording(proposer, seen)
    spec = SpeculativeGenerator(engine, proposer, min_accepted=0.0)
    spec.draft_in_program = False  # record by propose (the step program drafts the same chains)
    ps = prompts(batch)
    stats = SpeculativeStats()
    assert spec.generate(ps, 20, stats=stats) == engine.generate(ps, 20)
    assert stats.verify_steps > stats.decode_steps
    # Every draft is a target id that d2t maps to (all steps at batch 1; at batch 8 the first
    # step, before finished requests draft placeholders), and d2t moved some past the draft ids.
    drafts = torch.cat([s.flatten() for s in (seen if batch == 1 else seen[:1])])
    assert drafts.numel() >= 3 * batch and sd["t2d"][drafts].all()
    assert (drafts >= VOCAB // 4).any()
    _free(engine, proposer.engine)


def test_compiled_eagle3_is_exact_without_recompiles(tmp_path):
    target = tiny_target(6)
    write_head(tmp_path, target, seed=12)
    head = load_eagle3_head(str(tmp_path), target)
    proposer = Eagle3Proposer(_draft_engine(head, 2, compiled=True), 4)
    engine = Engine(target, max_batch=2, max_len=128, compile=True, prefill_chunk=16,
                    capture_hidden=proposer.target_hidden_layers)
    spec = SpeculativeGenerator(engine, proposer, min_accepted=0.0)
    ps = prompts(2)
    assert spec.generate(ps, 10) == engine.generate(ps, 10)
    with torch.compiler.set_stance("fail_on_recompile"):
        ps2 = prompts(2, seed=8)
        stats = SpeculativeStats()
        assert spec.generate(ps2, 12, stats=stats) == engine.generate(ps2, 12)
        assert stats.recompiles == 0
    _free(engine, proposer.engine)


def test_proposer_refuses_mismatched_engines(tmp_path):
    target = tiny_target()
    write_random_eagle_checkpoint(str(tmp_path / "eagle"), target.config)
    eagle_head = load_eagle_head(str(tmp_path / "eagle"), target)
    with pytest.raises(ValueError, match="draft_engine.*EAGLE-3"):
        Eagle3Proposer(_draft_engine(eagle_head, 1), 4)
    write_head(tmp_path / "eagle3", target)
    proposer = Eagle3Proposer(_draft_engine(load_eagle3_head(str(tmp_path / "eagle3"), target), 1), 4)
    assert isinstance(proposer, EagleProposer)
    last_only = Engine(target, max_batch=1, max_len=64, compile=False, capture_hidden=[-1])
    with pytest.raises(ValueError, match="capture_hidden=\\[1, 2, 3\\]"):
        SpeculativeGenerator(last_only, proposer).generate(prompts(1), 4)
    _free(last_only, proposer.engine)


# -- CLI ---------------------------------------------------------------------------------------

def test_cli_generate_eagle3_with_a_random_head_is_still_exact(tmp_path, capsys):
    """SmolLM2-135M (30 layers: default target layers [2, 15, 27]) with a random EAGLE-3 head."""
    from specdec_inductor import cli
    from specdec_inductor.loading import load_model
    target, _ = load_model()
    write_random_eagle3_checkpoint(str(tmp_path / "eagle3"), target.config, scale=0.02)
    assert cli.main(["generate", "--prompt", "What is the capital of France?",
                     "--max-new-tokens", "6", "--eager", "--method", "eagle3",
                     "--draft-model", str(tmp_path / "eagle3"), "--num-draft-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out and "EAGLE-3 head" in err and "[2, 15, 27]" in err


def test_cli_eagle3_needs_a_checkpoint(monkeypatch, tmp_path, capsys):
    from specdec_inductor import cli
    from specdec_inductor import loading
    monkeypatch.setattr(loading, "shipped_head", lambda method: str(tmp_path / "none"))
    with pytest.raises(SystemExit) as info:  # the flags' check, before anything loads
        cli.main(["generate", "--eager", "--method", "eagle3", "--max-new-tokens", "2"])
    assert info.value.code == 2
    assert "argument --draft-model: method eagle3 needs a head checkpoint" in capsys.readouterr().err


# -- a bf16 head on an fp32 target, trees over the draft vocabulary ----------------------------

def test_bf16_head_on_an_fp32_target_is_exact_and_leaves_the_shared_embedding_alone(tmp_path):
    target = tiny_target(5)
    write_head(tmp_path, target, seed=13)
    emb = target.get_input_embeddings()
    before = emb.weight.detach().clone()
    head = load_eagle3_head(str(tmp_path), target, torch.bfloat16)
    assert head.embed_tokens is emb and torch.equal(emb.weight, before)  # still fp32, untouched
    own = {n: p.dtype for n, p in head.named_parameters() if not n.startswith("embed_tokens")}
    assert own and set(own.values()) == {torch.bfloat16}
    draft = _draft_engine(head, 3)
    assert draft.dtype == torch.bfloat16 and draft.pool.k[0].dtype == torch.bfloat16
    for topk, depth in ((1, 3), (2, 3)):
        proposer = Eagle3Proposer(draft, 4, topk=topk, depth=depth)
        engine = Engine(target, max_batch=1, max_len=128, compile=False, prefill_chunk=16,
                        capture_hidden=proposer.target_hidden_layers)
        spec = SpeculativeGenerator(engine, proposer, min_accepted=0.0)
        for p in prompts(2):
            stats = SpeculativeStats()
            assert spec.generate([p], 16, stats=stats) == engine.generate([p], 16)
            assert stats.verify_steps > stats.decode_steps  # the bf16 head really drafted
        _free(engine, draft)
    with pytest.raises(ValueError, match="argument 'dtype'"):
        load_eagle3_head(str(tmp_path), target, torch.float16)


def test_trees_rank_the_draft_vocabulary_like_the_full_one(tmp_path):
    from specdec_inductor.proposers.tree_draft import TreeDrafter
    target = tiny_target(2)
    write_head(tmp_path, target, seed=14)
    head = load_eagle3_head(str(tmp_path), target)
    draft = _draft_engine(head, 3)
    proposer = Eagle3Proposer(draft, 6, topk=2, depth=3)
    assert torch.equal(proposer._tree.token_map, head.draft_to_target)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, 8), generator=gen)  # [1, T]
    feats = head.project(torch.randn(1, 8, 3 * HIDDEN, generator=gen))  # [1, T, H]
    req = draft.pool.admit([8], 1)[0]
    zero, eight = torch.zeros(1, dtype=torch.int64), torch.full((1,), 8)
    logits = draft.extend(ids, torch.arange(8).view(1, 8), torch.tensor([req.row]), zero,
                          eight, None, feats).logits
    draft.pool.release(req)
    assert logits.shape[-1] == head.draft_to_target.numel()  # [1, T, Vd] draft columns
    # The same logits scattered into the whole target vocabulary (-inf elsewhere), ranked by a
    # tree with no token map, must give the same log-probs and target ids.
    scattered = torch.full((8, VOCAB), float("-inf")).index_copy(1, head.draft_to_target,
                                                                 logits[0])  # [T, V]
    full = TreeDrafter(draft, 6, 2, 3)._children(scattered)  # [T, 2] over all VOCAB ids
    sub = proposer._tree._children(logits[0])
    torch.testing.assert_close(sub[0], full[0], atol=1e-6, rtol=0)  # same log-probs
    assert torch.equal(sub[1], full[1])  # same target ids
    assert bool((sub[1] != torch.topk(logits[0], 2).indices).any())  # the map really mapped
    for bad in (head.draft_to_target.float(), head.draft_to_target[:1], head.draft_to_target.view(-1, 1)):
        with pytest.raises(ValueError, match="argument 'token_map'"):
            TreeDrafter(draft, 6, 2, 3, bad)
    with pytest.raises(ValueError, match="logits are 30 wide"):
        proposer._tree._children(logits[0, :, :30])


@torch.inference_mode()
def test_extend_keeps_each_requests_last_row_only_where_asked(tmp_path):
    # The tree's draft extend needs the logits of each request's last extended row only:
    # the head's LM head then runs on that row (HF's logits_to_keep), g stays whole.
    target = tiny_target(2)
    write_head(tmp_path, target, seed=15)
    head = load_eagle3_head(str(tmp_path), target)
    draft = _draft_engine(head, 2)
    assert draft.keeps_last_rows
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, 8), generator=gen)  # [B, T]
    feats = head.project(torch.randn(2, 8, 3 * HIDDEN, generator=gen))  # [B, T, H]
    reqs = draft.pool.admit([8, 8], 1)
    rows = torch.tensor([r.row for r in reqs])
    zero, lens = torch.zeros(2, dtype=torch.int64), torch.tensor([8, 5])  # ragged
    pos = torch.arange(8).view(1, 8).expand(2, 8)
    _, full, g_full = draft.extend_step(ids, pos, rows, zero, lens, None, feats)
    _, kept, g_kept = draft.extend_step(ids, pos, rows, zero, lens, None, feats, last_only=True)
    draft.pool.release(reqs[0])
    draft.pool.release(reqs[1])
    vd = head.draft_to_target.numel()  # the logits' columns: the draft vocabulary
    assert full.shape == (2, 8, vd) and kept.shape == (2, 1, vd)
    torch.testing.assert_close(kept[:, 0], full[torch.arange(2), lens - 1], atol=1e-6, rtol=0)
    torch.testing.assert_close(g_kept, g_full, atol=0, rtol=0)
    with pytest.raises(ValueError, match="argument 'logits_to_keep'"):
        head(ids, pos, feats, logits_to_keep=3)


def test_default_head_dtype_follows_the_active_isa():
    import specdec_inductor as si
    from specdec_inductor.proposers.eagle3 import default_head_dtype
    was = si.active_isa()
    try:
        si.set_active_isa("portable")  # no bf16 kernels: the target's dtype
        assert default_head_dtype(torch.float32) == torch.float32
        assert default_head_dtype(torch.bfloat16) == torch.bfloat16
        if si.detected_isa() in ("avx512", "amx"):
            si.set_active_isa(si.detected_isa())
            assert default_head_dtype(torch.float32) == torch.bfloat16
    finally:
        si.set_active_isa(was)


@pytest.mark.parametrize("plain_steps", [0, 3])
def test_start_policy_keeps_greedy_output_exact(tmp_path, plain_steps):
    """EAGLE-3 behind a StartPolicy (plain steps, probes of verify size 2, backoff, then the
    acceptance gate's full trees) emits plain greedy's tokens, over a batch that admits
    requests twice."""
    target = tiny_target(4)
    write_head(tmp_path, target, seed=11)
    head = load_eagle3_head(str(tmp_path), target)
    proposer = Eagle3Proposer(_draft_engine(head, 2), 4)
    engine = Engine(target, max_batch=2, max_len=128, compile=False, prefill_chunk=16,
                    capture_hidden=proposer.target_hidden_layers)
    spec = SpeculativeGenerator(engine, proposer, tree_sizes=(1, 2, 4), min_accepted=0.0,
                                start_policy=dict(plain_steps=plain_steps, probe_misses=2))
    stats = SpeculativeStats()
    ps = prompts(2)
    want = [engine.generate([p], 24)[0] for p in ps]
    with spec.batch(2, stats) as batch:
        first = spec.admit(batch, ps[:1], 24)
        spec.step(batch)
        second = spec.admit(batch, ps[1:], 24)
        while batch.live:
            spec.step(batch)
        assert [first[0].tokens, second[0].tokens] == want
    assert stats.steps_by_size.get(2, 0) > 0 and stats.steps_by_size.get(1, 0) > 0
    _free(engine, proposer.engine)


def test_start_policy_argument_is_checked():
    """A bad start_policy fails at construction, naming the argument."""
    target = tiny_target(4)
    engine = Engine(target, max_batch=1, max_len=64, compile=False, prefill_chunk=16)
    for bad in (dict(plain_step=1), dict(probe_misses=0)):
        with pytest.raises(ValueError, match="start_policy"):
            SpeculativeGenerator(engine, NgramProposer(num_draft_tokens=4), start_policy=bad)
    spec = SpeculativeGenerator(engine, NgramProposer(num_draft_tokens=4), min_accepted=0.0,
                                adaptive=False, start_policy={})
    assert spec.tree_sizes == [1, 2, 4]
    assert type(spec.new_policy()).__name__ == "StartPolicy"
