"""skinny_linear: `F.linear` for the few rows of a decode or verify step, streaming each weight
row once at memory bandwidth (csrc/linear.cpp). The `specdec` backend's graph pass
(lowerings/skinny_linear.py) puts it in place of `mm`/`addmm` with a transposed weight."""
from typing import Optional

import torch
from torch import Tensor

import specdec_inductor._library  # noqa: F401  (loads the schemas before register_fake)


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
