"""skinny_linear: `F.linear` for the few rows of a decode or verify step, streaming each weight
row once at memory bandwidth (csrc/linear.cpp). The `specdec` backend's graph pass
(lowerings/skinny_linear.py) puts it in place of `mm`/`addmm` with a transposed weight.

Packed weights: a weight registered with `register_packed_weight` (the backend registers the
2-D parameters of every graph it compiles; option "specdec.pack_weights") is copied once, on
its first skinny_linear call, into a blocked layout that the AVX-512 path reads with no
horizontal sums: at 8 rows (a verify step) it runs about as fast as one row, where the plain
row kernel takes ~2x (benchmarks/bench_linear.py). The copy costs the weight's size again in
memory. An in-place update through the weight (its version counter) re-packs on the next
call; a write that bypasses the counter (`.data`, inference tensors) needs
`release_packed_weight` first. Results are those of the plain kernel up to summation order.
"""
from typing import Dict, Optional, Sequence

import torch
from torch import Tensor

import specdec_inductor._library  # noqa: F401  (loads the schemas before register_fake)
from specdec_inductor import _C  # the packed-weight registry (csrc/linear.cpp)


def skinny_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """y = x @ weight.T (+ bias), as `torch.nn.functional.linear`.

    Args: x [..., K] float32 or bfloat16 (any strides; it is copied dense, it is small);
    weight [N, K] of x's dtype, rows dense (stride(1) == 1; another layout is copied every call
    and counted as "skinny_linear_weight_copy" in kernel_path_counts()); bias [N] or None.
    Returns y [..., N] of x's dtype, accumulated in fp32 (bf16 rounded once, at the end).
    """
    return torch.ops.specdec.skinny_linear.default(x, weight, bias)


@torch.library.register_fake("specdec::skinny_linear")
def _(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def skinny_linear_cat(x: Tensor, weights: Sequence[Tensor],
                      biases: Optional[Sequence[Optional[Tensor]]] = None) -> Tensor:
    """`torch.cat([skinny_linear(x, w, b) for w, b in zip(weights, biases)], -1)` in one call
    (q/k/v, gate/up): y [..., sum N_i]. Registered weights whose N_i are multiples of 16 (the
    last may be any) are packed together once and streamed as one weight -- one thread fork and
    one stream ramp-up instead of one per weight; otherwise each weight runs as skinny_linear,
    into its columns. The `specdec` backend's graph pass (lowerings/skinny_linear.py) groups
    the skinny_linear calls that share their x.

    Args: x as skinny_linear; weights: one or more [N_i, K] of x's dtype; biases: None, or one
    entry (a [N_i] tensor or None) per weight.
    """
    weights = list(weights)
    biases = [None] * len(weights) if biases is None else list(biases)
    return torch.ops.specdec.skinny_linear_cat.default(x, weights, biases)


@torch.library.register_fake("specdec::skinny_linear_cat")
def _(x, weights, biases):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def register_packed_weight(weight: Tensor) -> None:
    """Let skinny_linear pack `weight` ([N, K] float32/bfloat16 CPU, any strides) on its first
    call and use the packed copy from then on. Idempotent; the entry goes when `weight` is
    freed."""
    _C.linear_pack_register(weight)


def release_packed_weight(weight: Tensor) -> bool:
    """Forget `weight` and free its packed copy; False if it was not registered."""
    return _C.linear_pack_release(weight)


def clear_packed_weights() -> None:
    """Forget every registered weight and free every packed copy."""
    _C.linear_pack_clear()


def packed_weight_stats() -> Dict[str, int]:
    """{"registered": live registered weights, "packed": how many have a copy, "groups": how
    many weight groups of skinny_linear_cat have one, "bytes": the size of all copies}."""
    return dict(_C.linear_pack_stats())
