"""LayerNorm folded into the projections that read it: layer_norm(x)·[W_1; …; W_n]ᵀ + [b_1 | …].

Fuses what LayerNorm models (OPT, GPT-NeoX, Phi, Falcon, BLOOM, StableLM, …) write as
`q, k, v = (p(ln(x)) for p in (q_proj, k_proj, v_proj))` or `fc1(ln(x))`. Unfused: the
norm's launch writes x̂ (M·K·elt) and each GEMM reads it back (n·M·K·elt). Fused, at
one-row decode: one GEMV launch whose programs compute the row's mean and rstd (x is tiny
and L2-resident) and normalise x on the way into the dot products — the norm's launch and
x̂ never happen. More rows: norm.py's LayerNorm kernel writes x̂ once and one GEMM reads it
for all n projections (what a merge of the projections alone would give, less one launch;
at 2-4 rows every GEMV program redoing all rows' stats cost more than that launch).

H100, session 33 (bf16, `benchmarks/results/h100-s33A-kernels-ln*.json`; µs, ours / eager
LN + one addmm per projection / torch.compile of the reference): LN -> QKV 4096 -> 12288 at
1 row 36.8 / 78.1 / 52.6 (2737 GB/s, 91% of copy), 16 rows 39.7 / 79.6 / 63.2, 128 rows
44.8 / 79.9 / 61.8, 512 rows 90.3 / 119.6 / 108.2; GPT-2 medium's LN -> c_fc (1024 -> 4096)
at 1 row 6.1 / 26.9 / 17.0.

Unlike RMSNorm (a row scale, `rmsnorm_linear`), LayerNorm's centring and β do not factor
out of the GEMM, so the tensor-core path normalises first rather than in its epilogue.
`apply` lays the projections' weights (and biases, when every projection has one) out back
to back once, so the merged W and b are zero-copy views (`merged_linear.merged_weight`).
The output is (..., ΣN_i); the runtime slices it per projection.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from advisor.kernels.gemm import (
    _ACT_NAMES,
    SPACE,
    _bytes,
    _flops,
    _problem,
    _use_triton,
    fused_launches,
    launch_gemm_layernorm,
    reference_layernorm,
    spills_gemm_layernorm,
    unfused_layernorm,
)
from advisor.kernels.merged_linear import merged_bias, merged_weight
from advisor.kernels.norm import MAX_BLOCK_N
from advisor.kernels.registry import KernelSpec, register
from advisor.kernels.space import decode
from advisor.kernels.testing import randn_nonzero

Tensors = list[torch.Tensor]
Biases = list[torch.Tensor | None]


def _usable(x: torch.Tensor) -> bool:
    """Triton runs it: CUDA (or the interpreter), a supported dtype, and rows norm.py's
    LayerNorm kernel holds (it normalises x ahead of the GEMM from 2 rows on)."""
    return _use_triton(x) and x.shape[-1] <= MAX_BLOCK_N


def reference(x: torch.Tensor, norm_w: torch.Tensor | None, norm_b: torch.Tensor | None,
              weights: Tensors, biases: Biases, eps: float, activation: str = "none") -> torch.Tensor:
    """x (..., K) -> (..., ΣN_i) in fp32 with one cast (normalised x not rounded);
    `activation` (one projection: fc1 of a GPT-style MLP) applied before the cast."""
    return reference_layernorm(x, norm_w, norm_b, torch.cat(weights, dim=0),
                               merged_bias(x, weights, biases), eps, activation)


def unfused(x, norm_w, norm_b, weights: Tensors, biases: Biases, eps: float,
            activation: str = "none") -> torch.Tensor:
    """Eager: the LayerNorm, then one addmm per projection (and the activation), as the model
    runs them."""
    return torch.cat([unfused_layernorm(x, norm_w, norm_b, w, b, eps, activation)
                      for w, b in zip(weights, biases)], dim=-1)


def launch(x: torch.Tensor, norm_w: torch.Tensor | None, norm_b: torch.Tensor | None,
           weights: Tensors, biases: Biases, eps: float, activation: str = "none",
           config: Mapping[str, int] | None = None) -> torch.Tensor:
    return launch_gemm_layernorm(x, norm_w, norm_b, merged_weight(weights),
                                 merged_bias(x, weights, biases), eps, activation, config)


@torch.library.custom_op(
    "advisor::layernorm_linear", mutates_args=(),
    schema="(Tensor x, Tensor? norm_w, Tensor? norm_b, Tensor[] weights, Tensor?[] biases, "
           "float eps, str activation, str config) -> Tensor")
def layernorm_linear(x, norm_w, norm_b, weights, biases, eps, activation, config):
    if _usable(x):
        return launch(x, norm_w, norm_b, list(weights), list(biases), eps, activation, decode(config))
    return reference(x, norm_w, norm_b, list(weights), list(biases), eps, activation).contiguous()


@layernorm_linear.register_fake
def _(x, norm_w, norm_b, weights, biases, eps, activation, config):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in weights)))


EPS = 1e-5


def _make_inputs(dims: Mapping[str, int], dtype, device, gen) -> tuple[Any, ...]:
    """x (M, K) ~ N(0.5, 1) (a mean to remove), norm weight and bias unless dims["affine"]
    is 0, and three projections (like Q (half), K, V) of ~ N(0, 1/K) with biases if
    dims["bias"]; with dims["act"] (a gemm.GEMM_ACTIVATIONS code) one projection (fc1) and
    that activation."""
    m, k, n = dims["M"], dims["K"], dims["N"]
    x = randn_nonzero((m, k), dtype, device, gen) + 0.5
    affine = dims.get("affine", 1)
    norm_w = randn_nonzero((k,), dtype, device, gen, 0.5) if affine else None
    norm_b = randn_nonzero((k,), dtype, device, gen, 0.5) if affine else None
    cut = [0, n] if "act" in dims else [0, n // 2, 3 * n // 4, n]
    w = randn_nonzero((n, k), dtype, device, gen, k ** -0.5)
    weights = [w[a:b] for a, b in zip(cut, cut[1:]) if b > a]
    b = randn_nonzero((n,), dtype, device, gen, 0.5) if dims.get("bias") else None
    biases = [None if b is None else b[p:q] for p, q in zip(cut, cut[1:]) if q > p]
    return x, norm_w, norm_b, weights, biases, EPS, _ACT_NAMES[dims.get("act", -1)]


def _merged(x, norm_w, norm_b, weights, biases, *rest) -> tuple[Any, ...]:
    """(x, norm_w, norm_b, W (ΣN, K), b (ΣN,) or None): what the GEMM reads."""
    return x, norm_w, norm_b, merged_weight(weights), merged_bias(x, weights, biases)


def _bytes_moved(*inputs: Any) -> int:
    merged = _merged(*inputs)
    return _bytes(merged[3].shape[0], *merged)


register(KernelSpec(
    name="layernorm_linear", reference=reference, launch=launch, space=SPACE,
    make_inputs=_make_inputs, unfused=unfused,
    problem=lambda x, norm_w, norm_b, weights, *_: {**_problem(x, weights[0]),
                                                     "N": sum(int(w.shape[0]) for w in weights)},
    bytes_moved=_bytes_moved,
    flops=lambda *inputs: _flops(inputs[0], _merged(*inputs)[3]),
    test_dims=({"M": 1, "K": 40, "N": 24, "bias": 1}, {"M": 1, "K": 24, "N": 8, "affine": 0},
               {"M": 1, "K": 40, "N": 24, "bias": 1, "act": 2}, {"M": 3, "K": 40, "N": 24, "affine": 0},
               {"M": 17, "K": 40, "N": 40, "bias": 1}, {"M": 17, "K": 24, "N": 40, "act": 1}),
    bench_dims=lambda tokens: {"M": tokens, "K": 4096, "N": 12288, "bias": 1},  # LN -> QKV, OPT-6.7B
    unfused_launches=4,  # eager LayerNorm, three addmm
    launches=lambda p: fused_launches(p, "layer"),
    matrix_kernel=True, usable=lambda x, *_: _usable(x),
    spills=lambda *inputs, config=None: spills_gemm_layernorm(*_merged(*inputs), *inputs[5:], config=config),
))
