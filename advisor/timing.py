"""Timing a forward: median of many runs after warm-up; CUDA events with an L2 flush on
the GPU (triton.testing.do_bench), wall clock on the CPU."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch


def median_ms(fn: Callable[[], Any], device: torch.device, *, warmup_ms: float = 100,
              rep_ms: float = 500, min_reps: int = 5,
              reset: Callable[[], Any] | None = None) -> float:
    """Median milliseconds per call of `fn`.

    reset: for a forward that advances state in place (a decode step writes its KV cache
    and moves a `transformers` StaticCache's write position), called before every run and
    left out of the timing, so hundreds of runs never write past the end of the cache and
    every run does the same work."""
    if reset is not None:
        return _median_with_reset(fn, reset, device, warmup_ms, rep_ms, min_reps)
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))
    return _median_with_reset(fn, lambda: None, device, 0.0, rep_ms, min_reps)


MAX_REPS = 200


def _median_with_reset(fn: Callable[[], Any], reset: Callable[[], Any], device: torch.device,
                       warmup_ms: float, rep_ms: float, min_reps: int) -> float:
    """Per run: reset (untimed), then fn timed alone (`elapsed_ms`: CUDA events on the GPU,
    where the reset's copies also push the last run's data out of L2; wall clock on the CPU)."""
    def once() -> float:
        reset()
        return elapsed_ms(fn, device)[1]

    spent = once()  # warm-up: at least one run, then up to warmup_ms
    while spent < warmup_ms:
        spent += once()
    times: list[float] = []
    while len(times) < min_reps or sum(times) < rep_ms:
        times.append(once())
        if len(times) >= MAX_REPS:
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
