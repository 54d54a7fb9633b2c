"""skinny_linear (csrc/linear.cpp) against its reference on every runnable ISA path, its
layouts and bad inputs, opcheck, and the `specdec` backend's graph pass that puts it in place
of mm/addmm (counter fired, generated code calls the op, eager == compiled)."""
import contextlib
import re

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import specdec_inductor
from specdec_inductor.backend import specdec_backend
from specdec_inductor.lowerings.compile import run_and_get_code
from specdec_inductor.lowerings import skinny_linear as skinny_pass
from specdec_inductor.ops import (clear_packed_weights, packed_weight_stats,
                                  register_packed_weight, release_packed_weight, skinny_linear,
                                  skinny_linear_cat)
from specdec_inductor.ops.reference import skinny_linear_cat_ref, skinny_linear_ref

PATHS = specdec_inductor.runnable_isas()
# Paths with a packed-weight kernel (an AMX machine runs the AVX-512 one).
PACKED_PATHS = [p for p in PATHS if p in ("avx2", "avx512")]


def kernel_of(path):
    """The kernel a forced path runs and records: AMX has no linear kernel of its own, so an
    AMX machine runs the AVX-512 ones."""
    return {"amx": "avx512"}.get(path, path)


# The path the default (unforced) ISA records for the SIMD kernels.
BEST = kernel_of(specdec_inductor.active_isa())
DTYPES = [torch.float32, torch.bfloat16]


def _check_close(out, x, w, b):
    """STYLE.md 2x rule: our error vs an fp64 reference is at most twice plain torch's in
    the same dtype (plus one ulp of the output's scale for exact cases)."""
    exact = x.double() @ w.double().T + (b.double() if b is not None else 0)
    torch_err = (F.linear(x, w, b).double() - exact).abs().max().item()
    ours_err = (out.double() - exact).abs().max().item()
    ulp = torch.finfo(x.dtype).eps * max(1.0, exact.abs().max().item())
    assert ours_err <= 2 * torch_err + ulp, (ours_err, torch_err)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 576, 100), (4, 576, 576), (1, 1536, 576), (1, 1, 9), (2, 15, 8), (3, 17, 7),
                                   (4, 32, 16), (5, 33, 1), (7, 63, 24), (16, 1000, 40),
                                   (33, 64, 9)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(path, dtype, m, k, n, bias):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).to(dtype)  # [M, K]
    w = torch.randn(n, k, generator=gen).to(dtype)  # [N, K]
    b = torch.randn(n, generator=gen).to(dtype) if bias else None  # [N]
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        out = skinny_linear(x, w, b)
    # Past 16 rows an unpacked weight goes to aten's GEMM (the row kernels lose there).
    expected = "skinny_linear_gemm:portable" if m > 16 else f"skinny_linear:{kernel_of(path)}"
    assert specdec_inductor.kernel_path_counts() == {expected: 1}
    assert out.dtype == dtype and out.shape == (m, n)
    _check_close(out, x, w, b)
    torch.testing.assert_close(out.float(), skinny_linear_ref(x, w, b).float(),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)


@pytest.mark.parametrize("path", PATHS)
def test_layouts(path):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, generator=gen)  # [2, 3, K]: leading dims are kept
    wide = torch.randn(24, 50, generator=gen)
    w = wide[:, 5:45]  # [N=24, K=40] with row stride 50: dense rows, no copy
    xt = torch.randn(40, 6, generator=gen).t()  # [6, K] transposed x
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        out = skinny_linear(x, w)
        out_t = skinny_linear(xt, w)
    assert specdec_inductor.kernel_path_counts() == {f"skinny_linear:{kernel_of(path)}": 2}
    assert out.shape == (2, 3, 24)
    _check_close(out.view(6, 24), x.view(6, 40), w, None)
    _check_close(out_t, xt, w, None)


def test_column_major_weight_is_copied_and_counted():
    w = torch.randn(30, 12).t()  # [N=12, K=30], stride(1) = 12
    x = torch.randn(2, 30)
    specdec_inductor.reset_kernel_path_counts()
    out = skinny_linear(x, w)
    counts = specdec_inductor.kernel_path_counts()
    assert counts.get("skinny_linear_weight_copy:portable") == 1
    _check_close(out, x, w, None)


