"""Issue 38's reliability defects, each pinned by a test that failed before its fix: streamed
text never splits a character, CLI mistakes end in one-line errors naming the flag before any
model loads, the compiled warm-up fits the request, a greedy run stopping at eos reports a real
decode rate, --data never overwrites a user's file, KV rows never leak when a proposer's
cleanup raises, non-finite heads are refused, bad values are refused instead of misread, and a
STANDALONE draft with another vocabulary is named. Tiny random models and a fake tokenizer
(the CLI's model loader is patched), so every test runs in seconds."""
import math
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specdec_inductor import cli, loading  # noqa: E402
from specdec_inductor.engine.engine import Engine  # noqa: E402
from specdec_inductor.engine.kv_pool import KVPool  # noqa: E402
from specdec_inductor.proposers.ngram import NgramProposer  # noqa: E402
from specdec_inductor.proposers.standalone import StandaloneProposer  # noqa: E402
from specdec_inductor.speculative import SpeculativeGenerator  # noqa: E402

VOCAB = 96


def tiny_model(seed=0, vocab=VOCAB, layers=2):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=layers, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config).eval()


class ByteTokenizer:
    """Token id k decodes to byte k + 32 (ids 0..95 are printable ASCII), unless `table` maps
    it to other bytes; decode replaces an invalid or unfinished UTF-8 sequence by U+FFFD, as a
    byte-level BPE tokenizer's does."""

    chat_template = None

    def __init__(self, eos_token_id=None, table=None):
        self.eos_token_id, self.table = eos_token_id, table or {}

    def __call__(self, text):
        return {"input_ids": [min(max(ord(c) - 32, 0), VOCAB - 1) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        raw = b"".join(self.table.get(i, bytes([i + 32])) for i in ids
                       if not (skip_special_tokens and i == self.eos_token_id))
        return raw.decode("utf-8", errors="replace")


# -- 1: streamed text ---------------------------------------------------------------------------
def test_text_stream_never_prints_a_split_character():
    text = "naïve café 日本語 🙂!"
    data = text.encode()
    table = {i: bytes([b]) for i, b in enumerate(data)}  # one byte per token
    tok = ByteTokenizer(table=table)
    stream = loading.TextStream(tok)
    pieces = [stream.push(i) for i in range(len(data))] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_text_stream_flushes_a_truly_invalid_tail():
    tok = ByteTokenizer(table={0: b"ok", 1: b"\xe6\x97"})  # a character cut off for good
    stream = loading.TextStream(tok)
    assert stream.push(0) == "ok" and stream.push(1) == ""
    assert stream.flush() == "\ufffd"


@pytest.fixture
def fake_model(monkeypatch):
    """cli's model loader patched to a tiny model and the byte tokenizer; returns a setter for
    the tokenizer's eos id (the tokens the tiny model emits are known only after a run)."""
    model = tiny_model()
    tok = ByteTokenizer()
    monkeypatch.setattr("specdec_inductor.loading.load_model", lambda path, dtype, **kw: (model, tok))
    monkeypatch.delenv("SPECDEC_EAGER", raising=False)
    return model, tok


def test_generate_streams_multibyte_characters_whole(fake_model, capsys):
    model, tok = fake_model
    plain = Engine(model, max_batch=1, max_len=64, compile=False).generate(
        [tok("abc")["input_ids"]], 8)[0]
    # Every emitted token becomes one byte of a two-byte character: alone, each is invalid.
    lead, tail = b"\xc3", b"\xa9"
    tok.table = {}
    for k, t in enumerate(plain):
        tok.table.setdefault(t, lead if k % 2 == 0 else tail)
    assert cli.main(["generate", "--prompt", "abc", "--max-new-tokens", "8", "--eager",
                     "--raw"]) == 0
    out = capsys.readouterr().out
    assert out.rstrip("\n") == tok.decode(plain)  # the same text as one decode of all tokens


# -- 8: decode rate at eos ----------------------------------------------------------------------
def test_generate_stopping_at_eos_reports_a_decode_rate(fake_model, capsys):
    model, tok = fake_model
    plain = Engine(model, max_batch=1, max_len=64, compile=False).generate(
        [tok("hello")["input_ids"]], 6)[0]
    tok.eos_token_id = plain[3]  # greedy stops at its 4th token
    stop = plain.index(plain[3])
    assert cli.main(["generate", "--prompt", "hello", "--max-new-tokens", "16", "--eager",
                     "--raw"]) == 0
    err = capsys.readouterr().err
    assert f"{stop + 1} tokens" in err
    assert "nan" not in err and "tokens/s" in err


# -- 7: the compiled warm-up fits the request ---------------------------------------------------
@pytest.mark.parametrize("method", [[], ["--method", "ngram", "--num-draft-tokens", "4"]])
def test_compiled_warm_up_fits_a_max_len_that_fits_the_request(fake_model, monkeypatch, capsys,
                                                              method):
    # Compiled engine whose steps run uncompiled (torch.compile as the identity): the warm-up's
    # own request sizes are what is tested, not Inductor.
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kwargs: fn)
    prompt = "hello world"
    extra = 4 if method else 0
    argv = ["generate", "--prompt", prompt, "--raw", "--max-new-tokens", "1",
            "--max-len", str(len(prompt) + 1 + extra)] + method
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "compiled" in err and "warm-up" in err


# -- 6 / 10: CLI mistakes are one-line errors naming the flag, before any model loads -----------
@pytest.mark.parametrize("argv,env,needle", [
    (["generate", "--method", "ngram", "--num-draft-tokens", "0"], {}, "--num-draft-tokens"),
    (["generate", "--method", "eagle3", "--num-draft-tokens", "1"], {}, "--num-draft-tokens"),
    (["generate", "--method", "standalone", "--topk", "3", "--depth", "4",
      "--num-draft-tokens", "4"], {}, "--num-draft-tokens/--topk/--depth"),
    (["generate", "--max-new-tokens", "-5"], {}, "--max-new-tokens"),
    (["generate", "--method", "ngram", "--max-new-tokens", "600"], {}, "--max-len"),
    (["generate", "--temperature", "1", "--max-new-tokens", "512"], {}, "--max-len"),
    (["generate", "--max-batch", "0"], {}, "--max-batch"),
    (["generate", "--method", "ngram", "--ngram-window", "4,2"], {}, "--ngram-window"),
    (["generate", "--method", "ngram", "--topk", "2"], {}, "--topk/--depth"),
    (["generate", "--method", "eagle", "--model", "."], {}, "--draft-model"),
    (["generate", "--seed", str(2 ** 70), "--temperature", "1"], {}, "--seed"),
    (["generate", "--model", "no/such/model-dir"], {}, "--model"),
    (["generate", "--method", "standalone", "--draft-model", "typo-draft"], {}, "--draft-model"),
    (["generate", "--method", "standalone", "--draft-layers", "0"], {}, "--draft-layers"),
    (["generate"], {"SPECDEC_ATTENTION": "flash"}, "SPECDEC_ATTENTION"),
    (["generate"], {"SPECDEC_EAGER": "maybe"}, "SPECDEC_EAGER"),
    (["generate", "--threads", "0"], {}, "--threads"),
    (["generate"], {"SPECDEC_THREADS": "many"}, "SPECDEC_THREADS"),
    (["bench", "--repeats", "0"], {}, "--repeats"),
    (["bench", "--num-prompts", "0"], {}, "--num-prompts"),
    (["train-draft", "--method", "eagle3", "--draft-vocab-size", "0"], {}, "--draft-vocab-size"),
    (["train-draft", "--method", "eagle", "--lr", "inf"], {}, "--lr"),
    (["train-draft", "--method", "eagle", "--lr", "nan"], {}, "--lr"),
    (["train-draft", "--method", "eagle", "--target", "missing.gguf"], {}, "--target"),
])
def test_cli_mistakes_exit_2_naming_the_flag_before_loading(monkeypatch, capsys, argv, env,
                                                            needle):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")
    monkeypatch.setattr("specdec_inductor.loading.load_model", no_load)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error:" in err and needle in err, err


def test_check_model_arg_accepts_paths_and_known_names(tmp_path, monkeypatch):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    assert loading.check_model_arg(None) is None
    assert loading.check_model_arg(str(tmp_path)) == str(tmp_path)
    assert loading.check_model_arg(str(gguf)) == str(gguf)
    with pytest.raises(ValueError, match="neither an existing path"):
        loading.check_model_arg("HuggingFaceTB/SmolLM2-typo")
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"):  # models.REGISTRY
        assert loading.check_model_arg(name) == name
    with pytest.raises(ValueError, match="neither an existing path"):
        loading.check_model_arg("qwen2.5-coder-7b")


def test_truncated_safetensors_names_the_file_and_the_fix(tmp_path, monkeypatch):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: ByteTokenizer())  # the weights are the point here
    with pytest.raises(SystemExit) as info:
        cli.load_checked(str(tmp_path), torch.float32)
    msg = str(info.value)
    assert str(weights) in msg and "download or save the model again" in msg
    # A damaged GGUF conversion in the cache: the hint is to delete the cache entry.
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path.parent))
    with pytest.raises(SystemExit, match=f"delete {tmp_path} and run again"):
        cli.load_checked(str(tmp_path), torch.float32)


