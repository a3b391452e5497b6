"""Split each forward's wall time into launch/host, memory, compute and idle/sync, per op.

Pure functions over a parsed `Trace`, a list of `OpCost` and measured `Ceilings`; testable
with hand-built traces. Within each iteration window (all times µs):

* device busy time = the union of kernel intervals; each kernel gets its exclusive part
  (overlap goes to the earliest kernel), classed *compute* when its op's FLOP/byte is at or
  above the ridge of the op's dtype, else *memory* (ops without costs: memory);
* a GPU-idle gap is *idle_sync* where it overlaps a blocking runtime call (synchronize,
  memcpy), else *launch_host*: the GPU waited for the host to issue work. Each gap piece is
  charged to the op row that the host was in then, or to "(python)" in the innermost module;
* on the CPU (no kernels), each op's duration is its "device" time, classed the same way,
  and the time between ops (Python, dispatch, views) is launch_host.

So the four categories sum to the window length; ``wall_ms`` is defined as their sum (the
mean window), so ``sum(budget.categories.values()) == budget.wall_ms`` holds exactly.

Ops and the join with costs: the costs pass records the ops that reach the Python
dispatch key under inference_mode, which are the profiler's top-level aten ops. A host op
is an *anchor* (a row with costs) when its (module, name) is costed; its subtree is part of
it. Anchors are numbered per (module, name) in time order, per window, and joined on
(module, op, index); a missing index falls back to the op name's average cost over all
modules. A top-level op with no costed op inside it becomes an anchor with that fallback
(or zero) cost, so nothing is dropped and nothing raises.

Example::

    >>> b = build_budget(trace, costs, ceilings, "bfloat16")     # doctest: +SKIP
    >>> abs(sum(b.categories.values()) - b.wall_ms) == 0          # doctest: +SKIP
    True
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from advisor.errors import AdvisorError
from advisor.profile.ceilings import Ceilings, dtype_name, ridge
from advisor.profile.costs import OpCost
from advisor.profile.trace import Trace

__all__ = ["CATEGORIES", "PYTHON", "UNATTRIBUTED", "OpBudget", "Budget", "build_budget",
           "by_op_type", "top_ops", "verdict", "gpu_busy_fraction"]

CATEGORIES = ("launch_host", "memory", "compute", "idle_sync")
PYTHON = "(python)"  # host time outside any op
UNATTRIBUTED = "(unattributed)"  # kernels whose launching op is unknown
Key = tuple[str, str]  # (module, op)
Interval = tuple[float, float]


@dataclass(frozen=True)
class OpBudget:
    """Per-forward time and cost of one op in one module (all calls summed)."""

    op: str  # "aten::linear", "(python)", "(unattributed)"
    module: str  # module path, "" at the top
    calls: int  # calls per forward
    kernels: int  # device kernels per forward (on the CPU: timed op calls)
    device_ms: float  # memory_ms + compute_ms
    launch_host_ms: float  # GPU-idle time while the host was in this op
    idle_sync_ms: float  # GPU-idle time while the host blocked in a sync inside this op
    memory_ms: float
    compute_ms: float
    flops: float  # per forward
    bytes: int  # per forward
    intensity: float  # flops / bytes (FLOP/byte); 0 without bytes
    roofline: str  # "launch-bound" / "memory-bound" / "compute-bound"
    achieved_gbps: float  # bytes / device time / 1e9
    achieved_tflops: float  # flops / device time / 1e12


@dataclass(frozen=True)
class Budget:
    """Where one forward's wall time goes, against this device's ceilings."""

    wall_ms: float  # == sum(categories.values()), mean profiled forward
    categories: dict[str, float]  # CATEGORIES -> ms per forward
    ops: tuple[OpBudget, ...]  # most expensive first
    device_type: str
    dtype: str
    iterations: int  # forwards averaged
    plain_wall_ms: float  # forward wall time without the profiler
    ridge: float  # FLOP/byte of `dtype` on this device
    launch_us: float  # eager launch cost used for the launch-bound test
    # Before `calibrated`: the traced categories and their sum (the profiled window), kept
    # so the profiler's own overhead stays visible; empty / 0 on an uncalibrated budget.
    profiled_categories: dict[str, float] = dataclasses.field(default_factory=dict)
    profiled_wall_ms: float = 0.0


# --------------------------------------------------------------------------- intervals


def _union(intervals: Iterable[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _complement(busy: list[Interval], w0: float, w1: float) -> list[Interval]:
    """[w0, w1] minus sorted disjoint `busy`."""
    out, cur = [], w0
    for s, e in busy:
        if s > cur:
            out.append((cur, min(s, w1)))
        cur = max(cur, e)
    if cur < w1:
        out.append((cur, w1))
    return [(s, e) for s, e in out if e > s]


def _intersect(a: list[Interval], b: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Pieces of sorted disjoint `a` inside sorted disjoint `b` rows (s, e, *payload)."""
    out, j = [], 0
    for s, e in a:
        while j < len(b) and b[j][1] <= s:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            lo, hi = max(s, b[k][0]), min(e, b[k][1])
            if hi > lo:
                out.append((lo, hi, *b[k][2:]))
            k += 1
    return out