@pytest.mark.parametrize("packed", [False, True])
def test_threads_do_not_change_the_result(packed):
    if packed and not PACKED_PATHS:
        pytest.skip("the packed kernels are AVX2 / AVX-512")
    x, w = torch.randn(8, 256), torch.randn(4096, 256)  # [M, K], [N, K]: splits across threads
    if packed:
        register_packed_weight(w)
    threads = torch.get_num_threads()
    specdec_inductor.reset_kernel_path_counts()
    try:
        torch.set_num_threads(1)
        one = skinny_linear(x, w)
        torch.set_num_threads(max(2, threads))
        many = skinny_linear(x, w)
    finally:
        torch.set_num_threads(threads)
        release_packed_weight(w)
    assert torch.equal(one, many)
    assert specdec_inductor.kernel_path_counts().get(f"skinny_linear_packed:{BEST}", 0) == (
        2 if packed else 0)


def test_empty_shapes():
    assert skinny_linear(torch.randn(0, 8), torch.randn(5, 8)).shape == (0, 5)
    assert skinny_linear(torch.randn(3, 8), torch.randn(0, 8)).shape == (3, 0)
    b = torch.randn(4)
    torch.testing.assert_close(skinny_linear(torch.randn(2, 0), torch.randn(4, 0), b),
                               b.expand(2, 4))


@pytest.mark.parametrize("args,match", [
    ((torch.randn(2, 8), torch.randn(5, 7)), "argument 'weight' must have shape"),
    ((torch.randn(2, 8), torch.randn(5, 8).double()), "argument 'weight' must have x's dtype"),
    ((torch.randn(2, 8).half(), torch.randn(5, 8).half()), "argument 'x' must be float32"),
    ((torch.randn(2, 8), torch.randn(8)), "argument 'weight' must have 2"),
    ((torch.randn(2, 8), torch.randn(5, 8), torch.randn(4)), "argument 'bias' must have shape"),
    ((torch.randn(2, 8), torch.randn(5, 8), torch.randn(5).bfloat16()),
     "argument 'bias' must have x's dtype"),
    ((torch.tensor(1.0), torch.randn(5, 8)), "argument 'x' must have at least 1"),
])
def test_bad_inputs(args, match):
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        skinny_linear(*args)


def _samples():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 20, generator=gen)
    w = torch.randn(9, 20, generator=gen)
    b = torch.randn(9, generator=gen)
    yield (x, w, b)  # contiguous
    yield (torch.randn(20, 3, generator=gen).t(), w, None)  # transposed x
    yield (torch.randn(3, 40, generator=gen)[:, ::2], torch.randn(9, 30, generator=gen)[:, 5:25],
           torch.randn(18, generator=gen)[::2])  # sliced x, bias; weight rows strided
    yield (x.bfloat16(), w.bfloat16(), b.bfloat16())


@pytest.mark.parametrize("sample", list(_samples()), ids=["contiguous", "transposed", "sliced",
                                                          "bf16"])
def test_opcheck(sample):
    opcheck(torch.ops.specdec.skinny_linear.default, sample)


# -- packed weights (register_packed_weight; the AVX2 and AVX-512 paths read the blocked copy) --

needs_packed = pytest.mark.skipif(not PACKED_PATHS, reason="the packed kernels are AVX2 / AVX-512")


def _packed_counts():
    return {k: v for k, v in specdec_inductor.kernel_path_counts().items() if "skinny" in k}


