"""Shared numerics for tests, benchmarks and plan verification: one tolerance table.

A check passes when `|out - ref| <= atol + rtol * |ref|` element-wise (llm.c style), with
NaN matching NaN only where the reference is NaN and infinities matching exactly.
References are computed in fp32 (fp64 for reductions where it matters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


# One table by dtype. bf16 has 8 mantissa bits (~4e-3 relative rounding), fp16 has 11.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.float16: Tolerance(atol=1e-3, rtol=1e-3),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1e-2),
}

# Whole-model comparisons accumulate rounding over many layers: same form, looser.
MODEL_TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-4, rtol=1e-4),
    torch.float16: Tolerance(atol=1e-2, rtol=1e-2),
    torch.bfloat16: Tolerance(atol=5e-2, rtol=5e-2),
}


def tolerance(dtype: torch.dtype, *, model: bool = False) -> Tolerance:
    table = MODEL_TOLERANCES if model else TOLERANCES
    return table.get(dtype, table[torch.float32])


CHUNK = 1 << 24  # elements per float64 slice: 128 MB, however large the compared tensors


def _pairs(out: torch.Tensor, ref: torch.Tensor):
    """(out, ref) flattened, in float64 slices of CHUNK elements, on their device (the host
    if they differ): confirming a site at 2048 tokens compared (2048, 128256) logits, and
    copying them to the host in float64 took 20 of the H100 first call's 41 s of
    confirmation (session 18 run C), where the device takes milliseconds."""
    o, r = out.detach().reshape(-1), ref.detach().reshape(-1)
    if o.device != r.device:
        o, r = o.cpu(), r.cpu()
    for i in range(0, o.numel(), CHUNK):
        yield o[i:i + CHUNK].double(), r[i:i + CHUNK].double()


def max_violation(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> float:
    """Largest `|out-ref| - (atol + rtol|ref|)` (<= 0 means within tolerance); inf if
    shapes differ, NaN/inf placement differs, or `out` has NaN where `ref` does not."""
    if out.shape != ref.shape:
        return float("inf")
    worst = None
    for o, r in _pairs(out, ref):
        nan_o, nan_r = torch.isnan(o), torch.isnan(r)
        if not torch.equal(nan_o, nan_r):
            return float("inf")
        inf_o, inf_r = torch.isinf(o), torch.isinf(r)
        if not torch.equal(inf_o, inf_r) or not torch.equal(o[inf_o], r[inf_r]):
            return float("inf")
        finite = ~(nan_r | inf_r)
        if finite.any():
            excess = float(((o[finite] - r[finite]).abs() - (tol.atol + tol.rtol * r[finite].abs())).max())
            worst = excess if worst is None else max(worst, excess)
    return 0.0 if worst is None else worst


def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| in float64 (inf where either is NaN, or if the shapes differ); 0.0
    for empty tensors."""
    if out.shape != ref.shape:
        return float("inf")
    return max((float(torch.nan_to_num((o - r).abs(), nan=float("inf")).max())
                for o, r in _pairs(out, ref)), default=0.0)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (inf if out has NaN/inf where ref does not)."""
    o, r = out.detach().double(), ref.detach().double()
    den = float(torch.linalg.vector_norm(r))
    num = float(torch.linalg.vector_norm(o - r))
    return num / den if den else num


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Assert `out` matches `ref` within the tolerance of `dtype` (default: out.dtype)."""
    tol = tolerance(dtype or out.dtype)
    excess = max_violation(out, ref, tol)
    if excess > 0:
        raise AssertionError(
            f"mismatch: max |out-ref| = {max_abs_error(out, ref):.3e} exceeds "
            f"atol={tol.atol} + rtol={tol.rtol}*|ref| (shape {tuple(out.shape)}, {out.dtype})"
        )


def nan_filled(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer poisoned with NaN so that an unwritten element fails the check."""
    return torch.full(tuple(shape), float("nan"), dtype=dtype, device=device)


_DRAWABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def randn_nonzero(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
    generator: torch.Generator | None = None, scale: float = 1.0,
) -> torch.Tensor:
    """Random normal values pushed away from zero (|x| >= 0.05·scale), so zeros cannot
    hide unwritten outputs or wrong indexing. Drawn where the generator lives (the host
    by default); on an accelerator in the target dtype: confirming a (128256, 4096)
    lm_head site drew 525M fp32 values on the host, seconds of a first call."""
    where = generator.device if generator is not None else torch.device("cpu")
    draw = dtype if where.type != "cpu" and dtype in _DRAWABLE else torch.float32
    x = torch.randn(shape, generator=generator, dtype=draw, device=where)
    x = torch.where(x.abs() < 0.05, torch.sign(x + 1e-9) * 0.05, x) * scale
    return x.to(device=device, dtype=dtype)
