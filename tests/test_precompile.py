"""Precompiling a recipe's kernels in forked workers (runtime/precompile.py).

No GPU here: a stand-in driver answers Triton's device and target queries (sm_90), so the
JIT path and the workers both really compile (Triton's code generation and ptxas) for
that target into on-disk caches. The test that matters: a worker, given only the
serialised specialisation the JIT's hook recorded, writes the cache entry the JIT path
itself reads (same key), so the parent's first call finds its kernels compiled.
"""

from __future__ import annotations

import json
import os
import sys
import types

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from advisor.errors import RecipeError
from advisor.runtime import kernel_spec, precompile
from advisor.runtime.plan import Plan
from advisor.runtime.recipe import Bucket, Recipe, recipe_from_json

PROBE = "advisor.kernels._precompile_probe"  # a kernel module name the resolver accepts


def _double(x, y, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + i, tl.load(x + i, mask=i < n) * 2, mask=i < n)


def _other(x, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)


class _Driver:
    """Triton's driver without a GPU: device 0, an sm_90 target, no launcher."""

    def __init__(self) -> None:
        self.get_current_device = lambda: 0
        self.get_current_stream = lambda device=None: 0
        self.get_current_target = lambda: GPUTarget("cuda", 90, 32)
        self.launcher_cls = lambda src, metadata: None


def _probe(cache):
    """(the advisor-named probe kernel, a kernel outside advisor), compiled (not
    interpreted) for sm_90 into `cache`."""
    _double.__module__ = PROBE
    fn = JITFunction(_double)
    module = types.ModuleType(PROBE)
    module._double = fn
    sys.modules[PROBE] = module
    driver.set_active(_Driver())
    _use_cache(cache)
    return fn, JITFunction(_other)


