"""advisor.profile: budget arithmetic on synthetic traces, costs, trace capture, ceilings.

CPU and fast; the two CUDA tests at the end run only where a GPU is present.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import advisor.profile as ap
from advisor.env import env_key, environment
from advisor.errors import AdvisorError
from advisor.profile import ceilings as ceil_mod
from advisor.profile.budget import PYTHON, by_op_type, gpu_busy_fraction, top_ops, verdict
from advisor.profile.costs import OpCost
from advisor.profile.trace import HostOp, Kernel, Span, Trace, parse_chrome_trace

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Ridge 100 FLOP/byte for every dtype: 100 TFLOP/s over 1000 GB/s.
CEIL = ap.Ceilings(
    device_name="synthetic", device_type="cuda", copy_gbps=1000.0,
    matmul_tflops={"float32": 100.0, "float16": 100.0, "bfloat16": 100.0},
    launch_us=1.0, graph_launch_us=0.5, env={}, measured_at="", method="synthetic")


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"_ex_{name}", EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- synthetic traces


def _cuda_trace(shift: float = 0.0, windows: int = 1) -> Trace:
    """One window [0, 100] µs (repeated `windows` times, 1000 µs apart):

    host:    python [0,10) | mm [10,30) | python | add [40,60) | python | sync [80,100)
    module "m" spans [5, 65]; kernels: mm's [20,50), add's [55,70).
    """
    ops, kernels, syncs, mods, wins = [], [], [], [], []
    for it in range(windows):
        t = shift + 1000.0 * it
        base = len(ops)
        wins.append(Span("advisor.iter", t, 100.0, it))
        mods.append(Span("m", t + 5, 60.0, it))
        ops += [HostOp("aten::mm", "m", t + 10, 20.0, it, -1, 0),
                HostOp("aten::empty", "m", t + 12, 1.0, it, base, 1),
                HostOp("aten::add", "m", t + 40, 20.0, it, -1, 0)]
        kernels += [Kernel("gemm", t + 20, 30.0, it, 7, base, "aten::mm", "m"),
                    Kernel("add_kernel", t + 55, 15.0, it, 7, base + 2, "aten::add", "m")]
        syncs.append(Span("cudaDeviceSynchronize", t + 80, 20.0, it))
    return Trace("cuda", tuple(wins), tuple(ops), tuple(kernels), tuple(syncs), tuple(mods),
                 trace_wall_ms=0.1, plain_wall_ms=0.09)


COSTS = [OpCost("aten::mm", "m", 0, flops=2e6, bytes=10_000, dtype="float32", launches=1),
         OpCost("aten::add", "m", 0, flops=1e3, bytes=12_000, dtype="float32", launches=1)]


def _row(b, module, op):
    return next(r for r in b.ops if (r.module, r.op) == (module, op))


def test_budget_categories_sum_exactly_and_split_as_expected():
    b = ap.build_budget(_cuda_trace(shift=1234.5678), COSTS, CEIL, "float32")
    assert sum(b.categories.values()) == b.wall_ms
    assert b.wall_ms == pytest.approx(0.100)
    c = {k: v * 1e3 for k, v in b.categories.items()}  # µs
    assert c["compute"] == pytest.approx(30.0)  # mm: 2e6 / 1e4 = 200 FLOP/B >= ridge 100
    assert c["memory"] == pytest.approx(15.0)  # add: 0.08 FLOP/B
    assert c["idle_sync"] == pytest.approx(20.0)  # gap [70,100) overlapping the sync [80,100)
    assert c["launch_host"] == pytest.approx(35.0)  # [0,20) + [50,55) + [70,80)
    assert gpu_busy_fraction(b) == pytest.approx(0.45)
    assert verdict(b) == "launch/host-bound"  # 35 + 20 host-side vs 30 compute vs 15 memory


def test_budget_gap_attribution_to_host_ops_and_python():
    b = ap.build_budget(_cuda_trace(), COSTS, CEIL, "float32")
    mm, add = _row(b, "m", "aten::mm"), _row(b, "m", "aten::add")
    assert mm.launch_host_ms * 1e3 == pytest.approx(10.0)  # gap [10,20) while host in mm
    assert add.launch_host_ms * 1e3 == pytest.approx(5.0)  # gap [50,55) while host in add
    assert _row(b, "m", PYTHON).launch_host_ms * 1e3 == pytest.approx(5.0)  # [5,10) in "m"
    top = _row(b, "", PYTHON)
    assert top.launch_host_ms * 1e3 == pytest.approx(15.0)  # [0,5) + [70,80)
    assert top.idle_sync_ms * 1e3 == pytest.approx(20.0)
    assert sum(r.launch_host_ms for r in b.ops) == pytest.approx(b.categories["launch_host"])
    assert (mm.calls, mm.kernels, mm.flops, mm.bytes) == (1, 1, 2e6, 10_000)
    assert mm.roofline == "compute-bound"
    assert mm.achieved_tflops == pytest.approx(2e6 / 30e-6 / 1e12)
    assert add.roofline == "memory-bound" and add.device_ms == pytest.approx(0.015)


def test_budget_averages_windows_and_aggregates():
    b = ap.build_budget(_cuda_trace(windows=3), COSTS, CEIL, "float32")
    assert b.iterations == 3 and b.wall_ms == pytest.approx(0.100)
    assert sum(b.categories.values()) == b.wall_ms
    assert _row(b, "m", "aten::mm").calls == 1  # per forward
    kinds = {r.op for r in by_op_type(b)}
    assert {"aten::mm", "aten::add", PYTHON} <= kinds
    assert top_ops(b, 1)[0].device_ms + top_ops(b, 1)[0].launch_host_ms >= 0.030 - 1e-9


def test_budget_ridge_classifies_by_intensity():
    low_ridge = dataclasses.replace(CEIL, matmul_tflops={"float32": 0.01, "float16": 0.01,
                                                         "bfloat16": 0.01})
    b = ap.build_budget(_cuda_trace(), COSTS, low_ridge, "float32")  # ridge 0.01: both compute
    assert b.categories["memory"] == 0 and b.categories["compute"] * 1e3 == pytest.approx(45.0)


def test_budget_unmatched_ops_fall_back_and_never_crash():
    b = ap.build_budget(_cuda_trace(), [], CEIL, "float32")  # no costs at all
    assert sum(b.categories.values()) == b.wall_ms
    assert b.categories["compute"] == 0  # no costs -> memory
    other = [OpCost("aten::mm", "elsewhere", 0, 4e6, 10_000, "float32", 1)]
    b2 = ap.build_budget(_cuda_trace(), other, CEIL, "float32")  # name-only average
    assert _row(b2, "m", "aten::mm").flops == 4e6


def test_budget_cpu_uses_op_durations_as_device_time():
    t = _cuda_trace()
    cpu = dataclasses.replace(t, device_type="cpu", kernels=(), syncs=())
    b = ap.build_budget(cpu, COSTS, CEIL, "float32")
    assert sum(b.categories.values()) == b.wall_ms
    assert b.categories["compute"] * 1e3 == pytest.approx(20.0)  # mm [10,30)
    assert b.categories["memory"] * 1e3 == pytest.approx(20.0)  # add [40,60)
    assert b.categories["launch_host"] * 1e3 == pytest.approx(60.0)


def test_cuda_trace_without_kernels_raises():
    t = dataclasses.replace(_cuda_trace(), kernels=())
    with pytest.raises(AdvisorError, match="no device kernels"):
        ap.build_budget(t, COSTS, CEIL, "float32")
    with pytest.raises(AdvisorError, match="no device kernels"):
        parse_chrome_trace(_chrome(kernel=False), "cuda", 1.0)


def _chrome(kernel: bool = True) -> dict:
    """A minimal CUDA-style Chrome trace: iter > module > linear > mm > cudaLaunchKernel."""
    host = {"pid": 1, "tid": 1, "ph": "X"}
    ev = [
        {**host, "cat": "user_annotation", "name": "advisor.iter", "ts": 0, "dur": 100},
        {**host, "cat": "user_annotation", "name": "advisor.module:layers.0.wq", "ts": 5,
         "dur": 50},
        {**host, "cat": "cpu_op", "name": "aten::linear", "ts": 10, "dur": 30,
         "args": {"External id": 3}},
        {**host, "cat": "cpu_op", "name": "aten::mm", "ts": 15, "dur": 20,
         "args": {"External id": 4}},
        {**host, "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 20, "dur": 5,
         "args": {"correlation": 42}},
        {**host, "cat": "cuda_runtime", "name": "cudaDeviceSynchronize", "ts": 60, "dur": 39},
        {"pid": 0, "tid": 7, "ph": "X", "cat": "kernel", "name": "sm90_gemm", "ts": 30,
         "dur": 40, "args": {"correlation": 42, "stream": 7}},
    ]
    return {"traceEvents": [e for e in ev if kernel or e["cat"] != "kernel"]}


def test_parse_chrome_trace_attributes_kernels_to_ops_and_modules():
    t = parse_chrome_trace(_chrome(), "cuda", 0.5)
    assert [(o.name, o.module, o.parent, o.depth) for o in t.ops] == [
        ("aten::linear", "layers.0.wq", -1, 0), ("aten::mm", "layers.0.wq", 0, 1)]
    (k,) = t.kernels
    assert (k.op_name, k.module, k.op, k.stream) == ("aten::mm", "layers.0.wq", 1, 7)
    assert [s.name for s in t.syncs] == ["cudaDeviceSynchronize"]
    assert t.trace_wall_ms == pytest.approx(0.1) and t.plain_wall_ms == 0.5
    b = ap.build_budget(t, [OpCost("aten::linear", "layers.0.wq", 0, 1e3, 100, "float32", 1)],
                        CEIL, "float32")
    assert _row(b, "layers.0.wq", "aten::linear").device_ms == pytest.approx(0.040)
    assert sum(b.categories.values()) == b.wall_ms


# --------------------------------------------------------------------------- costs


class _Proj(nn.Module):
    def __init__(self, k: int, n: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(k, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.mm(x, self.w)  # (M, N)
        return torch.mm(h, self.w.t())  # (M, K)


class _Tiny(nn.Module):
    def __init__(self, m: int, k: int, n: int):
        super().__init__()
        self.proj = _Proj(k, n)
        self.lin = nn.Linear(k, 24, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)  # (M, K)
        z = self.lin(y.view(1, *y.shape))  # (1, M, 24)
        return z.relu()


def test_op_costs_flops_bytes_views_and_module_paths():
    m, k, n = 7, 33, 10
    costs = ap.op_costs(_Tiny(m, k, n), (torch.randn(m, k),))
    by = {(c.module, c.op, c.index): c for c in costs}
    mm0, mm1 = by[("proj", "aten::mm", 0)], by[("proj", "aten::mm", 1)]
    assert mm0.flops == 2 * m * n * k and mm0.bytes == 4 * (m * k + k * n + m * n)
    assert mm1.flops == 2 * m * k * n and mm0.launches == 1 and mm0.dtype == "float32"
    views = [c for c in costs if c.op in ("aten::t", "aten::view")]
    assert len(views) == 2 and all(c.flops == 0 and c.bytes == 0 and c.launches == 0 for c in views)
    assert by[("lin", "aten::linear", 0)].flops == 2 * m * k * 24
    relu = by[("", "aten::relu", 0)]
    assert relu.flops == m * 24 and relu.bytes == 2 * 4 * m * 24
    assert not any(mod._forward_hooks or mod._forward_pre_hooks
                   for mod in _Tiny(m, k, n).modules())


# --------------------------------------------------------------------------- trace on CPU


@pytest.fixture(scope="module")
def tiny_llama():
    ex = _load_example("tiny_llama")
    model = ex.build_model(torch.device("cpu"), torch.float32)
    return model, ex.make_inputs(16, 2, torch.device("cpu"))


def test_capture_trace_tiny_llama_cpu(tiny_llama, tmp_path):
    model, inputs = tiny_llama
    out = tmp_path / "trace.json"
    t = ap.capture_trace(model, inputs, "cpu", warmup=1, iters=2, trace_path=out)
    assert len(t.windows) == 2 and t.device_type == "cpu" and t.kernels == ()
    assert out.is_file() and json.loads(out.read_text())["traceEvents"]
    assert ("layers.0.attention.wq", "aten::linear") in {(o.module, o.name) for o in t.ops}
    assert {"layers.1.feed_forward", "layers.0.attention"} <= {m.name for m in t.modules}
    assert t.plain_wall_ms > 0 and t.trace_wall_ms > 0
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())

    costs = ap.op_costs(model, inputs)
    top = [(o.module, o.name) for o in t.ops if o.depth == 0 and o.iteration == 0]
    assert top == [(c.module, c.op) for c in costs]  # the join key lines up one to one
    b = ap.build_budget(t, costs, dataclasses.replace(CEIL, device_type="cpu"), "float32")
    assert sum(b.categories.values()) == b.wall_ms and b.categories["idle_sync"] == 0
    wq = _row(b, "layers.0.attention.wq", "aten::linear")
    assert wq.calls == 1 and wq.flops == 2 * 2 * 16 * 128 * 128


def test_profile_model_facade(tiny_llama):
    model, inputs = tiny_llama
    b = ap.profile_model(model, inputs, "cpu", torch.float32,
                         ceilings=dataclasses.replace(CEIL, device_type="cpu"), warmup=1, iters=1)
    assert b.iterations == 1 and b.device_type == "cpu" and b.dtype == "float32"
    assert sum(b.categories.values()) == b.wall_ms > 0


def test_forward_failure_is_one_clear_error():
    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("bad shape\nmore")

    with pytest.raises(AdvisorError, match="forward failed during profiling: ValueError: bad"):
        ap.capture_trace(Boom(), (torch.zeros(1),), "cpu", warmup=1, iters=1)


# --------------------------------------------------------------------------- env + ceilings


def test_environment_and_key():
    env = environment("cpu")
    assert {"device_name", "capability", "torch", "triton", "advisor", "python"} <= set(env)
    assert env["capability"] is None and env["torch"] == torch.__version__
    assert env_key(env) == env_key(dict(reversed(list(env.items()))))
    assert env_key(env) != env_key({**env, "torch": "0.0"}) and len(env_key(env)) == 16


@pytest.fixture(scope="module")
def cpu_ceilings():
    return ap.measure_ceilings("cpu")


def test_measure_ceilings_cpu(cpu_ceilings):
    c = cpu_ceilings
    assert c.device_type == "cpu" and c.graph_launch_us is None and c.env == environment("cpu")
    assert c.copy_gbps > 0 and c.launch_us > 0 and c.method
    assert all(c.matmul_tflops[d] > 0 and math.isfinite(c.matmul_tflops[d])
               for d in ("float32", "float16", "bfloat16"))
    assert ap.ridge(c, torch.bfloat16) == pytest.approx(
        c.matmul_tflops["bfloat16"] * 1e12 / (c.copy_gbps * 1e9))


def test_ceilings_cache_round_trip_and_corrupt_file(cpu_ceilings, tmp_path, monkeypatch):
    calls = []

    def fake_measure(device):
        calls.append(device)
        return cpu_ceilings

    monkeypatch.setattr(ceil_mod, "measure_ceilings", fake_measure)
    first = ap.load_or_measure("cpu", cache_dir=tmp_path)
    (path,) = tmp_path.glob("ceilings-cpu-*.json")
    assert first == cpu_ceilings and len(calls) == 1
    assert ap.load_or_measure("cpu", cache_dir=tmp_path) == cpu_ceilings and len(calls) == 1
    path.write_text('{"schema_version": 1, "copy_gbps": ')  # truncated
    assert ap.load_or_measure("cpu", cache_dir=tmp_path) == cpu_ceilings and len(calls) == 2
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "copy_gbps": -1.0}))  # nonsense value
    ap.load_or_measure("cpu", cache_dir=tmp_path)
    assert len(calls) == 3 and json.loads(path.read_text())["copy_gbps"] > 0
    ap.load_or_measure("cpu", cache_dir=tmp_path, refresh=True)
    assert len(calls) == 4 and not list(tmp_path.glob("*.tmp"))
    monkeypatch.setenv("ADVISOR_CACHE_DIR", str(tmp_path / "env"))
    ap.load_or_measure("cpu")
    assert list((tmp_path / "env").glob("ceilings-cpu-*.json"))


# --------------------------------------------------------------------------- CUDA (GPU only)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_cuda_trace_and_budget_tiny_llama():
    ex = _load_example("tiny_llama")
    dev = torch.device("cuda")
    model = ex.build_model(dev, torch.bfloat16)
    inputs = ex.make_inputs(64, 2, dev)
    c = ap.measure_ceilings(dev)
    assert c.graph_launch_us is not None and c.graph_launch_us > 0 and c.copy_gbps > 100
    t = ap.capture_trace(model, inputs, dev, warmup=2, iters=3)
    assert t.kernels and t.syncs
    attributed = [k for k in t.kernels if k.op >= 0]
    assert len(attributed) >= 0.9 * len(t.kernels)
    assert "layers.0.attention.wq" in {k.module for k in attributed}
    b = ap.build_budget(t, ap.op_costs(model, inputs), c, torch.bfloat16)
    assert sum(b.categories.values()) == b.wall_ms > 0 and 0 < gpu_busy_fraction(b) <= 1
    wq = _row(b, "layers.0.attention.wq", "aten::linear")
    assert wq.kernels >= 1 and wq.device_ms > 0 and wq.flops == 2 * 2 * 64 * c_in(model) ** 2


def c_in(model: nn.Module) -> int:
    return model.layers[0].attention.wq.in_features


def test_calibrated_budget_sums_to_plain_wall_time():
    """Profiler overhead is taken out of launch/host only; device time is kept."""
    import dataclasses

    from advisor.profile.budget import CATEGORIES, Budget, calibrated

    cats = {"launch_host": 6.0, "memory": 3.0, "compute": 1.0, "idle_sync": 0.5}
    b = Budget(wall_ms=10.5, categories=cats, ops=(), device_type="cuda", dtype="bfloat16",
               iterations=3, plain_wall_ms=7.5, ridge=200.0, launch_us=8.0)
    c = calibrated(b)
    assert sum(c.categories[k] for k in CATEGORIES) == c.wall_ms == 7.5
    assert c.categories["launch_host"] == 3.0 and c.categories["memory"] == 3.0
    assert c.profiled_wall_ms == 10.5 and c.profiled_categories == cats  # overhead stays visible
    slow = calibrated(dataclasses.replace(b, plain_wall_ms=4.0))  # device time > plain wall
    assert slow.categories["launch_host"] == 0.0 and slow.wall_ms == 4.5
