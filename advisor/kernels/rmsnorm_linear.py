"""RMSNorm folded into the projections that read it: rms_norm(x)·[W_1; …; W_n]ᵀ in one GEMM.

Fuses what a model writes as `q, k, v = (p(norm(x)) for p in (q_proj, k_proj, v_proj))`
(or one projection): unfused, the norm writes the normalised x (M·K·elt) and each GEMM reads
it back (n·M·K·elt) over ~8 eager launches for the norm and n GEMMs; fused, a per-row scale
pre-pass (M floats) and one GEMM whose prologue scales x by the norm weight and whose
epilogue applies the row scale — the normalised x never reaches HBM.

This module adapts `gemm.py`'s `gemm_rmsnorm` to the separate weights a model holds: `apply`
lays them out back to back once, so the merged weight is a zero-copy view (`merged_weight`);
biases likewise, added after the row scale (Qwen2's Q/K/V have them).
The output is (..., ΣN_i); the runtime slices it per projection.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from advisor.kernels.gemm import (
    _problem,
    _use_triton,
    fused_launches,
    launch_gemm_rmsnorm,
    reference_rmsnorm,
    spills_gemm_rmsnorm,
    unfused_rmsnorm,
)
from advisor.kernels.merged_linear import merged_bias, merged_weight
from advisor.kernels.registry import KernelSpec, get, register
from advisor.kernels.space import decode
from advisor.kernels.testing import randn_nonzero

Biases = list[torch.Tensor | None]


def reference(x: torch.Tensor, norm_w: torch.Tensor, weights: list[torch.Tensor], biases: Biases,
              eps: float, weight_offset: float) -> torch.Tensor:
    """x (..., K) -> (..., ΣN_i) in fp32 with one cast (normalised x not rounded); each
    projection's bias (or none) added after the norm's row scale."""
    return reference_rmsnorm(x, norm_w, torch.cat(weights, dim=0), eps, weight_offset,
                             merged_bias(x, weights, biases))


def launch(x: torch.Tensor, norm_w: torch.Tensor, weights: list[torch.Tensor], biases: Biases,
           eps: float, weight_offset: float, config: Mapping[str, int] | None = None) -> torch.Tensor:
    return launch_gemm_rmsnorm(x, norm_w, merged_weight(weights), eps, weight_offset, config,
                               merged_bias(x, weights, biases))


@torch.library.custom_op(
    "advisor::rmsnorm_linear", mutates_args=(),
    schema="(Tensor x, Tensor norm_w, Tensor[] weights, Tensor?[] biases, float eps, float weight_offset, "
           "str config) -> Tensor")
def rmsnorm_linear(x, norm_w, weights, biases, eps, weight_offset, config):
    if _use_triton(x):
        return launch(x, norm_w, list(weights), list(biases), eps, weight_offset, decode(config))
    return reference(x, norm_w, list(weights), list(biases), eps, weight_offset).contiguous()


@rmsnorm_linear.register_fake
def _(x, norm_w, weights, biases, eps, weight_offset, config):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


def _listed(inputs: tuple[Any, ...], bias: torch.Tensor | None) -> tuple[Any, ...]:
    """gemm_rmsnorm's (x, norm_w, w, eps, off) -> (x, norm_w, [w split in 3 adjacent views],
    [bias split alike, or Nones], eps, off)."""
    x, norm_w, w, eps, off = inputs
    cut = [0, w.shape[0] // 2, 3 * w.shape[0] // 4, w.shape[0]]  # like Q (half), K, V
    spans = [(a, b) for a, b in zip(cut, cut[1:]) if b > a]
    return (x, norm_w, [w[a:b] for a, b in spans], [None if bias is None else bias[a:b] for a, b in spans],
            eps, off)


def _make_inputs(dims, dtype, device, gen) -> tuple[Any, ...]:
    """gemm_rmsnorm's inputs as three projections, with biases (Qwen2's Q/K/V) if dims["bias"]."""
    inputs = _base.make_inputs(dims, dtype, device, gen)
    bias = randn_nonzero((dims["N"],), dtype, device, gen, 0.5) if dims.get("bias") else None
    return _listed(inputs, bias)


def _merged(x, norm_w, weights, biases, eps, off) -> tuple[tuple[Any, ...], torch.Tensor | None]:
    """((x, norm_w, W (ΣN, K), eps, off): what gemm_rmsnorm reads, the merged bias or None)."""
    return (x, norm_w, merged_weight(weights), eps, off), merged_bias(x, weights, biases)


def _bytes_moved(*inputs: Any) -> int:
    base, bias = _merged(*inputs)
    return _base.bytes_moved(*base) + (0 if bias is None else bias.numel() * bias.element_size())


def _spills(*inputs: Any, config=None) -> int | None:
    base, bias = _merged(*inputs)
    return spills_gemm_rmsnorm(*base, config, bias)


_base = get("gemm_rmsnorm")
register(KernelSpec(
    name="rmsnorm_linear", reference=reference, launch=launch, space=_base.space, make_inputs=_make_inputs,
    problem=lambda x, norm_w, weights, *_: {**_problem(x, weights[0]),
                                            "N": sum(int(w.shape[0]) for w in weights)},
    bytes_moved=_bytes_moved, spills=_spills,
    test_dims=(*_base.test_dims, {"M": 1, "K": 40, "N": 40, "bias": 1},
               {"M": 17, "K": 24, "N": 8, "bias": 1}),
    bench_dims=_base.bench_dims, unfused_launches=11, matrix_kernel=True,
    launches=lambda p: fused_launches(p, "rms"),
    usable=lambda x, *_: _use_triton(x),
    unfused=lambda x, norm_w, weights, biases, eps, off: unfused_rmsnorm(
        x, norm_w, torch.cat(weights), eps, off, merged_bias(x, weights, biases)),
))