def _segments(spans: list[tuple[float, float, Key]], w0: float, w1: float,
              default: Key) -> list[tuple[float, float, Key]]:
    """Cut [w0, w1] into pieces labelled by the innermost of properly nested `spans`."""
    out: list[tuple[float, float, Key]] = []
    stack: list[tuple[float, Key]] = [(w1, default)]
    cur = w0

    def emit(end: float, key: Key) -> None:
        nonlocal cur
        if end > cur:
            out.append((cur, end, key))
            cur = end

    for s, e, key in sorted(spans, key=lambda x: (x[0], -x[1])):
        s = max(s, w0)
        while len(stack) > 1 and stack[-1][0] <= s:
            emit(*stack.pop())
        emit(s, stack[-1][1])
        stack.append((min(e, stack[-1][0]), key))
    while stack:
        emit(*stack.pop())
    return out


# --------------------------------------------------------------------------- op join


@dataclass(frozen=True)
class _Cost:
    flops: float
    bytes: float
    dtype: str
    launches: float


def _cost_tables(costs: Sequence[OpCost]) -> tuple[dict[tuple[str, str, int], _Cost],
                                                   dict[str, set[str]], dict[str, _Cost]]:
    """(module, op, index) -> cost; module -> costed op names; op -> average cost."""
    exact = {(c.module, c.op, c.index): _Cost(c.flops, c.bytes, c.dtype, c.launches)
             for c in costs}
    names: dict[str, set[str]] = defaultdict(set)
    by_name: dict[str, list[OpCost]] = defaultdict(list)
    for c in costs:
        names[c.module].add(c.op)
        by_name[c.op].append(c)
    avg = {op: _Cost(sum(c.flops for c in cs) / len(cs), sum(c.bytes for c in cs) / len(cs),
                     cs[0].dtype, sum(c.launches for c in cs) / len(cs))
           for op, cs in by_name.items()}
    return exact, names, avg


def _anchors(trace: Trace, costs: Sequence[OpCost]) -> tuple[list[int], dict[int, _Cost | None]]:
    """For each op: the anchor op it belongs to (-1: none); and each anchor's cost."""
    exact, names, avg = _cost_tables(costs)
    anchor = [-1] * len(trace.ops)
    cost: dict[int, _Cost | None] = {}
    has_anchor = [False] * len(trace.ops)
    counts: dict[tuple[int, str, str], int] = defaultdict(int)
    for i, op in enumerate(trace.ops):  # parents come before children
        if op.parent >= 0 and anchor[op.parent] >= 0:
            anchor[i] = anchor[op.parent]
        elif op.name in names.get(op.module, ()):
            n = counts[(op.iteration, op.module, op.name)]
            counts[(op.iteration, op.module, op.name)] += 1
            anchor[i] = i
            cost[i] = exact.get((op.module, op.name, n), avg.get(op.name))
            p = op.parent
            while p >= 0 and not has_anchor[p]:
                has_anchor[p] = True
                p = trace.ops[p].parent
    for i, op in enumerate(trace.ops):  # top-level ops with nothing costed inside
        if op.parent < 0 and anchor[i] < 0 and not has_anchor[i]:
            anchor[i], cost[i] = i, avg.get(op.name)
    return anchor, cost


def _row_keys(trace: Trace, anchor: list[int]) -> list[Key]:
    """Row of each op: its anchor's (module, name), else its top-level ancestor's."""
    top: list[int] = []
    for i, op in enumerate(trace.ops):
        top.append(i if op.parent < 0 else top[op.parent])
    return [(trace.ops[a].module, trace.ops[a].name) if a >= 0
            else (trace.ops[top[i]].module, trace.ops[top[i]].name)
            for i, a in enumerate(anchor)]


# --------------------------------------------------------------------------- budget


@dataclass
class _Acc:
    calls: int = 0
    kernels: int = 0
    memory: float = 0.0  # µs, summed over windows
    compute: float = 0.0
    launch_host: float = 0.0
    idle_sync: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    dtype: str = ""


