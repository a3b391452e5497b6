"""Device ceilings, measured on this device and cached with the versions they were measured under.

A budget is only as good as the roofline it is judged against, and peak numbers from a
spec sheet are not what eager PyTorch reaches. So we measure (STYLE.md practice 6):

* ``copy_gbps``: a large device-to-device copy, (bytes read + bytes written) / s / 1e9;
* ``matmul_tflops[dtype]``: a square matmul on random non-zero data (8192 on CUDA,
  1024 on the CPU), 2·n³ FLOP per product;
* ``launch_us``: wall µs per tiny eager op (``x.add_(1)`` on one element) issued
  back-to-back -- on CUDA this is the host-side issue rate;
* ``graph_launch_us``: µs per kernel inside a replayed CUDA graph (None on the CPU).

CUDA timings use ``torch.cuda.Event`` pairs, a warm-up, the median of repeats and an L2
flush (writing a 256 MB buffer) before every timed run; the CPU uses ``time.perf_counter``
medians and is sized to finish in a few seconds on two cores.

Example::

    >>> from advisor.profile.ceilings import load_or_measure, ridge
    >>> c = load_or_measure("cpu")              # measured once, then read from the cache
    >>> ridge(c, "float32") > 0                 # FLOP/byte where compute takes over
    True
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from advisor.env import env_key, environment

__all__ = ["Ceilings", "SCHEMA_VERSION", "MATMUL_DTYPES", "measure_ceilings", "load_or_measure",
           "ridge", "dtype_name", "cache_path"]

SCHEMA_VERSION = 1
MATMUL_DTYPES = ("float32", "float16", "bfloat16")

# Sizes: large enough to fill the device, small enough to stay quick.
_CUDA = {"copy_bytes": 1 << 30, "matmul_n": 8192, "flush_bytes": 256 << 20, "reps": 10,
         "launch_ops": 1000, "graph_ops": 256}
_CPU = {"copy_bytes": 64 << 20, "matmul_n": 1024, "flush_bytes": 64 << 20, "reps": 3,
        "launch_ops": 2000, "graph_ops": 0}


@dataclass(frozen=True)
class Ceilings:
    """What this device reaches in practice; all rates are per second."""

    device_name: str
    device_type: str  # "cuda" / "cpu"
    copy_gbps: float  # (bytes read + bytes written) / s / 1e9 of a large copy
    matmul_tflops: dict[str, float]  # "float32" / "float16" / "bfloat16" -> 1e12 FLOP/s
    launch_us: float  # wall µs per tiny eager op issued back-to-back
    graph_launch_us: float | None  # µs per kernel in a replayed CUDA graph; None off CUDA
    env: dict[str, Any]  # advisor.env.environment(device)
    measured_at: str  # ISO 8601, UTC
    method: str  # how each number was measured
    schema_version: int = SCHEMA_VERSION


def dtype_name(dtype: Any) -> str:
    """`torch.bfloat16` / "torch.bfloat16" / "bfloat16" -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def ridge(c: Ceilings, dtype: Any) -> float:
    """Arithmetic intensity (FLOP/byte) where a kernel turns compute-bound for `dtype`.

    Dtypes without a measured matmul rate (float64, integers) use float32's.
    """
    tflops = c.matmul_tflops.get(dtype_name(dtype), c.matmul_tflops["float32"])
    return tflops * 1e12 / (c.copy_gbps * 1e9)


# --------------------------------------------------------------------------- timing helpers


