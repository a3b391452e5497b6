"""The result files `advisor report` reads (analyze's and bench's JSON), checked in the
fields the report walks before anything renders: a wrong or stale file is one error line
naming its path, not a traceback from deep in the HTML."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from advisor.errors import AdvisorError


def _result(path: Path, kind: str, lists: tuple[str, ...]) -> dict[str, Any]:
    """`path`'s JSON, written by `kind`'s writer, with `lists` (top-level fields) lists of
    objects. Files from before `kind` and `schema_version` were written carry neither."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as exc:
        raise AdvisorError(f"{path}: cannot read JSON: {exc}") from None
    if not isinstance(obj, dict) or obj.get("kind", kind) != kind:
        got = obj.get("kind") if isinstance(obj, dict) else type(obj).__name__
        raise AdvisorError(f"{path}: not an {kind} JSON (kind {got!r})")
    if obj.get("schema_version", 1) != 1:
        raise AdvisorError(f"{path}: schema_version {obj.get('schema_version')!r} is not supported "
                           "(expects 1); write it again with this advisor")
    for name in lists:
        if not _objects(obj.get(name, [])):
            raise AdvisorError(f"{path}: invalid {kind} JSON at $.{name}: expected a list of objects")
    return obj


def _objects(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, dict) for v in value)


def read_analysis(path: Path) -> dict[str, Any]:
    """An `advisor analyze --json` file; each shape with its length and candidates."""
    obj = _result(path, "advisor.analysis", ("shapes",))
    for i, shape in enumerate(obj.get("shapes", [])):
        if not isinstance(shape.get("seq_len"), int) or not _objects(shape.get("candidates", [])):
            raise AdvisorError(f"{path}: invalid advisor.analysis JSON at $.shapes[{i}]: expected "
                               "an integer seq_len and a list of candidate objects")
    return obj


def read_bench(path: Path) -> dict[str, Any]:
    """An `advisor bench --json` file."""
    return _result(path, "advisor.bench", ("rows", "ablation", "alone"))
