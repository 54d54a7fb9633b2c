"""specdec::quant_linear_cat (csrc/quant.cpp): several quantized weights against one x. Every
output value is bitwise quant_linear's for that member alone (every file format and repacked
layout, FLOAT and INT8, mixed formats in one group, M = 1..16 and 64, 1 thread and all, every
runnable path; the path asserted), against the fp64 reference, opcheck, bad inputs named, empty
shapes. The quant_cat graph pass (lowerings/quant_cat.py) on tiny quantized GGUF models: the
counter fires, the generated code calls the op, compiled with the pass == compiled without it
bitwise (and close to eager), the switch turns it off, compiled generate gives the same tokens
with and without it."""
import pytest
import torch
from torch.library import opcheck

import specdec_inductor
from specdec_inductor.ops.quant import (FILE_FORMATS, QuantActivation, QuantFormat, is_repacked,
                                        quant_linear, quant_linear_cat, quant_repack)
from specdec_inductor.ops.reference import quant_linear_cat_ref, quant_linear_int8_terms_ref
from test_gguf_model import LAYERS, PROMPTS, TYPES, tokenizer_fields, write_tiny_gguf  # noqa: F401
from test_quant import PATHS, int8_kernel_of, kernel_of, random_weight
from test_quant_repack import r16_kernel_of

FLOAT, INT8 = QuantActivation.FLOAT, QuantActivation.INT8
K = 512  # a multiple of every block size (32 and 256)
REPACKED = [QuantFormat.Q4_K_R16, QuantFormat.Q6_K_R16]
ROWS = list(range(1, 17)) + [64]
_KERNEL_ORDER = ["portable", "avx2", "avx512"]


def weight_of(fmt, n, seed):
    """uint8 weight of N rows x K in `fmt` (a repacked fmt: random file rows repacked)."""
    if is_repacked(fmt):
        base = QuantFormat(int(fmt) - 256)
        return quant_repack(random_weight(base, n, K, seed), base)
    return random_weight(fmt, n, K, seed)


def group_of(fmts, sizes, seed, dtype=torch.float32):
    """(weights, biases) for `fmts`, member i with sizes[i] outputs, a bias on every other one."""
    gen = torch.Generator().manual_seed(seed)
    weights = [weight_of(f, n, seed + i) for i, (f, n) in enumerate(zip(fmts, sizes))]
    biases = [torch.randn(n, generator=gen).to(dtype) if i % 2 else None
              for i, n in enumerate(sizes)]
    return weights, biases


def separate(x, weights, fmts, biases, activation):
    return torch.cat([quant_linear(x, w, f, b, activation)
                      for w, f, b in zip(weights, fmts, biases)], dim=-1)


def expected_path(path, fmts, activation):
    """The one path a call records: FLOAT's quant kernel, or INT8's slowest member's."""
    if activation == FLOAT:
        return f"quant_linear_cat:{kernel_of(path)}"
    kernels = [r16_kernel_of(path) if is_repacked(f) else int8_kernel_of(path, f) for f in fmts]
    return f"quant_linear_cat_int8:{min(kernels, key=_KERNEL_ORDER.index)}"


def assert_bitwise_separate(x, weights, fmts, biases, activation, path):
    """The cat == the separate quant_linear calls, bitwise, 1 thread and all threads, with one
    path recorded per call."""
    threads = torch.get_num_threads()
    with specdec_inductor.forced_isa(path):
        want = separate(x, weights, fmts, biases, activation)
        for count in sorted({1, threads}):
            torch.set_num_threads(count)
            try:
                specdec_inductor.reset_kernel_path_counts()
                got = quant_linear_cat(x, weights, fmts, biases, activation)
            finally:
                torch.set_num_threads(threads)
            assert specdec_inductor.kernel_path_counts() == {
                expected_path(path, fmts, activation): 1}
            assert got.dtype == x.dtype and got.shape == want.shape
            assert torch.equal(got, want), (count, (got.float() - want.float()).abs().max())


