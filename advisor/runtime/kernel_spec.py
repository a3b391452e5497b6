"""The grammar a recorded Triton specialisation must fit before a worker compiles it (pure).

A recipe's `kernels` field (runtime/precompile.py) holds Triton's own serialised
specialisations. Triton reads their types and options as given: it evaluates part of a
`tensordesc` type's text, options name files (`extern_libs`, `ir_override`) and ptxas
flags, and a constant's cache key is its `str()`. So each one is checked here, when the
recipe is loaded and again in the worker: argument names are identifiers, types plain,
constants scalars at the signature's constexpr arguments and never spelled like another
value, attributes `tt.*` integers, options only those a launch sets. `check_spec`
returns the checked parts, the only ones a worker uses.
"""

from __future__ import annotations

import re
from typing import Any

_SCALAR = r"(i1|i8|i16|i32|i64|u1|u8|u16|u32|u64|fp8e4nv|fp8e5|fp8e4b15|fp8e4b8|fp8e5b16|fp16|bf16|fp32|fp64)"
_TYPE = re.compile(rf"\*k?{_SCALAR}|{_SCALAR}|constexpr|nvTmaDesc|tensordesc<{_SCALAR}\[\d+(, ?\d+)*\]>")
_WORD = re.compile(r"[A-Za-z0-9_.]{0,64}")  # a string constant (a dtype's name, a mode)
# Triton keys a constant by its str(): a string spelled like a number, a bool or None would
# share the key of that value and poison the cache with the other branch's kernel
_ALIAS = re.compile(r"None|True|False|[-+]?(inf|nan)|[-+0-9.eE]+", re.IGNORECASE)
_ATTR = re.compile(r"tt\.\w{1,32}")


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1024


def _flag(v: Any) -> bool:
    return isinstance(v, bool)


# options a launch sets (`kernel[grid](..., num_warps=…)`), each with its check; Triton
# fills in the others
LAUNCH_OPTIONS = {"num_warps": _count, "num_stages": _count, "num_ctas": _count,
                  "maxnreg": lambda v: v is None or _count(v), "launch_pdl": _flag,
                  "launch_cooperative_grid": _flag}
SPEC_KEYS = {"name", "signature", "constant_keys", "constant_vals", "attrs_keys", "attrs_vals",
             "options", "key", "target"}


class SpecError(ValueError):
    """A serialised specialisation outside what `check_spec` accepts."""


def _is_path(p: Any) -> bool:
    return isinstance(p, list) and 0 < len(p) <= 8 and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < 4096 for i in p)


def _is_type(t: Any, depth: int = 0) -> bool:
    if isinstance(t, str):
        return bool(_TYPE.fullmatch(t))
    return isinstance(t, list) and depth < 4 and len(t) <= 64 and all(_is_type(x, depth + 1) for x in t)


def _is_constant(v: Any, depth: int = 0) -> bool:
    if v is None or isinstance(v, (bool, int, float)):
        return True
    if isinstance(v, str):
        return bool(_WORD.fullmatch(v)) and not (v and _ALIAS.fullmatch(v))
    if isinstance(v, dict):  # {"constexpr": value}; 3.9's {"jit_function": …} is refused
        return set(v) == {"constexpr"} and _is_constant(v["constexpr"], depth + 1)
    return isinstance(v, list) and depth < 4 and len(v) <= 64 and all(_is_constant(x, depth + 1) for x in v)


def check_spec(spec: Any) -> dict[str, Any]:
    """The parts of a serialised specialisation (a parsed object) that a worker uses,
    checked: SpecError names the first that fails."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise SpecError("expected an object with a kernel name")
    if set(spec) - SPEC_KEYS:
        raise SpecError(f"unknown field(s) {sorted(set(spec) - SPEC_KEYS)}")
    sig = spec.get("signature")
    if not (isinstance(sig, dict) and len(sig) <= 256 and all(
            isinstance(k, str) and k.isidentifier() and _is_type(t) for k, t in sig.items())):
        raise SpecError("signature: expected argument names with plain Triton types")
    ck, cv = spec.get("constant_keys", []), spec.get("constant_vals", [])
    if not (isinstance(ck, list) and isinstance(cv, list) and len(ck) == len(cv)
            and all(_is_path(k) for k in ck) and all(_is_constant(v) for v in cv)):
        raise SpecError("constants: expected index paths and scalar values")
    constexprs = sorted([i] for i, t in enumerate(sig.values()) if t == "constexpr")
    if sorted(ck) != constexprs:  # each constant at its own constexpr argument, once
        raise SpecError("constants: not at the signature's constexpr arguments")
    ak, av = spec.get("attrs_keys", []), spec.get("attrs_vals", [])
    if not (isinstance(ak, list) and isinstance(av, list) and len(ak) == len(av)
            and all(_is_path(k) for k in ak)
            and all(isinstance(a, list) and all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and _ATTR.fullmatch(p[0])
                and isinstance(p[1], int) and not isinstance(p[1], bool) for p in a) for a in av)):
        raise SpecError("attributes: expected index paths and [tt.name, int] pairs")
    options = spec.get("options", {})
    if not isinstance(options, dict):
        raise SpecError("options: expected an object")
    launch = {key: options[key] for key in LAUNCH_OPTIONS if key in options}
    for key, value in launch.items():
        if not LAUNCH_OPTIONS[key](value):
            raise SpecError(f"options.{key}: {value!r}")
    return {"name": spec["name"], "signature": sig, "constant_keys": ck, "constant_vals": cv,
            "attrs_keys": ak, "attrs_vals": av, "options": launch}
