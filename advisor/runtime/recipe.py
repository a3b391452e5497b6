"""Recipes: versioned JSON (data only) holding the tuned plan per shape bucket.

Loading never imports or executes anything from the file: kernels are named by registry
id, configs are `name=int` text validated against the kernel's config space, and every
field is type-checked; a bad field is a RecipeError naming its JSON path (RELIABILITY.md
items 18–24). Writes are atomic (temp file + os.replace).

Schema (schema_version 1)::

    {"schema_version": 1, "kind": "advisor.recipe",
     "model": {"fingerprint": str, "source": str, "dtype": str, "batch": int, "phase": str},
     "environment": {"device": str, "capability": str|null, "torch": str, "triton": str, "advisor": str},
     "beyond_largest": "largest" | "unfused",
     "buckets": [{"max_len": int, "plan": {"fusions": [str], "configs": {str: str}, "cuda_graph": bool,
                                           "pdl": bool (optional, default false)},
                  "measured": {"unfused_ms": float, "tuned_ms": float, "max_error": float,
                               "trials": int, "failures": {str: int}}}],
     "kernels": {"triton": str, "target": str, "entries": [{"buckets": [int], "spec": str}]}}

`kernels` (optional) lists the Triton kernels each bucket's first call compiled, each as
Triton's serialised specialisation (a JSON text), so `apply` can compile them in other
processes while the first call traces (runtime/precompile.py). Kernels are named, never
imported (a name outside advisor's kernel modules is skipped), and each specialisation
must fit `kernel_spec.check_spec`'s grammar (plain types, scalar constants, launch options);
one that does not is left out with a warning (the plans stand).

A hand-written plan file is also accepted: {"schema_version": 1, "kind": "advisor.plan",
"fusions": [...], "configs": {...}, "cuda_graph": false} (one bucket covering every length).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from advisor.errors import RecipeError
from advisor.kernels.space import decode
from advisor.runtime.kernel_spec import SpecError, check_spec
from advisor.runtime.plan import FAMILIES, PLAN_FLAGS, UNTUNED_KERNELS, Plan

SCHEMA_VERSION = 1
EVERY_LENGTH = 2**31 - 1  # the bound of a plan file's one bucket: no length past it
BEYOND = ("largest", "unfused")
MEASURED_FLOATS = ("unfused_ms", "tuned_ms", "max_error")


@dataclass(frozen=True)
class Bucket:
    max_len: int                     # inclusive upper bound on sequence length
    plan: Plan
    measured: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Recipe:
    buckets: tuple[Bucket, ...]
    model: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    beyond_largest: str = "largest"   # lengths past the last bucket: its plan, or unfused
    kernels: dict[str, Any] | None = None  # compiled kernels to precompile (precompile.py)

    def bucket_for(self, length: int) -> Bucket | None:
        """Smallest bucket whose bound >= length; beyond the largest see `beyond_largest`."""
        for b in self.buckets:
            if length <= b.max_len:
                return b
        return self.buckets[-1] if self.beyond_largest == "largest" and self.buckets else None

    def apply(self, model: Any, **kwargs: Any) -> Any:
        from advisor.runtime.apply import apply

        return apply(model, self, **kwargs)

    def to_json(self) -> dict:
        return copy.deepcopy({  # a fresh tree: callers may mutate it freely
            "schema_version": SCHEMA_VERSION, "kind": "advisor.recipe",
            "model": self.model, "environment": self.environment,
            "beyond_largest": self.beyond_largest,
            "buckets": [{"max_len": b.max_len, "plan": b.plan.to_json(), "measured": b.measured}
                        for b in self.buckets],
            **({"kernels": self.kernels} if self.kernels else {}),
        })

    @staticmethod
    def from_plan(plan: Plan) -> Recipe:
        return Recipe(buckets=(Bucket(max_len=EVERY_LENGTH, plan=plan),))


# ---- validation: every check names the JSON path it rejects -------------------------

def fingerprint(model: Any, dtype: Any = None) -> str:
    """sha256 of the parameter names, shapes and dtypes (every one `dtype` where given: a
    model applied to before its cast to the tuned dtype)."""
    rows = (f"{n}:{tuple(p.shape)}:{dtype or p.dtype}" for n, p in model.named_parameters())
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


def _expect(cond: bool, path: str, what: str) -> None:
    if not cond:
        raise RecipeError(f"invalid recipe at {path}: {what}")


def _keys(obj: Any, path: str, required: set[str], optional: set[str] = frozenset()) -> None:
    _expect(isinstance(obj, dict), path, f"expected an object, got {type(obj).__name__}")
    missing, unknown = required - set(obj), set(obj) - required - optional
    _expect(not missing, path, f"missing field(s) {sorted(missing)}")
    _expect(not unknown, path, f"unknown field(s) {sorted(unknown)}")


def plan_from_json(obj: Any, path: str = "$", axes: bool = True) -> Plan:
    """A plan object (a recipe bucket's, a plan file's, a tune trial's), checked field by
    field; a RecipeError names the JSON path of what is wrong. `axes`: configs are checked
    against their kernels' grids (not for a recipe of another advisor version, whose grids
    may differ: apply runs it unfused with a warning, RELIABILITY item 19)."""
    _keys(obj, path, {"fusions"}, {"configs", *PLAN_FLAGS})
    fusions = obj["fusions"]
    _expect(isinstance(fusions, list) and all(isinstance(f, str) for f in fusions),
            f"{path}.fusions", "expected a list of family names")
    for i, fam in enumerate(fusions):
        _expect(fam in FAMILIES, f"{path}.fusions[{i}]", f"unknown fusion family {fam!r}")
    configs = obj.get("configs", {})
    _expect(isinstance(configs, dict), f"{path}.configs", "expected an object")
    for fam, text in configs.items():
        _expect(fam in FAMILIES, f"{path}.configs.{fam}", "unknown fusion family")
        _expect(isinstance(text, str), f"{path}.configs.{fam}", "expected a config string")
        try:
            cfg = decode(text)
        except ValueError as exc:
            raise RecipeError(f"invalid recipe at {path}.configs.{fam}: {exc}") from None
        for key, value in cfg.items():
            _expect(0 <= value <= 65536, f"{path}.configs.{fam}.{key}", f"value {value} out of range")
        if axes:
            _on_axes(fam, cfg, f"{path}.configs.{fam}")
    flags = {key: obj.get(key, False) for key in PLAN_FLAGS}
    for key, value in flags.items():
        _expect(isinstance(value, bool), f"{path}.{key}", "expected true/false")
    return Plan(fusions=tuple(fusions), configs=dict(configs), **flags)


def _on_axes(family: str, cfg: dict[str, int], path: str) -> None:
    """A tuned config names its kernel's axes and values on them (kernels/space.py): one
    off the grid (BLOCK_N=3, an unknown key) would fail at the site's first call and leave
    it unfused with no word, so it is refused here, at load."""
    from advisor.kernels.registry import get  # the kernel modules: only once a config is read

    kernel = FAMILIES[family]
    if not cfg or kernel in UNTUNED_KERNELS:
        return
    try:
        get(kernel).space.well_formed(cfg)
    except ValueError as exc:
        raise RecipeError(f"invalid recipe at {path}: {exc} (kernel {kernel})") from None


def _measured(obj: Any, path: str) -> dict[str, Any]:
    _expect(isinstance(obj, dict), path, "expected an object")
    _expect(_depth(obj) <= MAX_DEPTH, path, f"nested deeper than {MAX_DEPTH}")
    for key, value in obj.items():
        if key in MEASURED_FLOATS:
            _expect(isinstance(value, (int, float)) and not isinstance(value, bool)
                    and math.isfinite(value) and value >= 0, f"{path}.{key}",
                    f"expected a finite non-negative number, got {value!r}")
    return dict(obj)


MAX_DEPTH = 16  # free-form objects (model, environment, measured): a few levels in practice


def _depth(obj: Any, limit: int = MAX_DEPTH + 1) -> int:
    """Nesting depth of a JSON value, counted up to `limit` (deeper stops the walk: a
    copy or dump of such a value would exhaust the recursion limit)."""
    if limit <= 0 or not isinstance(obj, (dict, list)):
        return 0
    items = obj.values() if isinstance(obj, dict) else obj
    return 1 + max((_depth(v, limit - 1) for v in items), default=0)


MAX_SPEC_CHARS = 1 << 16  # one serialised specialisation: a few hundred characters


def _kernels(obj: Any, path: str) -> dict[str, Any]:
    _keys(obj, path, {"triton", "target", "entries"})
    for key in ("triton", "target"):
        _expect(isinstance(obj[key], str), f"{path}.{key}", "expected a string")
    _expect(isinstance(obj["entries"], list), f"{path}.entries", "expected a list")
    kept = []
    for i, e in enumerate(obj["entries"]):
        p = f"{path}.entries[{i}]"
        _keys(e, p, {"buckets", "spec"})
        _expect(isinstance(e["buckets"], list) and all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in e["buckets"]),
            f"{p}.buckets", "expected a list of bucket bounds")
        spec = e["spec"]
        _expect(isinstance(spec, str) and len(spec) <= MAX_SPEC_CHARS, f"{p}.spec",
                f"expected a JSON text of at most {MAX_SPEC_CHARS} characters")
        try:
            check_spec(json.loads(spec))
        except (json.JSONDecodeError, SpecError) as exc:
            # an accelerator, not the plan: a specialisation this advisor cannot vouch for (a
            # newer Triton's form, say) is left out, the rest of the recipe stands
            warnings.warn(f"advisor: recipe {p}.spec left out ({exc}); its kernel compiles "
                          "on the first call instead", stacklevel=3)
            continue
        kept.append(copy.deepcopy(e))
    return {**copy.deepcopy(obj), "entries": kept}


def recipe_from_json(obj: Any) -> Recipe:
    _expect(isinstance(obj, dict), "$", "expected a JSON object")
    version = obj.get("schema_version")
    _expect(version is not None, "$.schema_version", "missing")
    if version != SCHEMA_VERSION:
        raise RecipeError(f"recipe schema_version {version!r} is not supported by this advisor "
                          f"(expects {SCHEMA_VERSION}); re-run `advisor tune` to regenerate it")
    kind = obj.get("kind")
    if kind == "advisor.plan":
        body = {k: v for k, v in obj.items() if k not in ("schema_version", "kind")}
        return Recipe.from_plan(plan_from_json(body, "$"))
    _expect(kind == "advisor.recipe", "$.kind", f"expected 'advisor.recipe' or 'advisor.plan', got {kind!r}")
    _keys(obj, "$", {"schema_version", "kind", "buckets"},
          {"model", "environment", "beyond_largest", "kernels"})
    for name in ("model", "environment"):
        _expect(isinstance(obj.get(name, {}), dict), f"$.{name}", "expected an object")
        _expect(_depth(obj.get(name, {})) <= MAX_DEPTH, f"$.{name}", f"nested deeper than {MAX_DEPTH}")
    import advisor  # its version: another version's kernel grids may differ (plan_from_json)

    ours = obj.get("environment", {}).get("advisor", advisor.__version__) == advisor.__version__
    beyond = obj.get("beyond_largest", "largest")
    _expect(beyond in BEYOND, "$.beyond_largest", f"expected one of {BEYOND}")
    raw = obj["buckets"]
    _expect(isinstance(raw, list) and raw, "$.buckets", "expected a non-empty list")
    buckets = []
    for i, b in enumerate(raw):
        p = f"$.buckets[{i}]"
        _keys(b, p, {"max_len", "plan"}, {"measured"})
        m = b["max_len"]
        _expect(isinstance(m, int) and not isinstance(m, bool) and m >= 1, f"{p}.max_len",
                "expected a positive integer")
        _expect(not buckets or m > buckets[-1].max_len, f"{p}.max_len", "buckets must be in increasing order")
        buckets.append(Bucket(max_len=m, plan=plan_from_json(b["plan"], f"{p}.plan", axes=ours),
                              measured=_measured(b.get("measured", {}), f"{p}.measured")))
    kernels = _kernels(obj["kernels"], "$.kernels") if "kernels" in obj else None
    return Recipe(buckets=tuple(buckets), model=dict(obj.get("model", {})),
                  environment=dict(obj.get("environment", {})), beyond_largest=beyond,
                  kernels=kernels)


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe (or plan) file. Example::

        recipe = advisor.load_recipe("recipes/llama_hf-h200.json")
        model = recipe.apply(model)
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecipeError(f"{p}: cannot read recipe: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise RecipeError(f"{p}: not a JSON text file (binary content)") from None
    try:
        obj = json.loads(text, parse_constant=lambda c: float(c))
    except json.JSONDecodeError as exc:
        raise RecipeError(f"{p}: not valid JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}") from None
    except (RecursionError, ValueError) as exc:  # nesting past the parser's depth; an integer
        # past Python's digit limit
        raise RecipeError(f"{p}: not a recipe JSON ({type(exc).__name__}: {str(exc)[:120]})") from None
    try:
        return recipe_from_json(obj)
    except RecipeError as exc:
        raise RecipeError(f"{p}: {exc}") from None


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """Write JSON next to its destination, then os.replace: readers never see half a file."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, allow_nan=False)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a recipe is meant to be shared
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def save_recipe(recipe: Recipe, path: str | Path) -> Path:
    return write_json_atomic(path, recipe.to_json())