# One group per format: a member below the parallel grain, one big enough to be split across
# threads inside it (1000 rows), and one whose N is not a multiple of 8 (a short last block).
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("activation", [FLOAT, INT8])
@pytest.mark.parametrize("fmt", FILE_FORMATS + REPACKED)
def test_each_format_is_bitwise_quant_linear(fmt, activation, path):
    if is_repacked(fmt) and activation == FLOAT:
        pytest.skip("repacked layouts run INT8 only (test_bad_inputs)")
    sizes = [48, 1008, 32] if is_repacked(fmt) else [72, 1000, 13]
    weights, biases = group_of([fmt] * 3, sizes, seed=int(fmt))
    gen = torch.Generator().manual_seed(int(fmt) + 7)
    for m in ROWS:
        x = torch.randn(m, K, generator=gen)
        assert_bitwise_separate(x, weights, [fmt] * 3, biases, activation, path)


# Members of every format in one group: the 32-weight formats with all four weight offsets
# (Q4_0 8, Q5_0 16, Q8_0 128, Q4_1 / Q5_1 0), the K formats (256-value activation blocks) and
# the repacked layouts (INT8), as Qwen's q/k/v can mix Q5_0, Q8_0 and Q6_K in one layer.
MIXED = [QuantFormat.Q4_1, QuantFormat.Q8_0, QuantFormat.Q6_K, QuantFormat.Q4_0,
         QuantFormat.Q5_K, QuantFormat.Q5_0, QuantFormat.Q4_K, QuantFormat.Q5_1]
MIXED_SIZES = [64, 200, 48, 96, 40, 24, 320, 8]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", [FLOAT, INT8])
def test_mixed_formats_are_bitwise_quant_linear(activation, dtype, path):
    fmts, sizes = list(MIXED), list(MIXED_SIZES)
    if activation == INT8:
        fmts, sizes = fmts + REPACKED, sizes + [64, 32]
    weights, biases = group_of(fmts, sizes, seed=5, dtype=dtype)
    gen = torch.Generator().manual_seed(6)
    for m in ROWS:
        x = torch.randn(m, K, generator=gen).to(dtype)
        assert_bitwise_separate(x, weights, fmts, biases, activation, path)


@pytest.mark.parametrize("activation", [FLOAT, INT8])
def test_matches_the_fp64_reference(activation):
    """The cat against quant_linear_cat_ref (the references of its members side by side), by
    test_quant's rules: FLOAT within 2x F.linear's error on the dequantized weights is checked
    there per member; here the fp32 rounding bound of the INT8 definition, and FLOAT within
    1e-4 of the fp64 value relative to its largest magnitude."""
    fmts = MIXED + (REPACKED if activation == INT8 else [])
    weights, biases = group_of(fmts, [16] * len(fmts), seed=8)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(9))
    got = quant_linear_cat(x, weights, fmts, biases, activation)
    ref = quant_linear_cat_ref(x.double(), weights, fmts, biases, activation)
    if activation == INT8:
        mags = torch.cat([quant_linear_int8_terms_ref(x, w, f, b)[1]
                          for w, f, b in zip(weights, fmts, biases)], -1)
        assert ((got.double() - ref).abs() <= 2 * (K / 64 + 8) * 2.0 ** -24 * mags).all()
    else:
        assert ((got.double() - ref).abs() <= 1e-4 * ref.abs().max()).all()


def test_views_of_x_and_weights():
    """Transposed, sliced and 3-D x, row-sliced weights: the same values as contiguous copies."""
    fmts = [QuantFormat.Q5_0, QuantFormat.Q6_K]
    weights, biases = group_of(fmts, [40, 24], seed=10)
    gen = torch.Generator().manual_seed(11)
    xt = torch.randn(K, 6, generator=gen).t()
    xs = torch.randn(2, 5, K, generator=gen)[:, 1:4]
    sliced = [w[3:30] for w in weights]
    sliced_b = [None if b is None else b[3:30] for b in biases]
    for activation in (FLOAT, INT8):
        for x in (xt, xs):
            want = quant_linear_cat(x.contiguous(), weights, fmts, biases, activation)
            assert torch.equal(quant_linear_cat(x, weights, fmts, biases, activation), want)
        want = quant_linear_cat(xt.contiguous(), [w.clone() for w in sliced], fmts, sliced_b,
                                activation)
        assert torch.equal(quant_linear_cat(xt, sliced, fmts, sliced_b, activation), want)
    assert quant_linear_cat(xs, weights, fmts, biases).shape == (2, 3, 64)


