"""ISA path selection: detection, the SPECDEC_ISA override, and the per-path counters."""
import json
import os
import subprocess
import sys

import pytest
import torch

import specdec_inductor
from specdec_inductor import ops


def _active_in_subprocess(value):
    env = {**os.environ, "SPECDEC_ISA": value}
    code = "import specdec_inductor as s; print(s.active_isa())"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)


def test_default_path_is_best_runnable():
    assert specdec_inductor.runnable_isas()[0] == "portable"
    assert specdec_inductor.active_isa() == specdec_inductor.runnable_isas()[-1]


@pytest.mark.parametrize("path", specdec_inductor.runnable_isas())
def test_env_var_forces_path(path):
    result = _active_in_subprocess(path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == path


def test_env_var_typo_fails_at_import():
    result = _active_in_subprocess("avx-512")
    assert result.returncode != 0 and "unknown path 'avx-512'" in result.stderr


def test_forced_isa_restores_and_counts():
    before = specdec_inductor.active_isa()
    specdec_inductor.reset_kernel_path_counts()
    cache_loc, accept = torch.arange(10), torch.tensor([[0, 2, -1], [5, 7, 9]])
    with specdec_inductor.forced_isa("portable"):
        ops.compact_accepted_cache_locs(cache_loc, accept)
    assert specdec_inductor.active_isa() == before
    counts = specdec_inductor.kernel_path_counts()
    assert counts == {"compact_accepted_cache_locs:portable": 1}


def _cpuinfo_flags():
    try:
        with open("/proc/cpuinfo") as f:
            line = next(l for l in f if l.startswith("flags"))
    except (OSError, StopIteration):
        return None
    return set(line.split(":", 1)[1].split())


@pytest.mark.skipif(_cpuinfo_flags() is None, reason="no /proc/cpuinfo flags (not Linux)")
def test_detection_agrees_with_proc_cpuinfo():
    """cpuid + xgetbv detection against the kernel's own view of the CPU."""
    flags = _cpuinfo_flags()
    avx2 = {"avx2", "fma", "f16c"} <= flags
    avx512 = avx2 and {"avx512f", "avx512dq", "avx512bw", "avx512vl", "avx512_bf16"} <= flags
    amx = avx512 and {"amx_tile", "amx_bf16"} <= flags
    want = "amx" if amx else "avx512" if avx512 else "avx2" if avx2 else "portable"
    assert specdec_inductor.detected_isa() == want, sorted(f for f in flags if "avx" in f or "amx" in f)


@pytest.mark.skipif("avx2" not in specdec_inductor.runnable_isas(), reason="CPU without AVX2")
def test_avx2_path_really_runs_here():
    assert "avx2" in specdec_inductor.built_isas(), "compiler could not build the AVX2 units"
    x, w = torch.randn(3, 40), torch.randn(24, 40)
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa("avx2"):
        y = ops.skinny_linear(x, w)
    assert specdec_inductor.kernel_path_counts() == {"skinny_linear:avx2": 1}
    torch.testing.assert_close(y, x @ w.T, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif("avx512" not in specdec_inductor.runnable_isas(), reason="CPU without AVX-512")
def test_avx512_path_really_runs_here():
    assert "avx512" in specdec_inductor.built_isas(), "compiler could not build the AVX-512 units"
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa("avx512"):
        ops.compact_accepted_cache_locs(torch.arange(10), torch.tensor([1, -1, 3]))
    assert specdec_inductor.kernel_path_counts() == {"compact_accepted_cache_locs:avx512": 1}


def test_peak_probe_counts_its_multiply_adds_and_needs_simd():
    from specdec_inductor import _C
    threads = torch.get_num_threads()
    if "amx" in specdec_inductor.runnable_isas():
        with specdec_inductor.forced_isa("amx"):  # bf16 on 4 tiles of 16 x 16 x 32; fp32 AVX-512
            assert _C.peak_probe_isa(True) == "amx" and _C.peak_probe_isa(False) == "avx512"
            assert _C.peak_multiply_adds(True, 10) == threads * 10 * 4 * 16 * 16 * 32
            assert _C.peak_multiply_adds(False, 10) == threads * 10 * 12 * 16
    if "avx512" in specdec_inductor.runnable_isas():
        with specdec_inductor.forced_isa("avx512"):
            assert _C.peak_probe_isa(True) == "avx512"
            assert _C.peak_multiply_adds(False, 10) == threads * 10 * 12 * 16  # fp32 FMAs
            assert _C.peak_multiply_adds(True, 10) == threads * 10 * 12 * 32  # bf16 pairs
    if "avx2" in specdec_inductor.runnable_isas():
        with specdec_inductor.forced_isa("avx2"):  # 8-lane fp32 FMAs, bf16 widened
            assert _C.peak_multiply_adds(False, 10) == threads * 10 * 12 * 8
            assert _C.peak_multiply_adds(True, 10) == threads * 10 * 12 * 8
    with specdec_inductor.forced_isa("portable"):
        assert _C.peak_multiply_adds(False, 10) == 0
        assert _C.peak_probe_isa(True) == ""


def test_int8_peak_probe_counts_vpdpbusd_where_the_int8_kernels_use_vnni():
    """bench_quant's INT8 bound: 12 vpdpbusd (64 multiply-adds each) a step on every thread,
    wherever the INT8 kernels take the VNNI path, and nothing where they do not."""
    from specdec_inductor import _C
    from specdec_inductor.ops.quant import int8_path
    threads = torch.get_num_threads()
    if int8_path() == "avx512":
        assert _C.peak_int8_multiply_adds(10) == threads * 10 * 12 * 64
    else:
        assert _C.peak_int8_multiply_adds(10) == 0
    for isa in ("avx2", "portable"):
        if isa in specdec_inductor.runnable_isas():
            with specdec_inductor.forced_isa(isa):
                assert _C.peak_int8_multiply_adds(10) == 0


# ---- C++ exceptions across the extension boundary (conftest.py's cpp_raises marker) ------------

def test_cpp_exceptions_reach_python_here():
    """This build's throws reach Python (the probe says so, and so does a real throw)."""
    assert specdec_inductor.cpp_exceptions_work(), specdec_inductor.cpp_exceptions_cause()
    with pytest.raises(ValueError, match="specdec exception probe"):
        torch.ops.specdec._probe_throw()


def test_exception_probe_runs_and_is_cached(tmp_path):
    """A fresh probe (empty cache) succeeds and writes the answer keyed by the library's path,
    mtime and size; a stored False answer is then honoured without probing: importing warns
    with its cause."""
    from specdec_inductor import _library
    code = "import specdec_inductor as s; print(s.cpp_exceptions_work(), s.cpp_exceptions_cause())"
    env = {k: v for k, v in os.environ.items() if k != "SPECDEC_CPP_EXCEPTIONS"}
    env["XDG_CACHE_HOME"] = str(tmp_path)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("True"), run.stdout
    cache_file = tmp_path / "specdec_inductor" / "cpp_exceptions.json"
    cache = json.loads(cache_file.read_text())
    library = os.path.realpath(_library._C.__file__)
    st = os.stat(library)
    key = f"{library}:{st.st_mtime_ns}:{st.st_size}"
    assert cache[key][0] is True
    cache[key] = [False, "a stored probe failure"]
    cache_file.write_text(json.dumps(cache))
    run = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("False a stored probe failure"), run.stdout
    assert "RuntimeWarning" in run.stderr and "a stored probe failure" in run.stderr


def test_cpp_raises_tests_skip_where_exceptions_abort():
    """With SPECDEC_CPP_EXCEPTIONS=0 (as the probe answers on a broken toolchain) the tests that
    make the library throw are skipped with the cause, the others still run."""
    env = {**os.environ, "SPECDEC_CPP_EXCEPTIONS": "0"}
    tests = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         os.path.join(tests, "test_isa.py") + "::test_isa_selection_errors_raise",
         os.path.join(tests, "test_isa.py") + "::test_default_path_is_best_runnable"],
        env=env, capture_output=True, text=True, cwd=os.path.dirname(tests))
    assert "1 passed, 1 skipped" in run.stdout, run.stdout + run.stderr
    assert "SPECDEC_CPP_EXCEPTIONS=0" in run.stdout


def test_isa_selection_errors_raise():
    """A bad path name raises through pybind11 (named for the cpp_raises rule in conftest.py)."""
    with pytest.raises(ValueError):
        specdec_inductor.set_active_isa("no-such-path")
