"""Timing a forward: median of many runs after warm-up; CUDA events with an L2 flush on
the GPU (triton.testing.do_bench), wall clock on the CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def median_ms(fn: Callable[[], Any], device: torch.device, *, warmup_ms: float = 100,
              rep_ms: float = 500, min_reps: int = 5) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    fn()  # warm-up
    times, spent = [], 0.0
    while len(times) < min_reps or spent < rep_ms / 1e3:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        times.append(dt * 1e3)
        spent += dt
        if len(times) >= 200:
            break
    return statistics.median(times)


def timed_call(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """Run once and return (result, seconds) including any compilation it triggers."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    result = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - t0


def kernels_per_call(fn: Callable[[], Any], device: torch.device) -> int | None:
    """Device kernels one call launches (CUDA only; None on the CPU)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def elapsed_ms(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """Run `fn` once, timed end to end: CUDA events around it after a synchronize (what
    the device spent, launch gaps included), wall clock on the CPU."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        result = fn()
        return result, (time.perf_counter() - t0) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    result = fn()
    end.record()
    end.synchronize()
    return result, start.elapsed_time(end)
