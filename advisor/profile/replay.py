"""Device time of a short op sequence, as a CUDA-graph replay of the model would see it.

Used by the analysis probes (merge_probe, runtime/site_probe): each runs one spelling of
a site over enough distinct input copies to exceed twice the L2 (every layer reads its
own weights and activations; a replay of one copy would time L2 hits), captured in one
CUDA graph and replayed between CUDA events. Launch gaps and ramps of the kernels are
included, as in a captured forward. On the CPU: perf_counter (tests, CPU analyses).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch

PROBE_BYTES_MAX = 1 << 30   # input copies per spelling; bounds a probe's memory
COPIES_MAX = 16
REPS = 20                   # CUDA replays (median); the CPU takes 3


class CaptureFailed(RuntimeError):
    """A capture or replay failed: the device may be left unusable; stop probing."""


def copies_past_l2(set_bytes: int, device: torch.device) -> int:
    """How many copies of a `set_bytes` input set exceed twice the device's L2 (1 on CPU)."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    want = max(1, math.ceil(2 * l2 / max(1, set_bytes)))
    return max(1, min(want, COPIES_MAX, PROBE_BYTES_MAX // max(1, set_bytes)))


def graph_ms(run: Callable[[], None], device: torch.device, reps: int = REPS) -> float:
    """Median device ms of one replay of a CUDA graph of `run`."""
    prev = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(prev)
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # a host sync cannot be captured: fail here
    try:
        with torch.cuda.stream(side):  # warm up off the capture stream (compiles, workspaces)
            for _ in range(2):
                run()
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    prev.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            run()
        graph.replay()
        torch.cuda.synchronize(device)
    except Exception as exc:
        torch.cuda.set_stream(prev)  # a failed capture_end leaves the capture stream current
        raise CaptureFailed(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    pairs = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize(device)
    del graph
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def cpu_ms(run: Callable[[], None], reps: int = 3) -> float:
    run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def device_ms(run: Callable[[], None], device: torch.device) -> float:
    """graph_ms on CUDA, cpu_ms elsewhere."""
    return graph_ms(run, device) if device.type == "cuda" else cpu_ms(run)