def test_eager_env_accepts_only_booleans(monkeypatch):
    from specdec_inductor.engine.engine import eager_requested
    for value, want in [("1", True), ("yes", True), ("TRUE", True), ("0", False), ("no", False),
                        ("false", False), ("", False)]:
        monkeypatch.setenv("SPECDEC_EAGER", value)
        assert eager_requested() is want, value
    monkeypatch.setenv("SPECDEC_EAGER", "nope")
    with pytest.raises(ValueError, match="SPECDEC_EAGER"):
        eager_requested()


@pytest.mark.parametrize("kwargs,name", [({"num_slots": 0}, "num_slots"),
                                         ({"max_batch": 0}, "max_batch"),
                                         ({"max_len": 2.5}, "max_len"),
                                         ({"prefill_chunk": 0}, "prefill_chunk")])
def test_engine_refuses_bad_sizes(kwargs, name):
    with pytest.raises(ValueError, match=f"argument '{name}'"):
        Engine(tiny_model(), compile=False, **kwargs)


@pytest.mark.parametrize("prompts,max_new,needle", [
    ([[1.0, 2.0, 3.0]], 4, "token ids must be ints"),
    ([torch.tensor([1.5, 2.0])], 4, "dtype"),
    ([[1, 2, VOCAB]], 4, "outside the vocabulary"),
    ([[1, 2, -1]], 4, "outside the vocabulary"),
    ([[1, 2, 3]], 2.5, "max_new_tokens"),
    ([[1, 2, 3]], -5, "max_new_tokens"),
])
def test_generate_refuses_misread_values(prompts, max_new, needle):
    engine = Engine(tiny_model(), max_batch=1, max_len=64, compile=False)
    spec = SpeculativeGenerator(engine, NgramProposer(num_draft_tokens=4))
    for run in (engine.generate, spec.generate):
        with pytest.raises(ValueError, match=needle):
            run(prompts, max_new)
    engine.pool.check_consistent()
    assert engine.pool.num_free_slots == engine.pool.num_slots