def test_empty_shapes():
    fmts = [QuantFormat.Q8_0, QuantFormat.Q4_K]
    weights, biases = group_of(fmts, [4, 16], seed=12)
    assert quant_linear_cat(torch.randn(0, K), weights, fmts, biases).shape == (0, 20)
    x = torch.randn(3, K)
    out = quant_linear_cat(x, [weights[0][:0], weights[1]], fmts, biases, INT8)  # N = 0 member
    assert torch.equal(out, quant_linear(x, weights[1], fmts[1], biases[1], INT8))
    b = torch.randn(4)
    zero_k = quant_linear_cat(torch.randn(2, 0), [weights[0][:, :0], weights[1][:, :0]], fmts,
                              [b, None])
    assert torch.equal(zero_k, torch.cat([b.expand(2, 4), torch.zeros(2, 16)], -1))


def _samples():
    gen = torch.Generator().manual_seed(13)
    fmts = [int(QuantFormat.Q4_1), int(QuantFormat.Q5_K), int(QuantFormat.Q8_0)]
    weights, _ = group_of([QuantFormat(f) for f in fmts], [12, 8, 4], seed=14)
    r16 = weight_of(QuantFormat.Q4_K_R16, 16, 15)
    bias = [None, torch.randn(8, generator=gen), None]
    bias16 = [b if b is None else b.bfloat16() for b in bias]
    return [
        (torch.randn(3, K, generator=gen), weights, fmts, bias),
        (torch.randn(K, 4, generator=gen).t(), weights, fmts, bias, int(INT8)),  # transposed
        (torch.randn(2, 5, K, generator=gen)[:, 1:4], [w[2:6] for w in weights], fmts,
         [None, None, None]),  # sliced
        (torch.randn(K, 2, generator=gen).t().bfloat16(), weights, fmts, bias16),
        (torch.randn(2, K, generator=gen), weights + [r16], fmts + [int(QuantFormat.Q4_K_R16)],
         bias + [None], int(INT8)),
    ]


@pytest.mark.parametrize("sample", _samples())
def test_opcheck(sample):
    opcheck(torch.ops.specdec.quant_linear_cat.default, sample)


_W4, _W8 = random_weight(QuantFormat.Q4_0, 4, K, 1), random_weight(QuantFormat.Q8_0, 4, K, 2)
_X = torch.randn(2, K)
_R16 = weight_of(QuantFormat.Q4_K_R16, 16, 3)
Q4_0, Q8_0 = QuantFormat.Q4_0, QuantFormat.Q8_0
_cat = torch.ops.specdec.quant_linear_cat.default


@pytest.mark.parametrize("call,match", [
    (lambda: _cat(_X, [], [], [], 0), "argument 'weights'"),
    (lambda: _cat(_X, [_W4, _W8], [int(Q4_0)], [None, None], 0), "argument 'fmts'"),
    (lambda: _cat(_X, [_W4, _W8], [int(Q4_0), int(Q8_0)], [None], 0), "argument 'biases'"),
    (lambda: _cat(_X, [_W4, _W8], [int(Q4_0), 9], [None, None], 0), r"argument 'fmts\[1\]'"),
    (lambda: _cat(_X, [_W4, _W8], [int(Q4_0), int(Q4_0)], [None, None], 0), r"argument 'weights\[1\]'"),
    (lambda: _cat(_X, [_W4, _W8.float()], [int(Q4_0), int(Q8_0)], [None, None], 0), r"argument 'weights\[1\]'"),
    (lambda: _cat(_X, [_W4, _W8], [int(Q4_0), int(Q8_0)], [torch.randn(4).double(), None], 0),
     r"argument 'biases\[0\]'"),
    (lambda: _cat(_X, [_W4, _W8], [int(Q4_0), int(Q8_0)], [None, torch.randn(5)], 0),
     r"argument 'biases\[1\]'"),
    (lambda: _cat(_X, [_W4, _W8], [int(Q4_0), int(Q8_0)], [None, None], 2), "argument 'activation'"),
    (lambda: _cat(_X, [_W4, _R16], [int(Q4_0), int(QuantFormat.Q4_K_R16)], [None, None], 0),
     "argument 'activation'"),
    (lambda: _cat(_X.double(), [_W4, _W8], [int(Q4_0), int(Q8_0)], [None, None], 0), "argument 'x'"),
    (lambda: _cat(_X[:, :288], [_W4[:, :162], random_weight(QuantFormat.Q4_K, 4, 256, 4)],
                  [int(Q4_0), int(QuantFormat.Q4_K)], [None, None], 0), "argument 'x'"),  # K % 256
    (lambda: quant_linear_cat(_X, [_W4], [QuantFormat.Q4_0], None, activation=3), "'activation'"),
])
def test_bad_inputs(call, match):
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        call()


