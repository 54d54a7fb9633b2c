"""Loads the compiled `specdec_inductor._C` library and exposes its ISA queries.

Paths: "portable" (always built), "avx2" (AVX2 + FMA + F16C), "avx512" (AVX-512 F/BW/VL/DQ +
avx512_bf16), "amx" (AVX-512 plus AMX tiles); each implies the ones before it. The active path
is the best the CPU, OS and build support, unless the
environment variable SPECDEC_ISA forces one; kernel_path_counts() tells which path each op ran.
"""
import contextlib
import os

import torch  # noqa: F401  (loads libc10 / libtorch before the extension needs them)

BUILD_COMMAND = "pip install --no-build-isolation -e .  (from the repository root, torch installed)"

try:
    from specdec_inductor import _C
except ImportError as exc:  # never swallowed: the ops would silently be missing
    raise ImportError(
        f"specdec_inductor: the C++ extension failed to load ({exc}). Build it with: "
        f"{BUILD_COMMAND}; or run `bash scripts/setup.sh`."
    ) from exc


def detected_isa() -> str:
    """Best path this CPU and OS support: "portable", "avx2", "avx512" or "amx"."""
    return _C.detected_isa()


def built_isas() -> list:
    """Paths compiled into this build (the compiler may lack AMX support)."""
    return list(_C.built_isas())


_ORDER = ("portable", "avx2", "avx512", "amx")


def runnable_isas() -> list:
    """Paths this machine can run with this build (what tests iterate over)."""
    limit = _ORDER.index(detected_isa())
    return [p for p in built_isas() if _ORDER.index(p) <= limit]


def active_isa() -> str:
    """Path the kernels use now."""
    return _C.active_isa()


def set_active_isa(name: str) -> None:
    """Force a path for every kernel; raises ValueError if it cannot run here."""
    _C.set_active_isa(name)


@contextlib.contextmanager
def forced_isa(name: str):
    """Run a block with kernels forced onto one path, then restore the previous one."""
    previous = active_isa()
    set_active_isa(name)
    try:
        yield
    finally:
        set_active_isa(previous)


def kernel_path_counts() -> dict:
    """Calls per "<op>:<path>" (e.g. "compact_accepted_cache_locs:avx512") since the last reset."""
    return dict(_C.kernel_path_counts())


def reset_kernel_path_counts() -> None:
    _C.reset_kernel_path_counts()


# Validate SPECDEC_ISA at import time so a typo fails loudly, not at the first kernel call.
if os.environ.get("SPECDEC_ISA"):
    active_isa()
