"""Horizontal merge of linears that read the same input (Q/K/V, gate/up): one GEMM.

Unfused: n GEMMs, each reading x (M×K) and its W_i (N_i×K). Merged: one GEMM over
W = [W_1; …; W_n] ((ΣN_i)×K): x is read once instead of n times (saves (n−1)·M·K·elt bytes)
and n−1 launches go away. There is no Triton kernel here: cuBLAS runs the merged GEMM.

No per-call copies and no doubled weight memory: at apply time `runtime.weights` moves
each group's weights into one buffer and re-points the parameters as row slices of it, so
here the merged W is a zero-copy view (`as_strided`) over adjacent slices. Weights that are
not adjacent (e.g. apply was bypassed) still compute correctly through `torch.cat`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

COPIES = 0  # per-call weight concatenations (diagnostics)


def reference(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor:
    """x (M, K), W_i (N_i, K), b_i (N_i,) -> (M, ΣN_i) = [x·W_1ᵀ + b_1 | … ]."""
    return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)


def adjacent_view(weights: list[Tensor]) -> Tensor | None:
    """The (ΣN_i, K) tensor the weights are row slices of, without copying, if they are
    contiguous and stored back to back in one storage; else None."""
    first = weights[0]
    if not all(w.is_contiguous() and w.dim() == 2 for w in weights):
        return None
    k = first.shape[1]
    offset = first.storage_offset()
    storage = first.untyped_storage().data_ptr()
    for w in weights:
        if w.untyped_storage().data_ptr() != storage or w.storage_offset() != offset or w.shape[1] != k:
            return None
        offset += w.numel()
    rows = sum(int(w.shape[0]) for w in weights)
    return first.as_strided((rows, k), (k, 1), first.storage_offset())


def merged_weight(weights: list[Tensor]) -> Tensor:
    """The merged (ΣN, K) weight: a view when adjacent, else a per-call copy (counted in
    `COPIES`; expected only on the call during which apply() lays the weights out)."""
    global COPIES
    view = adjacent_view(weights)
    if view is not None:
        return view
    COPIES += 1
    return torch.cat(weights, dim=0)


def merged_linear_impl(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor:
    """x (M, K) -> (M, ΣN_i): one GEMM over the merged weight."""
    w = merged_weight(weights)
    b = None
    if any(bi is not None for bi in biases):
        b = torch.cat([bi if bi is not None else x.new_zeros(wi.shape[0]) for wi, bi in zip(weights, biases)])
    return F.linear(x, w, b)


@torch.library.custom_op("advisor::merged_linear", mutates_args=())
def merged_linear(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor:
    return merged_linear_impl(x, weights, biases)


@merged_linear.register_fake
def _(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor:
    rows = sum(w.shape[0] for w in weights)
    return x.new_empty((*x.shape[:-1], rows))
