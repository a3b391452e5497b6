"""The kernel registry: every fused op, by id, with its reference, launcher and space.

Kernels are resolved only by id from this table (never by import path from data), which
is what makes recipes safe to load (RELIABILITY.md item 22).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from advisor.kernels._triton import triton_can_run
from advisor.kernels.space import Config, ConfigSpace, Problem

# Modules that register kernels on import; imported lazily by `all_kernels()` / `get()`.
KERNEL_MODULES: tuple[str, ...] = (
    "advisor.kernels.norm",
    "advisor.kernels.gated_act",
    "advisor.kernels.bias_act",
    "advisor.kernels.rope",
    "advisor.kernels.rope_table",
    "advisor.kernels.merged_linear",
    "advisor.kernels.attention",
    "advisor.kernels.gemm",
    "advisor.kernels.linear_swiglu",
    "advisor.kernels.rmsnorm_linear",
    "advisor.kernels.layernorm_linear",
    "advisor.kernels.rmsnorm_swiglu",
)


@dataclass(frozen=True)
class KernelSpec:
    """One fused op.

    name:        registry id, also the custom op name (`torch.ops.advisor.<name>`).
    reference:   eager torch implementation; the single source of truth.
    launch:      `launch(*inputs, config=None)` runs the Triton kernel, returns like `reference`.
    space:       the config space searched by `advisor tune`.
    make_inputs: `make_inputs(dims, dtype, device, generator)` -> tuple of positional inputs
                 (random, non-zero) for `reference` / `launch`.
    problem:     `problem(*inputs)` -> Problem, the shape facts `space.keep` needs.
    bytes_moved: `bytes_moved(*inputs)` -> minimal HBM bytes (each input read once,
                 each output written once), for GB/s.
    test_dims:   small odd dims for CPU tests (Triton interpreter).
    bench_dims:  `bench_dims(tokens)` -> dims at Llama-3-8B sizes for the GPU benchmark.
    unfused_launches: kernel launches the unfused eager ops take (for "launches removed").
    """

    name: str
    reference: Callable[..., Any]
    launch: Callable[..., Any]
    space: ConfigSpace
    make_inputs: Callable[[Mapping[str, int], torch.dtype, torch.device, torch.Generator], tuple]
    problem: Callable[..., Problem]
    bytes_moved: Callable[..., int]
    test_dims: tuple[Mapping[str, int], ...]
    bench_dims: Callable[[int], Mapping[str, int]]
    unfused_launches: int
    spills: Callable[..., int | None] | None = None  # spills(*inputs, config=) -> count
    # usable(*inputs) -> can the Triton launcher take these inputs (device, dtype, width)?
    # Where not, the custom op and the runtime run `reference` instead. Default: the
    # inputs are on CUDA (or on the CPU under the Triton interpreter).
    usable: Callable[..., bool] | None = None
    # unfused(*inputs): the eager ops the fusion replaces, as a model runs them (in the
    # inputs' dtype, one launch per op) — the benchmark's "unfused eager" baseline.
    # Default: `reference` (which computes in fp32 and may cost more than eager does).
    unfused: Callable[..., Any] | None = None
    # flops(*inputs) -> matmul FLOPs, for kernels bound by compute at large sizes (GEMMs,
    # attention): the benchmark reports TFLOP/s against the measured matmul ceiling.
    flops: Callable[..., int] | None = None
    # A Triton kernel that does the matrix work itself (GEMM, attention), so it competes
    # with cuBLAS / flash kernels and can lose at some shapes; tune seeds a plan without them.
    matrix_kernel: bool = False
    # launches(problem) -> kernel launches the fused op takes at its default config for this
    # problem (a split-K sum, a norm's pre-pass); None: one. The analyzer's price of a site.
    launches: Callable[[Problem], int] | None = None

    def fused_launches(self, problem: Problem) -> int:
        return 1 if self.launches is None else int(self.launches(problem))

    def unfused_ops(self) -> Callable[..., Any]:
        return self.unfused if self.unfused is not None else self.reference

    def can_launch(self, *inputs: Any) -> bool:
        if self.usable is not None:
            return self.usable(*inputs)
        first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
        return first is not None and triton_can_run(first)

    def default_config(self, *inputs: Any) -> Config:
        return self.space.default(self.problem(*inputs))


_REGISTRY: dict[str, KernelSpec] = {}


def register(spec: KernelSpec) -> KernelSpec:
    if spec.name in _REGISTRY and _REGISTRY[spec.name] is not spec:
        raise ValueError(f"kernel {spec.name!r} registered twice")
    _REGISTRY[spec.name] = spec
    return spec


def _load_all() -> None:
    for module in KERNEL_MODULES:
        importlib.import_module(module)


def all_kernels() -> dict[str, KernelSpec]:
    _load_all()
    return dict(_REGISTRY)


def get(name: str) -> KernelSpec:
    """Look a kernel up by id; unknown ids are an error (never an import)."""
    _load_all()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown kernel {name!r}; known: {sorted(_REGISTRY)}") from None
