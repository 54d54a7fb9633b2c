"""Loads the compiled `specdec_inductor._C` library and exposes its ISA queries.

Paths: "portable" (always built), "avx2" (AVX2 + FMA + F16C), "avx512" (AVX-512 F/BW/VL/DQ +
avx512_bf16), "amx" (AVX-512 plus AMX tiles); each implies the ones before it. The active path
is the best the CPU, OS and build support, unless the
environment variable SPECDEC_ISA forces one; kernel_path_counts() tells which path each op ran.
"""
import contextlib
import functools
import json
import os
import subprocess
import sys
import warnings

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


# ---- can C++ exceptions reach Python? ---------------------------------------------------------
# Every bad-input check of the ops is a C++ exception (TORCH_CHECK) that the dispatcher turns into
# a Python error. With some compiler / torch pairings (seen: Ubuntu g++ 13.3 with torch
# 2.11.0+cu130) any exception thrown by an extension aborts the process instead. The probe makes
# the library throw -- through pybind11 (set_active_isa of a bad name) and through the dispatcher
# (the op specdec::_probe_throw, which only raises) -- in a subprocess, once per build:
# the answer is cached on disk keyed by the library's path, mtime and size
# ($XDG_CACHE_HOME/specdec_inductor/cpp_exceptions.json, or ~/.cache/...), so later imports read
# one small file. SPECDEC_CPP_EXCEPTIONS=1 / =0 states the answer and skips the probe.

_PROBE_SCRIPT = """
import importlib.machinery, importlib.util, sys
import torch
path = sys.argv[1]
loader = importlib.machinery.ExtensionFileLoader("specdec_inductor._C", path)
spec = importlib.util.spec_from_file_location("specdec_inductor._C", path, loader=loader)
module = importlib.util.module_from_spec(spec)
loader.exec_module(module)
try:  # through pybind11 (the ISA functions)
    module.set_active_isa("no-such-path")
    sys.exit(4)
except ValueError:
    pass
if not hasattr(torch.ops.specdec, "_probe_throw"):
    sys.exit(0)  # a library older than the op: the pybind11 throw above is the probe
try:  # through the dispatcher, like every op's bad-input checks
    torch.ops.specdec._probe_throw()
except ValueError as exc:
    sys.exit(0 if "specdec exception probe" in str(exc) else 3)
sys.exit(4)
"""


def _probe_cache_file() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "specdec_inductor", "cpp_exceptions.json")


def _run_exception_probe(library: str) -> tuple:
    """(works, cause): run specdec::_probe_throw in a fresh interpreter that loads `library`."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE_SCRIPT, library], env=env,
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False, "the probe process did not finish in 120 s"
    if proc.returncode == 0:
        return True, "exceptions thrown by the library reached Python as ValueError"
    tail = (proc.stderr or "").strip().splitlines()[-3:]
    if proc.returncode < 0:
        cause = f"the process died of signal {-proc.returncode} when the op threw"
    else:
        cause = f"the probe process exited with status {proc.returncode}"
    return False, cause + (": " + " | ".join(tail) if tail else "")


@functools.lru_cache(maxsize=None)
def _exception_probe() -> tuple:
    forced = os.environ.get("SPECDEC_CPP_EXCEPTIONS")
    if forced in ("0", "1"):
        return forced == "1", f"stated by SPECDEC_CPP_EXCEPTIONS={forced}"
    library = os.path.realpath(_C.__file__)
    st = os.stat(library)
    key = f"{library}:{st.st_mtime_ns}:{st.st_size}"
    cache_file = _probe_cache_file()
    try:
        with open(cache_file) as f:
            cache = json.load(f)
    except (OSError, ValueError):
        cache = {}
    if isinstance(cache.get(key), list) and len(cache[key]) == 2:
        return bool(cache[key][0]), str(cache[key][1])
    works, cause = _run_exception_probe(library)
    cache = {k: v for k, v in cache.items() if not k.startswith(library + ":")}  # stale builds
    cache[key] = [works, cause]
    try:  # best effort: an unwritable cache only costs a probe per process
        os.makedirs(os.path.dirname(cache_file), exist_ok=True)
        tmp = f"{cache_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cache, f, indent=1)
        os.replace(tmp, cache_file)
    except OSError:
        pass
    return works, cause


def cpp_exceptions_work() -> bool:
    """True when an error raised inside this library's C++ code (a bad input to any op) reaches
    Python as an exception; False when it would abort the process (a compiler / torch pairing
    that breaks exception unwinding across the extension). Probed once per build, cached."""
    return _exception_probe()[0]


def cpp_exceptions_cause() -> str:
    """How cpp_exceptions_work() got its answer (the probe's outcome, or the environment)."""
    return _exception_probe()[1]


def _warn_if_exceptions_abort() -> None:
    if not cpp_exceptions_work():
        warnings.warn(
            "specdec_inductor: C++ exceptions thrown by its extension do not reach Python with "
            f"this build ({cpp_exceptions_cause()}): a bad input to a specdec op will abort the "
            "process instead of raising. Seen with Ubuntu g++ 13.3 and torch 2.11.0+cu130; "
            "rebuilding with the compiler torch was built with may help. Valid inputs are "
            "unaffected.", RuntimeWarning, stacklevel=3)


# Validate SPECDEC_ISA at import time so a typo fails loudly, not at the first kernel call.
if os.environ.get("SPECDEC_ISA"):
    active_isa()
_warn_if_exceptions_abort()  # warns once per process (the answer is cached)
