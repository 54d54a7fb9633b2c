"""The proposer registry: every method is built from one ProposerConfig (target Engine capture,
draft Engine size, proposer) and drafts token-exact greedy output; bad configs are refused
naming the field, before anything loads."""
import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor.engine.engine import Engine  # noqa: E402
from specdec_inductor.proposers import registry  # noqa: E402
from specdec_inductor.proposers.autoregressive import AutoregressiveProposer  # noqa: E402
from specdec_inductor.proposers.draft_model import DraftModelProposer  # noqa: E402
from specdec_inductor.proposers.eagle import EagleProposer  # noqa: E402
from specdec_inductor.proposers.eagle3 import Eagle3Proposer  # noqa: E402
from specdec_inductor.proposers.mtp import MtpProposer  # noqa: E402
from specdec_inductor.proposers.ngram import NgramProposer  # noqa: E402
from specdec_inductor.proposers.registry import (  # noqa: E402
    ProposerConfig, ProposerConfigError, draft_engine_size, make_proposer, make_target_engine)
from specdec_inductor.proposers.standalone import StandaloneProposer  # noqa: E402
from specdec_inductor.speculative import SpeculativeGenerator  # noqa: E402
from specdec_inductor.testing import (  # noqa: E402
    write_random_eagle3_checkpoint, write_random_eagle_checkpoint, write_random_mtp_checkpoint)

VOCAB, LAYERS = 128, 4
# EAGLE-3 reads the outputs of layers 0, 1, 2: hidden_states 1, 2, 3 of the 4-layer target.
EAGLE3_LAYER_IDS = [0, 1, 2]