def _work(trace: Trace, anchor: list[int], cost: dict[int, _Cost | None],
          it: int) -> list[tuple[float, float, int]]:
    """Device work of window `it` as (start, end, op index): kernels, or on the CPU the
    anchors that do work (views and zero-launch ops are host overhead)."""
    if trace.kernels or trace.device_type == "cuda":
        return [(k.start_us, k.end_us, k.op) for k in trace.kernels if k.iteration == it]
    out = []
    for i, op in enumerate(trace.ops):
        c = cost.get(i)
        if op.iteration == it and anchor[i] == i and (c is None or c.launches > 0):
            out.append((op.start_us, op.end_us, i))
    return out


def _charge(acc: _Acc, cat: str, us: float, cats: dict[str, float]) -> None:
    setattr(acc, cat, getattr(acc, cat) + us)
    cats[cat] += us


def _device(trace: Trace, it: int, anchor: list[int], cost: dict[int, _Cost | None],
            rows: list[Key], ridges: dict[str, float], acc: dict[Key, _Acc],
            cats: dict[str, float]) -> list[Interval]:
    """Charge window `it`'s device work to memory/compute; returns the busy intervals."""
    w = trace.windows[it]
    busy, covered = [], w.start_us
    for s, e, i in sorted(_work(trace, anchor, cost, it)):
        s, e = max(s, covered), min(e, w.end_us)  # exclusive part: overlap -> earliest
        if e <= s:
            continue
        covered = e
        busy.append((s, e))
        key = rows[i] if i >= 0 else ("", UNATTRIBUTED)
        c = cost.get(anchor[i]) if i >= 0 else None
        compute = c is not None and c.flops > 0 and (
            c.bytes == 0 or c.flops / c.bytes >= ridges.get(c.dtype, ridges[""]))
        _charge(acc[key], "compute" if compute else "memory", e - s, cats)
        acc[key].kernels += 1
    return _union(busy)


def _gaps(trace: Trace, it: int, busy: list[Interval], rows: list[Key], acc: dict[Key, _Acc],
          cats: dict[str, float]) -> None:
    """Charge window `it`'s device-idle gaps to idle_sync / launch_host, per host row."""
    w = trace.windows[it]
    gaps = _complement(busy, w.start_us, w.end_us)
    syncs = _union((s.start_us, s.end_us) for s in trace.syncs if s.iteration == it)
    spans = [(m.start_us, m.end_us, (m.name, PYTHON)) for m in trace.modules if m.iteration == it]
    spans += [(op.start_us, op.end_us, rows[i]) for i, op in enumerate(trace.ops)
              if op.iteration == it]
    segs = _segments(spans, w.start_us, w.end_us, ("", PYTHON))
    parts = (("idle_sync", _intersect(gaps, syncs)),
             ("launch_host", _intersect(gaps, _complement(syncs, w.start_us, w.end_us))))
    for cat, pieces in parts:
        for s, e, key in _intersect([(p[0], p[1]) for p in pieces], segs):
            _charge(acc[key], cat, e - s, cats)


def _finish(op: str, module: str, a: _Acc, n: int, ridge_: float, launch_us: float) -> OpBudget:
    """Per-forward row from sums over `n` windows (µs -> ms)."""
    device = (a.memory + a.compute) / n / 1e3
    host = a.launch_host / n / 1e3
    kernels = round(a.kernels / n)
    flops, nbytes = a.flops / n, a.bytes / n
    intensity = flops / nbytes if nbytes else 0.0
    if device <= 0 or host > device or device * 1e3 / max(kernels, 1) < 2 * launch_us:
        roofline = "launch-bound"
    else:
        roofline = "compute-bound" if intensity >= ridge_ else "memory-bound"
    return OpBudget(
        op=op, module=module, calls=round(a.calls / n), kernels=kernels, device_ms=device,
        launch_host_ms=host, idle_sync_ms=a.idle_sync / n / 1e3, memory_ms=a.memory / n / 1e3,
        compute_ms=a.compute / n / 1e3, flops=flops, bytes=round(nbytes), intensity=intensity,
        roofline=roofline, achieved_gbps=nbytes / device / 1e6 if device else 0.0,
        achieved_tflops=flops / device / 1e9 if device else 0.0)


def _total_ms(r: OpBudget) -> float:
    return r.device_ms + r.launch_host_ms + r.idle_sync_ms


