"""Device time of a short op sequence, as a CUDA-graph replay of the model would see it.

Used by the analysis probes (merge_probe, runtime/site_probe): each runs one spelling of
a site over enough distinct input copies to exceed twice the L2 (every layer reads its
own weights and activations; a replay of one copy would time L2 hits), captured in one
CUDA graph and replayed between CUDA events. Launch gaps and ramps of the kernels are
included, as in a captured forward. The spellings of one site are replayed in turn
(`spellings_ms`: A B A B …, after a warm-up), so the device's drift over a probe does not
land on one side of a saving: session 21's cold probe of one GEMV site read +3.8 µs in one
run and −0.6 in the next, timed one spelling after the other. Replayed in turn, the
spellings must not read the same memory: one would time the L2 hits the other left
(callers give each its own copies). On the CPU: perf_counter (tests, CPU analyses).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch

PROBE_BYTES_MAX = 1 << 30   # input copies per spelling (a probe holds each of its spellings')
COPIES_MAX = 16
REPS = 20                   # CUDA replays (median); the CPU takes 3
WARMUP_MS = 10.0            # untimed rounds first: clocks ramp from idle over a few ms
WARMUP_BATCH_MAX = 4096     # rounds per warm-up batch, at most (batches double)


class CaptureFailed(RuntimeError):
    """A capture or replay failed: the device may be left unusable; stop probing."""


def copies_past_l2(set_bytes: int, device: torch.device) -> int:
    """How many copies of a `set_bytes` input set exceed twice the device's L2 (1 on CPU)."""
    if device.type != "cuda":
        return 1
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
    want = max(1, math.ceil(2 * l2 / max(1, set_bytes)))
    return max(1, min(want, COPIES_MAX, PROBE_BYTES_MAX // max(1, set_bytes)))


def _captured(run: Callable[[], None], device: torch.device) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `run`, warmed up (compiles, workspaces) and replayed once."""
    prev = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device=device)
    side.wait_stream(prev)
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # a host sync cannot be captured: fail here
    try:
        with torch.cuda.stream(side):  # warm up off the capture stream
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
    return graph


def _timed_round(graphs: list[torch.cuda.CUDAGraph]) -> list[tuple[torch.cuda.Event, torch.cuda.Event]]:
    """Each graph replayed once, in turn, between its own CUDA events."""
    pairs = []
    for graph in graphs:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        pairs.append((start, end))
    return pairs


def _warm_up(graphs: list[torch.cuda.CUDAGraph]) -> None:
    """Untimed rounds of every graph until WARMUP_MS of device time has passed, in
    batches that double (each timed by events): a one-token site's round is ~0.1 ms."""
    done, batch = 0.0, 1
    while done < WARMUP_MS and batch <= WARMUP_BATCH_MAX:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(batch):
            for graph in graphs:
                graph.replay()
        end.record()
        end.synchronize()
        done += start.elapsed_time(end)
        batch *= 2


def graphs_ms(runs: Sequence[Callable[[], None]], device: torch.device, reps: int = REPS) -> list[float]:
    """Median device ms of one replay of each run's CUDA graph. The graphs are replayed in
    turn (A B A B …), after WARMUP_MS of such rounds: the clocks' ramp from idle and any
    drift over the probe fall on every spelling alike, not on whichever was timed first.
    A replay that fails raises CaptureFailed (the device may be left unusable)."""
    graphs = [_captured(run, device) for run in runs]
    try:
        _warm_up(graphs)
        rounds = [_timed_round(graphs) for _ in range(reps)]
        torch.cuda.synchronize(device)
        return [statistics.median(s.elapsed_time(e) for s, e in column) for column in zip(*rounds)]
    except Exception as exc:
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CaptureFailed(f"replay: {why}") from exc


def cpus_ms(runs: Sequence[Callable[[], None]], reps: int = 3) -> list[float]:
    """Median host ms of each run, called in turn after one call each."""
    for run in runs:
        run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(reps):
        for run, ts in zip(runs, times):
            t0 = time.perf_counter()
            run()
            ts.append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(ts) for ts in times]


def spellings_ms(runs: Sequence[Callable[[], None]], device: torch.device) -> list[float]:
    """graphs_ms on CUDA, cpus_ms elsewhere: the spellings of one site timed in turn."""
    return graphs_ms(runs, device) if device.type == "cuda" else cpus_ms(runs)
