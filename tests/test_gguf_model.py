"""load_gguf: GGUF -> HF model. Dense (dequantize=True) logits equal transformers' own GGUF load
(SmolLM2 and tiny synthetic llama / qwen2 files, which cover the q/k row permutation, qwen2
biases, an untied F16 LM head and Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K); the quantized model
matches the dense one and runs through the Engine eager and compiled; bad inputs."""
import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from specdec_inductor.engine.gguf_model import (QuantEmbedding, QuantLinear,  # noqa: E402
                                                load_gguf, read_gguf, unpermute_rows)
from specdec_inductor.loading import convert_gguf, default_gguf_path  # noqa: E402

Q = gguf.GGMLQuantizationType
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Q: What is 17 times 3?\nA:"]
# Per synthetic architecture: GGUF type of each weight (ffn_down rows are 512 long, others 256).
TYPES = {
    "llama": dict(token_embd=Q.Q8_0, attn_q=Q.Q4_0, attn_k=Q.Q4_1, attn_v=Q.Q5_0,
                  attn_output=Q.Q8_0, ffn_gate=Q.Q4_K, ffn_up=Q.Q5_K, ffn_down=Q.Q6_K),
    "qwen2": dict(token_embd=Q.Q4_K, attn_q=Q.Q8_0, attn_k=Q.Q6_K, attn_v=Q.Q4_1,
                  attn_output=Q.Q5_0, ffn_gate=Q.Q4_0, ffn_up=Q.Q6_K, ffn_down=Q.Q4_K,
                  output=Q.F16),
}
HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 256, 4, 2, 512, 2
# K-quant blocks: byte offsets of their fp16 scales (the rest is random codes).
_K_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82)}



def random_tensor(rng, qtype, n, k):
    """[n, k] weights in `qtype`: numpy array ready for GGUFWriter.add_tensor."""
    if qtype in (Q.F32, Q.F16):
        return (rng.standard_normal((n, k)) * 0.05).astype(np.float32 if qtype == Q.F32
                                                           else np.float16)
    if qtype in _K_SCALES:  # gguf-py cannot quantize K-quants: random codes, small scales
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
        for at in _K_SCALES[qtype]:
            raw[:, :, at:at + 2] = np.frombuffer(np.float16(0.0015).tobytes(), np.uint8)
        return raw.reshape(n, k // block * size)
    return gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)


@pytest.fixture(scope="module")
def tokenizer_fields():
    reader = gguf.GGUFReader(default_gguf_path())
    return [f for f in reader.fields.values() if f.name.startswith("tokenizer.")]


