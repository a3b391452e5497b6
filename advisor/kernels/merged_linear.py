"""Horizontal merge of linears that read the same input (Q/K/V, gate/up): one GEMM.

Unfused: n GEMMs, each reading x (M×K) and its W_i (N_i×K). Merged: one GEMM over
W = [W_1; …; W_n] ((ΣN_i)×K): x is read once instead of n times (saves (n−1)·M·K·elt bytes)
and n−1 launches go away. There is no Triton kernel here: cuBLAS runs the merged GEMM.

No per-call copies and no doubled weight memory: at apply time `runtime.weights` moves
each group's weights (and biases, where every member has one: Qwen2's Q/K/V) into one
buffer and re-points the parameters as row slices of it, so here the merged W and b are
zero-copy views (`as_strided`) over adjacent slices. Tensors that are not adjacent (e.g.
apply was bypassed, or only some members have a bias) still compute correctly through
`torch.cat`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from advisor.errors import KernelInputError

COPIES = 0  # per-call weight concatenations (diagnostics)


def reference(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor:
    """x (M, K), W_i (N_i, K), b_i (N_i,) -> (M, ΣN_i) = [x·W_1ᵀ + b_1 | … ]."""
    return torch.cat([F.linear(x, w, b) for w, b in zip(weights, biases)], dim=-1)


def adjacent_view(tensors: list[Tensor]) -> Tensor | None:
    """The (ΣN_i, *rest) tensor that weights (N_i, K) or biases (N_i,) are row slices of,
    without copying, if they are contiguous and stored back to back in one storage; else
    None."""
    first = tensors[0]
    rest = tuple(first.shape[1:])
    if not all(t.is_contiguous() and t.dim() in (1, 2) and tuple(t.shape[1:]) == rest for t in tensors):
        return None
    offset = first.storage_offset()
    storage = first.untyped_storage().data_ptr()
    for t in tensors:
        if t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(int(t.shape[0]) for t in tensors)
    strides = (rest[0], 1) if rest else (1,)
    return first.as_strided((rows, *rest), strides, first.storage_offset())


def merged_weight(weights: list[Tensor]) -> Tensor:
    """The merged (ΣN, K) weight (or (ΣN,) bias): a view when adjacent, else a per-call
    copy (counted in `COPIES`; expected only on the call during which apply() lays the
    tensors out). One tensor is itself, in whatever strides it has (GPT-2's (K, N) Conv1D
    weight read as its transposed (N, K) view)."""
    global COPIES
    if len(weights) == 1:
        return weights[0]
    view = adjacent_view(weights)
    if view is not None:
        return view
    COPIES += 1
    return torch.cat(weights, dim=0)


def merged_bias(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor | None:
    """The merged (ΣN,) bias; None when no member has one; members without one add zeros
    (a per-call copy: apply lays out only complete sets)."""
    if len(biases) != len(weights):
        raise KernelInputError(f"biases: {len(biases)} for {len(weights)} weights (one each, or None)")
    if all(b is None for b in biases):
        return None
    if all(b is not None for b in biases):
        return merged_weight(biases)
    return torch.cat([b if b is not None else x.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])


def merged_linear_impl(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor:
    """x (M, K) -> (M, ΣN_i): one GEMM over the merged weight (and bias)."""
    return F.linear(x, merged_weight(weights), merged_bias(x, weights, biases))


@torch.library.custom_op("advisor::merged_linear", mutates_args=())
def merged_linear(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor:
    return merged_linear_impl(x, weights, biases)


@merged_linear.register_fake
def _(x: Tensor, weights: list[Tensor], biases: list[Tensor | None]) -> Tensor:
    rows = sum(w.shape[0] for w in weights)
    return x.new_empty((*x.shape[:-1], rows))
