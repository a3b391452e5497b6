"""Gate and up projections + SwiGLU/GeGLU as one GEMM: act(x·W_gᵀ)·(x·W_uᵀ).

Fuses what a model writes as `act(gate_proj(x)) * up_proj(x)` (two nn.Linear, no bias):
unfused, two GEMMs write their (M, N) outputs and the activation·mul reads both and writes
(M, N) again; fused, the (M, 2N) intermediate never reaches HBM — saves 4·M·N·elt bytes
and 3 launches per site (gate GEMM, up GEMM, act, mul → one).

This module adapts `gemm.py`'s merged-weight kernel (`gemm_swiglu`, [W_g; W_u] (2N, K)) to
the two separate parameters a model holds: `apply` lays them out back to back once
(`runtime.weights.arrange`), so the merged weight is a zero-copy view (`merged_weight`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from advisor.kernels.gemm import (
    SPACE,
    _problem,
    _use_triton,
    fused_launches,
    launch_gemm_swiglu,
    reference_swiglu,
    spills_gemm_swiglu,
    unfused_swiglu,
)
from advisor.kernels.merged_linear import merged_weight
from advisor.kernels.registry import KernelSpec, get, register
from advisor.kernels.space import decode


def reference(x: torch.Tensor, weights: list[torch.Tensor], activation: str) -> torch.Tensor:
    """x (..., K), weights [W_g (N, K), W_u (N, K)] -> (..., N), fp32 math, one cast."""
    return reference_swiglu(x, torch.cat(weights, dim=0), activation)


def launch(x: torch.Tensor, weights: list[torch.Tensor], activation: str,
           config: Mapping[str, int] | None = None) -> torch.Tensor:
    return launch_gemm_swiglu(x, merged_weight(weights), activation, config)


@torch.library.custom_op("advisor::linear_swiglu", mutates_args=(),
                         schema="(Tensor x, Tensor[] weights, str activation, str config) -> Tensor")
def linear_swiglu(x, weights, activation, config):
    if _use_triton(x):
        return launch(x, list(weights), activation, decode(config))
    return reference(x, list(weights), activation).contiguous()


@linear_swiglu.register_fake
def _(x, weights, activation, config):
    return x.new_empty((*x.shape[:-1], weights[0].shape[0]))


def _split(inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """gemm_swiglu's (x, w_gu, act) -> (x, [W_g, W_u] as adjacent views of w_gu, act)."""
    x, w_gu, act = inputs
    n = w_gu.shape[0] // 2
    return x, [w_gu[:n], w_gu[n:]], act


_base = get("gemm_swiglu")
register(KernelSpec(
    name="linear_swiglu", reference=reference, launch=launch, space=SPACE,
    make_inputs=lambda dims, dtype, device, gen: _split(_base.make_inputs(dims, dtype, device, gen)),
    problem=lambda x, weights, act: {**_problem(x, weights[0]), "gated": 1},  # N = W_g rows
    bytes_moved=lambda x, weights, act: _base.bytes_moved(x, merged_weight(weights), act),
    test_dims=_base.test_dims, bench_dims=_base.bench_dims, unfused_launches=4, matrix_kernel=True,
    launches=fused_launches,
    spills=lambda x, weights, act, config=None: spills_gemm_swiglu(x, merged_weight(weights), act, config),
    usable=lambda x, *_: _use_triton(x),
    unfused=lambda x, weights, act: unfused_swiglu(x, torch.cat(weights, dim=0), act),
))