@pytest.mark.parametrize("path", PACKED_PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,n", [(1, 576, 100), (4, 576, 576), (1, 1536, 576), (8, 1, 9),
                                   (2, 15, 8), (3, 17, 7), (16, 1000, 40), (8, 33, 49),
                                   (5, 64, 48), (6, 70, 50), (7, 100, 33), (9, 63, 97),
                                   (33, 64, 145)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_reference(path, dtype, m, k, n, bias):
    gen = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=gen).to(dtype)  # [M, K]
    w = torch.randn(n, k, generator=gen).to(dtype)  # [N, K]
    b = torch.randn(n, generator=gen).to(dtype) if bias else None  # [N]
    register_packed_weight(w)
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        first, second = skinny_linear(x, w, b), skinny_linear(x, w, b)
    # Packed once (on the first call), read twice; the row kernel never ran.
    assert _packed_counts() == {"skinny_linear_pack:portable": 1,
                                f"skinny_linear_packed:{kernel_of(path)}": 2}
    assert torch.equal(first, second) and first.dtype == dtype and first.shape == (m, n)
    _check_close(first, x, w, b)
    torch.testing.assert_close(first.float(), skinny_linear_ref(x, w, b).float(),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)
    assert release_packed_weight(w) and not release_packed_weight(w)
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        row = skinny_linear(x, w, b)  # unpacked again: same values up to summation order
    assert _packed_counts() == {"skinny_linear_gemm:portable" if m > 16 else f"skinny_linear:{kernel_of(path)}": 1}
    torch.testing.assert_close(row.float(), first.float(),
                               rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)


@pytest.mark.parametrize("path", PACKED_PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_strided_weights(path, dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 40, generator=gen).to(dtype)
    col_major = torch.randn(40, 24, generator=gen).to(dtype).t()  # [N=24, K=40], stride(1) = 24
    sliced = torch.randn(30, 50, generator=gen).to(dtype)[::2, 5:45]  # [15, 40], row stride 100
    for w in (col_major, sliced):
        register_packed_weight(w)
        specdec_inductor.reset_kernel_path_counts()
        with specdec_inductor.forced_isa(path):
            out = skinny_linear(x, w)
        # Packed straight from the strided weight: no per-call dense copy.
        assert _packed_counts() == {"skinny_linear_pack:portable": 1,
                                    f"skinny_linear_packed:{kernel_of(path)}": 1}
        _check_close(out, x, w, None)
        # A view with the same data pointer but another shape is not the registered weight.
        specdec_inductor.reset_kernel_path_counts()
        with specdec_inductor.forced_isa(path):
            skinny_linear(x, w[:7])
        assert f"skinny_linear_packed:{kernel_of(path)}" not in _packed_counts()
        release_packed_weight(w)


@pytest.mark.parametrize("path", PACKED_PATHS)
def test_packed_weight_follows_in_place_updates(path):
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 32, generator=gen), torch.nn.Parameter(torch.randn(20, 32, generator=gen))
    register_packed_weight(w)
    with specdec_inductor.forced_isa(path), torch.no_grad():
        skinny_linear(x, w)
        w.mul_(-0.5)  # bumps the version counter: the next call re-packs
        specdec_inductor.reset_kernel_path_counts()
        _check_close(skinny_linear(x, w), x, w, None)
        assert _packed_counts() == {"skinny_linear_repack:portable": 1,
                                    f"skinny_linear_packed:{kernel_of(path)}": 1}
        # A write through .data bypasses the version counter (documented): the stale copy is
        # used until the weight is released and registered again.
        before = skinny_linear(x, w)
        w.data.copy_(torch.randn(20, 32, generator=gen))
        assert torch.equal(skinny_linear(x, w), before)
        release_packed_weight(w)
        register_packed_weight(w)
        _check_close(skinny_linear(x, w), x, w, None)
    release_packed_weight(w)


@pytest.mark.parametrize("path", PACKED_PATHS)
def test_packed_copy_is_freed_with_its_weight(path):
    import gc
    clear_packed_weights()
    w = torch.randn(64, 48)
    register_packed_weight(w)
    register_packed_weight(w)  # idempotent
    assert packed_weight_stats() == {"registered": 1, "packed": 0, "groups": 0, "bytes": 0}
    with specdec_inductor.forced_isa(path):
        skinny_linear(torch.randn(2, 48), w)
    assert packed_weight_stats() == {"registered": 1, "packed": 1, "groups": 0, "bytes": 64 * 48 * 4}
    del w
    gc.collect()
    assert packed_weight_stats() == {"registered": 0, "packed": 0, "groups": 0, "bytes": 0}
    # A new tensor that happens to reuse the freed address is not mistaken for the old one.
    w2 = torch.randn(64, 48)
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        skinny_linear(torch.randn(2, 48), w2)
    assert _packed_counts() == {f"skinny_linear:{kernel_of(path)}": 1}


