"""The model-file contract (DESIGN.md): load a user's `model.py` with clear errors.

A model file defines::

    build_model(device, dtype) -> torch.nn.Module
    make_inputs(seq_len, batch, device) -> tuple | dict   # positional or keyword args of forward
    make_decode_inputs(context_len, batch, device[, dtype])  # optional, for --phase decode:
        # one decode step's inputs with a KV cache already filled to context_len
    next_decode_inputs(inputs, next_ids) -> tuple | dict  # optional, for bench --generate:
        # the next step's inputs given next_ids (B, 1) on the device (no host sync); by
        # default dict inputs get input_ids = next_ids and cache_position / position_ids + 1

Every failure (missing file, syntax/import error, missing function, a forward that raises)
becomes one `ModelFileError` line naming the file and the cause.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from advisor.errors import ModelFileError

Inputs = tuple[Any, ...] | dict[str, Any]

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ModelFileError(f"unknown dtype {name!r}; use one of {sorted(set(DTYPES))}") from None


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise ModelFileError(f"bad device {name!r}: {exc}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelFileError(f"--device {name}: no CUDA device is available on this machine")
    return device


def parse_shapes(text: str) -> tuple[int, ...]:
    """`"128,512,2048"` -> (128, 512, 2048): positive, strictly increasing once sorted."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ModelFileError(f"--shapes {text!r}: expected comma-separated integers") from None
    if not values or values[0] < 1:
        raise ModelFileError(f"--shapes {text!r}: expected positive sequence lengths")
    return tuple(values)


@dataclass(frozen=True)
class ModelFile:
    """A loaded model file: its path, source hash and the contract's functions."""

    path: Path
    sha256: str
    build_model: Callable[[torch.device, torch.dtype], torch.nn.Module]
    make_inputs: Callable[[int, int, torch.device], Inputs]
    make_decode_inputs: Callable[[int, int, torch.device], Inputs] | None
    next_decode_inputs: Callable[[Inputs, torch.Tensor], Inputs] | None = None


def _import_file(path: Path) -> ModuleType:
    name = f"advisor_user_model_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ModelFileError(f"{path}: not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look modules up by name
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        sys.modules.pop(name, None)
        raise ModelFileError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
    except Exception as exc:  # any import-time failure of user code
        sys.modules.pop(name, None)
        raise ModelFileError(f"{path}: import failed: {_one_line(exc)}") from None
    return module


def _one_line(exc: BaseException) -> str:
    """`Type: message` plus the innermost frame, on one line."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    msg = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {msg}{where}"


def load_model_file(path: str | Path) -> ModelFile:
    """Import `path` and check the contract; raises ModelFileError with one clear line."""
    p = Path(path)
    if not p.is_file():
        raise ModelFileError(f"{p}: no such model file")
    source = p.read_bytes()
    module = _import_file(p.resolve())
    funcs = {}
    for fname in ("build_model", "make_inputs"):
        fn = getattr(module, fname, None)
        if not callable(fn):
            raise ModelFileError(f"{p}: missing function {fname}(...) required by the model-file contract")
        funcs[fname] = fn
    decode = getattr(module, "make_decode_inputs", None)
    advance = getattr(module, "next_decode_inputs", None)
    return ModelFile(
        path=p, sha256=hashlib.sha256(source).hexdigest(),
        build_model=funcs["build_model"], make_inputs=funcs["make_inputs"],
        make_decode_inputs=decode if callable(decode) else None,
        next_decode_inputs=advance if callable(advance) else None,
    )


def build(mf: ModelFile, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    try:
        model = mf.build_model(device, dtype)
    except Exception as exc:
        raise ModelFileError(f"{mf.path}: build_model failed: {_one_line(exc)}") from None
    if not isinstance(model, torch.nn.Module):
        raise ModelFileError(f"{mf.path}: build_model returned {type(model).__name__}, not nn.Module")
    return model.eval()


PHASES = ("prefill", "decode")


def _takes_dtype(fn: Callable[..., Any]) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return len(params) >= 4 or any(p.kind is p.VAR_POSITIONAL for p in params)


def inputs_for(mf: ModelFile, seq_len: int, batch: int, device: torch.device,
               phase: str = "prefill", dtype: torch.dtype | None = None) -> Inputs:
    """Call make_inputs (or make_decode_inputs for phase='decode') with clear errors.
    A decode function that takes a 4th argument gets the model dtype (for its cache)."""
    if phase not in PHASES:
        raise ModelFileError(f"unknown phase {phase!r}; use one of {PHASES}")
    fn, fname, extra = mf.make_inputs, "make_inputs", ()
    if phase == "decode":
        if mf.make_decode_inputs is None:
            raise ModelFileError(
                f"{mf.path}: --phase decode needs make_decode_inputs(context_len, batch, device)")
        fn, fname = mf.make_decode_inputs, "make_decode_inputs"
        if dtype is not None and _takes_dtype(fn):
            extra = (dtype,)
    try:
        inputs = fn(seq_len, batch, device, *extra)
    except Exception as exc:
        raise ModelFileError(f"{mf.path}: {fname}({seq_len}, {batch}) failed: {_one_line(exc)}") from None
    if not isinstance(inputs, (tuple, list, Mapping)):
        raise ModelFileError(f"{mf.path}: {fname} must return a tuple or dict, got {type(inputs).__name__}")
    return dict(inputs) if isinstance(inputs, Mapping) else tuple(inputs)


def call(model: Callable[..., Any], inputs: Inputs) -> Any:
    """Run forward with positional (tuple) or keyword (dict) inputs."""
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def checked_forward(mf: ModelFile, model: Callable[..., Any], inputs: Inputs) -> Any:
    """One forward under no_grad (not inference_mode: inference tensors created in state such
    as a KV cache could not be used by later traced calls); a raising forward becomes a
    ModelFileError."""
    try:
        with torch.no_grad():
            return call(model, inputs)
    except Exception as exc:
        raise ModelFileError(f"{mf.path}: forward failed: {_one_line(exc)}") from None


def first_tensor(out: Any) -> torch.Tensor:
    """The main output tensor of a forward (a tensor, first tensor of a tuple, or .logits
    / first tensor value of a dict-like output such as transformers' ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    items = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    for item in items:
        if isinstance(item, torch.Tensor):
            return item
    raise TypeError(f"forward returned no tensor ({type(out).__name__})")