def tiny_llama(seed, layers=LAYERS):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(target directory with a NextN layer, EAGLE head directory, EAGLE-3 head directory)."""
    root = tmp_path_factory.mktemp("registry")
    target = tiny_llama(0)
    write_random_mtp_checkpoint(str(root / "target"), target, seed=1)
    write_random_eagle_checkpoint(str(root / "eagle"), target.config, seed=2)
    write_random_eagle3_checkpoint(str(root / "eagle3"), target.config, seed=3,
                                   layer_ids=EAGLE3_LAYER_IDS)
    return str(root / "target"), str(root / "eagle"), str(root / "eagle3")


def prompts(count, seed=5):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4 + 5 * i,), generator=gen).tolist() for i in range(count)]


# method, topk, depth, proposer class, target capture
CASES = [("none", None, None, AutoregressiveProposer, None),
         ("ngram", None, None, NgramProposer, None),
         ("standalone", 1, None, StandaloneProposer, None),
         ("standalone", 2, 3, StandaloneProposer, None),
         ("eagle", None, None, EagleProposer, [-1]),  # the default tree: topk 2, depth 4
         ("eagle3", 1, None, Eagle3Proposer, [1, 2, 3]),
         ("eagle3", 2, 3, Eagle3Proposer, [1, 2, 3]),
         ("mtp", 1, None, MtpProposer, [-1]),
         ("mtp", 2, 2, MtpProposer, [-1])]


@pytest.mark.parametrize("method,topk,depth,cls,capture", CASES,
                         ids=[f"{c[0]}-topk{c[1]}" for c in CASES])
def test_registry_builds_every_method_and_it_drafts_exact_greedy(checkpoints, method, topk,
                                                                 depth, cls, capture):
    target_dir, eagle_dir, eagle3_dir = checkpoints
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    head = {"eagle": eagle_dir, "eagle3": eagle3_dir}.get(method)
    config = ProposerConfig(method=method, num_draft_tokens=6, topk=topk, depth=depth,
                            draft_model=head, target_model=target_dir)
    engine = make_target_engine(config, target, max_batch=2, max_len=96, compile=False,
                                prefill_chunk=16)
    assert engine.capture_hidden == capture
    draft = tiny_llama(7, layers=1) if method == "standalone" else None
    lines = []
    proposer = make_proposer(config, engine, draft=draft, log=lines.append)
    assert type(proposer) is cls
    if isinstance(proposer, DraftModelProposer):
        assert (proposer.engine.max_batch, proposer.engine.max_len) == \
            draft_engine_size(config, engine)
        assert (proposer.topk, proposer.depth) == config.tree_shape()
        assert proposer.engine.compiled is engine.compiled and len(lines) == 1
    spec = SpeculativeGenerator(engine, proposer, min_accepted=0.0)
    ps = prompts(2)
    assert spec.generate(ps, 10) == engine.generate(ps, 10)
    for e in (engine, proposer.engine or engine):
        e.pool.check_consistent()
        assert e.pool.num_free_slots == e.pool.num_slots and not e.pool.live_requests


def test_default_trees_and_the_one_draft_engine_size():
    engine = type("E", (), {"max_batch": 3, "max_len": 200})()
    eagle3 = ProposerConfig(method="eagle3")
    assert eagle3.tree_shape() == registry.DEFAULT_TREES["eagle3"] == (3, 4)
    assert draft_engine_size(eagle3, engine) == (3 * 4, 200 + 3 * 4)
    chain = ProposerConfig(method="eagle3", num_draft_tokens=4)  # depth 4 does not fit N=4
    assert chain.tree_shape() == (1, 3) and draft_engine_size(chain, engine) == (3, 200)
    assert ProposerConfig(method="standalone", topk=2, depth=3).tree_shape() == (2, 3)
    assert ProposerConfig(method="ngram").tree_shape() == (1, 7)


@pytest.mark.parametrize("kwargs,field", [
    ({"method": "medusa"}, "method"),
    ({"method": "ngram", "num_draft_tokens": 1}, "num_draft_tokens"),
    ({"num_draft_tokens": 0}, "num_draft_tokens"),
    ({"method": "ngram", "topk": 2}, "topk/depth"),
    ({"method": "none", "depth": 3}, "topk/depth"),
    ({"method": "standalone", "topk": 0}, "topk"),
    ({"method": "standalone", "topk": 2, "depth": 1}, "num_draft_tokens/topk/depth"),
    ({"method": "standalone", "topk": 1, "depth": 3}, "num_draft_tokens/topk/depth"),
    ({"method": "standalone", "draft_layers": 0}, "draft_layers"),
    ({"method": "eagle", "draft_layers": 2}, "draft_layers"),
    ({"method": "standalone", "draft_model": "no-such-model"}, "draft_model"),
    ({"method": "eagle", "draft_model": "/no/such/dir"}, "draft_model"),
    ({"method": "eagle3", "target_model": "qwen2.5-coder-0.5b"}, "draft_model"),
    ({"method": "mtp", "draft_model": "/tmp"}, "draft_model"),
    ({"method": "eagle3", "draft_dtype": "fp16"}, "draft_dtype"),
    ({"dtype": "fp64"}, "dtype"),
    ({"method": "mtp", "mtp_layer": -1}, "mtp_layer"),
    ({"method": "ngram", "ngram_window": (3, 2)}, "ngram_window"),
    ({"method": "ngram", "ngram_breadth": (2, 0)}, "ngram_breadth"),
    ({"method": "standalone", "draft_vocab": 0}, "draft_vocab"),
    ({"method": "standalone", "draft_vocab": 40}, "draft_vocab"),  # not whole 16-row groups
    ({"method": "standalone", "draft_vocab": True}, "draft_vocab"),
    ({"method": "standalone", "draft_vocab": "32k"}, "draft_vocab"),
    ({"method": "eagle3", "draft_vocab": 32}, "draft_vocab"),
    ({"method": "standalone", "draft_stop_below": 1.0}, "draft_stop_below"),
    ({"method": "standalone", "draft_stop_below": -0.5}, "draft_stop_below"),
    ({"method": "standalone", "draft_stop_below": "0.5"}, "draft_stop_below"),
    ({"method": "standalone", "draft_stop_below": 0.5, "topk": 2, "depth": 3},
     "draft_stop_below"),
    ({"method": "eagle3", "draft_stop_below": 0.5}, "draft_stop_below"),
])
def test_bad_configs_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ProposerConfigError, match=f"argument '{field}'") as info:
        ProposerConfig(**kwargs)
    assert info.value.field == field


def test_heads_ship_for_the_default_model_only(monkeypatch, tmp_path):
    from specdec_inductor import loading
    assert ProposerConfig(method="eagle3").head_dir() == loading.shipped_head("eagle3")
    monkeypatch.setattr(loading, "shipped_head", lambda method: str(tmp_path / "none"))
    with pytest.raises(ProposerConfigError, match="no head is shipped"):
        ProposerConfig(method="eagle")


def test_draft_model_methods_need_their_target_engine_and_the_right_capture(checkpoints):
    target_dir, _, eagle3_dir = checkpoints
    with pytest.raises(ValueError, match="'target_engine'"):
        make_proposer(ProposerConfig(method="mtp", target_model=target_dir))
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    config = ProposerConfig(method="eagle3", draft_model=eagle3_dir, num_draft_tokens=4)
    plain = Engine(target, max_batch=1, max_len=64, compile=False)  # captures nothing
    with pytest.raises(ValueError, match=r"captures None.*\[1, 2, 3\].*make_target_engine"):
        make_proposer(config, plain)
    with pytest.raises(ValueError, match="'draft' applies to method standalone"):
        make_proposer(config, plain, draft=target)


def test_mtp_without_nextn_layers_is_refused_naming_the_target(tmp_path):
    target = tiny_llama(0)
    target.save_pretrained(str(tmp_path))
    engine = Engine(target, max_batch=1, max_len=64, compile=False, capture_hidden=[-1])
    with pytest.raises(ProposerConfigError, match="num_nextn_predict_layers") as info:
        make_proposer(ProposerConfig(method="mtp", target_model=str(tmp_path)), engine)
    assert info.value.field == "target_model"


def test_nothing_in_the_package_or_benchmarks_imports_the_cli():
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent
    offenders = [str(p.relative_to(root)) for d in ("specdec_inductor", "benchmarks")
                 for p in (root / d).rglob("*.py") if p.name != "cli.py"
                 and ("specdec_inductor.cli" in p.read_text()
                      or "from specdec_inductor import cli" in p.read_text())]
    assert offenders == []


def _draft_with_tokenizer(path):
    """A 1-layer draft saved with a word-level tokenizer over its VOCAB ids ("t0" ... "t127"),
    loaded back (so the draft knows its tokenizer's directory)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    tiny_llama(7, layers=1).save_pretrained(path)
    return transformers.AutoModelForCausalLM.from_pretrained(path).eval()


def test_standalone_draft_vocab_keeps_the_most_frequent_ids_and_exact_greedy(
        checkpoints, monkeypatch, tmp_path):
    from specdec_inductor.proposers import draft_vocab
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path / "cache"))
    frequent = [5, 9, 100, 127]
    monkeypatch.setattr(draft_vocab, "stdlib_sources",
                        lambda: iter([" ".join(f"t{i}" for i in frequent * 3), "t100 t127"]))
    target_dir = checkpoints[0]
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    config = ProposerConfig(method="standalone", num_draft_tokens=5, draft_vocab=32,
                            target_model=target_dir)
    engine = make_target_engine(config, target, max_batch=2, max_len=96, compile=False,
                                prefill_chunk=16)
    draft = _draft_with_tokenizer(str(tmp_path / "draft"))
    lines = []
    proposer = make_proposer(config, engine, draft=draft, log=lines.append)
    assert "draft vocabulary 32" in lines[-1] and proposer.engine.vocab_size == 32
    kept = draft.draft_to_target.tolist()
    # the 4 counted ids, then the 28 first of the rest in id order (0..29 without 5 and 9)
    assert kept == sorted(set(frequent) | set(range(30)))
    spec = SpeculativeGenerator(engine, proposer, min_accepted=0.0)
    ps = prompts(2)
    assert spec.generate(ps, 12) == engine.generate(ps, 12)
    # a draft shared by another proposer keeps its vocabulary, of the same size only
    make_proposer(config, engine, draft=draft)
    with pytest.raises(ProposerConfigError, match="already keeps a draft vocabulary of 32") as info:
        make_proposer(ProposerConfig(method="standalone", num_draft_tokens=5, draft_vocab=48,
                                     target_model=target_dir), engine, draft=draft)
    assert info.value.field == "draft_vocab"