def test_packed_weight_is_ignored_on_the_portable_path():
    x, w = torch.randn(2, 16), torch.randn(8, 16)
    register_packed_weight(w)
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa("portable"):
        out = skinny_linear(x, w)
    assert _packed_counts() == {"skinny_linear:portable": 1}
    _check_close(out, x, w, None)
    release_packed_weight(w)


@pytest.mark.parametrize("weight,match", [
    (torch.randn(8), "argument 'weight' must have 2"),
    (torch.randn(2, 8).half(), "argument 'weight' must be float32 or bfloat16"),
    (torch.ones(2, 8, dtype=torch.int64), "argument 'weight' must be float32 or bfloat16"),
])
def test_register_packed_weight_bad_inputs(weight, match):
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        register_packed_weight(weight)


# -- skinny_linear_cat (several weights against one x; packed as one stream when registered) --


def _cat_case(dtype, m, k, ns, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(dtype)  # [M, K]
    ws = [torch.randn(n, k, generator=gen).to(dtype) for n in ns]  # [N_i, K]
    # bias: "all", "none" or "mixed" (every other weight has one)
    bs = [torch.randn(n, generator=gen).to(dtype)
          if bias == "all" or (bias == "mixed" and i % 2 == 0) else None
          for i, n in enumerate(ns)]
    return x, ws, bs


def _check_cat(out, x, ws, bs):
    assert out.shape == (*x.shape[:-1], sum(w.shape[0] for w in ws)) and out.dtype == x.dtype
    col = 0
    for w, b in zip(ws, bs):
        _check_close(out[..., col:col + w.shape[0]], x, w, b)
        col += w.shape[0]
    tol = dict(rtol=2e-2, atol=1e-2) if x.dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.float(), skinny_linear_cat_ref(x, ws, bs).float(), **tol)


@contextlib.contextmanager
def _registered(ws):
    """The weights registered for packing inside the block, released after it (even when an
    assertion fails, so no registration leaks into the next test)."""
    for w in ws:
        register_packed_weight(w)
    try:
        yield
    finally:
        for w in ws:
            release_packed_weight(w)


CAT_SHAPES = [(1, 576, (576, 192, 192)), (4, 64, (48, 32, 7)), (8, 33, (16, 16)),
              (6, 40, (32, 9)), (33, 64, (64, 64)), (1, 17, (5,))]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,ns", CAT_SHAPES)
@pytest.mark.parametrize("bias", ["none", "all", "mixed"])
def test_cat_matches_reference(path, dtype, m, k, ns, bias):
    x, ws, bs = _cat_case(dtype, m, k, ns, bias, m * 100 + k)
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa(path):
        out = skinny_linear_cat(x, ws, bs)
    # Unregistered weights: each runs as skinny_linear would, into its columns.
    each = "skinny_linear_gemm:portable" if m > 16 else f"skinny_linear:{kernel_of(path)}"
    assert _packed_counts() == {each: len(ns), "skinny_linear_cat_split:portable": 1}
    _check_cat(out, x, ws, bs)