def write_tiny_gguf(path, arch, types, tokenizer_fields, seed=0):
    """A 2-layer `arch` GGUF with SmolLM2's tokenizer and random weights of `types`."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch=arch)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    vocab = 0
    for field in tokenizer_fields:
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), val_type, sub_type=sub_type)
        if field.name == "tokenizer.ggml.tokens":
            vocab = len(field.data)

    def add(name, qtype, n, k):
        data = random_tensor(rng, qtype, n, k)
        writer.add_tensor(name, data, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)

    add("token_embd.weight", types["token_embd"], vocab, HIDDEN)
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        for name, n, k in [("attn_q", HIDDEN, HIDDEN), ("attn_k", KV_HEADS * head_dim, HIDDEN),
                           ("attn_v", KV_HEADS * head_dim, HIDDEN),
                           ("attn_output", HIDDEN, HIDDEN), ("ffn_gate", FFN, HIDDEN),
                           ("ffn_up", FFN, HIDDEN), ("ffn_down", HIDDEN, FFN)]:
            add(f"blk.{i}.{name}.weight", types[name], n, k)
            if arch == "qwen2" and name in ("attn_q", "attn_k", "attn_v"):
                writer.add_tensor(f"blk.{i}.{name}.bias",
                                  rng.standard_normal(n).astype(np.float32) * 0.1)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight",
                              (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    if "output" in types:
        add("output.weight", types["output"], vocab, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tokenizer_fields):
    """arch -> path of its tiny GGUF (and a fresh SPECDEC_CACHE_DIR for their metadata)."""
    root = tmp_path_factory.mktemp("gguf")
    paths = {}
    for arch, types in TYPES.items():
        paths[arch] = str(root / f"tiny-{arch}.gguf")
        write_tiny_gguf(paths[arch], arch, types, tokenizer_fields)
    return paths


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


def _logits(model, tokenizer, prompt):
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        return model(ids).logits[0]  # [T, V]


def test_smollm2_dequantized_equals_transformers_gguf_load(monkeypatch):
    from transformers import AutoModelForCausalLM
    monkeypatch.delenv("SPECDEC_CACHE_DIR")  # share the converted fp32 directory
    ref = AutoModelForCausalLM.from_pretrained(convert_gguf(default_gguf_path()),
                                               dtype=torch.float32).eval()
    model, tokenizer = load_gguf(default_gguf_path(), dequantize=True)
    assert model.quantized_formats == {}
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for prompt in PROMPTS:
        torch.testing.assert_close(_logits(model, tokenizer, prompt),
                                   _logits(ref, tokenizer, prompt), rtol=0, atol=0)


@pytest.mark.parametrize("arch", list(TYPES))
def test_tiny_dequantized_equals_transformers_gguf_load(tiny, arch):
    from transformers import AutoModelForCausalLM
    directory, file = os.path.split(tiny[arch])
    ref = AutoModelForCausalLM.from_pretrained(directory, gguf_file=file,
                                               dtype=torch.float32).eval()
    model, tokenizer = load_gguf(tiny[arch], dequantize=True)
    assert type(model) is type(ref)
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias is not None
    for prompt in PROMPTS[:2]:
        torch.testing.assert_close(_logits(model, tokenizer, prompt),
                                   _logits(ref, tokenizer, prompt), rtol=0, atol=0)


def test_unpermute_rows_undoes_llama_cpp_permute():
    # llama.cpp's converter: w.reshape(h, 2, n // h // 2, ...).swapaxes(1, 2).reshape(w.shape)
    n, heads = 24, 3
    hf = np.arange(n)
    gguf_rows = hf.reshape(heads, 2, n // heads // 2).swapaxes(1, 2).reshape(n)
    assert (gguf_rows[unpermute_rows(n, heads)] == hf).all()


@pytest.mark.parametrize("arch", list(TYPES))
def test_tiny_quantized_matches_dequantized(tiny, arch):
    from specdec_inductor.ops.quant import QuantActivation
    model, tokenizer = load_gguf(tiny[arch], activation=QuantActivation.FLOAT)  # exact weights
    dense, _ = load_gguf(tiny[arch], dequantize=True)
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    assert isinstance(model.model.layers[1].mlp.down_proj, QuantLinear)
    assert set(model.quantized_formats) == {t.name for t in TYPES[arch].values()
                                            if t not in (Q.F32, Q.F16)}
    if "output" not in TYPES[arch]:  # tied: the head reads the embedding's bytes
        assert model.lm_head.weight is model.model.embed_tokens.weight
    down = model.model.layers[1].mlp.down_proj
    assert torch.equal(down.dequantized_weight(), dense.model.layers[1].mlp.down_proj.weight)
    rows = torch.tensor([5, 0, 77])
    up = model.model.layers[1].mlp.up_proj  # a draft vocabulary's rows, say
    x = torch.randn(2, HIDDEN)
    torch.testing.assert_close(up.select_rows(rows)(x), up(x)[:, rows], rtol=0, atol=0)
    for prompt in PROMPTS:
        got, ref = _logits(model, tokenizer, prompt), _logits(dense, tokenizer, prompt)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def _mapped_file(address):
    """The file mapped at `address` in this process (Linux /proc/self/maps), or None."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start <= address < end:
                return fields[5].strip() if len(fields) == 6 else None
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
def test_quantized_weights_are_views_of_the_file(tiny):
    """Without huge pages the quantized weights are the file's mapped bytes; with them (the
    default, where THP is available) copies of those bytes outside the file."""
    from specdec_inductor.engine import hugepages
    _, tensors = read_gguf(tiny["qwen2"])
    mapped = {t.name: t.data for t in tensors}
    for huge in (False, True):
        model, _ = load_gguf(tiny["qwen2"], hugepages=huge)
        down = model.model.layers[0].mlp.down_proj.weight  # [N, row_bytes] uint8
        assert down.dtype == torch.uint8
        assert torch.equal(down, torch.from_numpy(np.array(mapped["blk.0.ffn_down.weight"])))
        in_file = _mapped_file(down.data_ptr()) == os.path.realpath(tiny["qwen2"])
        assert in_file == (not (huge and hugepages.available()))  # zero-copy without
        assert [p for p in model.parameters() if p.dtype != torch.float32] == []