def test_fake_kernel_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(2, 3, K))
        ws = [mode.from_tensor(_W4), mode.from_tensor(_R16)]
        out = quant_linear_cat(x, ws, [Q4_0, QuantFormat.Q4_K_R16], None, INT8)
    assert out.shape == (2, 3, 4 + 16) and out.dtype == torch.float32


class _Qkv(torch.nn.Module):
    """Three projections and a gate/up pair off quantized weights (quant_linear), as a block."""

    def __init__(self, activation):
        super().__init__()
        self.activation = activation
        fmts = [QuantFormat.Q5_0, QuantFormat.Q8_0, QuantFormat.Q6_K, QuantFormat.Q4_K,
                QuantFormat.Q4_1]
        self.fmts = fmts
        weights, biases = group_of(fmts, [256, 256, 256, 96, 96], seed=16)
        for i, (w, b) in enumerate(zip(weights, biases)):
            self.register_buffer(f"w{i}", w)
            setattr(self, f"b{i}", b)
        self.down = random_weight(QuantFormat.Q8_0, K, 96, 17)

    def lin(self, x, i):
        return quant_linear(x, getattr(self, f"w{i}"), self.fmts[i], getattr(self, f"b{i}"),
                            self.activation)

    def forward(self, x):
        n = x * 2.0
        q, k, v = self.lin(n, 0), self.lin(n, 1), self.lin(n, 2)
        h = torch.cat([q, k + v], -1)
        g, u = self.lin(h, 3), self.lin(h, 4)
        return quant_linear(torch.nn.functional.silu(g) * u, self.down, QuantFormat.Q8_0,
                            None, self.activation), q


def _compile_and_code(model, x, options=None):
    from specdec_inductor.backend import specdec_backend
    from specdec_inductor.lowerings.compile import run_and_get_code
    torch._dynamo.reset()
    fn = torch.compile(model, fullgraph=True,
                       backend=lambda gm, ex: specdec_backend(gm, ex, options=options))
    with torch.no_grad():
        return run_and_get_code(fn, x)