@pytest.mark.parametrize("path", PACKED_PATHS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,k,ns", CAT_SHAPES)
@pytest.mark.parametrize("bias", ["none", "mixed"])
def test_cat_packed_matches_reference(path, dtype, m, k, ns, bias):
    x, ws, bs = _cat_case(dtype, m, k, ns, bias, m * 100 + k + 1)
    with _registered(ws):
        specdec_inductor.reset_kernel_path_counts()
        with specdec_inductor.forced_isa(path):
            first, second = skinny_linear_cat(x, ws, bs), skinny_linear_cat(x, ws, bs)
        assert torch.equal(first, second)
        _check_cat(first, x, ws, bs)
        # Every CAT_SHAPES group fills whole 16-output blocks up to its last weight: one packed
        # stream (test_cat_unaligned_weight_before_the_last_is_split covers the other case).
        assert _packed_counts() == {"skinny_linear_cat_pack:portable": 1,
                                    f"skinny_linear_cat_packed:{kernel_of(path)}": 2}
        assert packed_weight_stats()["groups"] >= 1


@pytest.mark.parametrize("path", PACKED_PATHS)
def test_cat_unaligned_weight_before_the_last_is_split(path):
    x, ws, bs = _cat_case(torch.float32, 3, 32, (9, 16), "none", 7)  # 9 outputs, then 16
    with _registered(ws):
        specdec_inductor.reset_kernel_path_counts()
        with specdec_inductor.forced_isa(path):
            out = skinny_linear_cat(x, ws, bs)
        assert _packed_counts() == {"skinny_linear_pack:portable": 2,
                                    f"skinny_linear_packed:{kernel_of(path)}": 2,
                                    "skinny_linear_cat_split:portable": 1}
        _check_cat(out, x, ws, bs)


@pytest.mark.parametrize("path", PATHS)
def test_cat_layouts(path):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 40, generator=gen)  # leading dims kept
    xt = torch.randn(40, 6, generator=gen).t()  # [6, K] transposed
    ws = [torch.randn(16, 50, generator=gen)[:, 5:45],  # row stride 50
          torch.randn(40, 32, generator=gen).t(),  # column-major
          torch.randn(32, 40, generator=gen)[::2]]  # every other row
    bs = [None, torch.randn(64, generator=gen)[::2], None]  # a strided bias
    with specdec_inductor.forced_isa(path):
        out = skinny_linear_cat(x, ws, bs)
        out_t = skinny_linear_cat(xt, ws, bs)
    assert out.shape == (2, 3, 64)
    _check_cat(out.view(6, 64), x.view(6, 40), ws, bs)
    _check_cat(out_t, xt, ws, bs)
    if path in PACKED_PATHS:  # the packed group reads the strided weights directly
        with _registered(ws):
            specdec_inductor.reset_kernel_path_counts()
            with specdec_inductor.forced_isa(path):
                packed = skinny_linear_cat(xt, ws, bs)
            assert _packed_counts() == {"skinny_linear_cat_pack:portable": 1,
                                        f"skinny_linear_cat_packed:{kernel_of(path)}": 1}
            _check_cat(packed, xt, ws, bs)


@pytest.mark.parametrize("path", PACKED_PATHS)
def test_cat_group_follows_updates_release_and_freeing(path):
    import gc
    clear_packed_weights()
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 32, generator=gen)
    q = torch.nn.Parameter(torch.randn(32, 32, generator=gen))
    k = torch.nn.Parameter(torch.randn(16, 32, generator=gen))
    register_packed_weight(q)
    register_packed_weight(k)
    with specdec_inductor.forced_isa(path), torch.no_grad():
        skinny_linear_cat(x, [q, k])
        assert packed_weight_stats() == {"registered": 2, "packed": 0, "groups": 1,
                                         "bytes": 48 * 32 * 4}
        k.mul_(2.0)  # one member updated in place: the group re-packs on the next call
        specdec_inductor.reset_kernel_path_counts()
        _check_cat(skinny_linear_cat(x, [q, k]), x, [q, k], [None, None])
        assert _packed_counts() == {"skinny_linear_cat_repack:portable": 1,
                                    f"skinny_linear_cat_packed:{kernel_of(path)}": 1}
        # The same weights in another order are another group.
        specdec_inductor.reset_kernel_path_counts()
        _check_cat(skinny_linear_cat(x, [k, q]), x, [k, q], [None, None])
        assert _packed_counts() == {"skinny_linear_cat_pack:portable": 1,
                                    f"skinny_linear_cat_packed:{kernel_of(path)}": 1}
        # Releasing a member drops its groups: the rest runs split.
        assert release_packed_weight(k)
        assert packed_weight_stats()["groups"] == 0
        specdec_inductor.reset_kernel_path_counts()
        _check_cat(skinny_linear_cat(x, [q, k]), x, [q, k], [None, None])
        assert _packed_counts() == {"skinny_linear_pack:portable": 1,
                                    f"skinny_linear_packed:{kernel_of(path)}": 1,
                                    f"skinny_linear:{kernel_of(path)}": 1,
                                    "skinny_linear_cat_split:portable": 1}
        register_packed_weight(k)
        skinny_linear_cat(x, [q, k])
    assert packed_weight_stats()["groups"] == 1
    del k
    gc.collect()  # a freed member frees the group's copy
    assert packed_weight_stats() == {"registered": 1, "packed": 1, "groups": 0,
                                     "bytes": 32 * 32 * 4}
    release_packed_weight(q)