@pytest.mark.parametrize("size,draft_kind,match", [
    (VOCAB, "tokenizer", "below the draft's vocabulary of 128"),
    (32, "bare", "no tokenizer")])
def test_standalone_draft_vocab_refused_for_this_draft(checkpoints, tmp_path, size, draft_kind,
                                                       match):
    target_dir = checkpoints[0]
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    config = ProposerConfig(method="standalone", num_draft_tokens=5, draft_vocab=size,
                            target_model=target_dir)
    engine = make_target_engine(config, target, max_batch=1, max_len=64, compile=False)
    draft = (_draft_with_tokenizer(str(tmp_path / "draft")) if draft_kind == "tokenizer"
             else tiny_llama(7, layers=1))
    with pytest.raises(ProposerConfigError, match=f"argument 'draft_vocab': .*{match}") as info:
        make_proposer(config, engine, draft=draft)
    assert info.value.field == "draft_vocab"
    assert getattr(draft, "draft_to_target", None) is None  # the draft is left as it was


def test_standalone_chains_that_end_early_verify_at_every_size(checkpoints):
    target_dir = checkpoints[0]
    config = ProposerConfig(method="standalone", num_draft_tokens=5, draft_stop_below=0.4,
                            target_model=target_dir)
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    engine = make_target_engine(config, target, max_batch=2, max_len=96, compile=False,
                                prefill_chunk=16)
    lines = []
    proposer = make_proposer(config, engine, draft=tiny_llama(7, layers=1), log=lines.append)
    assert proposer.stop_below == 0.4 and "chains end below p 0.4" in lines[-1]
    spec = SpeculativeGenerator(engine, proposer, min_accepted=0.0)
    assert proposer.variable_drafts and spec.tree_sizes == [1, 2, 3, 4, 5]
    ps = prompts(2)
    assert spec.generate(ps, 12) == engine.generate(ps, 12)
