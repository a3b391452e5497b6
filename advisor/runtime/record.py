"""Record which Triton kernels each bucket of a recipe compiles, into the recipe.

`record_kernels` applies the recipe, runs one input per bucket and keeps, per bucket, the
serialised specialisations of every advisor kernel its call compiled (its confirmations,
warm-ups and CUDA-graph capture included). The in-memory kernel caches are cleared
before each bucket's call, so a kernel an earlier bucket compiled too is listed for this
one as well (a read of the on-disk cache, not a compile). The result is the recipe's
`kernels` field (runtime/precompile.py), which a later `apply` compiles in other
processes while its first call traces.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from advisor.loader import Inputs, ModelFile, call, inputs_for
from advisor.runtime import precompile
from advisor.runtime.apply import apply
from advisor.runtime.recipe import EVERY_LENGTH, Recipe


def record_kernels(model: torch.nn.Module, recipe: Recipe, inputs: Mapping[int, Inputs], *,
                   length_of: Callable[..., int] | None = None,
                   before_call: Callable[[int], Any] | None = None) -> Recipe:
    """`recipe` with `kernels`: the kernels compiled by one call per entry of `inputs`
    (length -> the forward's inputs), each tagged with the bucket that length falls in.
    `before_call(length)` runs before each call (a decode model resets its cache there).
    Lengths no bucket fuses are skipped."""
    fast = apply(model, replace(recipe, kernels=None), length_of=length_of)
    specs: dict[int, list[str]] = {}
    for length, x in sorted(inputs.items()):
        bucket = recipe.bucket_for(length)
        if bucket is None or not (bucket.plan.fusions or bucket.plan.cuda_graph):
            continue
        if before_call is not None:
            before_call(length)
        precompile.reset_jit_caches()
        fast._confirmed.clear()  # confirmation compiles count for this bucket too
        with precompile.record() as seen, torch.no_grad():
            call(fast, x)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        specs.setdefault(bucket.max_len, []).extend(seen)
    return replace(recipe, kernels=precompile.manifest(specs) if specs else None)


def bounds(recipe: Recipe) -> tuple[int, ...]:
    """The lengths to record by default: each bucket's bound and, where the bucket holds
    it, the length below (a bound is mostly a multiple of 16, which Triton specialises
    integer arguments on: most lengths inside the bucket are not). A plan for every
    length has no bound."""
    out: list[int] = []
    lower = 0
    for b in recipe.buckets:
        if b.max_len >= EVERY_LENGTH:
            break
        out += [n for n in (b.max_len, b.max_len - 1) if n > max(lower, 1) or n == b.max_len]
        lower = b.max_len
    return tuple(sorted(set(out)))


def record_model_file(mf: ModelFile, model: torch.nn.Module, recipe: Recipe,
                      lengths: tuple[int, ...], *, batch: int, device: torch.device,
                      dtype: torch.dtype, phase: str = "prefill") -> Recipe:
    """`record_kernels` on the model file's inputs at `lengths`; a decode model is routed
    by its context length, as `advisor bench` routes it."""
    context = {"len": lengths[0] if lengths else 0}
    inputs = {n: inputs_for(mf, n, batch, device, phase=phase, dtype=dtype) for n in lengths}
    return record_kernels(model, recipe, inputs,
                          length_of=(lambda a, k: context["len"]) if phase == "decode" else None,
                          before_call=lambda n: context.update(len=n))