@pytest.mark.parametrize("args,match", [
    ((torch.randn(2, 8), [], []), "argument 'weights' must hold at least one"),
    ((torch.randn(2, 8), [torch.randn(5, 8)], []), "argument 'biases' must have one entry"),
    ((torch.randn(2, 8), [torch.randn(5, 8), torch.randn(5, 7)], [None, None]),
     r"argument 'weights\[1\]' must have shape"),
    ((torch.randn(2, 8), [torch.randn(5, 8), torch.randn(5, 8).double()], [None, None]),
     r"argument 'weights\[1\]' must have x's dtype"),
    ((torch.randn(2, 8), [torch.randn(5, 8)], [torch.randn(4)]),
     r"argument 'biases\[0\]' must have shape"),
    ((torch.randn(2, 8).half(), [torch.randn(5, 8).half()], [None]), "argument 'x' must be float32"),
    ((torch.tensor(1.0), [torch.randn(5, 8)], [None]), "argument 'x' must have at least 1"),
])
def test_cat_bad_inputs(args, match):
    with pytest.raises((ValueError, TypeError, RuntimeError), match=match):
        torch.ops.specdec.skinny_linear_cat.default(*args)


def test_cat_empty_shapes():
    assert skinny_linear_cat(torch.randn(0, 8), [torch.randn(5, 8), torch.randn(3, 8)]).shape == (0, 8)
    assert skinny_linear_cat(torch.randn(3, 8), [torch.randn(0, 8), torch.randn(2, 8)]).shape == (3, 2)
    b = torch.randn(4)
    out = skinny_linear_cat(torch.randn(2, 0), [torch.randn(4, 0), torch.randn(1, 0)], [b, None])
    torch.testing.assert_close(out, torch.cat([b.expand(2, 4), torch.zeros(2, 1)], 1))


def _cat_samples():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 20, generator=gen)
    ws = [torch.randn(16, 20, generator=gen), torch.randn(9, 20, generator=gen)]
    bs = [torch.randn(16, generator=gen), None]
    yield (x, ws, bs)  # contiguous
    yield (torch.randn(20, 3, generator=gen).t(), ws, [None, None])  # transposed x
    yield (torch.randn(3, 40, generator=gen)[:, ::2], [torch.randn(16, 30, generator=gen)[:, 5:25],
                                                      ws[1]],
           [torch.randn(32, generator=gen)[::2], torch.randn(9, generator=gen)])  # sliced
    yield (x.bfloat16(), [w.bfloat16() for w in ws], [bs[0].bfloat16(), None])


@pytest.mark.parametrize("sample", list(_cat_samples()), ids=["contiguous", "transposed", "sliced",
                                                              "bf16"])
def test_cat_opcheck(sample):
    opcheck(torch.ops.specdec.skinny_linear_cat.default, sample)


# -- the graph pass ----------------------------------------------------------------------------