def test_prompt_past_max_position_embeddings_warns():
    model = tiny_model()
    model.config.max_position_embeddings = 16
    engine = Engine(model, max_batch=1, max_len=64, compile=False)
    with pytest.warns(UserWarning, match="max_position_embeddings"):
        engine.generate([list(range(14))], 4)


# -- 3: --data never overwrites a user's file ---------------------------------------------------
def test_train_draft_data_never_overwrites_an_unknown_file(tmp_path, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr("specdec_inductor.loading.load_model", no_load)
    precious = tmp_path / "notes.txt"
    precious.write_text("my notes")
    with pytest.raises(SystemExit, match="--data .*--overwrite"):
        cli.main(["train-draft", "--method", "eagle", "--data", str(precious),
                  "--out", str(tmp_path / "out"), "--eager"])
    assert precious.read_text() == "my notes"


# -- 4: KV rows never leak ----------------------------------------------------------------------
def _standalone(max_batch=1):
    target, draft = tiny_model(0), tiny_model(1, layers=1)
    engine = Engine(target, max_batch=max_batch, max_len=64, compile=False, prefill_chunk=16)
    draft_engine = Engine(draft, max_batch=max_batch, max_len=64, compile=False, prefill_chunk=16)
    return engine, StandaloneProposer(draft_engine, 4)


def test_kv_rows_survive_a_finish_that_raises(monkeypatch):
    engine, proposer = _standalone()
    spec = SpeculativeGenerator(engine, proposer)
    real_finish = proposer.finish

    def finish(ids):
        real_finish(ids)
        raise RuntimeError("cleanup failed")
    monkeypatch.setattr(proposer, "finish", finish)
    with pytest.raises(RuntimeError, match="cleanup failed"):
        spec.generate([[1, 2, 3, 4]], 6)
    monkeypatch.setattr(proposer, "finish", real_finish)
    engine.pool.check_consistent()
    assert engine.pool.num_free_slots == engine.pool.num_slots
    # The engine still serves (max_batch 1: a leaked row would refuse every later call).
    assert spec.generate([[1, 2, 3, 4]], 6) == engine.generate([[1, 2, 3, 4]], 6)


def test_kv_rows_survive_a_start_that_raises_after_registering(monkeypatch):
    engine, proposer = _standalone()
    spec = SpeculativeGenerator(engine, proposer)
    real_start = proposer.start

    def start(ids, contexts):
        real_start(ids, contexts)  # the draft's requests are admitted and registered
        raise RuntimeError("start failed late")
    monkeypatch.setattr(proposer, "start", start)
    with pytest.raises(RuntimeError, match="start failed late"):
        spec.generate([[1, 2, 3, 4]], 6)
    monkeypatch.setattr(proposer, "start", real_start)
    for pool in (engine.pool, proposer.engine.pool):
        pool.check_consistent()
        assert pool.num_free_slots == pool.num_slots and pool.num_free_rows == pool.max_reqs
    assert spec.generate([[1, 2, 3, 4]], 6) == engine.generate([[1, 2, 3, 4]], 6)


def test_finish_releases_every_request_even_when_one_release_raises(monkeypatch):
    engine, proposer = _standalone(max_batch=2)
    pool = proposer.engine.pool
    proposer.start([0, 1], [[1, 2, 3], [4, 5, 6]])
    real_release, calls = pool.release, []

    def release(req):
        calls.append(req.row)
        real_release(req)
        if len(calls) == 1:
            raise RuntimeError("first release failed")
    monkeypatch.setattr(pool, "release", release)
    with pytest.raises(RuntimeError, match="first release failed"):
        proposer.finish([0, 1])
    assert len(calls) == 2 and pool.num_free_slots == pool.num_slots


def test_check_consistent_sees_rows_no_live_generation_holds():
    pool = KVPool(1, 1, 4, num_slots=32, max_reqs=2, max_len=16)
    with pool.generation():
        (req,) = pool.admit([3], 4)
        pool.check_consistent()  # held by a live generation: fine
    with pytest.raises(AssertionError, match="held by no live generation"):
        pool.check_consistent()
    pool.release(req)
    pool.check_consistent()
    (outside,) = pool.admit([3], 4)  # admitted outside any generation: the caller's own
    pool.check_consistent()
    pool.release(outside)


# -- 9: non-finite heads ------------------------------------------------------------------------
def test_loaders_refuse_non_finite_weights(tmp_path):
    from specdec_inductor.proposers.eagle import EagleCheckpointError, load_eagle_head
    from specdec_inductor.testing import write_random_eagle_checkpoint
    target = tiny_model()
    sd = write_random_eagle_checkpoint(tmp_path, target.config, fmt="safetensors")
    sd["fc.weight"][0, 0] = math.inf
    from safetensors.torch import save_file
    save_file(sd, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(EagleCheckpointError, match="model.safetensors.*'fc.weight'.*NaN or inf"):
        load_eagle_head(str(tmp_path), target)


def test_training_stops_when_it_diverges(tmp_path):
    from specdec_inductor.train.data import build_draft_data
    from specdec_inductor.train.trainer import TrainConfig, train_head
    target = tiny_model()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (4,), generator=gen).tolist() for _ in range(8)]
    data = build_draft_data(target, prompts, [], new_tokens=8, eos_token_id=None, max_batch=8,
                            compile=False)
    cfg = TrainConfig(method="eagle", epochs=2, batch_size=4, lr=1e30, precision="fp32")
    with pytest.raises(FloatingPointError, match="lr"):
        train_head(target, data, str(tmp_path), cfg, draft_vocab_size=32, progress=lambda s: None)
    assert not os.path.exists(tmp_path / "config.json")  # no head written
    with pytest.raises(ValueError, match="argument 'lr'"):
        TrainConfig(method="eagle", lr=math.inf).validate()