@pytest.mark.parametrize("activation", [FLOAT, INT8])
def test_pass_groups_shared_inputs(activation, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = _Qkv(activation).eval()
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(18))
    torch._dynamo.utils.counters.clear()
    specdec_inductor.reset_kernel_path_counts()
    out, codes = _compile_and_code(model, x)
    assert torch._dynamo.utils.counters["specdec"]["quant_cat"] == 2
    code = "\n".join(codes)
    assert code.count("torch.ops.specdec.quant_linear_cat.default(") == 2, code
    assert code.count("torch.ops.specdec.quant_linear.default(") == 1, code  # down alone
    kind = "quant_linear_cat_int8" if activation == INT8 else "quant_linear_cat"
    assert sum(c for p, c in specdec_inductor.kernel_path_counts().items()
               if p.startswith(kind + ":")) == 2
    with torch.no_grad():
        eager = model(x)
    torch._dynamo.utils.counters.clear()
    off, codes = _compile_and_code(model, x, {"specdec.quant_cat": False})
    assert torch._dynamo.utils.counters["specdec"]["quant_cat"] == 0
    assert "quant_linear_cat" not in "\n".join(codes)
    for got, without, want in zip(out, off, eager):
        assert torch.equal(got, without)  # the pass changes no bit
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_pass_with_dynamic_rows(monkeypatch, tmp_path):
    """A symbolic row count (dynamic=True): the groups still merge, one graph for every M, and
    q is bitwise eager's (the cat runs the separate calls' kernels)."""
    from specdec_inductor.backend import specdec_backend
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _Qkv(INT8).eval()
    fn = torch.compile(model, dynamic=True, fullgraph=True, backend=specdec_backend)
    gen = torch.Generator().manual_seed(19)
    with torch.no_grad():
        for rows in (3, 5, 9):
            x = torch.randn(rows, K, generator=gen)
            (out, q), (want_out, want_q) = fn(x), model(x)
            assert torch.equal(q, want_q)  # x * 2 is exact: the same input, the same bits
            torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)
    assert torch._dynamo.utils.counters["specdec"]["quant_cat"] == 2  # one graph


def test_pass_uuid_is_stable():
    from specdec_inductor.lowerings.quant_cat import QuantCatPass
    from specdec_inductor.lowerings.skinny_linear import LinearCatPass
    assert QuantCatPass().uuid() == QuantCatPass().uuid() != LinearCatPass().uuid()


# -- a tiny quantized model (tests/test_gguf_model.py's writer) ------------------------------


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, tokenizer_fields):  # noqa: F811
    """Path of a tiny llama GGUF: q/k/v in Q4_0 / Q4_1 / Q5_0 (three weight offsets), gate/up in
    Q4_K (repacked at load for INT8 on VNNI) / Q5_K."""
    path = str(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf")
    write_tiny_gguf(path, "llama", TYPES["llama"], tokenizer_fields)
    return path


@pytest.fixture(autouse=True)
def cache_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.mark.parametrize("activation", [FLOAT, INT8])
def test_pass_on_a_tiny_quantized_llama(tiny_llama, activation, tmp_path, monkeypatch):
    """The model's forward compiled: q/k/v and gate/up of every layer merged (2 groups per
    layer), the op in the generated code, logits bitwise those compiled without the pass."""
    from specdec_inductor.engine.gguf_model import load_gguf
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, tokenizer = load_gguf(tiny_llama, activation=activation)
    ids = torch.tensor([tokenizer(PROMPTS[1])["input_ids"]])

    def logits(x):
        return model(x, use_cache=False).logits

    torch._dynamo.utils.counters.clear()
    out, codes = _compile_and_code(logits, ids)
    assert torch._dynamo.utils.counters["specdec"]["quant_cat"] == 2 * LAYERS
    assert "\n".join(codes).count("torch.ops.specdec.quant_linear_cat.default(") == 2 * LAYERS
    off, codes = _compile_and_code(logits, ids, {"specdec.quant_cat": False})
    assert "quant_linear_cat" not in "\n".join(codes)
    assert torch.equal(out, off)
    with torch.no_grad():
        torch.testing.assert_close(out, logits(ids), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("activation", [FLOAT, INT8])
def test_compiled_generate_tokens_equal_with_and_without_the_pass(tiny_llama, activation,
                                                                  tmp_path, monkeypatch):
    from specdec_inductor.engine.engine import Engine
    from specdec_inductor.engine.gguf_model import load_gguf
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model, tokenizer = load_gguf(tiny_llama, activation=activation)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    tokens = {}
    for on in (True, False):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        engine = Engine(model, max_batch=2, max_len=64, compile=True, prefill_chunk=16,
                        compile_options={"specdec.quant_cat": on})
        tokens[on] = engine.generate(prompts, 8)
        fired = torch._dynamo.utils.counters["specdec"]["quant_cat"]
        assert fired > 0 if on else fired == 0
    assert tokens[True] == tokens[False]
    assert all(len(t) == 8 for t in tokens[True])