class _Mlp(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.up = torch.nn.Linear(64, 48).to(dtype)
        self.down = torch.nn.Linear(48, 16, bias=False).to(dtype)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _compile_and_code(model, x, options=None):
    torch._dynamo.reset()
    fn = torch.compile(model, backend=lambda gm, ex: specdec_backend(gm, ex, options=options),
                       fullgraph=True)
    with torch.no_grad():
        return run_and_get_code(fn, x)


def _op_lines(code):
    return "\n".join(re.sub(r"buf\d+", "buf", line.strip()) for line in code.splitlines()
                     if "= torch.ops.specdec.skinny_linear" in line or "extern_kernels.mm" in line
                     or "extern_kernels.addmm" in line)


def test_pass_rewrites_linear_layers():
    torch.manual_seed(0)
    model = _Mlp().eval()
    x = torch.randn(2, 3, 64)  # 6 rows <= MAX_ROWS
    torch._dynamo.utils.counters.clear()
    out, codes = _compile_and_code(model, x)
    assert torch._dynamo.utils.counters["specdec"]["skinny_linear"] == 2
    lines = _op_lines(codes[0])
    lines = re.sub(r"arg\d+_1", "arg", lines)
    # up (with bias) and down (no bias) both call the op; no GEMM is left.
    assert lines.count("torch.ops.specdec.skinny_linear.default(") == 2, lines
    assert "extern_kernels" not in lines
    assert re.search(r"skinny_linear\.default\(reinterpret_tensor\(arg, \(6, 64\), \(64, 1\), 0\), "
                     r"arg, arg\)", lines), lines
    assert re.search(r"skinny_linear\.default\(.*, arg, None\)", lines), lines
    with torch.no_grad():
        _check_close(out.view(6, 16), torch.relu(model.up(x)).view(6, 48), model.down.weight, None)
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)


def test_pass_bf16_and_switch_off():
    torch.manual_seed(0)
    model = _Mlp(torch.bfloat16).eval()
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    torch._dynamo.utils.counters.clear()
    out, codes = _compile_and_code(model, x)
    assert torch._dynamo.utils.counters["specdec"]["skinny_linear"] == 2
    assert _op_lines(codes[0]).count("specdec.skinny_linear") == 2
    with torch.no_grad():
        torch.testing.assert_close(out.float(), model(x).float(), rtol=2e-2, atol=2e-2)
    torch._dynamo.utils.counters.clear()
    _, codes = _compile_and_code(model, x, {"specdec.skinny_linear": False})
    assert torch._dynamo.utils.counters["specdec"]["skinny_linear"] == 0
    assert "specdec.skinny_linear" not in codes[0]


def test_pass_leaves_large_batches_and_other_layouts():
    torch.manual_seed(0)
    model = _Mlp().eval()
    # Too many rows: GEMM territory (the limit is higher with packed weights, the default).
    for rows, options in ((skinny_pass.PACKED_MAX_ROWS + 1, None),
                          (skinny_pass.MAX_ROWS + 1, {"specdec.pack_weights": False})):
        torch._dynamo.utils.counters.clear()
        out, codes = _compile_and_code(model, torch.randn(rows, 64), options)
        assert torch._dynamo.utils.counters["specdec"]["skinny_linear"] == 0
        assert "specdec.skinny_linear" not in codes[0]
    # Between the two limits the packed kernel takes the rows.
    x = torch.randn(skinny_pass.PACKED_MAX_ROWS, 64)
    torch._dynamo.utils.counters.clear()
    specdec_inductor.reset_kernel_path_counts()
    out, codes = _compile_and_code(model, x)
    assert torch._dynamo.utils.counters["specdec"]["skinny_linear"] == 2
    if PACKED_PATHS:
        assert _packed_counts() == {"skinny_linear_pack:portable": 2,
                                    f"skinny_linear_packed:{BEST}": 2}
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)

    class RightMultiply(torch.nn.Module):  # x @ W with W [K, N]: no transposed weight
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 8))

        def forward(self, x):
            return x @ self.w

    torch._dynamo.utils.counters.clear()
    _, codes = _compile_and_code(RightMultiply().eval(), torch.randn(2, 64))
    assert torch._dynamo.utils.counters["specdec"]["skinny_linear"] == 0
    assert "specdec.skinny_linear" not in codes[0]


