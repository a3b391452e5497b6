"""Small helpers every kernel module shares: when to run Triton, and resource reports.

Triton runs on CUDA tensors, and on CPU tensors only under its interpreter
(`TRITON_INTERPRET=1`, which the CPU tests set before importing advisor). Elsewhere the
custom ops fall back to the eager reference, so a CPU-only install still works.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from advisor.errors import KernelInputError


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_can_run(*tensors: torch.Tensor) -> bool:
    """True when the Triton kernel can run on these tensors (CUDA, or CPU in interpreter)."""
    device = tensors[0].device
    if device.type == "cuda":
        return True
    return device.type == "cpu" and interpreting()


@dataclass(frozen=True)
class Resources:
    """What the compiler reports for one compiled kernel (None under the interpreter)."""

    n_regs: int
    n_spills: int
    shared_bytes: int


def resources(compiled: Any) -> Resources | None:
    """Registers, spills and shared memory of a `CompiledKernel` returned by a launch or
    by `jit_fn.warmup(...)`; None where there is nothing compiled (interpreter)."""
    if compiled is None or not hasattr(compiled, "n_spills"):
        return None
    init = getattr(compiled, "_init_handles", None)
    if callable(init):
        init()
    return Resources(
        n_regs=int(getattr(compiled, "n_regs", 0) or 0),
        n_spills=int(getattr(compiled, "n_spills", 0) or 0),
        shared_bytes=int(getattr(compiled, "metadata", None) and compiled.metadata.shared or 0),
    )


def check(cond: bool, message: str) -> None:
    """Launcher argument check: a clear KernelInputError instead of a Triton crash."""
    if not cond:
        raise KernelInputError(message)


SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float(name: str, t: torch.Tensor) -> None:
    check(t.dtype in SUPPORTED_DTYPES, f"{name}: dtype {t.dtype} not in fp32/fp16/bf16")


@triton.jit
def cast_rn(x, dtype, INTERP_BF16: tl.constexpr):
    """fp32 x -> dtype, rounding to nearest even. The interpreter's fp32 -> bf16 cast
    truncates (INTERP_BF16 only): round the bits first, as the GPU's cvt.rn does."""
    if INTERP_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16).to(tl.float32, bitcast=True)
    return x.to(dtype)