def build_budget(trace: Trace, costs: Sequence[OpCost], ceilings: Ceilings,
                 dtype: Any) -> Budget:
    """Per-forward latency budget of `trace`, joined with `costs`, judged on `ceilings`."""
    n = len(trace.windows)
    if n == 0:
        raise AdvisorError("trace has no iteration windows: no forward was recorded")
    if trace.device_type == "cuda" and not trace.kernels:
        raise AdvisorError("no device kernels captured: a CUDA budget would be empty")
    anchor, cost = _anchors(trace, costs)
    rows = _row_keys(trace, anchor)
    dname = dtype_name(dtype)
    ridges = {d: ridge(ceilings, d) for d in ceilings.matmul_tflops} | {"": ridge(ceilings, dname)}
    acc: dict[Key, _Acc] = defaultdict(_Acc)
    for i, a in enumerate(anchor):
        if a == i:
            c = cost[i]
            r = acc[rows[i]]
            r.calls += 1
            r.flops += c.flops if c else 0.0
            r.bytes += c.bytes if c else 0.0
            r.dtype = r.dtype or (c.dtype if c else "")
    totals = dict.fromkeys(CATEGORIES, 0.0)  # µs over all windows
    for it in range(n):
        busy = _device(trace, it, anchor, cost, rows, ridges, acc, totals)
        _gaps(trace, it, busy, rows, acc, totals)
    cats = {k: totals[k] / n / 1e3 for k in CATEGORIES}
    ops = [_finish(op, module, a, n, ridges.get(a.dtype, ridges[""]), ceilings.launch_us)
           for (module, op), a in acc.items()]
    return Budget(
        wall_ms=sum(cats.values()), categories=cats, ops=tuple(sorted(ops, key=_total_ms,
                                                                     reverse=True)),
        device_type=trace.device_type, dtype=dname, iterations=n,
        plain_wall_ms=trace.plain_wall_ms, ridge=ridges[""], launch_us=ceilings.launch_us)


def calibrated(budget: Budget) -> Budget:
    """The budget with the profiler's own overhead taken out, summing to `plain_wall_ms`.

    The profiler records every op on the host, which slows the host side (2x seen on the
    CPU) but not the kernels. So device time (memory, compute) and sync waits are kept as
    traced, and the launch/host share — total and per op, in proportion — is rescaled so
    the categories add up to the wall time measured without the profiler. If the traced
    device time alone exceeds that wall time (noise at GPU-bound sizes), launch/host
    becomes 0 and the sum stays the traced device time.
    """
    c = budget.categories
    fixed = c["memory"] + c["compute"] + c["idle_sync"]
    host = max(0.0, budget.plain_wall_ms - fixed)
    scale = host / c["launch_host"] if c["launch_host"] > 0 else 0.0
    cats = {**c, "launch_host": host if c["launch_host"] > 0 else 0.0}
    ops = tuple(dataclasses.replace(r, launch_host_ms=r.launch_host_ms * scale) for r in budget.ops)
    return dataclasses.replace(budget, categories=cats, wall_ms=sum(cats.values()),
                               ops=tuple(sorted(ops, key=_total_ms, reverse=True)),
                               profiled_categories=dict(c), profiled_wall_ms=budget.wall_ms)


# --------------------------------------------------------------------------- views


def by_op_type(budget: Budget) -> tuple[OpBudget, ...]:
    """Rows summed over modules, one per op name (module ""), most expensive first."""
    acc: dict[str, _Acc] = defaultdict(_Acc)
    for r in budget.ops:
        a = acc[r.op]
        a.calls += r.calls
        a.kernels += r.kernels
        a.memory += r.memory_ms * 1e3
        a.compute += r.compute_ms * 1e3
        a.launch_host += r.launch_host_ms * 1e3
        a.idle_sync += r.idle_sync_ms * 1e3
        a.flops += r.flops
        a.bytes += r.bytes
    rows = [_finish(op, "", a, 1, budget.ridge, budget.launch_us) for op, a in acc.items()]
    return tuple(sorted(rows, key=_total_ms, reverse=True))


def top_ops(budget: Budget, n: int = 10) -> tuple[OpBudget, ...]:
    """The `n` rows with the most time (device + launch/host + idle/sync)."""
    return budget.ops[:n]


def gpu_busy_fraction(budget: Budget) -> float:
    """Share of the wall time the device was doing work (memory + compute)."""
    busy = budget.categories["memory"] + budget.categories["compute"]
    return busy / budget.wall_ms if budget.wall_ms > 0 else 0.0


def verdict(budget: Budget) -> str:
    """"launch/host-bound", "memory-bound" or "compute-bound": the largest share, where
    launch/host counts launch_host + idle_sync (the device waiting on the host)."""
    c = budget.categories
    shares = {"launch/host-bound": c["launch_host"] + c["idle_sync"],
              "memory-bound": c["memory"], "compute-bound": c["compute"]}
    return max(shares, key=lambda k: shares[k])