@needs_packed
def test_backend_packs_the_parameters_it_compiles():
    torch.manual_seed(0)
    model = _Mlp().eval()
    x = torch.randn(4, 64)
    specdec_inductor.reset_kernel_path_counts()
    out, _ = _compile_and_code(model, x)
    # up.weight and down.weight are registered and packed on their first call; biases are 1-D.
    assert _packed_counts() == {"skinny_linear_pack:portable": 2, f"skinny_linear_packed:{BEST}": 2}
    for p in (model.up.weight, model.down.weight):
        assert release_packed_weight(p)
    assert not release_packed_weight(model.up.bias)
    with torch.no_grad():
        torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    specdec_inductor.reset_kernel_path_counts()
    out, _ = _compile_and_code(model, x, {"specdec.pack_weights": False})
    assert _packed_counts() == {f"skinny_linear:{BEST}": 2}
    assert not release_packed_weight(model.up.weight)


def test_unknown_option_is_an_error():
    with pytest.raises((ValueError, torch._dynamo.exc.BackendCompilerFailed),
                       match="unknown option .specdec.skinny_lienar"):
        _compile_and_code(_Mlp().eval(), torch.randn(1, 64), {"specdec.skinny_lienar": True})


def test_pass_uuid_is_stable():
    assert skinny_pass.SkinnyLinearPass().uuid() == skinny_pass.SkinnyLinearPass().uuid()


class _QkvMlp(torch.nn.Module):
    """Projections that share their input, as in an attention block and a gated MLP."""

    def __init__(self):
        super().__init__()
        self.q = torch.nn.Linear(64, 64)  # with bias (Qwen2's q/k/v have them)
        self.k = torch.nn.Linear(64, 32, bias=False)
        self.v = torch.nn.Linear(64, 16)
        self.odd = torch.nn.Linear(64, 9)  # not whole 16-output blocks: may only come last
        self.odd2 = torch.nn.Linear(64, 7, bias=False)  # a second such one stays on its own
        self.gate = torch.nn.Linear(64, 48, bias=False)
        self.up = torch.nn.Linear(64, 48, bias=False)
        self.down = torch.nn.Linear(48, 64, bias=False)

    def forward(self, x):
        n = x * 2.0
        q, k, v, odd, odd2 = self.q(n), self.k(n), self.v(n), self.odd(n), self.odd2(n)
        h = x + q + torch.cat([k, k], -1) * v.sum(-1, keepdim=True)
        mlp = self.down(F.silu(self.gate(h)) * self.up(h))
        return mlp, odd * 3.0, odd2


@pytest.mark.parametrize("rows", [1, 6])
def test_linear_cat_pass_groups_shared_inputs(rows):
    torch.manual_seed(0)
    model = _QkvMlp().eval()
    x = torch.randn(rows, 64)
    torch._dynamo.utils.counters.clear()
    specdec_inductor.reset_kernel_path_counts()
    out, codes = _compile_and_code(model, x)
    counters = torch._dynamo.utils.counters["specdec"]
    assert counters["skinny_linear"] == 8 and counters["linear_cat"] == 2
    lines = _op_lines(codes[0])
    # q/k/v/odd as one group, gate/up as another; odd2 and down on their own.
    assert lines.count("skinny_linear_cat.default(") == 2, lines
    assert lines.count("skinny_linear.default(") == 2, lines
    if PACKED_PATHS:
        assert _packed_counts() == {"skinny_linear_cat_pack:portable": 2,
                                    f"skinny_linear_cat_packed:{BEST}": 2,
                                    "skinny_linear_pack:portable": 2,
                                    f"skinny_linear_packed:{BEST}": 2}
    with torch.no_grad():
        expected = model(x)
    for got, want in zip(out, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch._dynamo.utils.counters.clear()
    off, codes = _compile_and_code(model, x, {"specdec.linear_cat": False})
    assert torch._dynamo.utils.counters["specdec"]["linear_cat"] == 0
    assert "skinny_linear_cat" not in codes[0]
    for got, want in zip(off, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_linear_cat_pass_uuid_is_stable():
    assert skinny_pass.LinearCatPass().uuid() == skinny_pass.LinearCatPass().uuid()
    assert skinny_pass.LinearCatPass().uuid() != skinny_pass.SkinnyLinearPass().uuid()