def _use_cache(path) -> None:
    os.makedirs(path, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(path)


def _compiled(path) -> set[str]:
    """The cache entries (key folders) holding a cubin."""
    return {d for d in os.listdir(path) if any(f.endswith(".cubin") for f in os.listdir(path / d))}


def _warm(fn, n=1000):
    x, y = torch.ones(n), torch.empty(n)
    args = (x, y, n) if fn.fn.__name__ == "_double" else (x, n)
    return fn.warmup(*args, BLOCK=128, grid=(8,), num_warps=2)  # a launch option, as ours set


def scenario_record(tmp_path):
    double, other = _probe(tmp_path)
    with precompile.record() as seen:
        _warm(double)
        _warm(double)  # in-memory hit: no compile, no second entry
        _warm(other)  # not an advisor kernel
    assert len(seen) == 1 and json.loads(seen[0])["name"] == f"{PROBE}._double", seen
    precompile.reset_jit_caches()
    with precompile.record() as again:
        _warm(double)  # compiled again after the reset: an on-disk cache read
    assert again == seen


def scenario_workers(tmp_path):
    double, _ = _probe(tmp_path / "jit")
    with precompile.record() as seen:
        _warm(double)
    jit = _compiled(tmp_path / "jit")
    assert len(jit) == 1, jit

    _use_cache(tmp_path / "workers")
    precompile.unusable = lambda kernels: None
    torch.cuda.current_device = lambda: 0
    unknown = json.dumps({**json.loads(seen[0]), "name": "os.system"})  # never resolved
    kernels = {"triton": triton.__version__, "target": "cuda:90",
               "entries": [{"buckets": [1, 128], "spec": seen[0]}, {"buckets": [1], "spec": unknown},
                           {"buckets": [2048], "spec": seen[0]}]}
    handle = precompile.start(kernels, workers=2)
    assert handle is not None
    handle.wait(1)
    assert handle.counts(1) == {"compiled": 1, "failed": 1, "missing": 0}, handle.done
    assert handle.failures() == ["LookupError: not an advisor kernel"], handle.failures()
    assert handle.waited_s[1] >= 0
    handle.wait(2048)
    assert _compiled(tmp_path / "workers") == jit  # the key the JIT path computed


def _in_fresh_python(scenario: str, tmp_path) -> None:
    """Run a scenario in a process where Triton compiles: the interpreter, once it has run
    in this process (the other tests), leaves `triton.language` patched for itself."""
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    code = f"import pathlib, tests.test_precompile as t; t.{scenario}(pathlib.Path({str(tmp_path)!r}))"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_record_keeps_advisor_kernels_once(tmp_path):
    _in_fresh_python("scenario_record", tmp_path)


def test_workers_write_the_cache_entry_the_jit_reads(tmp_path):
    _in_fresh_python("scenario_workers", tmp_path)


def _spec(**change) -> dict:
    spec = {"name": f"{PROBE}._double", "signature": {"x": "*fp32", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"},
            "constant_keys": [[3]], "constant_vals": [128], "attrs_keys": [[0], [1], [2], [3]],
            "attrs_vals": [[["tt.divisibility", 16]], [["tt.divisibility", 16]], [], []],
            "options": {"num_warps": 2, "num_stages": 3, "extern_libs": [["libdevice", "/x.bc"]],
                        "ptx_options": "--evil"}, "key": "k", "target": {"backend": "cuda", "arch": 90}}
    return {**spec, **change}


def test_check_spec_keeps_only_launch_options():
    parts = kernel_spec.check_spec(_spec())
    assert parts["options"] == {"num_warps": 2, "num_stages": 3}  # no files, no ptxas flags
    assert parts["signature"]["n"] == "i32"


@pytest.mark.parametrize("change, what", [
    ({"signature": {"x": "tensordesc<fp32[16],__import__('os').system('true')>"}}, "signature"),
    ({"signature": {"x": "*fp32; import os"}}, "signature"),
    ({"signature": {"x y": "i32"}}, "signature"),
    ({"constant_vals": [{"jit_function": "os:system"}]}, "constants"),
    ({"constant_vals": ["a b"]}, "constants"),
    ({"attrs_vals": [[["tt.divisibility", "16"]], [], [], []]}, "attributes"),
    ({"options": {"num_warps": 10**6}}, "options.num_warps"),
    ({"options": {"num_warps": True}}, "options.num_warps"),
    ({"constant_vals": ["0"]}, "constants"),  # would share int 0's cache key
    ({"constant_vals": ["None"]}, "constants"),
    ({"constant_keys": [[2]]}, "constexpr arguments"),  # a constant moved to another argument
    ({"signature": {"x": "*fp32\n", "y": "*fp32", "n": "i32", "BLOCK": "constexpr"}}, "signature"),
    ({"ir_override": "/etc/passwd"}, "unknown field"),
    ({"name": 3}, "kernel name"),
])
def test_check_spec_refuses(change, what):
    with pytest.raises(kernel_spec.SpecError, match=what):
        kernel_spec.check_spec(_spec(**change))


@pytest.mark.parametrize("bad", [json.dumps(_spec(signature={"x": "tensordesc<fp32[16],print(1)>"})),
                                 "{", "[1]"])
def test_recipe_leaves_out_a_spec_it_cannot_vouch_for(bad):
    good = json.dumps(_spec())
    obj = _recipe_json({"triton": "3.6.0", "target": "cuda:90",
                        "entries": [{"buckets": [1], "spec": bad}, {"buckets": [1], "spec": good}]})
    with pytest.warns(UserWarning, match=r"\$\.kernels\.entries\[0\]\.spec left out"):
        rec = recipe_from_json(obj)
    assert [e["spec"] for e in rec.kernels["entries"]] == [good]  # the plans and the rest stand


def test_record_lengths_cover_a_bound_and_the_length_below():
    from advisor.runtime.record import bounds

    rec = Recipe(buckets=tuple(Bucket(n, Plan(fusions=("rms_norm",))) for n in (1, 2, 128)))
    assert bounds(rec) == (1, 2, 127, 128)
    assert bounds(Recipe.from_plan(Plan(fusions=("rms_norm",)))) == ()


def test_unusable_says_why(monkeypatch):
    ok = {"triton": triton.__version__, "target": "cuda:90", "entries": [{"buckets": [1], "spec": "{}"}]}
    assert precompile.unusable(None) == "the recipe lists no kernels"
    assert "interpreter" in precompile.unusable(ok)  # the tests run Triton's interpreter
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(precompile, "target_name", lambda: "cuda:90")
    assert precompile.unusable(ok) is None
    assert "triton 0.1" in precompile.unusable({**ok, "triton": "0.1"})
    assert "cuda:80" in precompile.unusable({**ok, "target": "cuda:80"})
    monkeypatch.setenv("ADVISOR_PRECOMPILE", "0")
    assert precompile.unusable(ok) == "ADVISOR_PRECOMPILE=0"


def _recipe_json(kernels) -> dict:
    rec = Recipe(buckets=(Bucket(1, Plan(fusions=("rms_norm",))),), kernels=kernels)
    return rec.to_json()


def test_recipe_carries_kernels():
    spec = json.dumps(_spec())
    kernels = {"triton": "3.6.0", "target": "cuda:90", "entries": [{"buckets": [1], "spec": spec}]}
    obj = _recipe_json(kernels)
    assert recipe_from_json(json.loads(json.dumps(obj))).kernels == kernels
    assert "kernels" not in _recipe_json(None)


@pytest.mark.parametrize("bad, where", [
    ({"triton": "3.6.0", "target": "cuda:90"}, "$.kernels: missing"),
    ({"triton": 3, "target": "cuda:90", "entries": []}, "$.kernels.triton"),
    ({"triton": "3.6.0", "target": "cuda:90", "entries": [{"buckets": [0], "spec": "{}"}]},
     "$.kernels.entries[0].buckets"),
    ({"triton": "3.6.0", "target": "cuda:90", "entries": [{"buckets": [1], "spec": 3}]},
     "$.kernels.entries[0].spec"),
])
def test_bad_kernels_field_names_its_path(bad, where):
    obj = _recipe_json(None)
    obj["kernels"] = bad
    with pytest.raises(RecipeError, match=where.replace("[", r"\[").replace("$", r"\$")):
        recipe_from_json(obj)


def test_apply_on_the_cpu_starts_no_workers():
    from advisor.runtime.apply import apply

    spec = json.dumps({"name": f"{PROBE}._double"})
    kernels = {"triton": triton.__version__, "target": "cuda:90", "entries": [{"buckets": [1], "spec": spec}]}
    rec = Recipe(buckets=(Bucket(1, Plan(fusions=("rms_norm",))),), kernels=kernels)
    fast = apply(torch.nn.Linear(4, 4), rec)
    assert fast.precompiling is None


def test_record_kernels_needs_cuda(tmp_path):
    import subprocess

    model = tmp_path / "model.py"
    model.write_text("import torch\n"
                     "def build_model(device, dtype):\n    return torch.nn.Linear(8, 8).to(device, dtype)\n"
                     "def make_inputs(seq_len, batch, device):\n    return (torch.randn(batch, seq_len, 8),)\n")
    recipe = tmp_path / "r.json"
    recipe.write_text(json.dumps(_recipe_json(None)))
    before = recipe.read_text()
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", "record-kernels", str(model), "--recipe",
                           str(recipe), "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "needs a CUDA device" in proc.stderr
    assert recipe.read_text() == before


def test_manifest_lists_each_spec_once_with_its_buckets():
    m = precompile.manifest({512: ["b", "a"], 128: ["a", "a"]})  # 128 recorded at 127 and 128
    assert m["entries"] == [{"buckets": [128, 512], "spec": "a"}, {"buckets": [512], "spec": "b"}]


def test_tune_says_whether_the_kernels_were_recorded(tmp_path):
    """`advisor tune` records in a worker under a trial's timeout per recorded length; a
    failure keeps the recipe as it is and says why (it used to leave only a missing field)."""
    from contextlib import contextmanager

    from advisor.search.study import TuneOptions, record_kernels

    recipe = Recipe(buckets=(Bucket(1, Plan(("rope",))), Bucket(512, Plan(("rope",)))))
    asked = []

    class Pool:
        def __init__(self, answer):
            self.answer = answer

        @contextmanager
        def lease(self):
            yield self

        def request(self, req, timeout_s):
            asked.append((req["op"], timeout_s))
            return self.answer

    options = TuneOptions("m.py", (1, 512), tmp_path / "r.json", torch.bfloat16, device="cuda",
                          trial_timeout_s=10.0)
    manifest = {"triton": triton.__version__, "target": "cuda:90", "entries": [{"buckets": [1], "spec": "{}"}]}
    got, note = record_kernels(Pool({"ok": True, "kernels": manifest}), recipe, options)
    assert got.kernels == manifest and note == "1 kernels recorded"
    assert asked == [("record", 10.0 * 3)]  # lengths 1, 511 and 512
    got, note = record_kernels(Pool({"ok": False, "reason": "timeout", "message": "no answer within 30s"}),
                               recipe, options)
    assert got is recipe and note.startswith("kernels not recorded (timeout: no answer within 30s)")
    assert record_kernels(Pool({"ok": True, "kernels": None}), recipe, options)[1] == "no kernels to record"
    cpu = TuneOptions("m.py", (1,), tmp_path / "r.json", torch.float32)
    assert record_kernels(Pool({}), recipe, cpu) == (recipe, "kernels not recorded: they are compiled for a "
                                                     "CUDA device")
