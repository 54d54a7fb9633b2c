"""ISA path selection: detection, the SPECDEC_ISA override, and the per-path counters."""
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


@pytest.mark.skipif(specdec_inductor.detected_isa() == "portable", reason="CPU without AVX-512")
def test_avx512_path_really_runs_here():
    assert "avx512" in specdec_inductor.built_isas(), "compiler could not build the AVX-512 units"
    specdec_inductor.reset_kernel_path_counts()
    with specdec_inductor.forced_isa("avx512"):
        ops.compact_accepted_cache_locs(torch.arange(10), torch.tensor([1, -1, 3]))
    assert specdec_inductor.kernel_path_counts() == {"compact_accepted_cache_locs:avx512": 1}


def test_peak_probe_counts_its_multiply_adds_and_needs_avx512():
    from specdec_inductor import _C
    threads = torch.get_num_threads()
    if "avx512" in specdec_inductor.runnable_isas():
        with specdec_inductor.forced_isa("avx512"):
            assert _C.peak_multiply_adds(False, 10) == threads * 10 * 12 * 16  # fp32 FMAs
            assert _C.peak_multiply_adds(True, 10) == threads * 10 * 12 * 32  # bf16 pairs
    with specdec_inductor.forced_isa("portable"):
        assert _C.peak_multiply_adds(False, 10) == 0