def test_smollm2_quantized_greedy_matches_dequantized():
    from specdec_inductor.ops.quant import QuantActivation
    model, tokenizer = load_gguf(default_gguf_path(), activation=QuantActivation.FLOAT)
    dense, _ = load_gguf(default_gguf_path(), dequantize=True)
    assert model.quantized_formats == {"Q8_0": 1, "Q4_1": 210}
    for prompt in PROMPTS:
        got, ref = _logits(model, tokenizer, prompt), _logits(dense, tokenizer, prompt)
        torch.testing.assert_close(got, ref, rtol=1e-3, atol=1e-3)
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("dequantize", [True, False], ids=["dense", "quantized"])
def test_tiny_model_through_engine_eager_and_compiled(tiny, dequantize, tmp_path, monkeypatch):
    """(Quantized: every weight in huge-page memory, each with a storage of its own, which the
    compiled layer regions need: views of one storage would be aliases there.)"""
    from specdec_inductor.engine import hugepages
    from specdec_inductor.engine.engine import Engine
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(hugepages, "MIN_BYTES", 1)
    model, tokenizer = load_gguf(tiny["qwen2"], dequantize=dequantize)
    assert (model.hugepage_bytes > 0) == (hugepages.available() and not dequantize)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    eager = Engine(model, max_batch=2, max_len=64, compile=False, prefill_chunk=16)
    want = eager.generate(prompts, 4)
    compiled = Engine(model, max_batch=2, max_len=64, compile=True, prefill_chunk=16)
    assert compiled.generate(prompts, 4) == want
    assert all(len(w) == 4 for w in want)


@pytest.mark.parametrize("arch", list(TYPES))
def test_quantized_weights_in_hugepages(tiny, arch, monkeypatch):
    """load_gguf copies a quantized model's streamed weights into huge-page memory (every one
    here: MIN_BYTES 1): the same bytes, tied tensors still one tensor, an untied embedding left
    in the file, the same logits as in ordinary pages, and the kernel backs the copies with huge
    pages where THP is available."""
    from specdec_inductor.engine import hugepages
    from specdec_inductor.ops.quant import QuantActivation
    monkeypatch.setattr(hugepages, "MIN_BYTES", 1)
    for act in (QuantActivation.FLOAT, QuantActivation.INT8):
        huge, tokenizer = load_gguf(tiny[arch], activation=act)
        plain, _ = load_gguf(tiny[arch], activation=act, hugepages=False)
        assert plain.hugepage_bytes == 0
        layers = {n: m for n, m in huge.named_modules() if isinstance(m, (QuantLinear, QuantEmbedding))}
        plain_layers = dict(plain.named_modules())
        for name, m in layers.items():
            assert torch.equal(m.weight, plain_layers[name].weight) and m.fmt == plain_layers[name].fmt
        weights = {id(m.weight): m.weight for m in layers.values() if isinstance(m, QuantLinear)}
        if not hugepages.available():
            assert huge.hugepage_bytes == 0
            continue
        assert huge.hugepage_bytes == sum(w.numel() for w in weights.values())
        assert len({w.untyped_storage().data_ptr() for w in weights.values()}) == len(weights)
        assert hugepages.backed_bytes(weights.values()) > 0
        embed = huge.model.embed_tokens.weight
        if "output" not in TYPES[arch]:  # tied: the head and the embedding share one tensor
            assert huge.lm_head.weight is embed
        else:  # an untied embedding is a lookup: it stays in the file (a few rows resident)
            assert _mapped_file(embed.data_ptr()) == os.path.realpath(tiny[arch])
        assert torch.equal(_logits(huge, tokenizer, PROMPTS[0]), _logits(plain, tokenizer, PROMPTS[0]))


def test_no_huge_pages_where_thp_is_off(tiny, monkeypatch):
    from specdec_inductor.engine import hugepages
    monkeypatch.setattr(hugepages, "available", lambda: False)
    model, _ = load_gguf(tiny["qwen2"])
    assert model.hugepage_bytes == 0
    down = model.model.layers[0].mlp.down_proj.weight
    assert _mapped_file(down.data_ptr()) == os.path.realpath(tiny["qwen2"])


