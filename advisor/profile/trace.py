"""Capture a torch.profiler trace of warmed-up forwards and parse it once into a table.

What is recorded: ``iters`` forwards, each inside ``record_function("advisor.iter")`` (and,
on CUDA, ending with ``torch.cuda.synchronize()`` so every kernel of the forward lands in
its window), with every submodule wrapped by forward pre/post hooks in
``record_function(f"advisor.module:{path}")``. The hooks are removed afterwards.

How it is parsed -- the exported Chrome trace JSON, not ``prof.events()``: its shape
("traceEvents" of ``ph == "X"`` with ``cat`` in cpu_op / user_annotation / kernel /
gpu_memcpy / gpu_memset / cuda_runtime / cuda_driver, and ``args.correlation``) has been
stable from torch 2.1 to 2.13, while FunctionEvent attributes (``device_type``,
``kernels``, ``cpu_parent``) changed meaning between releases. Category spellings of older
Kineto ("Operator", "Kernel", "Runtime") are accepted too. Parsing (Holistic Trace
Analysis style, one pass into frozen rows):

* windows: the ``advisor.iter`` annotations; their (pid, tid) is the host thread whose
  ops, module annotations and runtime calls we keep;
* host ops: cpu_op events in a window, nested by time containment (``parent`` indexes the
  enclosing op, -1 at the top) and given the innermost enclosing ``advisor.module:``
  path;
* kernels: GPU kernel / memcpy / memset events; the launching op is the innermost host op
  enclosing the runtime call (``cudaLaunchKernel``, ``cuLaunchKernel``,
  ``cudaMemcpyAsync``...) that has the kernel's ``correlation`` id (fallback: the cpu_op
  with the kernel's ``External id``);
* syncs: runtime calls that block the host on the device (``*Synchronize``,
  ``cudaMemcpy*``), as data in `SYNC_PATTERN`.

Each window is extended to the end of the last kernel launched in it, so it covers the
forward's device work. Wall time is also timed without the profiler (perf_counter, with
synchronize), since the profiler inflates host time; both are kept.

Example::

    >>> t = capture_trace(model, inputs, "cpu", warmup=1, iters=2)   # doctest: +SKIP
    >>> {op.module for op in t.ops} >= {"layers.0.attention.wq"}     # doctest: +SKIP
    True
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from advisor.errors import AdvisorError
from advisor.loader import Inputs, call
from advisor.profile.costs import module_hooks

__all__ = ["HostOp", "Kernel", "Span", "Trace", "capture_trace", "parse_chrome_trace",
           "ITER_NAME", "MODULE_PREFIX", "SYNC_PATTERN"]

ITER_NAME = "advisor.iter"
MODULE_PREFIX = "advisor.module:"
# Categories as data (lower-cased Chrome-trace `cat` -> our kind).
_CATS = {"cpu_op": "op", "operator": "op", "user_annotation": "annotation",
         "kernel": "kernel", "gpu_memcpy": "kernel", "gpu_memset": "kernel",
         "cuda_runtime": "runtime", "runtime": "runtime", "cuda_driver": "runtime"}
SYNC_PATTERN = re.compile(r"Synchronize|^cu(da)?Memcpy")


@dataclass(frozen=True)
class Span:
    """A named interval on the host timeline (a window, a module annotation, a sync call)."""

    name: str
    start_us: float
    dur_us: float
    iteration: int  # window index, -1 outside every window

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class HostOp:
    """One cpu_op on the forward's host thread."""

    name: str  # "aten::linear"
    module: str  # innermost module path ("layers.0.attention.wq"), "" at the top
    start_us: float
    dur_us: float
    iteration: int
    parent: int  # index in Trace.ops of the enclosing op; -1 for a top-level op
    depth: int  # 0 for a top-level op

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class Kernel:
    """One unit of device work (kernel, memcpy or memset) and what launched it."""

    name: str
    start_us: float
    dur_us: float
    iteration: int
    stream: int
    op: int  # index in Trace.ops of the innermost launching host op; -1 if unknown
    op_name: str  # that op's name, "" if unknown
    module: str  # that op's module path, "" if unknown

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


@dataclass(frozen=True)
class Trace:
    """The parsed profile of `len(windows)` forwards; all times in µs on one clock."""

    device_type: str  # "cuda" / "cpu"
    windows: tuple[Span, ...]  # one per forward, extended to its last kernel's end
    ops: tuple[HostOp, ...]  # sorted by (start, -dur): parents before children
    kernels: tuple[Kernel, ...]  # sorted by start
    syncs: tuple[Span, ...]  # blocking runtime calls on the host thread
    modules: tuple[Span, ...]  # module annotations, name = module path
    trace_wall_ms: float  # mean window length (profiler on)
    plain_wall_ms: float  # median forward wall time without the profiler
    trace_path: str | None = None  # the Chrome/Perfetto trace, when one was written