# -- 12: vocabulary-incompatible STANDALONE draft -----------------------------------------------
def test_standalone_draft_with_another_vocabulary_is_named(monkeypatch, tmp_path):
    target, draft = tiny_model(0), tiny_model(1, vocab=64)
    monkeypatch.setattr("specdec_inductor.loading.load_model",
                        lambda path, dtype, **kw: (draft if path else target, ByteTokenizer()))
    monkeypatch.delenv("SPECDEC_EAGER", raising=False)
    with pytest.raises(SystemExit, match=f"--draft-model: the draft model {tmp_path} has a "
                                         "vocabulary of 64 tokens, the target 96"):
        cli.main(["generate", "--prompt", "abc", "--raw", "--max-new-tokens", "4", "--eager",
                  "--method", "standalone", "--draft-model", str(tmp_path),
                  "--num-draft-tokens", "3"])


def test_ngram_start_failing_midway_is_finished_without_masking_the_error(monkeypatch):
    engine = Engine(tiny_model(), max_batch=2, max_len=64, compile=False)
    proposer = NgramProposer(num_draft_tokens=4)
    spec = SpeculativeGenerator(engine, proposer)
    real_add = proposer.add_request

    def add_request(rid, prompt):
        if proposer.num_requests() == 1:
            raise RuntimeError("second request refused")
        real_add(rid, prompt)
    monkeypatch.setattr(proposer, "add_request", add_request)
    with pytest.raises(RuntimeError, match="second request refused"):
        spec.generate([[1, 2, 3], [4, 5, 6]], 4)
    assert proposer.num_requests() == 0
    engine.pool.check_consistent()
    assert engine.pool.num_free_rows == engine.pool.max_reqs


def test_text_stream_with_the_default_tokenizer():
    """SmolLM2's byte-level BPE splits these characters over several tokens; each token decoded
    with the ones before it used to print U+FFFD."""
    from specdec_inductor.loading import convert_gguf, default_gguf_path
    tok = transformers.AutoTokenizer.from_pretrained(convert_gguf(default_gguf_path()))
    text = "Ça coûte 5 €; 日本語で 🙂 — ok"
    ids = tok(text)["input_ids"]
    assert any("\ufffd" in tok.decode(ids[:k]) for k in range(1, len(ids)))  # really split
    stream = loading.TextStream(tok)
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)