def test_bad_inputs(tiny, tmp_path, tokenizer_fields):
    with pytest.raises(FileNotFoundError, match="argument 'path'"):
        load_gguf(str(tmp_path / "missing.gguf"))
    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="argument 'path'.*not a GGUF file"):
        load_gguf(str(not_gguf), dequantize=True)
    other = tmp_path / "phi.gguf"
    writer = gguf.GGUFWriter(str(other), arch="phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="argument 'path'.*'phi2' is not supported"):
        load_gguf(str(other), dequantize=True)


def test_unsupported_tensor_type_names_the_tensor(tmp_path, tokenizer_fields):
    path = str(tmp_path / "q2_k.gguf")  # a format with no kernel of ours
    write_tiny_gguf(path, "llama", {**TYPES["llama"], "attn_v": Q.Q2_K}, tokenizer_fields)
    with pytest.raises(ValueError, match="tensor 'blk.0.attn_v.weight' has type Q2_K"):
        load_gguf(path)
    model, _ = load_gguf(path, dequantize=True)  # gguf-py dequantizes it
    assert model.model.layers[0].self_attn.v_proj.weight.dtype == torch.float32


def test_load_model_dispatch(monkeypatch):
    from specdec_inductor.loading import load_model
    monkeypatch.delenv("SPECDEC_CACHE_DIR")  # the SmolLM2 metadata directory made above
    by_name, tokenizer = load_model("smollm2-135m", dequantize=True)
    default, _ = load_model()  # dense while loading.DEFAULT_QUANTIZED is False
    assert by_name.quantized_formats == default.quantized_formats == {}
    torch.testing.assert_close(_logits(by_name, tokenizer, PROMPTS[0]),
                               _logits(default, tokenizer, PROMPTS[0]), rtol=0, atol=0)
    assert not hasattr(default.config, "quantization_config")
    with pytest.raises(ValueError, match="argument 'model'"):
        load_model("no-such-model")


def test_activation_mode_reaches_every_quantized_layer(tiny):
    """load_gguf's `activation` (default FLOAT) is every QuantLinear's, recorded on the model;
    INT8 runs the kernel it names and stays close to the exact weights' logits (8-bit
    activations err by ~0.4% of each block's largest |x|: 32-value blocks, 256 for the K formats
    as ggml's Q8_K; this random tiny model's logits move by ~3-7%)."""
    import specdec_inductor
    from specdec_inductor.ops.quant import QuantActivation, QuantFormat, int8_path
    default, tokenizer = load_gguf(tiny["qwen2"])
    assert default.quant_activation == "FLOAT"
    exact, _ = load_gguf(tiny["qwen2"], activation=QuantActivation.FLOAT)
    int8, _ = load_gguf(tiny["qwen2"], activation=QuantActivation.INT8)
    for model, mode in ((exact, "FLOAT"), (int8, "INT8")):
        assert model.quant_activation == mode
        assert {m.activation.name for m in model.modules() if isinstance(m, QuantLinear)} == {mode}
    specdec_inductor.reset_kernel_path_counts()
    got, ref = _logits(int8, tokenizer, PROMPTS[0]), _logits(exact, tokenizer, PROMPTS[0])
    # the file layout's kernel, or where every layer was repacked at load (VNNI) the R16 one
    ran = set(specdec_inductor.kernel_path_counts())
    r16 = f"quant_linear_int8_r16:{int8_path(QuantFormat.Q4_K_R16)}"
    assert ran & {f"quant_linear_int8:{int8_path()}", r16}
    assert not torch.equal(got, ref)  # the activations really were rounded
    assert (got - ref).abs().max() <= 0.08 * ref.abs().max()
    dense, _ = load_gguf(tiny["qwen2"], dequantize=True)
    assert dense.quant_activation is None


# Compiled with INT8 activations only (the default where the VNNI kernel runs, and the mode
# where a verify row that differed in any bit would show): the FLOAT kernel's rows are
# batch-invariant at the op (test_quant.py), the compiled engine's verify rows at the model
# (test_batch_invariance.py).
@pytest.mark.parametrize("activation,compiled", [("FLOAT", False), ("INT8", False),
                                                 ("INT8", True)],
                         ids=["eager-FLOAT", "eager-INT8", "compiled-INT8"])
def test_speculation_on_a_quantized_target_equals_its_ar(tiny, activation, compiled, tmp_path,
                                                         monkeypatch):
    """Greedy STANDALONE (a draft that is the target itself, so nearly every draft reaches a
    verify row, as a chain and as a top-2 tree, and a 1-layer cut that gets rejected often) and
    NGRAM on the quantized target
    emit exactly the target's own AR tokens in the same activation mode, batch 1 and a ragged
    batch of 2: every verify row reproduces the decode row bit for bit (INT8 rounds x to 8
    bits, so a verify row that differed in the last bit of any layer input would show)."""
    from specdec_inductor.engine.engine import Engine
    from specdec_inductor.loading import keep_first_layers
    from specdec_inductor.ops.quant import QuantActivation
    from specdec_inductor.proposers.ngram import NgramProposer
    from specdec_inductor.proposers.standalone import StandaloneProposer
    from specdec_inductor.speculative import SpeculativeGenerator, SpeculativeStats
    import specdec_inductor
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    act = QuantActivation[activation]
    model, tokenizer = load_gguf(tiny["qwen2"], activation=act)
    self_draft, _ = load_gguf(tiny["qwen2"], activation=act)
    cut_draft = keep_first_layers(load_gguf(tiny["qwen2"], activation=act)[0], 1)
    engine = Engine(model, max_batch=2, max_len=96, compile=compiled, prefill_chunk=16)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    specdec_inductor.reset_kernel_path_counts()
    plain = {b: engine.generate(prompts[:b], 24) for b in (1, 2)}
    # (INT8 on VNNI: the layers of REPACKED_AT_LOAD formats run the R16 kernel)
    kernels = ("quant_linear_int8", "quant_linear_int8_r16") if act == QuantActivation.INT8 else ("quant_linear",)
    assert any(k.split(":")[0] in kernels for k in specdec_inductor.kernel_path_counts())
    proposers = [StandaloneProposer(Engine(d, max_batch=2, max_len=96, compile=compiled,
                                           prefill_chunk=16), 5) for d in (self_draft, cut_draft)]
    # A top-2 tree from the self-draft: its accepted paths run through breadth-first rows
    # (1, 3, 5) whose masks skip their siblings -- tree rows, not a chain's.
    tree_draft = Engine(load_gguf(tiny["qwen2"], activation=act)[0], max_batch=2 * 3,
                        max_len=96 + 2 * 3, compile=compiled, prefill_chunk=16)
    proposers.append(StandaloneProposer(tree_draft, 7, topk=2, depth=3))
    proposers.append(NgramProposer(num_draft_tokens=4))
    accepted = []
    for proposer in proposers:
        spec = SpeculativeGenerator(engine, proposer, min_accepted=0.0)
        for b in (1, 2):
            stats = SpeculativeStats()
            assert spec.generate(prompts[:b], 24, stats=stats) == plain[b], (type(proposer), b)
            accepted.append(stats.mean_accepted_length)
    assert accepted[0] > 4.0  # the self-draft's chains were verified, not skipped
    assert accepted[4] > 2.0  # and its trees, through rows of depth 2 and more


@pytest.mark.parametrize("arch", list(TYPES))
def test_int8_repacks_layers_where_the_vnni_kernel_runs(tiny, arch):
    """With INT8 on a VNNI CPU, the layers of REPACKED_AT_LOAD formats (Q4_K, Q6_K and the
    32-weight formats) are repacked at load into their 16-row interleaved layout and run by the R16
    kernel (a tied embedding then reads the LM head's repacked copy); elsewhere (FLOAT, no VNNI,
    Q5_K) they keep the file's rows. Either way every weight dequantizes to the file's value,
    embedding rows and select_rows stay exact, and the model's logits stay within INT8's bound of
    the exact weights'."""
    import specdec_inductor
    from specdec_inductor.engine.gguf_model import REPACKED_AT_LOAD
    from specdec_inductor.ops.quant import QuantActivation, QuantFormat, file_format, int8_path
    vnni = int8_path(QuantFormat.Q4_K_R16) == "avx512"
    int8, tokenizer = load_gguf(tiny[arch], activation=QuantActivation.INT8)
    exact, _ = load_gguf(tiny[arch], activation=QuantActivation.FLOAT)
    layers = {n: m for n, m in int8.named_modules() if isinstance(m, QuantLinear)}
    files = {n: m for n, m in exact.named_modules() if isinstance(m, QuantLinear)}
    assert {m.fmt for m in files.values()} & set(REPACKED_AT_LOAD)
    for name in files:
        repacked = vnni and files[name].fmt in REPACKED_AT_LOAD
        want = QuantFormat(int(files[name].fmt) + 256) if repacked else files[name].fmt
        assert layers[name].fmt == want and files[name].fmt == file_format(want)
        assert layers[name].out_features == files[name].out_features
        assert torch.equal(layers[name].dequantized_weight(), files[name].dequantized_weight())
    assert all(m.fmt < 256 for m in files.values())  # FLOAT keeps the file layout
    embed, file_embed = int8.model.embed_tokens, exact.model.embed_tokens
    tied_repacked = "output" not in TYPES[arch] and vnni and file_embed.fmt in REPACKED_AT_LOAD
    if tied_repacked:  # one repacked copy serves the head and the embedding
        assert embed.weight is int8.lm_head.weight and embed.fmt == int8.lm_head.fmt
    else:
        assert embed.fmt == file_embed.fmt
    assert embed.num_embeddings == file_embed.num_embeddings
    ids = torch.tensor([[0, 17, 300], [1, 16, 511]])
    assert torch.equal(embed(ids), file_embed(ids))
    counted = {f: c for f, c in int8.quantized_formats.items() if f.endswith("_R16")}
    # (a tied head and its embedding: one repacked tensor, counted once)
    assert sum(counted.values()) == (sum(m.fmt in REPACKED_AT_LOAD for m in files.values()) if vnni else 0)
    for name in files:
        for index in (torch.tensor([5, 0, 17, 3]), torch.arange(32).flip(0)):  # 4 rows; 2 groups
            head = layers[name].select_rows(index)
            assert torch.equal(head.dequantized_weight(), files[name].dequantized_weight()[index])
    specdec_inductor.reset_kernel_path_counts()
    got, ref = _logits(int8, tokenizer, PROMPTS[0]), _logits(exact, tokenizer, PROMPTS[0])
    counts = specdec_inductor.kernel_path_counts()
    assert ("quant_linear_int8_r16:avx512" in counts) == vnni
    assert not any(k.startswith("quant_linear_int8_r16:") and not k.endswith("avx512") for k in counts)
    assert (got - ref).abs().max() <= 0.08 * ref.abs().max()


def test_int8_tree_verify_rows_reproduce_decode_rows_bitwise(tiny, tmp_path, monkeypatch):
    """Compiled with INT8 activations: every verify row of a top-2 tree whose path is the AR
    text -- first-branch rows and rows past a sibling alike -- reproduces the AR decode row's
    logits bit for bit (RowRecorder), across 64-key attention blocks. Token checks alone cannot
    show this: a differing row changes a token only at a near tie, which a short run rarely
    meets."""
    from specdec_inductor.engine.engine import Engine
    from specdec_inductor.ops.quant import QuantActivation
    from specdec_inductor.proposers.standalone import StandaloneProposer
    from specdec_inductor.speculative import SpeculativeGenerator
    from specdec_inductor.testing import RowRecorder
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(SpeculativeGenerator, "one_program", False)  # steps via engine.verify
    act = QuantActivation.INT8
    model, tokenizer = load_gguf(tiny["qwen2"], activation=act)
    engine = Engine(model, max_batch=1, max_len=160, compile=True, prefill_chunk=16)
    draft = Engine(load_gguf(tiny["qwen2"], activation=act)[0], max_batch=3, max_len=166,
                   compile=True, prefill_chunk=16)
    prompt = tokenizer(PROMPTS[0])["input_ids"]
    recorder = RowRecorder(engine)
    recorder.on = True
    ar = engine.generate([prompt], 96)[0]
    ar_rows, recorder.rows = recorder.rows, []
    spec = SpeculativeGenerator(engine, StandaloneProposer(draft, 7, topk=2, depth=3),
                                min_accepted=0.0)
    out = spec.generate([prompt], 96)[0]
    recorder.on = False
    same, different, worst = recorder.compare(ar_rows, recorder.rows, prompt + ar)
    assert out == ar
    assert different == 0 and same > 60, (same, different, worst)
