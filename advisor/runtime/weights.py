"""Lay out the weights (and biases) of merged linears back to back, once, at apply time.

After `arrange(model, ["…q_proj.weight", "…k_proj.weight", "…v_proj.weight"])` the three
parameters are row slices of one (ΣN, K) buffer, so `merged_linear` reads them as one
matrix with no per-call copy and no second copy of the weights; biases (N_i,) the same way,
as slices of one (ΣN,) vector. Values are unchanged, so the original model computes
exactly what it did.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from advisor.kernels.merged_linear import adjacent_view


def arrange(model: torch.nn.Module, fqns: tuple[str, ...]) -> bool:
    """Make the named parameters (all 2-D of one width, or all 1-D) adjacent in memory;
    False if they cannot be."""
    with unset_fake_temporarily():  # may be called from inside a compiler's fake mode
        return _arrange(model, fqns)


def _arrange(model: torch.nn.Module, fqns: tuple[str, ...]) -> bool:
    try:
        params = [model.get_parameter(name) for name in fqns]
    except AttributeError:
        return False
    if adjacent_view(params) is not None:
        return True
    first = params[0]
    if any(p.dim() not in (1, 2) or p.shape[1:] != first.shape[1:] or p.dtype != first.dtype
           or p.device != first.device for p in params):
        return False
    with torch.no_grad():
        buffer = torch.cat([p.detach() for p in params], dim=0)  # (ΣN, K) or (ΣN,)
        start = 0
        for p in params:
            rows = p.shape[0]
            p.data = buffer[start:start + rows]
            start += rows
    return True
