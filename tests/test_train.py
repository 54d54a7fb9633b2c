"""Draft-head training (specdec_inductor/train/): the data built through the Engine equals a
plain HF forward over the same tokens; a few training steps lower the loss and write a
checkpoint that the method's own loader reads and whose drafts keep greedy output exact and
are accepted more often than the untrained head's; resuming from the trainer state gives the
same head bit for bit; held-out prompts never occur in training; bad arguments are refused."""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor.engine.engine import Engine  # noqa: E402
from specdec_inductor.proposers.eagle import EagleProposer, load_eagle_head  # noqa: E402
from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats  # noqa: E402
from specdec_inductor.train import corpus  # noqa: E402
from specdec_inductor.train.data import build_draft_data  # noqa: E402
from specdec_inductor.train.heads import EagleHead, write_checkpoint  # noqa: E402
from specdec_inductor.train.trainer import TrainConfig, eagle_loss, train_head  # noqa: E402

VOCAB = 96


def sharp_target(seed=0, num_layers=2, scale=4.0):
    """A tiny Llama whose greedy continuations are predictable enough to learn (scaled LM head)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=num_layers, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


def prompts(count, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (3 + i % 6,), generator=gen).tolist() for i in range(count)]


@pytest.fixture(scope="module")
def data_and_target():
    target = sharp_target()
    reference = copy.deepcopy(target)
    data = build_draft_data(target, prompts(24), [], new_tokens=20, eos_token_id=None,
                            max_batch=8, compile=False)
    return data, target, reference


def test_data_matches_a_plain_forward(data_and_target):
    data, target, reference = data_and_target
    engine = Engine(target, max_batch=1, max_len=64, compile=False)
    for i, p in enumerate(prompts(24)[:6]):
        tokens = data.tokens[i]
        cont = engine.generate([p], 20)[0]
        # Every generated token but the last was fed back, so it has a hidden row.
        assert tokens.tolist() == p + cont[:-1]
        with torch.no_grad():
            out = reference(tokens.view(1, -1), output_hidden_states=True)
        torch.testing.assert_close(data.final[i], out.hidden_states[-1][0], atol=2e-5, rtol=1e-4)
        assert torch.equal(data.label_ids[i][:, 0], out.logits[0].argmax(-1))
        assert data.feats[i].shape == (tokens.numel(), 0)
        torch.testing.assert_close(data.label_probs[i].sum(-1), torch.ones(tokens.numel()))
    assert data.num_generated_tokens == sum(t.numel() for t in data.tokens) - data.num_prompt_tokens


def test_data_stops_each_row_at_its_eos(data_and_target):
    """Rows of one batch that reach eos at different steps keep exactly their own prefix: the
    prompt and the fed-back continuation up to (not including) eos, with matching hidden rows
    and labels."""
    _, target, reference = data_and_target
    engine = Engine(target, max_batch=1, max_len=64, compile=False)
    plist = prompts(24)[:8]
    conts = [engine.generate([p], 20)[0] for p in plist]
    # The most common id in the middle of the continuations: rows stop at different steps.
    eos = int(torch.tensor([t for c in conts for t in c[2:-2]]).bincount().argmax())
    data = build_draft_data(target, plist, [], new_tokens=20, eos_token_id=eos, max_batch=8,
                            compile=False)
    stops = set()
    for i, p in enumerate(plist):
        cont = engine.generate([p], 20, eos)[0]
        stops.add(len(cont))
        assert data.tokens[i].tolist() == p + cont[:-1]
        with torch.no_grad():
            out = reference(data.tokens[i].view(1, -1), output_hidden_states=True)
        torch.testing.assert_close(data.final[i], out.hidden_states[-1][0], atol=2e-5, rtol=1e-4)
        assert torch.equal(data.label_ids[i][:, 0], out.logits[0].argmax(-1))
        assert data.label_probs[i].shape == (data.tokens[i].numel(), data.label_ids[i].shape[1])
    assert len(stops) >= 3, stops  # ragged stops, including rows that never met eos


def _acceptance(target, head_dir, plist):
    head = load_eagle_head(str(head_dir), target)
    engine = Engine(target, max_batch=1, max_len=64, compile=False, capture_hidden=[-1])
    draft = Engine(head, max_batch=1, max_len=64, compile=False, capture_hidden=[-1],
                   prefill_chunk=8)
    spec = SpeculativeGenerator(engine, EagleProposer(draft, 4), min_accepted=0.0)
    stats = SpeculativeStats()
    for p in plist:
        assert spec.generate([p], 20, None, stats)[0] == engine.generate([p], 20)[0]
    for e in (engine, draft):
        e.pool.check_consistent()
        assert e.pool.num_free_slots == e.pool.num_slots
    return stats.mean_accepted_length


def test_eagle_training_lowers_the_loss_and_the_head_drafts_exactly(data_and_target, tmp_path):
    data, target, _ = data_and_target
    cfg = TrainConfig(epochs=25, batch_size=8, lr=3e-3, save_every=1000)
    torch.manual_seed(cfg.seed)
    untrained = EagleHead(target)
    write_checkpoint(untrained, str(tmp_path / "untrained"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        before = float(eagle_loss(untrained, data, list(range(8)), 0.0, gen)[0])
    head = train_head(target, data, str(tmp_path / "trained"), cfg, progress=lambda s: None)
    with torch.no_grad():
        after = float(eagle_loss(head, data, list(range(8)), 0.0, gen)[0])
    assert after < 0.8 * before, (before, after)
    # The head's draft vocabulary: the data's most frequent ids (all 96 of this tiny vocabulary).
    from specdec_inductor.proposers.eagle import read_draft_vocab
    from specdec_inductor.train.trainer import draft_vocabulary
    assert torch.equal(read_draft_vocab(str(tmp_path / "trained"), VOCAB),
                       draft_vocabulary(target, data, 8192))
    trained = _acceptance(target, tmp_path / "trained", prompts(24)[:4])
    baseline = _acceptance(target, tmp_path / "untrained", prompts(24)[:4])
    assert trained > baseline + 0.1, (trained, baseline)


def test_eagle_loss_scores_the_draft_vocabulary_the_proposer_drafts_from(data_and_target):
    """A narrowed EAGLE head's logits are the target LM head's rows for its draft vocabulary,
    and its cross-entropy is the soft labels' inside that vocabulary, renormalized, over the
    rows whose target top-1 is in it (a row-by-row reference)."""
    from specdec_inductor.train.trainer import draft_vocabulary
    data, target, _ = data_and_target
    vocab = draft_vocabulary(target, data, 48)
    torch.manual_seed(0)
    full = EagleHead(target)
    narrow = EagleHead(target, vocab)
    narrow.load_state_dict(full.state_dict())
    idx = list(range(8))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        _, stats = eagle_loss(narrow, data, idx, 0.0, gen)
        ces, reached = [], 0
        for i in idx:
            nxt, feats = data.tokens[i][1:], data.final[i][:-1].float()
            g = full(nxt[None], feats[None])[0]  # [T, H]
            assert torch.equal(narrow.logits(g), target.lm_head(g)[:, vocab])
            logp = torch.log_softmax(target.lm_head(g)[:, vocab].float(), -1)
            for row, (ids, probs) in enumerate(zip(data.label_ids[i][1:].tolist(),
                                                   data.label_probs[i][1:].tolist())):
                if ids[0] not in vocab.tolist():
                    continue
                reached += 1
                kept = [(vocab.tolist().index(t), p) for t, p in zip(ids, probs)
                        if t in vocab.tolist()]
                mass = sum(p for _, p in kept)
                ces.append(-sum(p / mass * float(logp[row, d]) for d, p in kept))
    assert 0 < reached < sum(len(data.tokens[i]) - 1 for i in idx)  # some rows fall outside
    assert stats["ce"] == pytest.approx(sum(ces) / len(ces), rel=1e-4)


def test_resume_continues_to_the_same_head(data_and_target, tmp_path):
    data, target, _ = data_and_target
    cfg = TrainConfig(epochs=2, batch_size=8, lr=3e-3, save_every=1)
    whole = train_head(target, data, str(tmp_path / "a"), cfg, progress=lambda s: None)

    class Stop(Exception):
        pass

    def stop_at_step_4(line):
        if "step 4/" in line:
            raise Stop

    with pytest.raises(Stop):  # interrupted at step 4 (the state of step 3 is on disk)
        train_head(target, data, str(tmp_path / "b"), cfg, progress=stop_at_step_4, log_every=1)
    resumed = train_head(target, data, str(tmp_path / "b"), cfg, resume=True,
                         progress=lambda s: None)
    for (k, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), k
    with pytest.raises(ValueError, match="resume"):
        train_head(target, data, str(tmp_path / "b"), TrainConfig(epochs=3, lr=3e-3),
                   resume=True, progress=lambda s: None)


def test_heldout_prompts_never_occur_in_training():
    from specdec_inductor.cli import BENCH_PROMPTS
    everything = corpus.training_prompts(len(corpus.TEMPLATES) * len(corpus.TOPICS)
                                         + len(corpus.CODE_TEMPLATES) * len(corpus.CODE_TASKS))
    held = corpus.heldout_prompts()
    assert len(set(everything)) == len(everything) and len(held) >= 16
    for topic in corpus.HELDOUT_TOPICS + corpus.HELDOUT_CODE_TASKS:
        assert not any(topic in p for p in everything), topic
    assert not set(BENCH_PROMPTS) & set(everything)
    assert corpus.training_prompts(40, seed=3) == corpus.training_prompts(40, seed=3)


def test_bad_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="'method'"):
        TrainConfig(method="medusa").validate()
    with pytest.raises(ValueError, match="'epochs'"):
        TrainConfig(epochs=0).validate()
    with pytest.raises(ValueError, match="'lr'"):
        TrainConfig(lr=0.0).validate()
    with pytest.raises(ValueError, match="'precision'"):
        TrainConfig(precision="fp16").validate()
    with pytest.raises(ValueError, match="'num_prompts'"):
        corpus.training_prompts(0)
    from specdec_inductor.cli import main
    with pytest.raises(SystemExit) as info:  # the CLI's one-line error, before any loading
        main(["train-draft", "--method", "eagle", "--epochs", "0", "--out", str(tmp_path)])
    assert info.value.code == 2 and "argument --epochs" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="num_prompts"):
        main(["train-draft", "--method", "eagle", "--num-prompts", "100000", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as info:
        main(["train-draft", "--method", "eagle", "--max-batch", "0", "--out", str(tmp_path)])
    assert info.value.code == 2 and "argument --max-batch" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse refuses the choice, naming the option
        main(["train-draft", "--method", "eagle", "--data-precision", "fp16", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="'precision'"):
        build_draft_data(sharp_target(), prompts(2), [], new_tokens=4, eos_token_id=None,
                         compile=False, precision="fp16")


def test_batch_order_covers_every_sequence_and_pads_little():
    """Each epoch's batches hold every sequence once, ceil(n / batch) batches, seeded; the
    length-sorted windows pad far less than a plain shuffle would."""
    from specdec_inductor.train.trainer import _batch_order
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(20, 200, (203,), generator=gen).tolist()
    batches = _batch_order(lengths, 8, seed=3, epoch=1)
    assert len(batches) == (203 + 7) // 8
    assert sorted(i for b in batches for i in b) == list(range(203))
    assert batches == _batch_order(lengths, 8, seed=3, epoch=1)
    assert batches != _batch_order(lengths, 8, seed=3, epoch=2)

    def padded(bs):
        return sum(max(lengths[i] for i in b) * len(b) for b in bs) / sum(lengths)
    perm = torch.randperm(203, generator=torch.Generator().manual_seed(3)).tolist()
    shuffled = [perm[i:i + 8] for i in range(0, 203, 8)]
    assert padded(batches) < 1.1 < padded(shuffled), (padded(batches), padded(shuffled))


LAYERS3 = [1, 2, 3]  # a 4-layer target's inputs of layers 1..3 (the defaults collide this shallow)


@pytest.fixture(scope="module")
def data3_and_target():
    target = sharp_target(seed=2, num_layers=4, scale=8.0)
    data = build_draft_data(target, prompts(16, seed=5), LAYERS3, new_tokens=16,
                            eos_token_id=None, max_batch=8, compile=False)
    return data, target


def _draft_engine(head_dir, target):
    from specdec_inductor.proposers.eagle3 import load_eagle3_head
    head = load_eagle3_head(str(head_dir), target)
    return head, Engine(head, max_batch=1, max_len=64, compile=False, capture_hidden=[-1],
                        prefill_chunk=32)


def _eagle3_acceptance(head_dir, target, plist, num_steps):
    """Mean accepted length of the EAGLE-3 head in head_dir drafting chains of num_steps for
    `target` over plist, asserting greedy output identical to plain decoding."""
    from specdec_inductor.proposers.eagle3 import Eagle3Proposer
    _, draft = _draft_engine(head_dir, target)
    proposer = Eagle3Proposer(draft, num_steps)
    engine = Engine(target, max_batch=1, max_len=64, compile=False,
                    capture_hidden=proposer.target_hidden_layers)
    spec = SpeculativeGenerator(engine, proposer, min_accepted=0.0)
    stats = SpeculativeStats()
    for p in plist:
        assert spec.generate([p], 16, None, stats)[0] == engine.generate([p], 16)[0]
    return stats.mean_accepted_length


def test_eagle3_training_time_test_matches_drafting(data3_and_target, tmp_path):
    """The unrolled training forward (step s, index i) equals what the loaded head computes
    while drafting: extend over the committed pairs 0..i, then s decode steps feeding back g."""
    from specdec_inductor.train.heads import Eagle3Head
    data, target = data3_and_target
    torch.manual_seed(0)
    vocab = torch.arange(0, VOCAB, 2)  # a draft vocabulary of every other id
    train = Eagle3Head(target, vocab, LAYERS3)
    with torch.no_grad():
        for p in train.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    write_checkpoint(train, str(tmp_path), dtype=torch.float32)
    head, engine = _draft_engine(tmp_path, target)
    assert head.target_hidden_layers == LAYERS3
    assert torch.equal(head.draft_to_target, vocab)
    tokens, feats = data.tokens[0], data.feats[0]  # [T], [T, 3H]
    t = tokens.numel()
    with torch.no_grad():
        want = train(tokens.view(1, t), feats.view(1, t, -1), steps=3)  # [1, T, Vd] per step
    req = engine.pool.admit([t], 4)[0]
    rows = torch.tensor([req.row])
    for i in (0, 3, t - 5):
        ids = tokens[1:i + 2].view(1, -1)  # x_1 .. x_{i+1}
        _, logits, g = engine.extend(ids, torch.arange(i + 1).view(1, -1), rows,
                                  torch.tensor([0]), torch.tensor([i + 1]), None,
                                  head.project(feats[:i + 1]).view(1, i + 1, -1))
        assert logits.shape[-1] == vocab.numel()  # the draft vocabulary's columns
        torch.testing.assert_close(logits[0, i], want[0][0, i], atol=1e-4, rtol=1e-4)
        g = g[:, i]  # [1, H]
        for s in (1, 2):
            tok = tokens[i + s + 1].view(1)
            _, logits, g = engine.decode(tok, rows, torch.tensor([i + s]), g)
            torch.testing.assert_close(logits[0], want[s][0, i], atol=1e-4, rtol=1e-4)
    engine.pool.release(req)


def test_eagle3_training_lowers_the_loss_and_the_head_drafts_exactly(data3_and_target, tmp_path):
    from specdec_inductor.train.trainer import eagle3_loss, make_head
    data, target = data3_and_target
    cfg = TrainConfig(method="eagle3", epochs=40, batch_size=8, lr=3e-3, ttt_steps=3,
                      save_every=1000)
    untrained = make_head(target, data, cfg, draft_vocab_size=64)
    with torch.no_grad():
        before = eagle3_loss(untrained, data, list(range(8)), 3)
    head = train_head(target, data, str(tmp_path), cfg, draft_vocab_size=64,
                      progress=lambda s: None)
    with torch.no_grad():
        after = eagle3_loss(head, data, list(range(8)), 3)
    # The soft cross-entropy has the target's entropy as its floor: check top-1 agreement too.
    assert float(after[0]) < float(before[0]) - 0.2, (before, after)
    assert after[1]["acc0"] > before[1]["acc0"] + 0.2, (before, after)
    assert int(head.t2d.sum()) == 64
    # The draft vocabulary is the 64 most frequent ids of the data.
    counts = data.token_counts(VOCAB)
    assert counts[head.t2d].min() >= counts[~head.t2d].max()
    assert _eagle3_acceptance(tmp_path, target, prompts(16, seed=5)[:3], 4) > 1.1


def test_eagle3_warm_start_begins_at_the_checkpoint_and_keeps_its_vocabulary(data3_and_target,
                                                                              tmp_path):
    """train_head with cfg.init starts from the checkpoint's weights (its loss, not a fresh
    head's), keeps its draft vocabulary (not the data's most frequent ids) and refuses heads
    that do not fit the data."""
    from specdec_inductor.train.heads import Eagle3Head
    from specdec_inductor.train.trainer import eagle3_loss, make_head
    data, target = data3_and_target
    torch.manual_seed(0)
    vocab = torch.arange(1, VOCAB, 3)  # not the data's top ids
    start = Eagle3Head(target, vocab, LAYERS3)
    with torch.no_grad():
        for p in start.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    write_checkpoint(start, str(tmp_path / "start"), dtype=torch.float32)
    cfg = TrainConfig(method="eagle3", epochs=2, batch_size=8, lr=1e-3, ttt_steps=3,
                      save_every=1000, init=str(tmp_path / "start"))
    warm = make_head(target, data, cfg, draft_vocab_size=64)
    idx = list(range(8))
    with torch.no_grad():
        want, _ = eagle3_loss(start, data, idx, 3)
        got, _ = eagle3_loss(warm, data, idx, 3)
        fresh, _ = eagle3_loss(make_head(target, data, TrainConfig(method="eagle3"), 64),
                               data, idx, 3)
    torch.testing.assert_close(got, want)
    assert abs(float(fresh) - float(want)) > 1e-3
    head = train_head(target, data, str(tmp_path / "out"), cfg, progress=lambda s: None)
    assert torch.equal(head.t2d.nonzero().flatten(), vocab)
    assert not torch.equal(head.fc.weight, start.fc.weight)  # it trained
    assert _eagle3_acceptance(tmp_path / "out", target, prompts(16, seed=5)[:2], 4) >= 1.0
    with pytest.raises(ValueError, match="'init'"):
        make_head(target, data, TrainConfig(method="eagle", init=str(tmp_path / "start")), 64)
    with pytest.raises(ValueError, match="'init'"):
        make_head(target, data, TrainConfig(method="eagle3", init=str(tmp_path / "none")), 64)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
@pytest.mark.parametrize("model", [None, "smollm2-135m"], ids=["dense", "quantized"])
def test_shipped_heads_draft_for_the_default_model_exactly(method, model):
    """The heads in specdec_inductor/heads/ load by default for SmolLM2 -- the dense default
    and the same GGUF file kept quantized (`--model smollm2-135m`) -- and are accepted on a
    held-out prompt, with output identical to plain greedy decoding of that target."""
    from specdec_inductor.engine.gguf_model import QuantLinear
    from specdec_inductor.loading import load_model
    from specdec_inductor.loading import encode, shipped_head
    from specdec_inductor.proposers.registry import (ProposerConfig, make_proposer,
                                                     make_target_engine)
    from specdec_inductor.train.corpus import heldout_prompts
    target, tokenizer = load_model(model)
    assert isinstance(target.lm_head, QuantLinear) == (model is not None)
    config = ProposerConfig(method=method, target_model=model, num_draft_tokens=6, topk=1)
    assert config.head_dir() == shipped_head(method)
    engine = make_target_engine(config, target, max_batch=1, max_len=256, compile=False)
    proposer = make_proposer(config, engine)
    ids = encode(tokenizer, heldout_prompts()[0], chat=True)
    stats = SpeculativeStats()
    spec = SpeculativeGenerator(engine, proposer, min_accepted=0.0)
    assert spec.generate([ids], 24, None, stats)[0] == engine.generate([ids], 24)[0]
    # A random head accepts ~nothing on SmolLM2 (tests/test_cli.py); a trained one does.
    assert stats.mean_accepted_length > 1.2, stats.summary()


def test_data_precision_follows_the_cpu():
    """bf16 data passes are the default only where AMX tiles run oneDNN's bf16 GEMMs, and only
    there does the data Engine turn the packed-GEMV pass off (its bf16 path is slower at 64
    rows than the AMX GEMMs)."""
    from specdec_inductor import detected_isa
    from specdec_inductor.train.data import data_engine_options, data_precision
    amx = detected_isa() == "amx"
    assert data_precision("auto") == ("bf16" if amx else "fp32")
    assert data_precision("fp32") == "fp32" and data_precision("bf16") == "bf16"
    assert data_engine_options("fp32") == {}
    off = {"specdec.skinny_linear": False, "specdec.pack_weights": False}
    assert data_engine_options("bf16") == (off if amx else {})


def test_bf16_data_pass_leaves_the_target_and_trains_an_exact_head(tmp_path):
    """precision='bf16' continues the prompts with a bf16 copy of the target (the target itself
    stays fp32), stores the features in bf16 with the bf16 model's own greedy tokens, hidden
    states and labels, and a head trained on them in fp32 learns and drafts exactly for the fp32
    target."""
    from specdec_inductor.train.trainer import eagle3_loss, make_head
    target = sharp_target(seed=2, num_layers=4, scale=8.0)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    plist = prompts(16, seed=5)
    data = build_draft_data(target, plist, LAYERS3, new_tokens=16, eos_token_id=None,
                            max_batch=8, compile=False, precision="bf16")
    assert all(v.dtype == torch.float32 and torch.equal(v, before[k])
               for k, v in target.state_dict().items())
    assert data.precision == "bf16"
    assert all(f.dtype == torch.bfloat16 for f in data.feats + data.final)
    low = copy.deepcopy(target).to(torch.bfloat16)
    engine = Engine(copy.deepcopy(low), max_batch=1, max_len=64, compile=False)
    for i, p in enumerate(plist[:4]):
        cont = engine.generate([p], 16)[0]
        assert data.tokens[i].tolist() == p + cont[:-1]
        with torch.no_grad():
            out = low(data.tokens[i].view(1, -1), output_hidden_states=True)
        torch.testing.assert_close(data.final[i], out.hidden_states[-1][0], atol=0.05, rtol=0.02)
        torch.testing.assert_close(data.feats[i][:, :32], out.hidden_states[LAYERS3[0]][0],
                                   atol=0.05, rtol=0.02)
        # bf16 rounds by the batch's shapes: near-ties may break the other way.
        same = data.label_ids[i][:, 0] == out.logits[0].float().argmax(-1)
        assert float(same.float().mean()) >= 0.9, same
    cfg = TrainConfig(method="eagle3", epochs=40, batch_size=8, lr=3e-3, ttt_steps=3,
                      save_every=1000, precision="fp32")
    head = train_head(target, data, str(tmp_path), cfg, draft_vocab_size=64,
                      progress=lambda s: None)
    with torch.no_grad():
        loss = float(eagle3_loss(head, data, list(range(8)), 3)[0])
    with torch.no_grad():
        untrained = float(eagle3_loss(make_head(target, data, cfg, 64), data, list(range(8)), 3)[0])
    assert loss < 0.8 * untrained, (untrained, loss)
    assert _eagle3_acceptance(tmp_path, target, plist[:4], 3) > 1.1


def test_train_precision_follows_the_cpu():
    from specdec_inductor.train.trainer import train_precision
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert train_precision("auto") == ("bf16" if native else "fp32")
    assert train_precision("fp32") == "fp32" and train_precision("bf16") == "bf16"


def test_compiled_soft_cross_entropy_equals_the_eager_one():
    """The Inductor-compiled loss (dynamic shapes) gives the eager loss and gradients, for fp32
    and bf16 logits and two sequence lengths, without recompiling for the second length."""
    from specdec_inductor.train.trainer import _soft_ce, soft_ce_fn
    compiled = soft_ce_fn(True)
    assert compiled is not _soft_ce and soft_ce_fn(True) is compiled
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for t in (7, 13):
            logits = (torch.randn(2, t, 300, generator=gen) * 3).to(dtype)
            ids = torch.randint(0, 300, (2, t, 5), generator=gen)
            probs = torch.rand(2, t, 5, generator=gen)
            probs = probs / probs.sum(-1, keepdim=True)
            grads = []
            for fn in (_soft_ce, compiled):
                x = logits.clone().requires_grad_(True)
                out = fn(x, ids, probs)
                out.sum().backward()
                grads.append((out.detach(), x.grad.float()))
            torch.testing.assert_close(grads[1][0], grads[0][0], atol=1e-4, rtol=1e-4)
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(grads[1][1], grads[0][1], atol=tol, rtol=tol)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="no native bf16 matmuls on this CPU")
def test_bf16_training_with_the_compiled_loss_learns(data3_and_target, tmp_path):
    """The CLI's default on a CPU with bf16 matmuls (autocast, compiled loss) trains as fp32
    does: the loss and top-1 agreement improve by the margins of the fp32 test, and the head
    drafts exactly."""
    from specdec_inductor.train.trainer import eagle3_loss, make_head
    data, target = data3_and_target
    cfg = TrainConfig(method="eagle3", epochs=40, batch_size=8, lr=3e-3, ttt_steps=3,
                      save_every=1000, precision="bf16", compile_loss=True)
    untrained = make_head(target, data, cfg, draft_vocab_size=64)
    with torch.no_grad():
        before = eagle3_loss(untrained, data, list(range(8)), 3)
    lines = []
    head = train_head(target, data, str(tmp_path), cfg, draft_vocab_size=64,
                      progress=lines.append)
    assert all(p.dtype == torch.float32 for p in head.parameters())  # master weights stay fp32
    assert lines and all("acc0=" in line for line in lines)
    with torch.no_grad():
        after = eagle3_loss(head, data, list(range(8)), 3)
        # Off the progress lines the loss skips the accuracies (an argmax over the logits).
        assert not any(k.startswith("acc") for k in
                       eagle3_loss(head, data, list(range(8)), 3, with_acc=False)[1])
    assert float(after[0]) < float(before[0]) - 0.2, (before, after)
    assert after[1]["acc0"] > before[1]["acc0"] + 0.2, (before, after)
    _eagle3_acceptance(tmp_path, target, prompts(16, seed=5)[:3], 4)  # asserts exactness