# --------------------------------------------------------------------------- parsing


def _events(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(kind, event) for every complete event whose category we use."""
    out = []
    for ev in data.get("traceEvents", []):
        if not isinstance(ev, dict) or ev.get("ph") != "X" or "ts" not in ev:
            continue
        kind = _CATS.get(str(ev.get("cat", "")).lower())
        if kind is not None:
            out.append((kind, ev))
    return out


def _t(ev: dict[str, Any]) -> tuple[float, float]:
    return float(ev["ts"]), float(ev.get("dur", 0.0) or 0.0)


def _window_of(starts: list[float], windows: list[Span], ts: float) -> int:
    i = bisect.bisect_right(starts, ts) - 1
    return i if i >= 0 and ts <= windows[i].end_us else -1


def _host_table(host: list[tuple[str, dict[str, Any]]], windows: list[Span]) -> tuple[
        list[HostOp], list[Span], dict[Any, int], list[Span]]:
    """Nest host events by time: ops (with parent + module), module spans, correlation id ->
    launching op index, sync spans."""
    starts = [w.start_us for w in windows]
    host.sort(key=lambda ke: (float(ke[1]["ts"]), -float(ke[1].get("dur", 0.0) or 0.0)))
    ops: list[HostOp] = []
    modules: list[Span] = []
    launched_by: dict[Any, int] = {}
    syncs: list[Span] = []
    stack: list[tuple[float, int, str | None]] = []  # (end, op index | -1, module path | None)
    for kind, ev in host:
        ts, dur = _t(ev)
        it = _window_of(starts, windows, ts)
        if it < 0:
            continue
        while stack and stack[-1][0] <= ts:
            stack.pop()
        parent = next((s[1] for s in reversed(stack) if s[1] >= 0), -1)
        module = next((s[2] for s in reversed(stack) if s[2] is not None), "")
        name = str(ev.get("name", ""))
        if kind == "op" and not name.startswith("profiler::"):
            depth = ops[parent].depth + 1 if parent >= 0 else 0
            ops.append(HostOp(name, module, ts, dur, it, parent, depth))
            stack.append((ts + dur, len(ops) - 1, None))
        elif kind == "annotation" and name.startswith(MODULE_PREFIX):
            path = name[len(MODULE_PREFIX):]
            modules.append(Span(path, ts, dur, it))
            stack.append((ts + dur, -1, path))
        elif kind == "runtime":
            corr = (ev.get("args") or {}).get("correlation")
            if corr is not None and parent >= 0:
                launched_by[corr] = parent
            if SYNC_PATTERN.search(name):
                syncs.append(Span(name, ts, dur, it))
    return ops, modules, launched_by, syncs


def _kernel_table(gpu: list[dict[str, Any]], ops: list[HostOp], launched_by: dict[Any, int],
                  by_external: dict[Any, int], windows: list[Span]) -> list[Kernel]:
    starts = [w.start_us for w in windows]
    kernels = []
    for ev in gpu:
        args = ev.get("args") or {}
        op = launched_by.get(args.get("correlation"), by_external.get(args.get("External id"), -1))
        ts, dur = _t(ev)
        it = ops[op].iteration if op >= 0 else _window_of(starts, windows, ts)
        if it < 0:
            continue
        stream = args.get("stream", ev.get("tid", 0))
        kernels.append(Kernel(
            name=str(ev.get("name", "")), start_us=ts, dur_us=dur, iteration=it,
            stream=stream if isinstance(stream, int) else -1, op=op,
            op_name=ops[op].name if op >= 0 else "", module=ops[op].module if op >= 0 else ""))
    kernels.sort(key=lambda k: k.start_us)
    return kernels


def parse_chrome_trace(data: dict[str, Any], device_type: str, plain_wall_ms: float,
                       trace_path: str | None = None) -> Trace:
    """Parse an exported Chrome trace (already `json.load`-ed) into a Trace.

    Raises AdvisorError when there is no `advisor.iter` window, or when `device_type` is
    "cuda" and no kernel was captured (RELIABILITY.md #3: never an empty result).
    """
    events = _events(data)
    iters = sorted((ev for k, ev in events if k == "annotation" and ev.get("name") == ITER_NAME),
                   key=lambda ev: float(ev["ts"]))
    if not iters:
        raise AdvisorError(f"profiler trace has no '{ITER_NAME}' ranges: nothing was recorded")
    thread = (iters[0].get("pid"), iters[0].get("tid"))
    windows = [Span(ITER_NAME, *_t(ev), i) for i, ev in enumerate(iters)]
    host = [(k, ev) for k, ev in events
            if k in ("op", "annotation", "runtime") and (ev.get("pid"), ev.get("tid")) == thread]
    ops, modules, launched_by, syncs = _host_table(host, windows)
    op_ext = [(k, ev) for k, ev in host if k == "op"]
    by_external = _external_ids(op_ext, ops)
    gpu = [ev for k, ev in events if k == "kernel"]
    kernels = _kernel_table(gpu, ops, launched_by, by_external, windows)
    if device_type == "cuda" and not kernels:
        raise AdvisorError(
            f"no device kernels captured: the profiler saw {len(ops)} host ops but no CUDA "
            "kernels (is the model on the GPU? is CUPTI available to torch.profiler?)")
    ends = [w.end_us for w in windows]
    for k in kernels:
        ends[k.iteration] = max(ends[k.iteration], k.end_us)
    windows = [Span(w.name, w.start_us, ends[i] - w.start_us, i) for i, w in enumerate(windows)]
    return Trace(
        device_type=device_type, windows=tuple(windows), ops=tuple(ops), kernels=tuple(kernels),
        syncs=tuple(syncs), modules=tuple(modules),
        trace_wall_ms=statistics.fmean(w.dur_us for w in windows) / 1e3,
        plain_wall_ms=plain_wall_ms, trace_path=trace_path,
    )


def _external_ids(op_events: list[tuple[str, dict[str, Any]]], ops: list[HostOp]) -> dict[Any, int]:
    """External id -> op index, matching events to parsed ops by (name, start)."""
    index = {(op.name, op.start_us): i for i, op in enumerate(ops)}
    out = {}
    for _, ev in op_events:
        ext = (ev.get("args") or {}).get("External id")
        i = index.get((str(ev.get("name", "")), float(ev["ts"])))
        if ext is not None and i is not None:
            out[ext] = i
    return out


# --------------------------------------------------------------------------- capture


def _forward(model: torch.nn.Module, inputs: Inputs) -> Any:
    try:
        return call(model, inputs)
    except AdvisorError:
        raise
    except Exception as exc:
        msg = (str(exc).strip().splitlines() or [""])[0]
        raise AdvisorError(f"forward failed during profiling: {type(exc).__name__}: {msg}") from exc


def _plain_wall_ms(model: torch.nn.Module, inputs: Inputs, iters: int,
                   sync: Callable[[], None]) -> float:
    """Median wall ms of a forward (host issue + device drain), no profiler."""
    times = []
    for _ in range(max(iters, 1)):
        sync()
        t0 = time.perf_counter()
        _forward(model, inputs)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _record(model: torch.nn.Module, inputs: Inputs, dev: torch.device, iters: int,
            sync: Callable[[], None], path: Path) -> None:
    """Profile `iters` annotated forwards and export the Chrome trace to `path`."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    opened: list[Any] = []

    def enter(path: str) -> None:
        rf = record_function(MODULE_PREFIX + path)
        rf.__enter__()
        opened.append(rf)

    def leave(path: str) -> None:
        if opened:
            opened.pop().__exit__(None, None, None)

    with module_hooks(model, enter, leave):
        with profile(activities=acts, record_shapes=False) as prof:
            _forward(model, inputs)  # profiler start-up cost lands outside every window
            sync()
            for _ in range(iters):
                with record_function(ITER_NAME):
                    _forward(model, inputs)
                    sync()
    prof.export_chrome_trace(str(path))


def _load_json(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return json.load(fh)


def capture_trace(model: torch.nn.Module, inputs: Inputs, device: torch.device | str, *,
                  warmup: int = 3, iters: int = 5, trace_path: str | Path | None = None) -> Trace:
    """Profile `iters` warmed-up forwards of `model` on `device` and parse the trace.

    Raises AdvisorError when the forward fails, or when `device` is CUDA and no device
    kernels were captured (never an empty result). Writes the Chrome/Perfetto trace to
    `trace_path` when given.
    """
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    with torch.inference_mode(), tempfile.TemporaryDirectory(prefix="advisor-trace-") as tmp:
        for _ in range(warmup):
            _forward(model, inputs)
        sync()
        plain = _plain_wall_ms(model, inputs, iters, sync)
        path = Path(trace_path) if trace_path is not None else Path(tmp) / "trace.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        _record(model, inputs, dev, iters, sync, path)
        return parse_chrome_trace(_load_json(path), dev.type, plain,
                                  str(path) if trace_path is not None else None)
