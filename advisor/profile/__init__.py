"""Where does the time go? Device ceilings, a profiler trace, per-op costs -> a latency Budget.

One analysis per module behind this thin facade (Holistic Trace Analysis style):
``ceilings`` (measured, cached), ``costs`` (FLOPs / bytes per aten op), ``trace``
(torch.profiler, parsed once into a table), ``budget`` (pure: split wall time into
launch/host, memory, compute and idle/sync, per op). Importing it touches no CUDA.

Example::

    >>> import torch, advisor.profile as ap
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
    >>> b = ap.profile_model(model, (torch.randn(8, 64),), "cpu", "float32",
    ...                      warmup=1, iters=2)                    # doctest: +SKIP
    >>> sorted(b.categories) == sorted(ap.CATEGORIES)             # doctest: +SKIP
    True
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from advisor.loader import Inputs
from advisor.profile.budget import (
    CATEGORIES,
    Budget,
    OpBudget,
    build_budget,
    by_op_type,
    calibrated,
    gpu_busy_fraction,
    top_ops,
    verdict,
)
from advisor.profile.ceilings import Ceilings, load_or_measure, measure_ceilings, ridge
from advisor.profile.costs import OpCost, op_costs
from advisor.profile.trace import Trace, capture_trace

__all__ = [
    "CATEGORIES", "Budget", "OpBudget", "Ceilings", "OpCost", "Trace",
    "build_budget", "calibrated", "by_op_type", "capture_trace", "gpu_busy_fraction", "load_or_measure",
    "measure_ceilings", "op_costs", "profile_model", "ridge", "top_ops", "verdict",
]


def profile_model(model: torch.nn.Module, inputs: Inputs, device: torch.device | str,
                  dtype: Any, *, ceilings: Ceilings | None = None, warmup: int = 3,
                  iters: int = 5, trace_path: str | Path | None = None) -> Budget:
    """Costs pass + profiled forwards + budget, against `ceilings` (default: cached or
    measured for `device`), calibrated to the unprofiled wall time (see
    `budget.calibrated`). Raises AdvisorError when no device kernels are captured on CUDA."""
    c = ceilings if ceilings is not None else load_or_measure(device)
    costs = op_costs(model, inputs)
    trace = capture_trace(model, inputs, device, warmup=warmup, iters=iters,
                          trace_path=trace_path)
    return calibrated(build_budget(trace, costs, c, dtype))
