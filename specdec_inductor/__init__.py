"""specdec_inductor: speculative decoding for LLMs on the CPU, as PyTorch custom ops that
torch.compile / Inductor can trace and compile.

Importing the package loads the C++ library (registering every `torch.ops.specdec` op) and the
fake kernels; a load failure raises with the build command instead of leaving the ops missing.
"""
from specdec_inductor._library import (  # noqa: F401  (re-exported API)
    active_isa,
    built_isas,
    cpp_exceptions_cause,
    cpp_exceptions_work,
    detected_isa,
    forced_isa,
    kernel_path_counts,
    reset_kernel_path_counts,
    runnable_isas,
    set_active_isa,
)
from specdec_inductor import ops  # noqa: F401  (registers fake kernels)

__version__ = "0.1.0"