def _cuda_median_ms(fn: Callable[[], Any], reps: int, flush: torch.Tensor | None) -> float:
    """Median device ms of `fn` by CUDA events, after 2 warm-ups; L2 flushed before each run."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()  # writes 256 MB: evicts the L2 (50-60 MB on Hopper)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in pairs)


def _cpu_median_ms(fn: Callable[[], Any], reps: int, flush: torch.Tensor | None) -> float:
    """Median wall ms of `fn` by perf_counter after one warm-up; caches flushed before each."""
    fn()
    times = []
    for _ in range(reps):
        if flush is not None:
            flush.zero_()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _copy_gbps(dev: torch.device, cfg: dict[str, int], timer: Callable[..., float],
               flush: torch.Tensor) -> float:
    n = cfg["copy_bytes"] // 4
    src = torch.randn(n, device=dev)  # (n,) float32, random non-zero
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src), cfg["reps"], flush)
    return 2 * src.nbytes / (ms * 1e-3) / 1e9  # read + write


def _matmul_tflops(dev: torch.device, cfg: dict[str, int], timer: Callable[..., float],
                   flush: torch.Tensor) -> dict[str, float]:
    n = cfg["matmul_n"]
    out = {}
    for name in MATMUL_DTYPES:
        dtype = getattr(torch, name)
        a = torch.randn(n, n, device=dev).to(dtype)  # (n, n)
        b = torch.randn(n, n, device=dev).to(dtype)
        ms = timer(lambda a=a, b=b: torch.mm(a, b), cfg["reps"], flush)
        out[name] = 2 * n**3 / (ms * 1e-3) / 1e12
        del a, b
    return out


def _launch_us(dev: torch.device, ops: int) -> float:
    """Median over 5 rounds of host µs per back-to-back `x.add_(1)` on one element."""
    x = torch.zeros(1, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(100):
        x.add_(1)
    rounds = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        for _ in range(ops):
            x.add_(1)
        rounds.append((time.perf_counter() - t0) * 1e6 / ops)  # issue time only
        sync()
    return statistics.median(rounds)


def _graph_launch_us(dev: torch.device, ops: int, reps: int) -> float:
    """µs per kernel when `ops` tiny kernels are replayed from one CUDA graph."""
    x = torch.zeros(1, device=dev)
    side = torch.cuda.Stream(device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # warm up off the capture stream, as the docs advise
        for _ in range(3):
            x.add_(1)
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ops):
            x.add_(1)
    ms = _cuda_median_ms(graph.replay, reps, None)
    del graph
    return ms * 1e3 / ops


def _method(dev: torch.device, cfg: dict[str, int]) -> str:
    reps, flush_mb = cfg["reps"], cfg["flush_bytes"] >> 20
    clock = (f"torch.cuda.Event, median of {reps} after 2 warm-ups, L2 flushed ({flush_mb} MB "
             "write) before each") if dev.type == "cuda" else (
        f"time.perf_counter, median of {reps} after 1 warm-up, caches flushed ({flush_mb} MB "
        "write) before each")
    parts = [
        f"copy: float32 Tensor.copy_ of {cfg['copy_bytes'] >> 20} MB, (read+write) bytes/s",
        f"matmul: torch.mm {cfg['matmul_n']}x{cfg['matmul_n']} on randn data, 2n^3 FLOP "
        f"(float32_matmul_precision={torch.get_float32_matmul_precision()})",
        f"timing: {clock}",
        f"launch: x.add_(1) on 1 element x{cfg['launch_ops']} back-to-back, host issue time, "
        "median of 5",
    ]
    if cfg["graph_ops"]:
        parts.append(f"graph: {cfg['graph_ops']} x.add_(1) in one CUDA graph, replay time / ops")
    return "; ".join(parts)


def measure_ceilings(device: torch.device | str) -> Ceilings:
    """Measure copy bandwidth, matmul rate per dtype and launch costs on `device`."""
    dev = torch.device(device)
    is_cuda = dev.type == "cuda"
    if is_cuda and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    cfg = _CUDA if is_cuda else _CPU
    timer = _cuda_median_ms if is_cuda else _cpu_median_ms
    env = environment(dev)
    with torch.inference_mode(), (torch.cuda.device(dev) if is_cuda else nullcontext()):
        flush = torch.empty(cfg["flush_bytes"], dtype=torch.uint8, device=dev)
        copy = _copy_gbps(dev, cfg, timer, flush)
        mm = _matmul_tflops(dev, cfg, timer, flush)
        del flush
        launch = _launch_us(dev, cfg["launch_ops"])
        graph = _graph_launch_us(dev, cfg["graph_ops"], cfg["reps"]) if is_cuda else None
    if is_cuda:
        torch.cuda.empty_cache()
    return Ceilings(
        device_name=env["device_name"], device_type=dev.type, copy_gbps=copy, matmul_tflops=mm,
        launch_us=launch, graph_launch_us=graph, env=env,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        method=_method(dev, cfg),
    )


# --------------------------------------------------------------------------- cache


def cache_path(env: dict[str, Any], cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`<cache_dir>/ceilings-<device_type>-<env_key>.json`; default dir $ADVISOR_CACHE_DIR
    or ~/.cache/advisor."""
    root = cache_dir or os.environ.get("ADVISOR_CACHE_DIR") or Path.home() / ".cache" / "advisor"
    return Path(root) / f"ceilings-{env['device_type']}-{env_key(env)}.json"


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _from_json(text: str, env: dict[str, Any]) -> Ceilings | None:
    """A Ceilings from cache text, or None when it is corrupt, stale or of another env."""
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
            return None
        c = Ceilings(**data)
    except (ValueError, TypeError):
        return None
    mm = c.matmul_tflops
    ok = (c.env == env and _positive(c.copy_gbps) and _positive(c.launch_us)
          and isinstance(mm, dict) and all(_positive(mm.get(k)) for k in MATMUL_DTYPES)
          and (c.graph_launch_us is None or _positive(c.graph_launch_us))
          and isinstance(c.method, str) and isinstance(c.measured_at, str))
    return c if ok else None


def _write_atomic(path: Path, c: Ceilings) -> None:
    """Write JSON to a temp file in the same folder, then os.replace: never a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(dataclasses.asdict(c), fh, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_or_measure(device: torch.device | str, cache_dir: str | os.PathLike[str] | None = None,
                    refresh: bool = False) -> Ceilings:
    """Cached ceilings for this device + software versions, measured when missing.

    A corrupt, stale-schema or other-environment cache file is ignored and re-measured;
    an unwritable cache folder only warns (the measured ceilings are still returned).
    """
    dev = torch.device(device)
    env = environment(dev)
    path = cache_path(env, cache_dir)
    if not refresh:
        try:
            cached = _from_json(path.read_text(encoding="utf-8"), env)
        except (OSError, UnicodeDecodeError):
            cached = None
        if cached is not None:
            return cached
    c = measure_ceilings(dev)
    try:
        _write_atomic(path, c)
    except OSError as exc:
        warnings.warn(f"advisor: could not cache ceilings at {path}: {exc}", stacklevel=2)
    return c
