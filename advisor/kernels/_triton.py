"""Small helpers every kernel module shares: when to run Triton, and resource reports.

Triton runs on CUDA tensors, and on CPU tensors only under its interpreter
(`TRITON_INTERPRET=1`, which the CPU tests set before importing advisor). Elsewhere the
custom ops fall back to the eager reference, so a CPU-only install still works.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from advisor.errors import KernelInputError


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _interpreter_index_fix() -> None:
    """Triton 3.6's interpreter turns a tensor used as a Python int (a `range()` bound made
    from `tl.program_id`, a 1-element array there) into one with `int(ndarray)`, which
    NumPy 2 refuses for arrays of one dimension ("only 0-dimensional arrays can be
    converted to Python scalars": every kernel whose loop bounds depend on the program
    failed); triton 3.9 squeezes first. Do the same on every interpreted launch."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "advisor_squeezes", False):
        return

    def index(self) -> int:
        return int(self.handle.data.squeeze())

    def patched(tensor, *scope) -> None:  # triton 3.5+ passes a scope that restores after
        patch(tensor, *scope)
        if scope:
            scope[0].set_attr(tensor, "__index__", index)
        else:  # older: attributes set for good
            tensor.__index__ = index

    patched.advisor_squeezes = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


if interpreting():  # read when the kernels are defined, as @triton.jit reads it
    _interpreter_index_fix()


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


# --------------------------------------------------------------------------- PDL
# Programmatic dependent launch (sm_90+): a kernel launched with it may start while the
# kernel before it in the stream is still running; `gdc_wait` blocks until that one has
# finished and its writes are visible. A one-token decode step is ~100 short kernels in a
# CUDA graph, each paying launch latency plus the ramp to full memory bandwidth; with PDL
# the next GEMV's programs are already resident and streaming their first weight tile when
# the previous kernel ends. Contract for every kernel launched with it (`GDC` constexpr):
# read nothing another kernel writes and write nothing before `gdc_enter` (weights may be
# prefetched: they are parameters, never written by a step). Kernels launched without it
# keep stream order, so PDL kernels may sit next to eager aten kernels.
_PDL = contextvars.ContextVar("advisor_pdl", default=False)


@contextlib.contextmanager
def programmatic_launch(on: bool) -> Iterator[None]:
    """Within this block, kernels that support it launch with PDL (a plan's `pdl` option)."""
    token = _PDL.set(bool(on))
    try:
        yield
    finally:
        _PDL.reset(token)


@functools.cache
def _pdl_device(index: int) -> bool:
    from triton.language.extra import cuda as tl_cuda

    return torch.cuda.get_device_capability(index)[0] >= 9 and hasattr(tl_cuda, "gdc_wait")


def pdl_supported(device: torch.device) -> bool:
    """Compiled Triton on a CUDA device of compute capability 9.0 or newer."""
    if device.type != "cuda" or interpreting():
        return False
    return _pdl_device(device.index if device.index is not None else torch.cuda.current_device())


def pdl_launch(t: torch.Tensor) -> dict[str, Any]:
    """Launch options for a kernel on `t`'s device: {"GDC": bool} for the kernel's
    constexpr, plus Triton's `launch_pdl` when on (inside `programmatic_launch(True)`, on a
    device `pdl_supported`)."""
    on = _PDL.get() and pdl_supported(t.device)
    return {"GDC": True, "launch_pdl": True} if on else {"GDC": False}


_HAS_DESCRIPTORS = importlib.util.find_spec("triton.tools.tensor_descriptor") is not None


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether these tensors can be read through TMA descriptors (Hopper's tensor memory
    accelerator, `descriptor`): triton >= 3.3, a GPU of compute capability 9.0+ (or the
    interpreter), unit last stride, a 16-byte aligned base and 16-byte multiples for every
    other stride."""
    t = tensors[0]
    if not _HAS_DESCRIPTORS or not interpreting() and not (
            t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9):
        return False
    return all(u.stride(-1) == 1 and u.data_ptr() % 16 == 0
               and all((st * u.element_size()) % 16 == 0 for st in u.stride()[:-1])
               for u in tensors)


INTERPRETER_SMS = 3  # "SMs" of the interpreter: persistent kernels then loop over tiles


def sm_count(t: torch.Tensor) -> int:
    """Streaming multiprocessors of t's GPU (a persistent grid's size; INTERPRETER_SMS on
    the CPU, so the tests walk several tiles per program)."""
    return _sm_count(t.device.index or 0) if t.is_cuda else INTERPRETER_SMS


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def descriptor(t: torch.Tensor, block_shape: list[int]) -> Any:
    """A host-side TMA descriptor of `t` (checked by `tma_ok`) loading `block_shape`
    blocks; a block past `t`'s bounds reads zeros there."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, block_shape)


# --------------------------------------------------------------------------- warm start
# Triton's per-process setup — its cache key (a hash of its own sources and of libtriton,
# read once per process: 1.05 s of the H100's first call under cProfile, session 14) and
# the CUDA driver's utilities — is paid by the first compile or cache lookup. Started when
# a recipe is applied, it runs while dynamo traces the first call (hashing and file reads
# leave the GIL), and the rewrite waits for it before any kernel is compiled.
_warming: threading.Thread | None = None


def _triton_setup() -> None:
    try:
        from triton.runtime.cache import triton_key

        triton_key()
        triton.runtime.driver.active.get_current_device()
    except Exception:  # an optimisation only: the first compile does it, as before
        pass


def warm_start() -> None:
    """Start Triton's per-process setup in a thread, once (CUDA, compiled kernels only;
    ADVISOR_TRITON_SETUP=0: not at all, the first compile does it)."""
    global _warming
    if (_warming is None and not interpreting() and torch.cuda.is_available()
            and os.environ.get("ADVISOR_TRITON_SETUP", "1") != "0"):
        _warming = threading.Thread(target=_triton_setup, name="advisor-triton-setup", daemon=True)
        _warming.start()


def warm_wait() -> None:
    """Until `warm_start`'s thread is done (none started: at once)."""
    if _warming is not None:
        _warming.join()


@triton.jit
def gdc_enter(GDC: tl.constexpr):
    """Wait for the previous kernel (its writes visible), then let the next one launch:
    its programs take free SM slots and run up to their own wait (a weight prefetch).
    Waiting first keeps at most one kernel ahead in flight. No-op unless GDC."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
