"""RMSNorm folded into the gate/up projections and SwiGLU into their epilogue, one GEMM:
act(n·W_gᵀ)·(n·W_uᵀ) with n = rms_norm(x).

Fuses a Llama MLP's front half, `act(gate_proj(norm(h))) * up_proj(norm(h))`: unfused, the
norm writes n (M·K·elt), two GEMMs read it and write (M, N) each, and act·mul reads both and
writes (M, N) — about 12 eager launches. `rmsnorm_linear` alone still leaves the (M, 2N)
projection in HBM and the act·mul launch; here the normalised x and the projections never
reach HBM: one launch (two with split-K). At one token that is the norm's pre-pass-free GEMV
(`gemm.py` `_gemv_kernel`, NORM and GATED together).

The weights are the model's two parameters, laid out back to back once at apply time
(`runtime.weights.arrange`), so `merged_weight` is a zero-copy (2N, K) view.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from advisor.kernels.gemm import (
    _ACT_NAMES,
    EPS,
    SPACE,
    _bytes,
    _flops,
    _problem,
    _use_triton,
    _x_w,
    fused_launches,
    launch_gemm_rmsnorm_swiglu,
    reference_rmsnorm_swiglu,
    spills_gemm_rmsnorm_swiglu,
    unfused_rmsnorm_swiglu,
)
from advisor.kernels.merged_linear import merged_weight
from advisor.kernels.registry import KernelSpec, register
from advisor.kernels.space import decode
from advisor.kernels.testing import randn_nonzero


def reference(x: torch.Tensor, norm_w: torch.Tensor, weights: list[torch.Tensor], eps: float,
              weight_offset: float, activation: str) -> torch.Tensor:
    """x (..., K), norm_w (K,), weights [W_g (N, K), W_u (N, K)] -> (..., N); fp32 inside."""
    return reference_rmsnorm_swiglu(x, norm_w, torch.cat(weights, dim=0), eps, weight_offset, activation)


def launch(x: torch.Tensor, norm_w: torch.Tensor, weights: list[torch.Tensor], eps: float,
           weight_offset: float, activation: str, config: Mapping[str, int] | None = None) -> torch.Tensor:
    return launch_gemm_rmsnorm_swiglu(x, norm_w, merged_weight(weights), eps, weight_offset,
                                      activation, config)


@torch.library.custom_op(
    "advisor::rmsnorm_swiglu", mutates_args=(),
    schema="(Tensor x, Tensor norm_w, Tensor[] weights, float eps, float weight_offset, "
           "str activation, str config) -> Tensor")
def rmsnorm_swiglu(x, norm_w, weights, eps, weight_offset, activation, config):
    if _use_triton(x):
        return launch(x, norm_w, list(weights), eps, weight_offset, activation, decode(config))
    return reference(x, norm_w, list(weights), eps, weight_offset, activation).contiguous()


@rmsnorm_swiglu.register_fake
def _(x, norm_w, weights, eps, weight_offset, activation, config):
    return x.new_empty((*x.shape[:-1], weights[0].shape[0]))


def _make_inputs(dims, dtype, device, generator) -> tuple[Any, ...]:
    """x (M, K), norm_w (K,), [W_g, W_u] as adjacent views of one (2N, K) tensor."""
    x, w_gu = _x_w(dims, 2 * dims["N"], dtype, device, generator)
    norm_w = randn_nonzero((dims["K"],), dtype, device, generator, 0.5)
    n = dims["N"]
    return (x, norm_w, [w_gu[:n], w_gu[n:]], EPS, float(dims.get("weight_offset", 0)),
            _ACT_NAMES[dims.get("act", 0)])


register(KernelSpec(
    name="rmsnorm_swiglu", reference=reference, launch=launch, space=SPACE,
    make_inputs=_make_inputs,
    problem=lambda x, norm_w, weights, *_: _problem(x, merged_weight(weights), gated=True),
    bytes_moved=lambda x, norm_w, weights, *_: _bytes(weights[0].shape[0], x, norm_w, merged_weight(weights)),
    flops=lambda x, norm_w, weights, *_: _flops(x, merged_weight(weights)),
    test_dims=({"M": 3, "K": 24, "N": 8}, {"M": 1, "K": 40, "N": 40, "act": 1},
               {"M": 17, "K": 40, "N": 24, "weight_offset": 1}),
    bench_dims=lambda tokens: {"M": tokens, "K": 4096, "N": 14336},  # Llama-3-8B norm -> gate/up
    unfused_launches=12,  # eager RMSNorm 8 (norm.py), gate GEMM, up GEMM, act, mul
    launches=lambda p: fused_launches(p, "rms"),
    matrix_kernel=True, usable=lambda x, *_: _use_triton(x),
    spills=lambda x, norm_w, weights, eps, off, act, config=None: spills_gemm_rmsnorm_swiglu(
        x, norm_w, merged_weight(weights), eps, off, act, config),
    unfused=lambda x, norm_w, weights, eps, off, act: unfused_rmsnorm_swiglu(
        x, norm_w, torch.cat(weights), eps, off, act),
))
