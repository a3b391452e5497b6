"""Kernel config spaces as data: axes of values plus a `keep` filter.

The same space serves the CPU tests (a couple of configs), the GPU benchmark (sweep) and
the Optuna search (one categorical parameter per enabled kernel), so it is declared once.

A config is a plain `dict[str, int]` (e.g. ``{"BLOCK_N": 1024, "num_warps": 4}``); it
travels through custom ops and recipes as its canonical string form
``"BLOCK_N=1024,num_warps=4"`` (sorted keys), see `encode` / `decode`.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

Config = dict[str, int]
Problem = Mapping[str, Any]  # e.g. {"n_cols": 4096, "n_rows": 2048, "dtype": "bfloat16"}


def encode(cfg: Mapping[str, int]) -> str:
    """Canonical text form of a config: sorted `key=value` pairs joined by commas."""
    return ",".join(f"{k}={int(cfg[k])}" for k in sorted(cfg))


def decode(text: str) -> Config:
    """Inverse of `encode`; raises ValueError on anything that is not `name=int,...`."""
    if not text:
        return {}
    out: Config = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"bad kernel config entry {part!r} in {text!r}")
        out[key] = int(value)
    return out


def _keep_all(cfg: Config, problem: Problem) -> bool:
    return True


# Configs `resolve` replaced by the problem's default, collected while `refused_configs` is
# open (the rewrite's confirmation: a recipe's config that no longer fits its site is said).
_REFUSED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("refused", default=None)


@contextlib.contextmanager
def refused_configs() -> Iterator[list[str]]:
    """The configs (canonical text) that launches inside this block were given but ran
    the default in place of, because `keep` refused them for their problem."""
    refused: list[str] = []
    token = _REFUSED.set(refused)
    try:
        yield refused
    finally:
        _REFUSED.reset(token)


@dataclass(frozen=True)
class ConfigSpace:
    """Axes (name -> candidate values) and a filter that drops configs unfit for a problem.

    `default(problem)` is the heuristic config used when nothing was tuned. `fill` names
    axes added after configs were first stored (recipes, tune results): a config that omits
    one of them takes this value, which is the behaviour from before the axis existed.
    """

    axes: Mapping[str, tuple[int, ...]]
    default: Callable[[Problem], Config]
    keep: Callable[[Config, Problem], bool] = field(default=_keep_all)
    fill: Mapping[str, int] = field(default_factory=dict)

    def configs(self, problem: Problem) -> list[Config]:
        """Every config on the grid that `keep` accepts for this problem, in grid order."""
        names = list(self.axes)
        grid = (dict(zip(names, values)) for values in itertools.product(*self.axes.values()))
        return [cfg for cfg in grid if self.keep(cfg, problem)]

    def resolve(self, cfg: Mapping[str, int] | None, problem: Problem) -> Config:
        """What a launcher runs: the default for an empty config; a malformed config (keys
        or values off the axes) is a KernelInputError (a clear error, not a Triton crash).
        A well-formed config that `keep` rejects for *this* problem runs the problem's
        default instead: a config is tuned at a bucket's representative length, and every
        other length routed to that bucket must still run (a tile wider than the rows,
        split-K off the decode path)."""
        from advisor.errors import KernelInputError

        if not cfg:
            return self.default(problem)
        try:
            clean = self.well_formed(cfg)
        except ValueError as e:
            raise KernelInputError(f"config: {e}") from None
        if self.keep(clean, problem):
            return clean
        refused = _REFUSED.get()
        if refused is not None:
            refused.append(encode(clean))
        return self.default(problem)

    def well_formed(self, cfg: Mapping[str, int]) -> Config:
        """`cfg` as ints when it names every axis (those in `fill` may be omitted) and only
        values on them; else ValueError."""
        cfg = {**cfg, **{k: v for k, v in self.fill.items() if k not in cfg}}
        if set(cfg) != set(self.axes):
            raise ValueError(f"config keys {sorted(cfg)} != space axes {sorted(self.axes)}")
        for name, value in cfg.items():
            if value not in self.axes[name]:
                raise ValueError(f"{name}={value} is not one of {self.axes[name]}")
        return {k: int(v) for k, v in cfg.items()}

    def validate(self, cfg: Mapping[str, int], problem: Problem) -> Config:
        """Check a config from outside (a recipe, a CLI flag) against this space."""
        clean = self.well_formed(cfg)
        if not self.keep(clean, problem):
            raise ValueError(f"config {encode(clean)} is not valid for problem {dict(problem)}")
        return clean
